"""GLUE metrics by hand and against scikit-learn / scipy (the GLUE scorer's own), on
handmade cases and on real dev labels. (SQuAD's: test_finetune_squad_metrics.py.)"""

import numpy as np
import pytest

from maelm_jax.finetune.tasks.glue import examples, metrics

from conftest import require_shared_data

pytestmark = pytest.mark.tier("unit")

# --- GLUE --------------------------------------------------------------------------------

LABELS = [1, 1, 0, 0, 1]
PREDS = [1, 0, 0, 1, 1]  # tp = 2, fn = 1, tn = 1, fp = 1


def test_accuracy_and_f1_by_hand():
    assert metrics.accuracy(LABELS, PREDS) == pytest.approx(3 / 5)
    # F1 = 2 tp / (2 tp + fp + fn) = 4 / 6
    assert metrics.f1_binary(LABELS, PREDS) == pytest.approx(4 / 6)
    assert metrics.f1_binary([0, 0], [0, 0]) == 0.0  # no positive at all: 0, as sklearn


def test_matthews_correlation_by_hand():
    # (tp tn - fp fn) / sqrt((tp + fp)(tp + fn)(tn + fp)(tn + fn)) = (2 - 1) / sqrt(3 3 2 2)
    assert metrics.matthews_corrcoef(LABELS, PREDS) == pytest.approx(1 / 6)
    assert metrics.matthews_corrcoef([0, 1, 1, 0], [0, 1, 1, 0]) == pytest.approx(1.0)
    assert metrics.matthews_corrcoef([0, 1, 1, 0], [1, 0, 0, 1]) == pytest.approx(-1.0)
    # A constant prediction: the denominator is 0 and the score 0 (sklearn's convention).
    assert metrics.matthews_corrcoef([0, 1, 1, 0], [1, 1, 1, 1]) == 0.0


def test_pearson_and_spearman_by_hand():
    # Deviations (-1, 0, 1) and (-1, 1, 0): covariance 1, norms sqrt(2) each -> 0.5.
    assert metrics.pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert metrics.spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    # Monotone but not linear: Spearman 1, Pearson below 1.
    assert metrics.spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)
    assert metrics.pearson([1, 2, 3, 4], [1, 4, 9, 16]) < 0.99
    assert metrics.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert metrics.pearson([1, 2, 3], [2, 2, 2]) == 0.0  # constant: undefined -> 0


def _sklearn_metrics():
    return pytest.importorskip("sklearn.metrics",
                               reason="scikit-learn (requirements-dev.txt) is not installed")


def _dev_labels(task: str, column: int, header: bool) -> np.ndarray:
    """A GLUE dev file's gold column, read as the GLUE scorer sees it."""
    path = require_shared_data("glue", task, "dev.tsv")
    rows = path.read_text(encoding="utf-8-sig").splitlines()[1 if header else 0:]
    return np.array([float(r.split("\t")[column]) for r in rows if r.strip()])


def _classifications(labels: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Predictions of the kinds that corner a metric: right, wrong, constant, random,
    mostly right, one class missing from the predictions."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    flip = rng.random(len(labels)) < 0.15
    return {
        "right": labels.copy(),
        "wrong": np.where(labels == classes[0], classes[-1], classes[0]),
        **{f"always_{c:g}": np.full_like(labels, c) for c in classes},
        "random": rng.choice(classes, len(labels)),
        "mostly_right": np.where(flip, rng.choice(classes, len(labels)), labels),
        "no_last_class": np.where(labels == classes[-1], classes[0], labels),
    }


def _check_classification(labels: np.ndarray, predictions: np.ndarray) -> None:
    sk = _sklearn_metrics()
    close = dict(rel=1e-12, abs=1e-12)
    assert metrics.accuracy(labels, predictions) == pytest.approx(
        sk.accuracy_score(labels, predictions), **close)
    assert metrics.matthews_corrcoef(labels, predictions) == pytest.approx(
        sk.matthews_corrcoef(labels, predictions), **close)
    if set(np.unique(labels)) <= {0, 1}:
        assert metrics.f1_binary(labels, predictions) == pytest.approx(
            sk.f1_score(labels, predictions, zero_division=0.0), **close)


@pytest.mark.filterwarnings("ignore:A single label was found")  # sklearn, on one class
@pytest.mark.parametrize("labels, predictions", [
    (LABELS, PREDS),
    ([0, 0, 0], [0, 0, 0]),  # one class everywhere: MCC and F1 undefined -> 0
    ([1, 1, 1], [1, 1, 1]),
    ([0, 1], [1, 0]),
    ([0, 1, 2, 2, 1, 0, 2], [0, 2, 2, 2, 1, 1, 0]),  # MNLI's three classes
    ([2, 2, 0, 1], [1, 1, 1, 1]),
])
def test_classification_metrics_equal_sklearn_on_corner_cases(labels, predictions):
    _check_classification(np.array(labels), np.array(predictions))


@pytest.mark.parametrize("task, column, header", [
    ("CoLA", 1, False), ("SST-2", 1, True), ("MRPC", 0, True)])
def test_classification_metrics_equal_sklearn_on_real_dev_labels(task, column, header):
    labels = _dev_labels(task, column, header).astype(np.int64)
    assert set(np.unique(labels)) == {0, 1}
    for predictions in _classifications(labels, seed=len(labels)).values():
        _check_classification(labels, predictions)
    three = np.random.default_rng(3).integers(0, 3, len(labels))  # a multiclass MCC
    _check_classification(three, _classifications(three, 4)["mostly_right"])


def _check_correlations(labels: np.ndarray, predictions: np.ndarray) -> None:
    import scipy.stats

    for ours, theirs in ((metrics.pearson, scipy.stats.pearsonr),
                         (metrics.spearman, scipy.stats.spearmanr)):
        if np.ptp(predictions) == 0:  # scipy: nan (and a warning); ours: 0, documented
            assert ours(labels, predictions) == 0.0
        else:
            assert ours(labels, predictions) == pytest.approx(
                float(theirs(labels, predictions)[0]), rel=1e-12, abs=1e-12)


def test_correlations_equal_scipy_on_real_sts_b_dev_scores():
    labels = _dev_labels("STS-B", -1, True)
    rng = np.random.default_rng(0)
    noisy = labels + rng.normal(0.0, 1.0, len(labels))
    for predictions in (labels, noisy, np.round(noisy),  # ties, ranked as scipy does
                        np.exp(labels), -labels, rng.uniform(0, 5, len(labels)),
                        np.full_like(labels, 2.5)):
        _check_correlations(labels, predictions)
    _check_correlations(np.array([1.0, 2.0, 2.0, 3.0]), np.array([2.0, 2.0, 1.0, 9.0]))


def test_task_metrics_pick_the_glue_metrics_per_task():
    mrpc = metrics.task_metrics(examples.get_task("mrpc"), LABELS, PREDS)
    assert mrpc == pytest.approx({"accuracy": 0.6, "f1": 4 / 6, "acc_and_f1": (0.6 + 4 / 6) / 2})
    cola = metrics.task_metrics(examples.get_task("cola"), LABELS, PREDS)
    assert set(cola) == {"accuracy", "mcc"}
    assert set(metrics.task_metrics(examples.get_task("sst2"), LABELS, PREDS)) == {"accuracy"}
    stsb = metrics.task_metrics(examples.get_task("sts-b"), [1.0, 2.0, 3.0], [1.0, 3.0, 2.0])
    assert stsb == pytest.approx({"pearson": 0.5, "spearman": 0.5, "corr": 0.5})


# Rows of the MAE-LM paper's Table 1 (dev): MNLI-m, MNLI-mm, QQP, QNLI, SST-2, CoLA, RTE,
# MRPC, STS-B, and the paper's AVG.
TABLE_1 = {
    "MAE-LM base": ((87.2, 87.1, 91.6, 92.9, 93.8, 63.1, 79.1, 90.2, 90.9), 86.1),
    "RoBERTa (Ours) base": ((85.9, 85.8, 91.6, 92.3, 93.7, 64.3, 75.5, 88.7, 89.5), 85.2),
    "BERT base (no MNLI-mm)": ((84.5, None, 91.3, 91.7, 93.2, 58.9, 68.6, 87.3, 89.5), 83.1),
    "MAE-LM large++": ((90.4, 90.6, 92.2, 95.1, 96.2, 68.7, 88.8, 90.7, 92.1), 89.3),
}


@pytest.mark.parametrize("row", TABLE_1)
def test_glue_average_reproduces_the_papers_table_1(row):
    (m, mm, qqp, qnli, sst2, cola, rte, mrpc, stsb), average = TABLE_1[row]
    results = {
        "MNLI": {"m/accuracy": m, "mm/accuracy": mm},
        "QQP": {"accuracy": qqp, "f1": 0.0},
        "QNLI": {"accuracy": qnli},
        "SST-2": {"accuracy": sst2},
        "CoLA": {"mcc": cola, "accuracy": 0.0},
        "RTE": {"accuracy": rte},
        "MRPC": {"accuracy": mrpc, "f1": 0.0},
        "STS-B": {"spearman": stsb, "pearson": 0.0},
    }
    assert round(metrics.glue_average(results), 1) == average


def test_glue_average_leaderboard_convention_by_hand():
    results = {
        "MNLI": {"m/accuracy": 80.0, "mm/accuracy": 82.0},  # 81
        "QQP": {"accuracy": 90.0, "f1": 86.0},  # 88
        "QNLI": {"accuracy": 90.0},
        "SST-2": {"accuracy": 92.0},
        "CoLA": {"mcc": 60.0},
        "RTE": {"accuracy": 70.0},
        "MRPC": {"accuracy": 86.0, "f1": 90.0},  # 88
        "STS-B": {"pearson": 88.0, "spearman": 86.0},  # 87
    }
    expected = (81 + 88 + 90 + 92 + 60 + 70 + 88 + 87) / 8
    assert metrics.glue_average(results, "leaderboard") == pytest.approx(expected)
    with pytest.raises(KeyError, match="RTE is missing"):
        metrics.glue_average({k: v for k, v in results.items() if k != "RTE"})


def _write_tsv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join("\t".join(r) for r in [header, *rows]) + "\n")


@pytest.fixture
def pair_tasks(tmp_path):
    """MRPC, STS-B and MNLI directories of four rows per split."""
    pairs = [("a cat sat", "a cat sat down"), ("it rains", "the sun shines"),
             ("we left", "we went away"), ("red car", "blue sky")]
    header = ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]
    for split in ("train", "dev"):
        _write_tsv(tmp_path / "MRPC" / f"{split}.tsv", header,
                   [(str(i % 2), "1", "2", a, b) for i, (a, b) in enumerate(pairs)])
        _write_tsv(tmp_path / "STS-B" / f"{split}.tsv", ["sentence1", "sentence2", "score"],
                   [(a, b, str(float(i))) for i, (a, b) in enumerate(pairs)])
    for split in ("train", "dev_matched", "dev_mismatched"):
        _write_tsv(tmp_path / "MNLI" / f"{split}.tsv", ["sentence1", "sentence2", "gold_label"],
                   [(a, b, ("entailment", "neutral")[i % 2]) for i, (a, b) in enumerate(pairs)])
    return tmp_path


@pytest.mark.parametrize("name, maelm, threeml", [
    ("mrpc", "accuracy", "acc_and_f1"),
    ("stsb", "spearman", "corr"),
    ("mnli", "m/accuracy", "m+mm/accuracy"),
    ("sst2", "accuracy", "accuracy"),
    ("cola", "mcc", "mcc"),
])
def test_runs_are_compared_by_the_metric_their_paper_reports(name, maelm, threeml):
    assert metrics.REPORTED_METRIC["maelm"][examples.get_task(name).name] == maelm
    assert metrics.REPORTED_METRIC["3ml"][examples.get_task(name).name] == threeml


def test_a_3ml_run_reports_and_selects_by_the_pair_means(pair_tasks, tiny_tokenizer):
    from configs.finetune import glue as glue_config
    from maelm_jax.finetune import tasks

    def scores(name, paper, predict):
        c = glue_config.get_config(f"{name},{paper}")
        c.data.data_dir = str(pair_tasks)
        task = tasks.GlueTask(c, tiny_tokenizer, 32)
        def run_eval(sequences, targets):
            return [(np.arange(len(sequences)), {"prediction": predict(targets["labels"])})]

        return task.primary_metric, task.score(run_eval)

    def flip_last(labels):
        return np.concatenate([labels[:-1], [(labels[-1] + 1) % 2]])

    primary, got = scores("mrpc", "3ml", flip_last)  # labels 0 1 0 1, last one wrong
    assert primary == "acc_and_f1"
    assert got[primary] == pytest.approx((75.0 + 100 * 2 / 3) / 2)  # acc 3/4, F1 2/3
    primary, got = scores("stsb", "3ml", lambda labels: labels ** 2)
    assert primary == "corr"
    assert got[primary] == pytest.approx((got["pearson"] + got["spearman"]) / 2)
    assert got["spearman"] == pytest.approx(100.0) and got["pearson"] < 99.0
    primary, got = scores("mnli", "3ml", lambda labels: np.zeros_like(labels))
    assert primary == "m+mm/accuracy" and got[primary] == pytest.approx(50.0)
    assert scores("mnli", "maelm", lambda labels: labels)[0] == "m/accuracy"
