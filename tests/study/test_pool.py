"""Pooling a study's calls (maelm_jax/study/pool.py): designs, paired differences and their
intervals, each claim's status, and the README's table kept in step with the committed
records."""

import json
import statistics

import pytest
from scipy import stats

from maelm_jax.study import pool

from conftest import REPO_ROOT

SEEDS = ["1", "2", "3"]


def _record(pretrain_seed: int, scores: dict, *, rank=None, flops=None, lr=1e-4,
            finished=True) -> dict:
    """A finished call: scores {model: {task: [per seed]}}."""
    settings = {"pretrain": {"seed": pretrain_seed, "model": {"d_model": 256}},
                "finetune": {"learning_rate": lr, "seeds_per_program": 5},
                "step_scale": {"3ml_self": 0.86}}
    models = [m for m in scores if m != "scratch"]
    return {
        "title": "call", "finished": finished, "models": models,
        "controls": ["scratch"] if "scratch" in scores else [],
        "pretrain_seed": pretrain_seed, "seconds": 500.0,
        "parts": [{"device": "1 x NVIDIA H100", "jax": "0.11.2", "commit": "abc"}],
        "identity": {"settings": settings, "tokenizer_sha256": "t", "data_fingerprint": "d"},
        "pretraining": {m: {"step": 1000, "train_flops": (flops or {}).get(m, 100.0)}
                        for m in models},
        "glue": {m: {t: {"per_seed": dict(zip(SEEDS, v, strict=True)),
                         "median": statistics.median(v)} for t, v in per_task.items()}
                 for m, per_task in scores.items()},
        "rank": {"runs": rank or []},
    }


def test_one_call_pairs_by_seed_and_says_so():
    record = _record(0, {"maelm": {"SST-2": [80, 82, 84], "STS-B": [60, 60, 60]},
                         "mlm": {"SST-2": [79, 80, 81], "STS-B": [60, 61, 59]},
                         "scratch": {"SST-2": [70, 71, 72], "STS-B": [10, 12, 14]}})
    diff = pool.paired([record], "maelm", "mlm", ["SST-2", "STS-B"])
    # Per seed: mean over the tasks, maelm minus mlm: (70-69.5, 71-70.5, 72-70) = .5, .5, 2.
    values = [0.5, 0.5, 2.0]
    half = stats.t.ppf(0.975, 2) * statistics.stdev(values) / 3 ** 0.5
    assert diff["difference"] == pytest.approx(1.0)
    assert diff["lower"] == pytest.approx(1.0 - half) and diff["upper"] == pytest.approx(1.0 + half)
    assert diff["over"] == "fine-tuning seeds" and diff["n"] == 3
    claims = pool.pool_records([("r.json", record)])[0]["claims"]
    a = claims["a"]
    assert a["models"]["maelm"]["GLUE average"]["difference"] == pytest.approx(
        statistics.fmean([(80 + 60) / 2 - (70 + 10) / 2, (82 + 60) / 2 - (71 + 12) / 2,
                          (84 + 60) / 2 - (72 + 14) / 2]))
    assert a["status"] == "shown"  # both models beat the control by far more than 5
    assert claims["b"]["status"] == "not shown"  # the interval [1 - 3.7, ...] reaches below -1
    assert claims["c"]["status"] == "not measured" and claims["d"]["status"] == "not measured"


def test_calls_pool_over_pretraining_seeds_and_designs_stay_apart():
    calls = [_record(s, {"maelm": {"SST-2": [80 + d] * 3}, "mlm": {"SST-2": [80] * 3}})
             for s, d in ((0, 1.0), (1, 2.0), (2, 3.0))]
    other = _record(3, {"maelm": {"SST-2": [50] * 3}, "mlm": {"SST-2": [90] * 3}}, lr=3e-4)
    pooled = pool.pool_records([(f"{i}.json", r) for i, r in enumerate(calls + [other])])
    assert len(pooled) == 2  # another fine-tuning rate: another design
    first = next(p for p in pooled if len(p["calls"]) == 3)
    b = first["claims"]["b"]["difference"]
    assert b["over"] == "calls" and b["n"] == 3 and b["difference"] == pytest.approx(2.0)
    assert b["lower"] == pytest.approx(2.0 - stats.t.ppf(0.975, 2) * 1.0 / 3 ** 0.5)
    # [2 - 2.48, 2 + 2.48]: not above 0, but above -1
    assert first["claims"]["b"]["status"] == "shown (within 1 point)"
    assert pool.design(calls[0]) == pool.design(calls[2])  # the pretraining seed is not part


def test_ranks_and_flops_decide_c_and_d():
    rank = [{"label": "mlm", "with_mask": [10, 20, 30, 40], "without_mask": [10, 19, 25, 30]},
            {"label": "maelm", "with_mask": [10, 20, 30, 40], "without_mask": [10, 20, 30, 36]}]
    scores = {"mlm": {"SST-2": [80, 81, 82]}, "3ml_self": {"SST-2": [80, 81, 82.5]}}
    record = _record(0, scores, rank=rank, flops={"mlm": 100.0, "3ml_self": 75.0})
    claims = pool.pool_records([("r", record)])[0]["claims"]
    assert claims["c"]["status"] == "shown"
    assert claims["c"]["mlm_gap_per_layer"] == [[0, 1, 5, 10]]
    assert claims["d"]["flops_ratio"] == 0.75
    assert claims["d"]["status"].startswith("shown")
    too_much = _record(0, scores, rank=rank, flops={"mlm": 100.0, "3ml_self": 87.0})
    d = pool.pool_records([("r", too_much)])[0]["claims"]["d"]
    assert d["status"] == "not measured (3ML_self trained on 0.87x MLM's FLOPs)"
    flat = [{"label": "mlm", "with_mask": [10, 20, 30, 40], "without_mask": [10, 20, 30, 41]}]
    assert pool.pool_records([("r", _record(0, scores, rank=flat))])[0]["claims"]["c"][
        "status"] == "not shown"


def test_inputs_are_read_and_unfinished_calls_left_out(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(_record(0, {"mlm": {"SST-2": [1, 2, 3]}})))
    (tmp_path / "b.json").write_text(json.dumps(_record(1, {"mlm": {"SST-2": [1, 2, 3]}},
                                                        finished=False)))
    assert [w for w, _ in pool.read_records(str(tmp_path))] == [str(tmp_path / "a.json")]
    unfinished = pool.read_records(str(tmp_path), finished=False)
    assert [w for w, _ in unfinished] == [str(tmp_path / "b.json")]
    text = pool.markdown(pool.pool_records(pool.read_records(str(tmp_path))), unfinished)
    assert "Unfinished, left out of the claims" in text and "(`b.json`)" in text
    assert "No finished study call" in pool.markdown([], unfinished)
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(pool.PoolError, match=r"c.json is not a study's record"):
        pool.read_records(str(tmp_path))
    with pytest.raises(pool.PoolError, match="config.inputs: .*nowhere does not exist"):
        pool.read_records(str(tmp_path / "nowhere"))


def test_the_readme_table_is_the_committed_records():
    """README.md's block is what configs/study/pool.py writes from benchmarks/results/study/:
    run `python main.py --config=configs/study/pool.py --workdir=runs/pool
    --config.readme=README.md` after committing a record."""
    records = str(REPO_ROOT / "benchmarks" / "results" / "study")
    readme = (REPO_ROOT / "README.md").read_text()
    assert pool.readme_table(pool.pool_records(pool.read_records(records)),
                             pool.read_records(records, finished=False)) in readme


def test_a_model_left_on_the_unigram_plateau_measures_no_claim_of_its_objective():
    """MAE-LM on the first H200 call: 5.4 % [MASK] accuracy against the most frequent
    piece's 4.6 %. Its fine-tuning and ranks measure word frequencies, not MAE-LM: (b) is
    not measured, (a) rests on MLM alone and says so, (c) keeps MLM's part only."""
    scores = {"maelm": {"SST-2": [50, 51, 50]}, "mlm": {"SST-2": [80, 81, 82]},
              "scratch": {"SST-2": [70, 71, 72]}}
    layers = {"mlm": ([10, 20, 30], [12, 25, 40]), "maelm": ([1, 1, 1], [1, 1, 1])}
    rank = [{"label": m, "without_mask": wo, "with_mask": w} for m, (wo, w) in layers.items()]
    record = _record(0, scores, rank=rank)
    record["pretraining"]["mlm"].update(eval_mask_accuracy=0.32, eval_unigram_accuracy=0.046)
    record["pretraining"]["maelm"].update(eval_mask_accuracy=0.054, eval_unigram_accuracy=0.046)
    claims = pool.pool_records([("r", record)])[0]["claims"]
    assert claims["b"]["status"] == "not measured (MAE-LM stayed on the unigram plateau)"
    assert claims["a"]["status"] == ("shown (MAE-LM left out: stayed on the unigram "
                                     "plateau)")
    assert claims["c"]["maelm_minus_mlm_last_layer"] == []
    assert claims["c"]["status"] == "partly shown"
    record["pretraining"]["maelm"]["eval_mask_accuracy"] = 0.20  # left it: measured again
    claims = pool.pool_records([("r", record)])[0]["claims"]
    assert claims["b"]["status"] == "not shown" and claims["a"]["status"] == "not shown"


def test_the_call_report_names_a_model_left_on_the_unigram_plateau():
    from maelm_jax.study import plateau, report

    result = {"models": ["mlm", "maelm"], "pretraining": {
        "mlm": {"eval_mask_accuracy": 0.32, "eval_unigram_accuracy": 0.046},
        "maelm": {"eval_mask_accuracy": 0.054, "eval_unigram_accuracy": 0.046}}}
    [_, line] = report.plateau_lines(result)
    assert "MAE-LM (5.4 % against 4.6 %)" in line and "MLM (" not in line
    result["pretraining"]["maelm"]["eval_mask_accuracy"] = 0.2
    assert report.plateau_lines(result) == []
    assert not plateau.on_plateau({})  # no evaluation: nothing to tell
