"""The GLUE tasks and their two readers: local TSV files and TFDS.

TSV files follow the layout written by the standard ``download_glue_data.py``: one
directory per task (``SST-2/train.tsv``, ``MNLI/dev_matched.tsv``, ...), a header row
except in CoLA's train and dev files, ``index`` (QQP: ``id``) in the test files. TFDS
reads ``glue/<name>`` through ``tfds.data_source`` (ArrayRecord), without TensorFlow.

Both readers return the same `GlueExamples`: the texts, the labels as ids into the
task's ``label_names`` (floats for STS-B) and each row's index (the GLUE submission key).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import sys
from collections.abc import Sequence

import numpy as np
from absl import logging

from maelm_jax.infra import errors, paths

# Sentences in GLUE are never this long, but csv's default limit (128K) is near what a
# QQP row with a stray quote can reach under QUOTE_NONE.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


class GlueDataError(errors.UserError):
    """A GLUE task name, file or row that cannot be used (one-line message)."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One GLUE task: its files, columns, labels, metrics and submission names."""

    name: str  # GLUE's spelling: the task directory and the submission file stem
    text_columns: tuple[str, ...]  # TSV header names of sentence A (and B)
    label_column: str | None  # TSV header name of the label
    # Label strings as in the files and the submission; () for regression (STS-B).
    label_names: tuple[str, ...]
    tfds_config: str  # glue/<tfds_config>
    tfds_features: tuple[str, ...]  # TFDS feature names of sentence A (and B)
    small: bool  # Table 5's "GLUE small tasks" (CoLA, RTE, MRPC, STS-B; WNLI too)
    primary_metric: str  # the number the MAE-LM paper reports for the task
    # split -> (TSV file stem, TFDS split, submission file stem or None)
    splits: tuple[tuple[str, str, str, str | None], ...] = (
        ("train", "train", "train", None),
        ("dev", "dev", "validation", None),
        ("test", "test", "test", ""),  # "" = the task name
    )
    # CoLA's train and dev files have no header: (label column, sentence column) positions.
    headerless_columns: tuple[int, int] | None = None

    @property
    def is_regression(self) -> bool:
        return not self.label_names

    @property
    def num_outputs(self) -> int:
        return len(self.label_names) or 1

    @property
    def eval_splits(self) -> tuple[str, ...]:
        return tuple(s[0] for s in self.splits if s[0].startswith("dev"))

    @property
    def test_splits(self) -> tuple[str, ...]:
        return tuple(s[0] for s in self.splits if s[0].startswith("test"))

    def split_info(self, split: str) -> tuple[str, str, str | None]:
        for name, stem, tfds_split, submission in self.splits:
            if name == split:
                return stem, tfds_split, (self.name if submission == "" else submission)
        raise GlueDataError(f"GLUE task {self.name} has no split {split!r}; "
                            f"available: {', '.join(s[0] for s in self.splits)}")


_BINARY = ("0", "1")
_NLI = ("entailment", "not_entailment")
_MNLI_SPLITS = (
    ("train", "train", "train", None),
    ("dev_matched", "dev_matched", "validation_matched", None),
    ("dev_mismatched", "dev_mismatched", "validation_mismatched", None),
    ("test_matched", "test_matched", "test_matched", "MNLI-m"),
    ("test_mismatched", "test_mismatched", "test_mismatched", "MNLI-mm"),
)

TASKS = {
    t.name: t
    for t in (
        TaskSpec("CoLA", ("sentence",), "label", _BINARY, "cola", ("sentence",), True, "mcc",
                 headerless_columns=(1, 3)),
        TaskSpec("SST-2", ("sentence",), "label", _BINARY, "sst2", ("sentence",), False,
                 "accuracy"),
        TaskSpec("MRPC", ("#1 String", "#2 String"), "Quality", _BINARY, "mrpc",
                 ("sentence1", "sentence2"), True, "accuracy"),
        TaskSpec("STS-B", ("sentence1", "sentence2"), "score", (), "stsb",
                 ("sentence1", "sentence2"), True, "spearman"),
        TaskSpec("QQP", ("question1", "question2"), "is_duplicate", _BINARY, "qqp",
                 ("question1", "question2"), False, "accuracy"),
        TaskSpec("MNLI", ("sentence1", "sentence2"), "gold_label",
                 ("entailment", "neutral", "contradiction"), "mnli", ("premise", "hypothesis"),
                 False, "accuracy", splits=_MNLI_SPLITS),
        TaskSpec("QNLI", ("question", "sentence"), "label", _NLI, "qnli", ("question", "sentence"),
                 False, "accuracy"),
        TaskSpec("RTE", ("sentence1", "sentence2"), "label", _NLI, "rte",
                 ("sentence1", "sentence2"), True, "accuracy"),
        # TFDS orders WNLI's classes (not_entailment, entailment), which is 0 / 1 as in the file.
        TaskSpec("WNLI", ("sentence1", "sentence2"), "label", _BINARY, "wnli",
                 ("sentence1", "sentence2"), True, "accuracy"),
    )
}
TASK_NAMES = tuple(TASKS)


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


_BY_KEY = {_key(name): task for name, task in TASKS.items()}


def get_task(name: str) -> TaskSpec:
    """The task for 'SST-2', 'sst2', 'sst-2', ... (case, '-' and '_' do not matter)."""
    task = _BY_KEY.get(_key(name))
    if task is None:
        raise GlueDataError(f"unknown GLUE task {name!r}; expected one of {', '.join(TASKS)}")
    return task


@dataclasses.dataclass
class GlueExamples:
    """One split of a task. texts: one list per text column, each [N] strings."""

    texts: list[list[str]]
    labels: np.ndarray  # [N] int32 ids into label_names (float32 for STS-B); -1 / nan unknown
    index: list[str]  # [N] the row keys of the GLUE submission (the test files' index)

    def __len__(self) -> int:
        return len(self.index)

    def head(self, n: int) -> GlueExamples:
        """The first n examples (all when n is 0)."""
        if not n:
            return self
        return GlueExamples([t[:n] for t in self.texts], self.labels[:n], self.index[:n])


def task_dir(data_dir: str, task: TaskSpec) -> paths.Path:
    """<data_dir>/<TASK> when it exists (the standard download), else data_dir itself."""
    nested = paths.Path(data_dir) / task.name
    return nested if nested.is_dir() else paths.Path(data_dir)


def tsv_path(data_dir: str, task: TaskSpec, split: str) -> paths.Path:
    stem, _, _ = task.split_info(split)
    return task_dir(data_dir, task) / f"{stem}.tsv"


def read_tsv(data_dir: str, task: TaskSpec, split: str,
             require_labels: bool = True) -> GlueExamples:
    """Reads <data_dir>/<TASK>/<split>.tsv.

    Rows with a missing field (a few in QQP's train file) are skipped and counted, as
    TFDS does. Labels are required in train and dev files; test files have none.
    """
    path = tsv_path(data_dir, task, split)
    if not path.is_file():
        raise GlueDataError(f"config.data.data_dir: {task.name} {split} file {path} does not "
                            f"exist (expected the layout of download_glue_data.py)")
    # utf-8-sig: MRPC's files start with a byte order mark. QUOTE_NONE: quotes are text.
    # newline="": line breaks inside a field are the csv reader's to keep.
    text = io.StringIO(path.read_bytes().decode("utf-8-sig"), newline="")
    rows = list(csv.reader(text, delimiter="\t", quoting=csv.QUOTE_NONE))
    if task.headerless_columns and not split.startswith("test"):
        label_col, text_col = task.headerless_columns
        text_cols, label_idx, index_col, body = [text_col], label_col, None, rows
    else:
        header, body = (rows[0] if rows else []), rows[1:]
        missing = [c for c in task.text_columns if c not in header]
        if missing:
            raise GlueDataError(f"{path}: no column {missing[0]!r} in the header {header}")
        text_cols = [header.index(c) for c in task.text_columns]
        label_idx = header.index(task.label_column) if task.label_column in header else None
        index_col = next((header.index(c) for c in ("index", "id") if c in header), None)
    if label_idx is None and require_labels:
        raise GlueDataError(f"{path}: no label column {task.label_column!r}")
    texts: list[list[str]] = [[] for _ in text_cols]
    labels, index, skipped = [], [], 0
    needed = max(text_cols + [label_idx if label_idx is not None else 0])
    is_test = split.startswith("test")
    for row_number, row in enumerate(body):
        malformed = len(row) <= needed or any(
            not row[c].strip() for c in text_cols + ([label_idx] if label_idx is not None else [])
        )
        if malformed and not is_test:  # a test row is kept: the submission needs every index
            skipped += 1
            continue
        for column, c in zip(texts, text_cols, strict=False):
            column.append(row[c].strip() if c < len(row) else "")
        has_label = label_idx is not None and label_idx < len(row) and row[label_idx].strip()
        labels.append(_label(task, row[label_idx], path, row_number) if has_label
                      else _unknown_label(task))
        index.append(row[index_col] if index_col is not None else str(row_number))
    if skipped:
        logging.warning("%s: skipped %d malformed row(s)", path, skipped)
    if not index:
        raise GlueDataError(f"{path}: no examples")
    dtype = np.float32 if task.is_regression else np.int32
    return GlueExamples(texts, np.asarray(labels, dtype), index)


def _unknown_label(task: TaskSpec):
    return float("nan") if task.is_regression else -1


def _label(task: TaskSpec, value: str, path: str, row: int):
    value = value.strip()
    if task.is_regression:
        try:
            return float(value)
        except ValueError:
            raise GlueDataError(f"{path}: row {row + 1}: score {value!r} is not a number") from None
    if value not in task.label_names:
        raise GlueDataError(f"{path}: row {row + 1}: label {value!r} is not one of "
                            f"{task.label_names}")
    return task.label_names.index(value)


def tfds_name(task: TaskSpec, configured: str = "") -> str:
    return configured or f"glue/{task.tfds_config}"


def read_tfds(task: TaskSpec, split: str, name: str = "", data_dir: str = "") -> GlueExamples:
    """Reads a prepared TFDS GLUE dataset (ArrayRecord) without TensorFlow.

    TFDS's class ids follow the same order as `TaskSpec.label_names`; test labels are -1.
    """
    import tensorflow_datasets as tfds  # heavy import: only TFDS users pay for it

    name = tfds_name(task, name)
    _, tfds_split, _ = task.split_info(split)
    try:
        records = tfds.data_source(name, split=tfds_split, data_dir=data_dir or None)
    except Exception as e:  # tfds raises many types; the first line says what was wrong
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GlueDataError(f"config.data.tfds_name: TFDS dataset {name!r} split "
                            f"{tfds_split!r}: {message}") from None
    rows = records.__getitems__(list(range(len(records))))
    texts = [[_text(r[f]) for r in rows] for f in task.tfds_features]
    dtype = np.float32 if task.is_regression else np.int32
    labels = np.asarray([r["label"] for r in rows], dtype)
    if task.is_regression:
        # TFDS has no "missing" float; test scores are -1, which no STS-B score can be.
        labels = np.where(labels < 0, np.nan, labels).astype(np.float32)
    index = [str(int(r["idx"])) for r in rows]
    return GlueExamples(texts, labels, index)


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def read_split(task: TaskSpec, split: str, source: str, data_dir: str = "", tfds_dataset: str = "",
               tfds_data_dir: str = "") -> GlueExamples:
    """One split from "files" (TSV) or "tfds"."""
    if source == "tfds":
        return read_tfds(task, split, tfds_dataset, tfds_data_dir)
    return read_tsv(data_dir, task, split, require_labels=not split.startswith("test"))


def split_available(task: TaskSpec, split: str, source: str, data_dir: str = "",
                    tfds_dataset: str = "", tfds_data_dir: str = "") -> bool:
    """Whether a split can be read (GLUE test files are often not downloaded)."""
    if source == "tfds":
        import tensorflow_datasets as tfds

        try:
            builder = tfds.builder(tfds_name(task, tfds_dataset), data_dir=tfds_data_dir or None)
            return task.split_info(split)[1] in builder.info.splits
        except Exception:  # not prepared, unknown name: the split is not there
            return False
    return tsv_path(data_dir, task, split).is_file()


def label_strings(task: TaskSpec, predictions: Sequence) -> list[str]:
    """Class ids -> the label strings GLUE's submission expects; scores -> '%.3f'."""
    if task.is_regression:
        return [f"{float(p):.3f}" for p in predictions]
    return [task.label_names[int(p)] for p in predictions]
