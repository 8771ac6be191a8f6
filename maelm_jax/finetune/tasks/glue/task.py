"""GLUE: sentence (pair) classification, or STS-B regression, on the pooled first token.

The kind serves every GLUE task name (examples.py: CoLA, SST-2, ..., in any of their
spellings); its data are the standard TSV files under config.data.data_dir or TFDS; its
metrics are GLUE's (metrics.py); it writes the GLUE server's submission files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from maelm_jax.finetune import data
from maelm_jax.finetune.tasks import base
from maelm_jax.finetune.tasks.glue import examples, metrics, outputs
from maelm_jax.infra import paths
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.workdirs import layout

if TYPE_CHECKING:
    import flax.linen as nn

    from maelm_jax.models import encoder as encoder_lib

# Table 5 of the MAE-LM paper, GLUE. "base" covers base and base++; "large" is large++.
GLUE_SMALL_GRID = {
    "num_epochs": (2, 3, 5, 10),
    "learning_rate": {"base": (2e-5, 3e-5, 4e-5, 5e-5), "large": (7e-6, 1e-5, 2e-5, 3e-5)},
    "batch_size": (16, 32),
    "warmup_ratio": (0.06, 0.10),
}
GLUE_LARGE_GRID = {
    "num_epochs": (2, 3, 5),
    "learning_rate": {"base": (1e-5, 2e-5, 3e-5, 4e-5), "large": (5e-6, 7e-6, 1e-5, 2e-5)},
    "batch_size": (32,),
    "warmup_ratio": (0.06,),
}
# 3ML Table 5 (borrowed from 24hBERT), with weight decay 0.1 and 6 % warmup.
THREEML_SMALL_GRID = {
    "num_epochs": (3, 5, 10),
    "learning_rate": (1e-5, 3e-5, 5e-5, 8e-5),
    "batch_size": (16, 32),
    "warmup_ratio": (0.06,),
}
THREEML_LARGE_GRID = {
    "num_epochs": (3, 5),
    "learning_rate": (5e-5, 8e-5),
    "batch_size": (32,),
    "warmup_ratio": (0.06,),
}
# 3ML Table 5's left column; every other GLUE task (CoLA, SST-2, MRPC, STS-B, RTE, and
# WNLI, which 3ML does not fine-tune) takes the right one. Not MAE-LM's split, which puts
# SST-2 with the large tasks.
THREEML_LARGE_TASKS = ("qqp", "mnli", "qnli")


def read_args(d: ml_collections.ConfigDict) -> dict:
    """glue.read_split's source arguments from config.data."""
    return {"source": d.source, "data_dir": d.data_dir, "tfds_dataset": d.tfds_name,
            "tfds_data_dir": d.tfds_data_dir}


def split_sequences(task: examples.TaskSpec, split: str, tok: tokenizer_lib.Tokenizer,
                    max_len: int, **read_kwargs) -> list[np.ndarray]:
    """A split encoded as fine-tuning encodes it (<s> A </s></s> B </s>); "" = the first
    dev split (MNLI's matched)."""
    read = examples.read_split(task, split or task.eval_splits[0], **read_kwargs)
    return data.encode_texts(tok, read.texts, max_len)


class GlueTask(base.Task):
    """A GLUE task: sentence (pair) classification or STS-B regression on the first token."""

    kind = "glue"

    @classmethod
    def task_names(cls) -> tuple[str, ...]:
        return tuple(t.tfds_config for t in examples.TASKS.values())

    @classmethod
    def serves(cls, task: str) -> bool:
        try:
            examples.get_task(task)
        except examples.GlueDataError:
            return False
        return True

    @classmethod
    def describe(cls) -> str:
        return f"a GLUE task ({', '.join(examples.TASK_NAMES)})"

    @classmethod
    def validate(cls, c: ml_collections.ConfigDict) -> None:
        if c.data.source == "files":
            base.require(bool(c.data.data_dir), "data.data_dir",
                         "the GLUE data directory (<data_dir>/SST-2/train.tsv, ...)", "")

    @classmethod
    def paper_grid(cls, task: str, size: str, paper: str) -> dict:
        if paper == "3ml":
            large = examples.get_task(task).tfds_config in THREEML_LARGE_TASKS
            return dict(THREEML_LARGE_GRID if large else THREEML_SMALL_GRID)
        table = GLUE_SMALL_GRID if examples.get_task(task).small else GLUE_LARGE_GRID
        return {k: tuple(v[size] if isinstance(v, dict) else v) for k, v in table.items()}

    @classmethod
    def dev_sequences(cls, run_cfg: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
                      seq_len: int) -> list[np.ndarray]:
        return split_sequences(examples.get_task(run_cfg.task), "", tok, seq_len,
                               **read_args(run_cfg.data))

    @classmethod
    def export_head(cls, run_cfg: ml_collections.ConfigDict) -> base.ExportHead:
        task = examples.get_task(run_cfg.task)
        labels = list(task.label_names) or ["score"]
        fields = {"id2label": dict(enumerate(labels)),
                  "label2id": {name: i for i, name in enumerate(labels)},
                  "problem_type": ("regression" if task.is_regression
                                   else "single_label_classification")}
        return base.ExportHead("MaelmForSequenceClassification", fields, "classifier",
                               task.name)

    def __init__(self, config: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
                 max_len: int):
        self.config, self.task = config, examples.get_task(config.task)
        self.max_len, self.tok = max_len, tok
        d = config.data
        self._read_args = read_args(d)
        train = examples.read_split(self.task, "train", **self._read_args).head(
            d.max_train_examples)
        self.train = self._encode(train)
        self.eval = {s: self._encode(examples.read_split(self.task, s, **self._read_args)
                                     .head(d.max_eval_examples))
                     for s in self.task.eval_splits}
        self._labels = {s: split.targets["labels"] for s, split in self.eval.items()}

    @property
    def name(self) -> str:
        return self.task.name

    @property
    def primary_metric(self) -> str:
        """The score runs are compared by: the config's paper's (config.metric)."""
        return metrics.REPORTED_METRIC[self.config.metric][self.task.name]

    def _prefix(self, split: str) -> str:
        """MNLI reports matched and mismatched: "m/accuracy", "mm/accuracy"."""
        if len(self.task.eval_splits) == 1:
            return ""
        return "m/" if split.endswith("_matched") else "mm/"

    def _encode(self, examples: examples.GlueExamples) -> base.Split:
        return base.Split(data.encode_texts(self.tok, examples.texts, self.max_len),
                          {"labels": examples.labels}, examples.index)

    def model(self, encoder_cfg: encoder_lib.EncoderConfig) -> nn.Module:
        from maelm_jax.finetune import heads  # Flax: the kind's config side stays plain data

        return heads.SequenceClassifier(encoder_cfg, self.task.num_outputs,
                                        self.config.model.classifier_dropout,
                                        self.config.model.pooling)

    def loss_sums(self, outputs: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
        from maelm_jax.finetune import heads

        if self.task.is_regression:
            return heads.regression_loss_sums(outputs, batch["labels"], batch["weights"])
        return heads.classification_loss_sums(outputs, batch["labels"], batch["weights"])

    def eval_outputs(self, outputs: jax.Array) -> dict:
        if self.task.is_regression:
            return {"prediction": outputs[:, 0]}
        return {"prediction": jnp.argmax(outputs, axis=-1)}

    def _predictions(self, split: base.Split, batches: base.BatchOutputs) -> np.ndarray:
        return data.scatter_rows([(rows, out["prediction"]) for rows, out in batches], len(split))

    def score(self, run_eval: base.RunEval) -> dict:
        """Every dev split's metrics, in percent."""
        out = {}
        for name, split in self.eval.items():
            predictions = self._predictions(split, run_eval(split.sequences, split.targets))
            for k, v in metrics.task_metrics(self.task, self._labels[name], predictions).items():
                out[self._prefix(name) + k] = 100.0 * v
        if self.task.name == "MNLI":
            out.update(metrics.mnli_mean(out))
        return out

    def write_outputs(self, workdir: paths.Path, run_eval: base.RunEval) -> list[str]:
        """GLUE submission files for the test splits that are available."""
        if not self.config.predict_test:
            return []
        written = []
        for name in self.task.test_splits:
            if not examples.split_available(self.task, name, **self._read_args):
                logging.warning("no %s %s split: no submission file written", self.task.name,
                                name)
                continue
            split = self._encode(examples.read_split(self.task, name, **self._read_args))
            predictions = self._predictions(split, run_eval(split.sequences, split.targets))
            path = outputs.write_submission(workdir / layout.PREDICTIONS_DIR, self.task,
                                               name, split.index, predictions)
            written.append(str(path))
        return written
