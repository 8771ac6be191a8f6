"""GLUE and SQuAD behind one interface, so the training loop knows neither.

A task reads and encodes its splits, builds its model, defines the loss (as sums, divided
once by the batch's real examples) and what the eval step returns, turns eval outputs
into the benchmark's metrics (percentages, as the papers and the SQuAD script report),
and writes its predictions (GLUE submission files; SQuAD predictions.json and friends).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from maelm_jax import layout, paths
from maelm_jax import tokenizer as tokenizer_lib
from maelm_jax.finetune import (
    data,
    glue,
    heads,
    metrics,
    squad,
    squad_metrics,
    squad_postprocess,
    submission,
)
from maelm_jax.models import encoder as encoder_lib

# (rows [B], outputs {name: [B, ...]}) per eval batch; rows of -1 are filler.
BatchOutputs = list[tuple[np.ndarray, dict]]
RunEval = Callable[[Sequence[np.ndarray], dict], BatchOutputs]


@dataclasses.dataclass
class Split:
    """Encoded sequences plus per-example targets ({name: [N, ...]})."""

    sequences: list[np.ndarray]
    targets: dict
    index: list[str] | None = None  # GLUE rows' keys, for submission files

    def __len__(self) -> int:
        return len(self.sequences)


class GlueTask:
    """A GLUE task: sentence (pair) classification or STS-B regression on the first token."""

    def __init__(self, config: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
                 max_len: int):
        self.config, self.task = config, glue.get_task(config.task)
        self.max_len, self.tok = max_len, tok
        d = config.data
        self._read_args = {"source": d.source, "data_dir": d.data_dir,
                           "tfds_dataset": d.tfds_name, "tfds_data_dir": d.tfds_data_dir}
        train = glue.read_split(self.task, "train", **self._read_args).head(d.max_train_examples)
        self.train = self._encode(train)
        self.eval = {s: self._encode(glue.read_split(self.task, s, **self._read_args)
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

    def _encode(self, examples: glue.GlueExamples) -> Split:
        return Split(data.encode_texts(self.tok, examples.texts, self.max_len),
                     {"labels": examples.labels}, examples.index)

    def model(self, encoder_cfg: encoder_lib.EncoderConfig) -> nn.Module:
        return heads.SequenceClassifier(encoder_cfg, self.task.num_outputs,
                                        self.config.model.classifier_dropout,
                                        self.config.model.pooling)

    def loss_sums(self, outputs: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
        if self.task.is_regression:
            return heads.regression_loss_sums(outputs, batch["labels"], batch["weights"])
        return heads.classification_loss_sums(outputs, batch["labels"], batch["weights"])

    def eval_outputs(self, outputs: jax.Array) -> dict:
        if self.task.is_regression:
            return {"prediction": outputs[:, 0]}
        return {"prediction": jnp.argmax(outputs, axis=-1)}

    def _predictions(self, split: Split, batches: BatchOutputs) -> np.ndarray:
        return data.scatter_rows([(rows, out["prediction"]) for rows, out in batches], len(split))

    def score(self, run_eval: RunEval) -> dict:
        """Every dev split's metrics, in percent."""
        out = {}
        for name, split in self.eval.items():
            predictions = self._predictions(split, run_eval(split.sequences, split.targets))
            for k, v in metrics.task_metrics(self.task, self._labels[name], predictions).items():
                out[self._prefix(name) + k] = 100.0 * v
        if self.task.name == "MNLI":
            out.update(metrics.mnli_mean(out))
        return out

    def write_outputs(self, workdir: paths.Path, run_eval: RunEval) -> list[str]:
        """GLUE submission files for the test splits that are available."""
        if not self.config.predict_test:
            return []
        written = []
        for name in self.task.test_splits:
            if not glue.split_available(self.task, name, **self._read_args):
                logging.warning("no %s %s split: no submission file written", self.task.name,
                                name)
                continue
            split = self._encode(glue.read_split(self.task, name, **self._read_args))
            predictions = self._predictions(split, run_eval(split.sequences, split.targets))
            path = submission.write_submission(workdir / layout.PREDICTIONS_DIR, self.task,
                                               name, split.index, predictions)
            written.append(str(path))
        return written


class SquadTask:
    """SQuAD 2.0 (or 1.1): answer spans over windows, scored by the official script."""

    name = "SQuAD"
    primary_metric = "f1"  # the paper reports EM and F1; runs are compared by F1

    def __init__(self, config: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
                 max_len: int):
        self.config, self.tok, self.max_len = config, tok, max_len
        s, d = config.squad, config.data
        self.version_2 = s.version == "2.0"
        if d.source == "tfds":
            name = squad.tfds_name(s.version, d.tfds_name)
            train = squad.read_squad_tfds(name, "train", d.tfds_data_dir)
            dev = squad.read_squad_tfds(name, "validation", d.tfds_data_dir)
        else:
            train, dev = squad.read_squad_json(s.train_file), squad.read_squad_json(s.dev_file)
        train = train[: d.max_train_examples or None]
        self.dev_examples = dev[: d.max_eval_examples or None]
        self.gold = squad.gold_answers(self.dev_examples)
        args = (tok, max_len, s.doc_stride, s.max_query_len)
        features = squad.make_features(train, *args, training=True)
        self.train = Split(features.sequences, {"start_positions": features.start_positions,
                                                "end_positions": features.end_positions})
        self.dev_features = squad.make_features(self.dev_examples, *args, training=False)
        self.eval = {"dev": Split(self.dev_features.sequences, {})}
        logging.info("SQuAD %s: %d train questions -> %d windows, %d dev questions -> %d "
                     "windows", s.version, len(train), len(self.train), len(self.dev_examples),
                     len(self.dev_features))

    def model(self, encoder_cfg: encoder_lib.EncoderConfig) -> nn.Module:
        return heads.SpanExtractor(encoder_cfg, self.config.squad.exclude_question)

    def loss_sums(self, outputs, batch: dict) -> tuple[jax.Array, jax.Array]:
        start, end = outputs
        return heads.span_loss_sums(start, end, batch["start_positions"],
                                    batch["end_positions"], batch["weights"])

    def eval_outputs(self, outputs) -> dict:
        start, end = outputs
        return {"start": start, "end": end}

    def _predict(self, run_eval: RunEval) -> squad_postprocess.Predictions:
        starts: list = [None] * len(self.dev_features)
        ends: list = [None] * len(self.dev_features)
        for rows, out in run_eval(self.dev_features.sequences, {}):
            for i, r in enumerate(rows):
                if r >= 0:
                    n = len(self.dev_features.sequences[r])
                    starts[r], ends[r] = out["start"][i, :n], out["end"][i, :n]
        s = self.config.squad
        return squad_postprocess.postprocess(
            self.dev_examples, self.dev_features, starts, ends, s.n_best, s.max_answer_len,
            self.version_2, s.null_score_diff_threshold)

    def _evaluate(self, predictions: squad_postprocess.Predictions) -> dict:
        out = squad_metrics.evaluate(self.gold, predictions.text)
        if self.version_2:
            # The official best-threshold search ranks questions by their no-answer score;
            # it needs each question's best span (not "" where the threshold chose null).
            best = squad_metrics.evaluate(self.gold, predictions.best_span, predictions.null_odds)
            out.update({k: v for k, v in best.items() if k.startswith("best_")})
        return {k: float(v) for k, v in out.items() if not k.endswith("total")}

    def score(self, run_eval: RunEval) -> dict:
        return self._evaluate(self._predict(run_eval))

    def write_outputs(self, workdir: paths.Path, run_eval: RunEval) -> list[str]:
        """predictions.json (qid -> text), null_odds.json (the official script's
        --na-prob-file) and nbest_predictions.json for the dev set."""
        predictions = self._predict(run_eval)
        directory = workdir / layout.PREDICTIONS_DIR
        paths.make_dirs(directory)
        files = {"predictions.json": predictions.text, "nbest_predictions.json": predictions.nbest}
        if self.version_2:
            files["null_odds.json"] = predictions.null_odds
        for name, content in files.items():
            paths.write_text(directory / name, json.dumps(content, indent=1, ensure_ascii=False))
        return [str(directory / name) for name in files]


def make_task(config: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer, max_len: int):
    if config.task == "squad":
        return SquadTask(config, tok, max_len)
    return GlueTask(config, tok, max_len)
