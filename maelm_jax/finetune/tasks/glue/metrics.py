"""GLUE metrics as the benchmark defines them, and the GLUE average as the papers do.

The GLUE scorer uses scikit-learn's accuracy, F1 (positive class 1), Matthews correlation
and scipy's Pearson / Spearman; these are the same formulas on numpy.

Which number per task the average takes (MAE-LM, Table 1 caption): "Spearman correlation
for STS, Matthews correlation for CoLA, and accuracy for the other tasks", over eight tasks
with MNLI counted once, by its matched accuracy. The paper's rows reproduce that way (e.g.
MAE-LM base: (87.2 + 91.6 + 92.9 + 93.8 + 63.1 + 79.1 + 90.2 + 90.9) / 8 = 86.1, and rows
without an MNLI-mm number still have an average). So MRPC and QQP count by accuracy; their
F1 is computed and reported too. The GLUE leaderboard convention (used by 3ML: mean of
acc and F1, of Pearson and Spearman, of MNLI-m and -mm) is `glue_average(...,
convention="leaderboard")`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from maelm_jax.finetune.tasks.glue import examples


def accuracy(labels: Sequence[int], predictions: Sequence[int]) -> float:
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    return float(np.mean(labels == predictions)) if len(labels) else 0.0


def f1_binary(labels: Sequence[int], predictions: Sequence[int], positive: int = 1) -> float:
    """F1 of the positive class; 0 when there is no true positive (as scikit-learn)."""
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    tp = np.sum((predictions == positive) & (labels == positive))
    fp = np.sum((predictions == positive) & (labels != positive))
    fn = np.sum((predictions != positive) & (labels == positive))
    return float(2 * tp / (2 * tp + fp + fn)) if tp else 0.0


def matthews_corrcoef(labels: Sequence[int], predictions: Sequence[int]) -> float:
    """Matthews correlation (the multiclass form of scikit-learn; 0 when undefined)."""
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    classes = np.union1d(labels, predictions)
    confusion = np.zeros((len(classes), len(classes)), np.float64)
    np.add.at(confusion, (np.searchsorted(classes, labels),
                          np.searchsorted(classes, predictions)), 1)
    t_sum, p_sum = confusion.sum(axis=1), confusion.sum(axis=0)
    n_correct, n = np.trace(confusion), confusion.sum()
    cov_ytyp = n_correct * n - np.dot(t_sum, p_sum)
    cov_ypyp = n**2 - np.dot(p_sum, p_sum)
    cov_ytyt = n**2 - np.dot(t_sum, t_sum)
    if cov_ypyp * cov_ytyt == 0:
        return 0.0
    return float(cov_ytyp / np.sqrt(cov_ytyt * cov_ypyp))


def _correlation(fn, labels, predictions) -> float:
    labels = np.asarray(labels, np.float64)
    predictions = np.asarray(predictions, np.float64)
    # A constant prediction (early in training) has no defined correlation; scipy returns
    # nan with a warning. 0 keeps medians and best-epoch choices meaningful.
    if len(labels) < 2 or np.ptp(labels) == 0 or np.ptp(predictions) == 0:
        return 0.0
    return float(fn(labels, predictions)[0])


# scipy.stats is imported where it is used: it takes about a second, which every main.py
# process would pay (this module is part of the config language) for a metric only an
# STS-B evaluation computes.
def pearson(labels: Sequence[float], predictions: Sequence[float]) -> float:
    import scipy.stats

    return _correlation(scipy.stats.pearsonr, labels, predictions)


def spearman(labels: Sequence[float], predictions: Sequence[float]) -> float:
    import scipy.stats

    return _correlation(scipy.stats.spearmanr, labels, predictions)


def task_metrics(task: examples.TaskSpec, labels: np.ndarray, predictions: np.ndarray) -> dict:
    """All of the task's GLUE metrics on one split, as fractions (accuracy 0.9, not 90).

    labels / predictions: [N] class ids, or [N] scores for STS-B.
    """
    if task.is_regression:
        p, s = pearson(labels, predictions), spearman(labels, predictions)
        return {"pearson": p, "spearman": s, "corr": (p + s) / 2}
    out = {"accuracy": accuracy(labels, predictions)}
    if task.name in ("MRPC", "QQP"):
        out["f1"] = f1_binary(labels, predictions)
        out["acc_and_f1"] = (out["accuracy"] + out["f1"]) / 2
    if task.name == "CoLA":
        out["mcc"] = matthews_corrcoef(labels, predictions)
    return out


# Task -> the metric the MAE-LM paper reports (and averages).
PAPER_METRIC = {name: task.primary_metric for name, task in examples.TASKS.items()}
# The mean of MNLI's matched and mismatched accuracy (`mnli_mean`).
MNLI_MEAN = "m+mm/accuracy"
# Paper -> task -> the one number by which runs of the task are compared, as the paper
# reports it: MAE-LM's (Table 1) one metric per task; 3ML's (Table 3) the mean of the pair
# where it reports two (MRPC and QQP F1/accuracy, STS-B Pearson/Spearman, MNLI-m/mm).
REPORTED_METRIC = {
    "maelm": {name: ("m/" if name == "MNLI" else "") + metric
              for name, metric in PAPER_METRIC.items()},
    "3ml": {**PAPER_METRIC, "MRPC": "acc_and_f1", "STS-B": "corr", "QQP": "acc_and_f1",
            "MNLI": MNLI_MEAN},
}
# Task -> the GLUE leaderboard's task score: the mean of these metrics.
LEADERBOARD_METRICS = {
    "CoLA": ("mcc",),
    "SST-2": ("accuracy",),
    "MRPC": ("accuracy", "f1"),
    "STS-B": ("pearson", "spearman"),
    "QQP": ("accuracy", "f1"),
    "MNLI": ("m/accuracy", "mm/accuracy"),
    "QNLI": ("accuracy",),
    "RTE": ("accuracy",),
}


def mnli_mean(scores: Mapping[str, float]) -> dict:
    """{MNLI_MEAN: ...} from MNLI's scores ("m/accuracy", "mm/accuracy")."""
    return {MNLI_MEAN: (scores["m/accuracy"] + scores["mm/accuracy"]) / 2}


AVERAGED_TASKS = ("MNLI", "QQP", "QNLI", "SST-2", "CoLA", "RTE", "MRPC", "STS-B")


def glue_average(results: Mapping[str, Mapping[str, float]],
                 convention: str = "maelm") -> float:
    """The average over the eight GLUE tasks (WNLI excluded, as in both papers).

    results: task name -> its dev metrics (as `task_metrics` returns; MNLI's keys are
      prefixed "m/" and "mm/"). Raises KeyError naming a missing task.
    convention: "maelm" (the MAE-LM paper's) or "leaderboard".
    """
    scores = []
    for name in AVERAGED_TASKS:
        if name not in results:
            raise KeyError(f"glue_average needs all of {AVERAGED_TASKS}; {name} is missing")
        metrics = results[name]
        if convention == "maelm":
            key = "m/accuracy" if name == "MNLI" else PAPER_METRIC[name]
            scores.append(metrics[key])
        elif convention == "leaderboard":
            scores.append(float(np.mean([metrics[k] for k in LEADERBOARD_METRICS[name]])))
        else:
            raise ValueError(f"convention: expected 'maelm' or 'leaderboard', got {convention!r}")
    return float(np.mean(scores))
