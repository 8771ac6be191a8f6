"""GLUE test-set predictions in the submission format of gluebenchmark.com.

One ``<TASK>.tsv`` per test set (``MNLI-m.tsv`` and ``MNLI-mm.tsv`` for MNLI), a header
``index\tprediction``, then one row per test example keyed by the test file's index, the
label as GLUE spells it (``entailment`` / ``not_entailment`` for RTE and QNLI, MNLI's
three names, ``0`` / ``1`` for CoLA, SST-2, MRPC, QQP and WNLI) or STS-B's score.
"""

from __future__ import annotations

from collections.abc import Sequence

from maelm_jax.finetune.tasks.glue import examples
from maelm_jax.infra import paths


def write_submission(directory: paths.Path, task: examples.TaskSpec, split: str,
                     index: Sequence[str], predictions: Sequence) -> paths.Path:
    """Writes directory/<name>.tsv for one test split; returns its path.

    predictions: [N] class ids (or scores for STS-B), in the order of `index`.
    """
    _, _, stem = task.split_info(split)
    paths.make_dirs(directory)
    path = directory / f"{stem}.tsv"
    rows = zip(index, examples.label_strings(task, predictions), strict=False)
    paths.write_text(path, "index\tprediction\n" + "".join(f"{i}\t{p}\n" for i, p in rows))
    return path
