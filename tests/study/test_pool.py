"""Pooling a study's calls (maelm_jax/study/pool.py): designs, paired differences and their
intervals, each claim's status, and the tables of calls (the README's block of the committed
records is tests/benchmarks/test_tables.py's)."""

import json
import statistics

import pytest
from scipy import stats

from maelm_jax.study import pool

pytestmark = pytest.mark.tier("unit")

SEEDS = ["1", "2", "3"]


def _record(pretrain_seed: int, scores: dict, *, rank=None, flops=None, lr=1e-4,
            finished=True, base=None, cap=1000) -> dict:
    """A finished call: scores {model: {task: [per seed]}}; `base` the sizing's planned
    base steps (none: the configured `cap`), step_scale applied as study/config.py does."""
    settings = {"pretrain": {"seed": pretrain_seed, "model": {"d_model": 256},
                             "train": {"num_steps": cap, "batch_size": 8},
                             "data": {"seq_len": 16}},
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
        **({"sizing": {"base_steps": base, "steps": {
            m: max(1, round(base * settings["step_scale"].get(m, 1.0))) for m in models}}}
           if base else {}),
    }


def _run(label: str, with_mask: list[int], without_mask: list[int], centred=None) -> dict:
    """A rank analysis run (layers 0..L, 0 the embeddings); centred: (with, without)."""
    run = {"label": label, "layers": list(range(len(with_mask))), "with_mask": with_mask,
           "without_mask": without_mask}
    if centred:
        run["centred"] = {"with_mask": centred[0], "without_mask": centred[1]}
    return run


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
    assert claims["c"]["c1"]["uncentred"]["status"] == "not measured (no rank analysis of MLM)"
    assert claims["d"]["status"] == "not measured"


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


def test_flops_decide_d():
    scores = {"mlm": {"SST-2": [80, 81, 82]}, "3ml_self": {"SST-2": [80, 81, 82.5]}}
    record = _record(0, scores, flops={"mlm": 100.0, "3ml_self": 75.0})
    claims = pool.pool_records([("r", record)])[0]["claims"]
    assert claims["d"]["flops_ratio"] == 0.75
    assert claims["d"]["status"].startswith("shown")
    too_much = _record(0, scores, flops={"mlm": 100.0, "3ml_self": 87.0})
    d = pool.pool_records([("r", too_much)])[0]["claims"]["d"]
    assert d["status"] == "not measured (3ML_self trained on 0.87x MLM's FLOPs)"


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


def test_a_model_left_on_the_unigram_plateau_measures_no_claim_of_its_objective():
    """MAE-LM on the first H200 call: 5.4 % [MASK] accuracy against the most frequent
    piece's 4.6 %. Its fine-tuning and ranks measure word frequencies, not MAE-LM: (b) is
    not measured, (a) rests on MLM alone and says so, (c) keeps MLM's part only."""
    scores = {"maelm": {"SST-2": [50, 51, 50]}, "mlm": {"SST-2": [80, 81, 82]},
              "scratch": {"SST-2": [70, 71, 72]}}
    rank = [_run("mlm", [12, 25, 40], [10, 20, 30]), _run("maelm", [1, 1, 1], [1, 1, 1])]
    record = _record(0, scores, rank=rank)
    record["pretraining"]["mlm"].update(eval_mask_accuracy=0.32, eval_unigram_accuracy=0.046)
    record["pretraining"]["maelm"].update(eval_mask_accuracy=0.054, eval_unigram_accuracy=0.046)
    claims = pool.pool_records([("r", record)])[0]["claims"]
    assert claims["b"]["status"] == "not measured (MAE-LM stayed on the unigram plateau)"
    assert claims["a"]["status"] == ("shown (MAE-LM left out: stayed on the unigram "
                                     "plateau)")
    assert claims["c"]["c2"]["uncentred"]["status"] == (
        "not measured (MAE-LM stayed on the unigram plateau)")
    assert claims["c"]["c1"]["uncentred"]["n"] == 1  # MLM's own rule is still measured
    record["pretraining"]["maelm"]["eval_mask_accuracy"] = 0.20  # left it: measured again
    claims = pool.pool_records([("r", record)])[0]["claims"]
    assert claims["b"]["status"] == "not shown" and claims["a"]["status"] == "not shown"
    assert claims["c"]["c2"]["uncentred"]["n"] == 1


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


# ------------------------------------------------------- claim (c) by its fixed rules

def _ranked(mlm: dict, maelm: dict | None = None, accuracy: dict | None = None) -> dict:
    """A call whose rank analysis holds MLM (and MAE-LM): each {"w": [...], "wo": [...],
    "c": (with, without) centred or absent}; accuracy: model -> [MASK] accuracy."""
    runs = [_run("mlm", mlm["w"], mlm["wo"], mlm.get("c"))]
    if maelm:
        runs.append(_run("maelm", maelm["w"], maelm["wo"], maelm.get("c")))
    scores = {"mlm": {"SST-2": [80, 81, 82]}, **({"maelm": {"SST-2": [80, 81, 82]}}
                                                if maelm else {})}
    record = _record(0, scores, rank=runs, flops={"mlm": 100.0, "maelm": 116.0})
    for m, acc in (accuracy or {}).items():
        record["pretraining"][m].update(eval_mask_accuracy=acc,
                                        eval_unigram_accuracy=0.046)
    return record


MLM_GROWING = {"w": [50, 40, 40, 40], "wo": [30, 39, 35, 30]}  # gaps 20 (embeddings), 1, 5, 10


def test_c1_holds_when_the_last_layer_loses_rank_and_more_than_layer_one():
    from maelm_jax.study import claims

    d = claims.c1(_ranked(MLM_GROWING))
    # Layer 0's gap (20) is the embeddings': the rule starts at layer 1 (gap 1).
    assert d == {"holds": True, "status": "holds", "with_mask": 40, "without_mask": 30,
                 "gap_first": 1, "gap_last": 10, "last_layer": 3}
    assert claims.c1_text(d) == "w. 40 / w/o 30; gap +1 at layer 1, +10 at layer 3: holds"


@pytest.mark.parametrize("without, why", [
    ([30, 30, 35, 38], "the gap at the last layer (2) is smaller than at layer 1 (10)"),
    ([30, 39, 35, 41], "without [MASK] the last layer's rank is higher"),
    ([30, 35, 35, 35], "the gap is the same at both (5)"),
])
def test_c1_does_not_hold(without, why):
    from maelm_jax.study import claims

    d = claims.c1(_ranked({"w": [50, 40, 40, 40], "wo": without}))
    assert d["holds"] is False and d["status"] == "does not hold", why


def test_c2_in_one_call_shows_its_figures_and_decides_nothing():
    from maelm_jax.study import claims

    record = _ranked(MLM_GROWING, {"w": [60, 50, 45, 45], "wo": [60, 50, 45, 44]})
    higher = claims.c2(record)
    assert (higher["value"], higher["reference_value"], higher["difference"]) == (44, 30, 14)
    assert higher["flops_per_step"] == pytest.approx(1.16)  # same planned steps
    assert higher["holds"] is None and higher["interval"] is None
    assert claims.c2_text(higher) == ("MAE-LM 44 vs MLM 30 (+14), at 1.16x MLM's FLOPs per "
                                      "step: one pretraining seed: not decidable")
    # With the analysis's paired bootstrap difference (recorded as MAE-LM minus MLM).
    record["rank"]["differences"] = [{"a": "maelm", "b": "mlm", "view": "uncentred",
                                      "statistic": "without_mask", "difference": 14.0,
                                      "interval": [12.5, 15.25]}]
    assert "(+14 [+12.5, +15.2])" in claims.c2_text(claims.c2(record))


def _spectral(mlm_last: float, other_last: float, other: str = "maelm",
              mask=((1.0, 5.0, 8.0), (1.0, 2.0, 3.0))) -> dict:
    """A call whose rank analysis has continuous ranks (statistics) of MLM and `other`:
    last-layer ranks without [MASK]; mask: the [MASK]-row ranks of MLM and the other."""
    def run(label, last, mask_only):
        stats = {"with_mask": [40.0, 40.0, last + 5], "without_mask": [30.0, 35.0, last],
                 "mask_only": list(mask_only)}
        return {"label": label, "layers": [0, 1, 2],
                **{k: [round(x) for x in v] for k, v in stats.items()},
                "statistics": {"uncentred": {k: {"continuous": v} for k, v in stats.items()}}}

    record = _record(0, {"mlm": {"SST-2": [80] * 3}, other: {"SST-2": [80] * 3}},
                     rank=[run("mlm", mlm_last, mask[0]), run(other, other_last, mask[1])])
    record["rank"]["tau"] = 0.9
    return record


def test_c0_reads_the_mask_rows_growing_in_mlm_and_above_maelm():
    from maelm_jax.study import claims

    d = claims.c0(_spectral(50.0, 50.0))
    assert d["holds"] and (d["mlm_first"], d["mlm_last"], d["maelm_last"]) == (5, 8, 3)
    assert claims.c0_text(d) == "MLM 5 -> 8 (layer 1 -> 2), MAE-LM 3 at layer 2: holds"
    assert not claims.c0(_spectral(50.0, 50.0, mask=((1, 5, 4), (1, 2, 3))))["holds"]
    assert not claims.c0(_spectral(50.0, 50.0, mask=((1, 5, 8), (1, 2, 9))))["holds"]


@pytest.mark.parametrize("differences, status", [
    ([1.0, 1.5, 0.8, 1.2, 1.1], "supported"),  # the interval above 0
    ([0.1, -0.2, 0.0, 0.2, -0.1], "no effect at this scale"),  # upper bound < 2 % of 50
    ([3.0, -2.0, 1.0, 4.0, -1.0], "not resolved"),
    ([1.0, 1.5, 0.8, 1.2], "not decidable (4 pretraining seeds of the 5 needed)"),
])
def test_c2_and_c2_prime_over_pretraining_seeds_by_the_rule(differences, status):
    from maelm_jax.study import claims

    for rule, other in (("c2", "mlm"), ("c2'", "enc_mask")):
        calls = []
        for seed, d in enumerate(differences):
            record = _spectral(50.0, 50.0 + d, other="maelm") if other == "mlm" else None
            if other == "enc_mask":  # MAE-LM against the encoder with [MASK]
                record = _spectral(50.0, 50.0, other="enc_mask")
                runs = record["rank"]["runs"]
                maelm = json.loads(json.dumps(runs[1]))
                maelm["label"] = "maelm"
                maelm["statistics"]["uncentred"]["without_mask"]["continuous"][-1] = 50.0 + d
                runs.append(maelm)
                record["pretraining"]["maelm"] = {"step": 1000, "train_flops": 100.0}
            record["pretrain_seed"] = seed
            calls.append(record)
        found = claims.pooled(calls)[rule]["uncentred"]
        assert found["status"] == status, rule
        assert found["difference"] == pytest.approx(statistics.fmean(differences))
    one = claims.pooled(calls[:1])["c2"]["uncentred"]
    assert one["status"] == "one pretraining seed: not decidable"
    assert claims.over_seeds_text(one) == f"{differences[0]:+.1f} (1 pretraining seed)"


def test_centred_and_uncentred_are_decided_apart_and_missing_ones_not_measured():
    from maelm_jax.study import claims

    mlm = dict(MLM_GROWING, c=([50, 40, 40, 40], [30, 30, 35, 38]))  # centred: gap shrinks
    decided = claims.decide(_ranked(mlm))
    assert decided["c1"]["uncentred"]["holds"] and decided["c1"]["centred"]["holds"] is False
    assert decided["c2"]["uncentred"]["status"] == "not measured (no rank analysis of MAE-LM)"
    assert claims.c1(_ranked(MLM_GROWING), "centred")["status"] == (
        "not measured (no centred ranks of MLM)")


def test_a_model_on_the_plateau_measures_nothing_of_c():
    from maelm_jax.study import claims

    maelm = {"w": [60, 50, 1, 1], "wo": [60, 50, 1, 1]}
    stuck = claims.decide(_ranked(MLM_GROWING, maelm, {"mlm": 0.32, "maelm": 0.054}))
    assert stuck["c1"]["uncentred"]["holds"]
    for view in claims.VIEWS:
        assert stuck["c2"][view] == {
            "holds": None, "status": "not measured (MAE-LM stayed on the unigram plateau)"}
    mlm_stuck = claims.decide(_ranked(MLM_GROWING, maelm, {"mlm": 0.05, "maelm": 0.30}))
    assert mlm_stuck["c1"]["centred"]["status"] == (
        "not measured (MLM stayed on the unigram plateau)")


def test_the_sign_test_over_calls_counts_only_the_calls_that_measure():
    from maelm_jax.study import claims

    maelm = {"w": [60, 50, 45, 45], "wo": [60, 50, 45, 44]}
    holding = [_ranked(MLM_GROWING, maelm) for _ in range(5)]
    c = claims.pooled(holding)
    assert (c["c1"]["uncentred"]["held"], c["c1"]["uncentred"]["n"]) == (5, 5)
    assert c["c1"]["uncentred"]["p"] == pytest.approx(1 / 32)  # 5 of 5 is the least to show
    assert c["c1"]["uncentred"]["status"] == "shown"
    failing = _ranked({"w": [50, 40, 40, 40], "wo": [30, 30, 35, 38]}, maelm)
    stuck = _ranked(MLM_GROWING, maelm, {"maelm": 0.05})  # c2 not measured there: not counted
    c = claims.pooled(holding[:4] + [failing, stuck])
    expected = stats.binomtest(5, 6, 0.5, alternative="greater").pvalue
    assert (c["c1"]["uncentred"]["held"], c["c1"]["uncentred"]["n"]) == (5, 6)
    assert c["c1"]["uncentred"]["p"] == pytest.approx(expected)
    assert c["c1"]["uncentred"]["status"] == "not shown"  # p = 0.11
    assert c["c2"]["uncentred"]["n"] == 5  # the plateaued call left out
    assert claims.pooled([stuck])["c2"]["centred"] == {
        "n": 0, "status": "not measured (MAE-LM stayed on the unigram plateau)"}
    # The pool states it per design: the rows of (c1) and (c2), uncentred and centred.
    text = pool.markdown(pool.pool_records([(f"{i}.json", r) for i, r in enumerate(holding)]))
    assert ("| (c1) | " + claims.RULES["c1"] + " | uncentred: 5 of 5 call(s) hold, p = 0.031; "
            "centred: — | uncentred: shown; centred: not measured (no centred ranks of MLM) |"
            ) in text


def test_the_call_report_shows_claim_c_per_rule_and_view():
    from maelm_jax.study import claims, report

    record = _ranked(dict(MLM_GROWING, c=([50, 40, 40, 40], [30, 30, 35, 38])),
                     {"w": [60, 50, 1, 1], "wo": [60, 50, 1, 1]}, {"maelm": 0.05})
    record["rank"]["tau"] = 0.9
    for m, p in record["pretraining"].items():
        p["workdir"] = f"/w/{m}"
    for run in record["rank"]["runs"]:
        run["path"], run["last_layer"] = f"/w/{run['label']}", {}
    record.update(seeds=[1, 2, 3], glue_dir="", glue={})
    text = report.markdown(record)
    assert ("| (c1) MLM's real-token rank is lower without [MASK] at the last layer, the gap "
            "(with minus without) larger there than at layer 1 | w. 40 / w/o 30; gap +1 at "
            "layer 1, +10 at layer 3: holds | w. 40 / w/o 38; gap +10 at layer 1, +2 at "
            "layer 3: does not hold |") in text
    assert ("| (c2) " + claims.RULES["c2"] + " | not measured (MAE-LM stayed on the unigram "
            "plateau) | not measured (MAE-LM stayed on the unigram plateau) |") in text
    assert claims.TABLE_3 in text


# ---------------------------------------------- the design key: planned tokens per model

def test_the_design_holds_the_planned_tokens_not_the_step_cap():
    scores = {"maelm": {"SST-2": [81] * 3}, "mlm": {"SST-2": [80] * 3}}
    sized = _record(0, scores, base=800)
    same = _record(1, scores, base=800, cap=2000)  # another cap, the same plan
    fewer_models = _record(4, {"mlm": {"SST-2": [80] * 3}}, base=800)  # a seed call's share
    other = _record(2, scores, base=600)  # another machine's plan
    unsized = _record(3, scores, cap=800)  # no sizing: the configured steps
    assert (pool.design(sized) == pool.design(same) == pool.design(unsized)
            == pool.design(fewer_models))
    assert pool.design(other) != pool.design(sized)
    pooled = pool.pool_records([(f"{i}.json", r) for i, r in
                                enumerate((sized, same, other, unsized, fewer_models))])
    assert sorted(len(p["calls"]) for p in pooled) == [1, 4]
    text = pool.markdown(pooled)
    # Every call listed, with its tokens: 800 x 8 x 16 = 102,400; 600 x 128 = 76,800.
    assert "| `2` | " + pool.design(other) + " | MAE-LM | 77K (600) |" in text
    assert "| `0` | " + pool.design(sized) + " | MAE-LM | 102K (800) |" in text
    from maelm_jax.study import budget

    assert budget.planned_steps(unsized, "3ml_self") is None  # not in the call
    unsized["models"].append("3ml_self")
    assert budget.planned_steps(unsized, "3ml_self") == 688  # 800 x 0.86, as config.py


def test_the_readme_lists_each_call_with_its_tokens_gains_and_claim_c():
    scores = {"maelm": {"SST-2": [81, 82, 83]}, "mlm": {"SST-2": [80, 80, 80]},
              "scratch": {"SST-2": [70, 72, 74]}}
    record = _record(0, scores, base=500,
                     flops={"mlm": 500 * 2.0, "maelm": 500 * 2.4},
                     rank=[_run("mlm", MLM_GROWING["w"], MLM_GROWING["wo"]),
                           _run("maelm", [60, 50, 45, 45], [60, 50, 45, 44])])
    unfinished = dict(record, finished=False, parts_done=["a"], parts_left=["b", "c"])
    pooled = pool.pool_records([("x/call.json", record)])
    text = pool.markdown(pooled, [("x/late.json", unfinished)])
    key = pool.design(record)
    assert f"| `call` | {key} | MAE-LM | 64K (500) | — | 1.20x | +10.0 |" in text
    assert f"| `late` (unfinished: 1 of 3 parts) | {key} | MAE-LM |" in text
    assert ("MAE-LM 44 vs MLM 30 (+14), at 1.20x MLM's FLOPs per step: one pretraining "
            "seed: not decidable") in text
    assert "; MAE-LM at 1.20x MLM's FLOPs per step |" in text  # beside (b)
    assert "Unfinished, left out of the claims" in text


def test_a_pool_refused_leaves_nothing_behind(tmp_path):
    """A workdir of another mode is one line and leaves no config.json, pool.json or pool.md
    behind."""
    from maelm_jax.workdirs import layout

    records = tmp_path / "records"
    records.mkdir()
    (records / "a.json").write_text(json.dumps(_record(0, {"mlm": {"SST-2": [1, 2, 3]}})))
    c = pool.pool_defaults()
    c.inputs = str(records)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text('{"mode": "finetune"}')
    with pytest.raises(layout.WorkdirError, match="holds a finetune run; pool the calls into"):
        pool.pool(c, str(tmp_path / "run"))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json"]
    pool.pool(c, str(tmp_path / "out"))  # the check is real: a good call writes
    assert (tmp_path / "out" / "pool.md").is_file()


def test_the_call_report_shows_the_evaluations_at_the_fixed_ratio_when_recorded(tmp_path):
    """A pretraining workdir's last eval at train.eval_mask_ratio (fixed_loss,
    fixed_accuracy) goes into the record and the table; records from before it keep their
    table."""
    from maelm_jax.study import report

    (tmp_path / "metrics.jsonl").write_text(
        '{"split": "eval", "step": 8, "loss": 5.0, "accuracy": 0.1, "fixed_loss": 4.25, '
        '"fixed_accuracy": 0.125}\n')
    assert report.pretraining_record(tmp_path) | {"curves": None} == {
        "curves": None, "step": 8, "eval_loss": 5.0, "eval_accuracy": 0.1,
        "eval_fixed_loss": 4.25, "eval_fixed_accuracy": 0.125}
    record = _ranked(MLM_GROWING, {"w": [60, 50, 1, 1], "wo": [60, 50, 1, 1]})
    for m, p in record["pretraining"].items():
        p["workdir"] = f"/w/{m}"
    for run in record["rank"]["runs"]:
        run["path"], run["last_layer"] = f"/w/{run['label']}", {}
    record.update(glue={}, controls=["scratch"])
    before = report.table(record)
    assert "fixed ratio" not in before[0] and len(before[-1].split("|")) == len(
        before[0].split("|"))
    for p in record["pretraining"].values():
        p.update(eval_fixed_loss=4.25, eval_fixed_accuracy=0.125)
    after = report.table(record)
    assert "| loss at the fixed ratio | acc. % at the fixed ratio |" in after[0]
    assert all("| 4.25 | 12.5 |" in row for row in after[2:-1])
    assert len(after[-1].split("|")) == len(after[0].split("|"))  # the control's row too


def test_ranks_after_fine_tuning_are_listed_per_seed_and_paired_across_objectives():
    from maelm_jax.study import claims, report

    def ranks(*values):
        return {str(s): {"last_layer": {"uncentred": {"without_mask": {"continuous": v}}}}
                for s, v in zip(SEEDS, values, strict=True)}

    record = _ranked(MLM_GROWING, {"w": [60, 50, 45, 45], "wo": [60, 50, 45, 44]})
    record["glue"]["mlm"]["SST-2"]["rank_per_seed"] = ranks(40.0, 42.0, 41.0)
    record["glue"]["maelm"]["SST-2"]["rank_per_seed"] = ranks(45.0, 46.0, 48.0)
    found = claims.finetuned_ranks(record)["SST-2"]
    assert found["models"]["maelm"] == {"1": 45.0, "2": 46.0, "3": 48.0}
    pair = found["paired"]["maelm minus mlm"]
    half = stats.t.ppf(0.975, 2) * statistics.stdev([5.0, 4.0, 7.0]) / 3 ** 0.5
    assert pair["n"] == 3 and pair["difference"] == pytest.approx(16 / 3)
    assert pair["lower"] == pytest.approx(16 / 3 - half)
    record.update(seeds=[1, 2, 3], glue_dir="/g", rank={**record["rank"], "tau": 0.9})
    for m, p in record["pretraining"].items():
        p["workdir"] = f"/w/{m}"
    for run in record["rank"]["runs"]:
        run["path"], run["last_layer"] = f"/w/{run['label']}", {}
    for per_task in record["glue"].values():
        per_task["SST-2"].update(metric="accuracy", seconds=60.0)
    text = report.markdown(record)
    assert "| SST-2 | MAE-LM | 45.0, 46.0, 48.0 | 46.3 |" in text
    assert "| SST-2 | MAE-LM minus MLM | paired over 3 fine-tuning seeds | +5.3 [" in text
