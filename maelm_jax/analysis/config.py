"""The effective-rank analysis config: defaults, fields and validation.

`configs/analysis/rank.py` starts from `rank_defaults()`; main.py runs it when
``config.mode == "rank"`` (maelm_jax/analysis/run.py).

``config.source`` says which held-out text the encoders read:

* ``kind="validation"`` (default): each run's own. A pretraining run's validation blocks
  (those its evals score); a fine-tuning run's dev set, read as its config.json says
  (GLUE: the first dev split, MNLI's matched; SQuAD: the dev file's windows).
* a corpus kind of the pretraining config's ``data.sources`` (``text``, ``jsonl``,
  ``wikiextractor``, ``builtin``, ``tfds``, with that kind's fields, e.g.
  ``--config.source.kind=text --config.source.path=held_out.txt``): its documents packed
  into blocks of ``seq_len`` as pretraining packs them.
* ``kind="glue"`` with ``task`` and ``data_dir`` (the GLUE directory, as fine-tuning's
  ``data.data_dir``), optionally ``split`` (default: the task's first dev split).
* ``kind="squad"`` with ``path`` (the official dev JSON).
"""

from __future__ import annotations

from typing import Any

import ml_collections

from maelm_jax.config import schema
from maelm_jax.config import sections as config_sections
from maelm_jax.data import sources
from maelm_jax.infra import errors, paths

CORPUS_KINDS = ("builtin", *sources.FILE_KINDS, "tfds")
SOURCE_KINDS = ("validation", *CORPUS_KINDS, "glue", "squad")
# Fields of the analysis's own source kinds (corpus kinds are checked by data/sources.py).
_OWN_SOURCE_FIELDS = {
    "validation": ((), ()),
    "glue": (("task", "data_dir"), ("split",)),
    "squad": (("path",), ()),
}
# n = this many times d_model of each run when config.num_tokens is 0 (the paper: n ~ 5e6
# tokens for d = 768, about 6,500 d; at 100 d the sampling alone moved a rank by about 1).
# The tokens stream through the Gram sums: memory does not grow with n.
DEFAULT_TOKENS_PER_DIM = 1000


class RankConfigError(errors.UserError):
    """An analysis config mistake; the message names the field and what is expected."""


def rank_defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "rank"  # main.py dispatches on it
    # The encoders to analyse: pretraining or fine-tuning workdirs, or <workdir>/checkpoints/
    # <step> directories; comma-separated or a list. Each is one line of the plots.
    c.runs = ""
    c.tau = 0.9  # rank_tau: the smallest k whose top-k squared singular values hold tau
    # Also the ranks of the centred representations (each statistic's mean row subtracted),
    # next to the paper's uncentred ones: the mean direction alone can hold much of the
    # energy of a small model's H and count as a dimension.
    c.center = True
    c.num_tokens = 0  # n, the rows of H (real tokens); 0 = 1000 x each run's d_model
    c.mask_ratio = 0.15  # positions set to [MASK] in the "with [MASK]" inputs (Fig. 1)
    c.batch_size = 32  # sequences per forward pass (global; split over the mesh)
    # Sequence length; 0 = each run's own (a pretraining run's data.seq_len, which its
    # validation blocks have; a fine-tuning run's data.max_seq_len, or max positions <= 512).
    c.seq_len = 0
    c.source = ml_collections.ConfigDict({"kind": "validation"})  # see the module docstring
    c.seed = 0  # which positions are masked, and the bootstrap's draws
    # Bootstrap 95 % intervals (maelm_jax/analysis/bootstrap.py): the batches summed in this
    # many groups, resampled this many times (0: no intervals).
    c.bootstrap_groups = 20
    c.bootstrap_replicates = 200
    c.dtype = "float32"  # compute dtype of the encoders; the Gram sums are always float32
    config_sections.MESH.add_to(c)  # as in pretraining
    return c


def _run_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return [str(part) for part in value]


FIELDS: dict[str, schema.Field] = {
    "mode": schema.choice("rank"),
    "runs": schema.Field((str, list, tuple), "workdirs, comma-separated or a list",
                         lambda v: bool(_run_list(v))),
    "tau": schema.number(0.0, 1.0, low_open=True),
    "center": schema.boolean(),
    "num_tokens": schema.integer(0),
    "mask_ratio": schema.number(0.0, 1.0, low_open=True, high_open=True),
    "batch_size": schema.integer(1),
    "seq_len": schema.integer(0),
    "source": schema.free_form("a source: kind='validation', a corpus kind, 'glue' or 'squad'"),
    "seed": schema.integer(0),
    "bootstrap_groups": schema.integer(2),
    "bootstrap_replicates": schema.integer(0),
    "dtype": schema.choice("float32", "bfloat16", "float16"),
    **config_sections.MESH.fields(),
}


def runs(config: ml_collections.ConfigDict) -> list[str]:
    """config.runs as a list of paths."""
    return _run_list(config.runs)


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises RankConfigError (or sources.SourceError) for the first problem found."""
    schema.check(config, FIELDS, rank_defaults(), RankConfigError)
    names = runs(config)
    if len(set(names)) != len(names):
        raise RankConfigError(f"config.runs: expected distinct workdirs, got {names}")
    kind = config.source.get("kind")
    if kind not in SOURCE_KINDS:
        raise RankConfigError(f"config.source.kind: expected one of {', '.join(SOURCE_KINDS)}, "
                              f"got {kind!r}")
    if kind in CORPUS_KINDS:
        sources.validate_source(config.source, "config.source")
        return
    required, optional = _OWN_SOURCE_FIELDS[kind]
    for name in config.source.keys():
        if name not in ("kind", *required, *optional):
            raise RankConfigError(f"config.source.{name}: unknown field for a {kind!r} source; "
                                  f"expected {', '.join(('kind', *required, *optional))}")
    for name in required:
        value = config.source.get(name)
        if not isinstance(value, str) or not value:
            raise RankConfigError(f"config.source.{name}: required for a {kind!r} source")


def resolve_paths(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy whose run and source paths are absolute against the current directory."""
    c = config.copy_and_resolve_references()
    with c.ignore_type():
        c.runs = [paths.absolute(path, "config.runs") for path in runs(c)]
    for name in ("path", "data_dir"):
        if isinstance(c.source.get(name), (str, list, tuple)):
            c.source[name] = schema.absolute_spec(c.source[name], f"config.source.{name}")
    return c
