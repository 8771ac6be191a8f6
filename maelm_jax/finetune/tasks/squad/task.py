"""SQuAD 2.0 (or 1.1): answer spans over context windows, scored by the official script.

config.task = "squad"; the kind's own fields are config.squad.* (the version, the JSON
files, windowing and answer decoding). Its head is heads.SpanExtractor, its metrics the
official script of its version (metrics.py), its outputs predictions.json and friends.

The reported numbers are the official script's on the files a run writes: SQuAD 2.0's
are ``evaluate-v2.0.py dev.json predictions.json --na-prob-file null_odds.json
--na-prob-thresh <squad.null_score_diff_threshold>`` (best_* included: the threshold
search runs on the written predictions, as the script's does), SQuAD 1.1's
``evaluate-v1.1.py dev.json predictions.json``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import jax
import ml_collections
import numpy as np
from absl import logging

from maelm_jax.config import schema
from maelm_jax.finetune.tasks import base
from maelm_jax.finetune.tasks.squad import examples, metrics, outputs
from maelm_jax.infra import paths
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.workdirs import layout

if TYPE_CHECKING:
    import flax.linen as nn

    from maelm_jax.models import encoder as encoder_lib

VERSIONS = ("2.0", "1.1")
# Table 6 of the MAE-LM paper, SQuAD 2.0.
SQUAD_GRID = {
    "num_epochs": (2, 3),
    "learning_rate": {"base": (2e-5, 3e-5, 4e-5, 5e-5), "large": (7e-6, 1e-5, 2e-5, 3e-5)},
    "batch_size": (16, 32),
    "warmup_ratio": (0.06, 0.10),
}


def read_examples(config: ml_collections.ConfigDict,
                  split: str) -> list[examples.SquadExample]:
    """The "train" or "validation" questions, from the JSON files or TFDS."""
    s, d = config.squad, config.data
    if d.source == "tfds":
        return examples.read_squad_tfds(examples.tfds_name(s.version, d.tfds_name), split,
                                     d.tfds_data_dir)
    return examples.read_squad_json(s.train_file if split == "train" else s.dev_file)


class SquadTask(base.Task):
    """SQuAD 2.0 (or 1.1): answer spans over windows, scored by the official script."""

    kind = "squad"
    name = "SQuAD"
    primary_metric = "f1"  # the paper reports EM and F1; runs are compared by F1

    @classmethod
    def task_names(cls) -> tuple[str, ...]:
        return ("squad",)

    @classmethod
    def add_defaults(cls, c: ml_collections.ConfigDict) -> None:
        c.squad = ml_collections.ConfigDict()
        c.squad.version = "2.0"  # "2.0" (with unanswerable questions) or "1.1"
        c.squad.train_file = ""  # the official JSON files (train-v2.0.json, dev-v2.0.json)
        c.squad.dev_file = ""
        c.squad.doc_stride = 128  # tokens between the starts of consecutive context windows
        c.squad.max_query_len = 64  # question tokens kept
        c.squad.max_answer_len = 30  # tokens, for the predicted span
        c.squad.n_best = 20  # start / end candidates per window, and answers kept per question
        c.squad.null_score_diff_threshold = 0.0  # answer "" when null - best span > this
        # The start/end softmax runs over the context and <s> (no answer) only, in training
        # and inference, as the official SQuAD head does; False: over every real token.
        c.squad.exclude_question = True

    @classmethod
    def fields(cls) -> dict[str, schema.Field]:
        return {
            "squad.version": schema.choice(*VERSIONS),
            "squad.train_file": schema.path("the SQuAD train JSON"),
            "squad.dev_file": schema.path("the SQuAD dev JSON"),
            "squad.doc_stride": schema.integer(1),
            "squad.max_query_len": schema.integer(1),
            "squad.max_answer_len": schema.integer(1),
            "squad.n_best": schema.integer(1),
            "squad.null_score_diff_threshold": schema.number(),
            "squad.exclude_question": schema.boolean(),
        }

    @classmethod
    def validate(cls, c: ml_collections.ConfigDict) -> None:
        base.require(c.metric == "maelm", "metric",
                     "'maelm' for SQuAD (3ML reports no SQuAD metric; runs compare by F1)",
                     c.metric)
        if c.data.source == "files":
            base.require(bool(c.squad.train_file), "squad.train_file", "the SQuAD train JSON",
                         "")
            base.require(bool(c.squad.dev_file), "squad.dev_file", "the SQuAD dev JSON", "")

    @classmethod
    def paper_grid(cls, task: str, size: str, paper: str) -> dict:
        if paper == "3ml":
            raise base.FinetuneConfigError("the 3ML paper fine-tunes on GLUE only; use the "
                                           "MAE-LM grid for SQuAD")
        return {k: tuple(v[size] if isinstance(v, dict) else v) for k, v in SQUAD_GRID.items()}

    @classmethod
    def dev_sequences(cls, run_cfg: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
                      seq_len: int) -> list[np.ndarray]:
        s = run_cfg.squad
        return examples.make_features(read_examples(run_cfg, "validation"), tok, seq_len,
                                   s.doc_stride, s.max_query_len, training=False).sequences

    @classmethod
    def export_head(cls, run_cfg: ml_collections.ConfigDict) -> base.ExportHead:
        return base.ExportHead("MaelmForQuestionAnswering",
                               {"qa_context_only": bool(run_cfg.squad.exclude_question)},
                               "qa_outputs", "SQuAD " + run_cfg.squad.version)

    def __init__(self, config: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
                 max_len: int):
        self.config, self.tok, self.max_len = config, tok, max_len
        s, d = config.squad, config.data
        self.version_2 = s.version == "2.0"
        train, dev = read_examples(config, "train"), read_examples(config, "validation")
        train = train[: d.max_train_examples or None]
        self.dev_examples = dev[: d.max_eval_examples or None]
        self.dev_is_partial = len(self.dev_examples) < len(dev)
        self.gold = examples.gold_answers(self.dev_examples)
        unanswerable = next((qid for qid, answers in self.gold.items() if not answers), None)
        if not self.version_2 and unanswerable is not None:
            raise examples.SquadDataError(
                f"config.squad.version=1.1: dev question {unanswerable!r} has no answer, "
                "which the SQuAD 1.1 script cannot score; a SQuAD 2.0 file needs "
                "--config.squad.version=2.0")
        args = (tok, max_len, s.doc_stride, s.max_query_len)
        features = examples.make_features(train, *args, training=True)
        self.train = base.Split(features.sequences,
                                {"start_positions": features.start_positions,
                                 "end_positions": features.end_positions})
        self.dev_features = examples.make_features(self.dev_examples, *args, training=False)
        self.eval = {"dev": base.Split(self.dev_features.sequences, {})}
        logging.info("SQuAD %s: %d train questions -> %d windows, %d dev questions -> %d "
                     "windows", s.version, len(train), len(self.train), len(self.dev_examples),
                     len(self.dev_features))

    def model(self, encoder_cfg: encoder_lib.EncoderConfig) -> nn.Module:
        from maelm_jax.finetune import heads  # Flax: the kind's config side stays plain data

        return heads.SpanExtractor(encoder_cfg, self.config.squad.exclude_question)

    def loss_sums(self, outputs, batch: dict) -> tuple[jax.Array, jax.Array]:
        from maelm_jax.finetune import heads

        start, end = outputs
        return heads.span_loss_sums(start, end, batch["start_positions"],
                                    batch["end_positions"], batch["weights"])

    def eval_outputs(self, outputs) -> dict:
        start, end = outputs
        return {"start": start, "end": end}

    def _predict(self, run_eval: base.RunEval) -> outputs.Predictions:
        starts: list = [None] * len(self.dev_features)
        ends: list = [None] * len(self.dev_features)
        for rows, out in run_eval(self.dev_features.sequences, {}):
            for i, r in enumerate(rows):
                if r >= 0:
                    n = len(self.dev_features.sequences[r])
                    starts[r], ends[r] = out["start"][i, :n], out["end"][i, :n]
        s = self.config.squad
        return outputs.postprocess(
            self.dev_examples, self.dev_features, starts, ends, s.n_best, s.max_answer_len,
            self.version_2, s.null_score_diff_threshold)

    def _evaluate(self, predictions: outputs.Predictions) -> dict:
        """The official script of the version on what write_outputs writes (the counts,
        *total, left out). At the run's own threshold the script forces "" where the
        prediction is "" already; it scores the two alike except on an answerable
        question whose every gold answer normalises to "" (forced: wrong, predicted:
        right), and the run reports what the script gives."""
        if not self.version_2:
            out = metrics.evaluate_v1(self.gold, predictions.text)
        else:
            out = metrics.evaluate_v2(self.gold, predictions.text, predictions.null_odds,
                                      self.config.squad.null_score_diff_threshold)
        return {k: float(v) for k, v in out.items() if not k.endswith("total")}

    def score(self, run_eval: base.RunEval) -> dict:
        return self._evaluate(self._predict(run_eval))

    def write_outputs(self, workdir: paths.Path, run_eval: base.RunEval) -> list[str]:
        """predictions.json (qid -> text), null_odds.json (SQuAD 2.0: qid -> no-answer
        score, the official script's --na-prob-file) and nbest_predictions.json for the dev
        set. ASCII JSON: the official scripts read them in the locale's encoding."""
        predictions = self._predict(run_eval)
        directory = workdir / layout.PREDICTIONS_DIR
        paths.make_dirs(directory)
        files = {"predictions.json": predictions.text, "nbest_predictions.json": predictions.nbest}
        if self.version_2:
            files["null_odds.json"] = predictions.null_odds
        for name, content in files.items():
            paths.write_text(directory / name, json.dumps(content, indent=1))
        if self.dev_is_partial:
            logging.info("SQuAD: scored on the first %d dev questions (data.max_eval_examples)"
                         ", so the official script on the whole dev file differs",
                         len(self.dev_examples))
        else:
            logging.info("SQuAD: the official script on these files gives the reported "
                         "numbers: %s", self.official_command(directory))
        return [str(directory / name) for name in files]

    def official_command(self, directory: paths.Path) -> str:
        """The official evaluation's command line on the files in `directory`."""
        s = self.config.squad
        dev = s.dev_file or f"dev-v{s.version}.json"
        if not self.version_2:
            return f"python evaluate-v1.1.py {dev} {directory / 'predictions.json'}"
        return (f"python evaluate-v2.0.py {dev} {directory / 'predictions.json'} "
                f"--na-prob-file {directory / 'null_odds.json'} "
                f"--na-prob-thresh {s.null_score_diff_threshold!r}")
