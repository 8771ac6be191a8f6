"""Claim (c) of the MAE-LM paper decided by rules fixed before the data, in each call and
over calls.

The paper's Fig. 1 and Table 3 as rules on a call's rank analysis (study.json's "rank":
per model its ranks per layer; the continuous rank_tau where the record has it, its
integer rank_tau otherwise), each decided on the ranks as the paper defines them
("uncentred") and on the centred ones (the mean row subtracted; docs/analysis.md). The
first layer is the first transformer layer, layer 1: layer 0 is the embeddings, where
[MASK] is one row of a lookup table and no context has been mixed in yet.

(c0) Fig. 1(b): MLM's [MASK]-row rank grows from layer 1 to the last layer, and exceeds
     MAE-LM's there.
(c1) Fig. 1(a): MLM's real-token rank without [MASK] in the input is below its rank with
     [MASK] at the last layer, and that gap (with minus without) is larger at the last
     layer than at layer 1.
(c2) Table 3: MAE-LM minus MLM, the continuous last-layer rank without [MASK], paired
     within a call (the same held-out sequences), over calls (pretraining seeds): with at
     least MIN_SEEDS seeds and Student's t 95 % interval over the calls' differences,
     "supported" when its lower bound is above 0, "no effect at this scale" when its upper
     bound is below NO_EFFECT (2 %) of MLM's rank (the calls' mean), "not resolved"
     otherwise. Fewer seeds are not decidable: one call shows its difference with the
     bootstrap interval of the measurement (analysis/bootstrap.py), which leaves out how
     pretraining seeds differ.
(c2') The same for MAE-LM against MAE-LM with [MASK] in the encoder (`enc_mask`,
     masking.delta = 1: the same decoder and FLOPs), the mechanism's own contrast: a
     difference to MLM mixes it with the decoder's extra FLOPs.

The paper's Table 3 is itself one pair of models (MAE-LM 491 against RoBERTa 462 after
pretraining) at 131B tokens.

A rule is "not measured" in a call, with the reason, when a model it needs has no rank
analysis there or ended pretraining on the unigram plateau (study/plateau.py): the ranks of
a model that learnt word frequencies say nothing of its objective. Over calls, (c0) and
(c1) take a one-sided sign test over the calls where the rule is measured: shown when
P(at least k of n hold | each holds with probability 1/2) < 0.05, which takes 5 calls out
of 5 (7 of 8, 9 of 10, ...).
"""

from __future__ import annotations

import statistics

from maelm_jax.analysis import report as rank_report
from maelm_jax.infra import markdown
from maelm_jax.pretrain.objectives import recipes
from maelm_jax.study import budget, plateau

FIRST_LAYER = 1  # the first transformer layer (0 is the embeddings)
VIEWS = ("uncentred", "centred")
SIGNIFICANCE = 0.05
MIN_SEEDS = 5  # pretraining seeds (calls) before (c2) and (c2') are decided
NO_EFFECT = 0.02  # of the reference's rank: below it, "no effect at this scale"
RULES = {
    "c0": "MLM's [MASK]-row rank grows from layer 1 to the last layer and exceeds MAE-LM's "
          "there (Fig. 1b)",
    "c1": "MLM's real-token rank is lower without [MASK] at the last layer, the gap (with "
          "minus without) larger there than at layer 1",
    "c2": "MAE-LM's last-layer rank (no [MASK]) is above MLM's, over >= 5 pretraining seeds",
    "c2'": "MAE-LM's last-layer rank (no [MASK]) is above that of MAE-LM with [MASK] in the "
           "encoder, over >= 5 pretraining seeds",
}
SIGN_RULES = ("c0", "c1")  # decided per call, then by the sign test
PAIRED_RULES = {"c2": ("maelm", "mlm"), "c2'": ("maelm", "enc_mask")}
TABLE_3 = ("the paper's Table 3 is one pair of models (MAE-LM 491 against RoBERTa 462 after "
           "pretraining) at 131B tokens")


def _not_measured(reason: str) -> dict:
    return {"holds": None, "status": f"not measured ({reason})"}


def _verdict(holds: bool, figures: dict) -> dict:
    return {"holds": holds, "status": "holds" if holds else "does not hold", **figures}


def _ranks(record: dict, models: list[str], view: str) -> dict[str, dict] | str:
    """model -> {"layers", "with_mask", "without_mask", "mask_only"} (continuous where
    recorded) in `view`, or why not."""
    analysis = record.get("rank") or {}
    tau = analysis.get("tau") or 0.9
    runs = {r["label"]: r for r in analysis.get("runs", [])}
    for m in models:  # first what would make any view meaningless
        if plateau.on_plateau(record.get("pretraining", {}).get(m, {})):
            return f"{recipes.display_name(m)} stayed on the unigram plateau"
    out = {}
    for m in models:
        if m not in runs:
            return f"no rank analysis of {recipes.display_name(m)}"
        if view == "centred" and not runs[m].get("centred"):
            return f"no centred ranks of {recipes.display_name(m)}"
        ranks = runs[m] if view == "uncentred" else runs[m]["centred"]
        out[m] = {"layers": runs[m]["layers"], "run": runs[m],
                  **{stat: _numbers(rank_report.continuous_ranks(runs[m], view, stat, tau))
                     for stat in ("with_mask", "without_mask", "mask_only") if stat in ranks}}
    return out


def _numbers(values: list[float]) -> list[float | int]:
    """Whole numbers as ints: an older record's integer ranks read as they were."""
    return [int(v) if float(v).is_integer() else round(float(v), 2) for v in values]


def c0(record: dict, view: str = "uncentred") -> dict:
    """Rule (c0) in one call: MLM's [MASK]-row rank at layer 1 and the last layer, and
    MAE-LM's at the last layer."""
    found = _ranks(record, ["mlm", "maelm"], view)
    if isinstance(found, str):
        return _not_measured(found)
    mlm, maelm = found["mlm"], found["maelm"]
    if "mask_only" not in mlm or "mask_only" not in maelm:
        return _not_measured("no [MASK]-row ranks")
    if FIRST_LAYER not in mlm["layers"][:-1]:
        return _not_measured(f"no layer {FIRST_LAYER} below the last")
    first = mlm["layers"].index(FIRST_LAYER)
    figures = {"mlm_first": mlm["mask_only"][first], "mlm_last": mlm["mask_only"][-1],
               "maelm_last": maelm["mask_only"][-1], "last_layer": mlm["layers"][-1]}
    return _verdict(figures["mlm_last"] > figures["mlm_first"]
                    and figures["mlm_last"] > figures["maelm_last"], figures)


def c1(record: dict, view: str = "uncentred") -> dict:
    """Rule (c1) in one call: MLM's ranks at its last layer and the gaps at layer 1 and the
    last layer, with the verdict."""
    found = _ranks(record, ["mlm"], view)
    if isinstance(found, str):
        return _not_measured(found)
    mlm = found["mlm"]
    if FIRST_LAYER not in mlm["layers"][:-1]:
        return _not_measured(f"no layer {FIRST_LAYER} below the last")
    first = mlm["layers"].index(FIRST_LAYER)
    w, wo = mlm["with_mask"], mlm["without_mask"]
    figures = {"with_mask": w[-1], "without_mask": wo[-1],
               "gap_first": _numbers([w[first] - wo[first]])[0],
               "gap_last": _numbers([w[-1] - wo[-1]])[0], "last_layer": mlm["layers"][-1]}
    return _verdict(wo[-1] < w[-1] and figures["gap_last"] > figures["gap_first"], figures)


def _call_interval(run_a: dict, run_b: dict, analysis: dict, view: str) -> list | None:
    """The bootstrap interval of run a minus run b recorded by the analysis (paired on the
    same sequences), or None."""
    for d in analysis.get("differences", []):
        if d["view"] != view or d["statistic"] != "without_mask":
            continue
        if (d["a"], d["b"]) == (run_a["label"], run_b["label"]):
            return list(d["interval"])
        if (d["b"], d["a"]) == (run_a["label"], run_b["label"]):
            return [-d["interval"][1], -d["interval"][0]]
    return None


def paired_in_call(record: dict, model: str, reference: str, view: str = "uncentred") -> dict:
    """One call's figures for (c2) or (c2'): both models' continuous last-layer ranks
    without [MASK], their difference and its bootstrap interval (the measurement's); the
    status says one call decides nothing."""
    found = _ranks(record, [reference, model], view)
    if isinstance(found, str):
        return _not_measured(found)
    a, b = found[model]["without_mask"][-1], found[reference]["without_mask"][-1]
    interval = _call_interval(found[model]["run"], found[reference]["run"],
                              record.get("rank") or {}, view)
    return {"holds": None, "measured": True, "status": "one pretraining seed: not decidable",
            "model": model, "reference": reference, "value": a, "reference_value": b,
            "difference": _numbers([a - b])[0], "interval": interval,
            "flops_per_step": budget.flops_per_step_ratio(record, model, reference)}


def c2(record: dict, view: str = "uncentred") -> dict:
    """(c2)'s figures in one call: MAE-LM against MLM."""
    return paired_in_call(record, *PAIRED_RULES["c2"], view)


def decide(record: dict) -> dict:
    """{rule: {view: decision}} for one call: every rule of RULES, views uncentred and
    centred."""
    rules = {"c0": c0, "c1": c1, **{r: (lambda rec, v, pair=pair: paired_in_call(rec, *pair, v))
                                    for r, pair in PAIRED_RULES.items()}}
    return {rule: {v: rules[rule](record, v) for v in VIEWS} for rule in RULES}


def _reasons(decisions: list[dict]) -> str:
    reasons = sorted({d["status"][len("not measured ("):-1] for d in decisions
                      if d["status"].startswith("not measured (")})
    return f"not measured ({'; '.join(reasons)})" if reasons else "not measured"


def sign_test(decisions: list[dict]) -> dict:
    """(c0) or (c1) over calls: how many of the calls measuring it hold, and the one-sided
    sign test's p (each call holding with probability 1/2 under the null)."""
    from scipy import stats

    measured = [d for d in decisions if d["holds"] is not None]
    if not measured:
        return {"n": 0, "held": 0, "p": None, "status": _reasons(decisions)}
    n, held = len(measured), sum(bool(d["holds"]) for d in measured)
    p = float(stats.binomtest(held, n, 0.5, alternative="greater").pvalue)
    return {"n": n, "held": held, "p": p,
            "status": "shown" if p < SIGNIFICANCE else "not shown"}


def over_seeds(decisions: list[dict], seeds: list) -> dict:
    """(c2) or (c2') over calls: the calls' paired differences, their mean and Student's
    t 95 % interval over the pretraining seeds, and the verdict by the rule."""
    from scipy import stats

    measured = [(d, s) for d, s in zip(decisions, seeds, strict=True) if d.get("measured")]
    if not measured:
        return {"n": 0, "status": _reasons(decisions)}
    values = [float(d["difference"]) for d, _ in measured]
    reference = statistics.fmean(float(d["reference_value"]) for d, _ in measured)
    n_seeds = len({s for _, s in measured})
    out = {"n": len(values), "seeds": n_seeds, "difference": statistics.fmean(values),
           "reference": reference, "lower": None, "upper": None}
    if n_seeds == 1:
        d = measured[0][0]
        return {**out, "status": "one pretraining seed: not decidable",
                "interval": d.get("interval")}
    half = (float(stats.t.ppf(0.975, len(values) - 1)) * statistics.stdev(values)
            / len(values) ** 0.5)
    out.update(lower=out["difference"] - half, upper=out["difference"] + half)
    if n_seeds < MIN_SEEDS:
        out["status"] = f"not decidable ({n_seeds} pretraining seeds of the {MIN_SEEDS} needed)"
    elif out["lower"] > 0:
        out["status"] = "supported"
    elif out["upper"] < NO_EFFECT * reference:
        out["status"] = "no effect at this scale"
    else:
        out["status"] = "not resolved"
    return out


def pooled(records: list[dict]) -> dict:
    """Claim (c) over the calls of one design: per rule and view, the sign test (c0, c1)
    or the interval over pretraining seeds (c2, c2')."""
    per_call = [decide(r) for r in records]
    seeds = [r.get("pretrain_seed") for r in records]
    return {"claim": "MLM's [MASK] rows grow in rank with depth (Fig. 1b); MLM's real-token "
                     "rank is lower without [MASK], the gap growing with depth (Fig. 1a); "
                     "MAE-LM's last layer has a higher rank than MLM's (Table 3) and than "
                     "MAE-LM's with [MASK] in the encoder",
            "rules": dict(RULES), "per_call": per_call, "table_3": TABLE_3,
            **{rule: {v: sign_test([d[rule][v] for d in per_call]) for v in VIEWS}
               for rule in SIGN_RULES},
            **{rule: {v: over_seeds([d[rule][v] for d in per_call], seeds) for v in VIEWS}
               for rule in PAIRED_RULES}}


# --------------------------------------------------------------------------- reports

def _g(value) -> str:
    return f"{value:g}" if isinstance(value, int) else f"{value:.1f}"


def _signed(value) -> str:
    return f"{value:+g}" if isinstance(value, int) else f"{value:+.1f}"


def c0_text(d: dict) -> str:
    """(c0) in one cell: `MLM 1 -> 76 (layer 1 -> 6), MAE-LM 16 at layer 6: holds`."""
    if d["holds"] is None:
        return d["status"]
    return (f"MLM {_g(d['mlm_first'])} -> {_g(d['mlm_last'])} (layer {FIRST_LAYER} -> "
            f"{d['last_layer']}), MAE-LM {_g(d['maelm_last'])} at layer {d['last_layer']}: "
            f"{d['status']}")


def c1_text(d: dict) -> str:
    """(c1) in one cell: `w. 74 / w/o 64; gap -2 at layer 1, 10 at layer 6: holds`."""
    if d["holds"] is None:
        return d["status"]
    return (f"w. {_g(d['with_mask'])} / w/o {_g(d['without_mask'])}; gap "
            f"{_signed(d['gap_first'])} at layer {FIRST_LAYER}, {_signed(d['gap_last'])} at "
            f"layer {d['last_layer']}: {d['status']}")


def paired_text(d: dict) -> str:
    """(c2) or (c2') of one call in one cell: `MAE-LM 86.4 vs MLM 87.1 (-0.7 [-1.9, +0.4]),
    at 1.48x MLM's FLOPs per step: one pretraining seed: not decidable`."""
    if not d.get("measured"):
        return d["status"]
    model, ref = recipes.display_name(d["model"]), recipes.display_name(d["reference"])
    interval = ("" if d.get("interval") is None else
                f" [{d['interval'][0]:+.1f}, {d['interval'][1]:+.1f}]")
    flops = ("" if d.get("flops_per_step") is None else
             f", at {d['flops_per_step']:.2f}x {ref}'s FLOPs per step")
    return (f"{model} {_g(d['value'])} vs {ref} {_g(d['reference_value'])} "
            f"({_signed(d['difference'])}{interval}){flops}: {d['status']}")


c2_text = paired_text


def over_seeds_text(test: dict) -> str:
    """(c2) or (c2') over calls in one cell."""
    if not test["n"]:
        return "—"
    if test["lower"] is None:
        interval = ("" if test.get("interval") is None else
                    f" [{test['interval'][0]:+.1f}, {test['interval'][1]:+.1f}] over the "
                    "measurement")
        return f"{test['difference']:+.1f}{interval} (1 pretraining seed)"
    return (f"{test['difference']:+.1f} [{test['lower']:+.1f}, {test['upper']:+.1f}] over "
            f"{test['seeds']} pretraining seeds (2 % of the reference: "
            f"{NO_EFFECT * test['reference']:.1f})")


TEXTS = {"c0": c0_text, "c1": c1_text, "c2": paired_text, "c2'": paired_text}


def call_lines(record: dict) -> list[str]:
    """study.md's claim (c) section: each rule, uncentred and centred, with its figures."""
    decisions = decide(record)
    rows = [[f"({rule}) {RULES[rule]}", TEXTS[rule](decisions[rule]["uncentred"]),
             TEXTS[rule](decisions[rule]["centred"])] for rule in RULES]
    return ["", f"Claim (c), decided by rules fixed before the call (layer {FIRST_LAYER} is "
                "the first transformer layer; continuous ranks where recorded, with the "
                "bootstrap interval of the measurement; " + TABLE_3 + "):", "",
            *markdown.table(["rule", "uncentred", "centred"], rows)]


# ------------------------------------------------------ Table 3's ranks after fine-tuning

def finetuned_ranks(record: dict) -> dict:
    """{task: {"models": {model: {seed: continuous rank}}, "paired": {(model, reference):
    {"difference", "lower", "upper", "n"}}}}: each fine-tuned encoder's last-layer rank
    (uncentred, real tokens without [MASK]) on the task's dev sequences, and every pair of
    the study's models (not the control) paired by fine-tuning seed, with Student's t 95 %
    interval over the seeds (fine-tuning seeds only: one pretraining seed)."""
    from scipy import stats

    out = {}
    tasks = dict.fromkeys(t for per_task in record.get("glue", {}).values() for t in per_task)
    for task in tasks:
        models = {}
        for m, per_task in record["glue"].items():
            found = per_task.get(task, {}).get("rank_per_seed")
            if found:
                models[m] = {s: r["last_layer"]["uncentred"]["without_mask"]["continuous"]
                             for s, r in found.items()}
        if not models:
            continue
        paired = {}
        studied = [m for m in record.get("models", []) if m in models]
        for i, ref in enumerate(studied):
            for m in studied[i + 1:]:
                seeds = sorted(set(models[m]) & set(models[ref]))
                values = [models[m][s] - models[ref][s] for s in seeds]
                if not values:
                    continue
                mean = statistics.fmean(values)
                half = (float(stats.t.ppf(0.975, len(values) - 1)) * statistics.stdev(values)
                        / len(values) ** 0.5 if len(values) > 1 else None)
                paired[f"{m} minus {ref}"] = {
                    "difference": mean, "n": len(values),
                    "lower": None if half is None else mean - half,
                    "upper": None if half is None else mean + half}
        out[task] = {"models": models, "paired": paired}
    return out


def finetuned_lines(record: dict) -> list[str]:
    """study.md's section of ranks after fine-tuning (MAE-LM Table 3's other columns)."""
    found = finetuned_ranks(record)
    if not found:
        return []
    rows = []
    for task, t in found.items():
        for m, per_seed in t["models"].items():
            rows.append([task, recipes.display_name(m),
                         ", ".join(f"{v:.1f}" for v in per_seed.values()),
                         f"{statistics.fmean(per_seed.values()):.1f}"])
        for pair, d in t["paired"].items():
            m, ref = pair.split(" minus ")
            interval = ("" if d["lower"] is None else
                        f" [{d['lower']:+.1f}, {d['upper']:+.1f}]")
            rows.append([task, f"{recipes.display_name(m)} minus {recipes.display_name(ref)}",
                         f"paired over {d['n']} fine-tuning seeds",
                         f"{d['difference']:+.1f}{interval}"])
    return ["", "Ranks after fine-tuning (MAE-LM Table 3's other columns): each fine-tuned "
                "encoder's continuous last-layer rank_0.9 on the task's dev sequences (real "
                "tokens, no [MASK]), per fine-tuning seed; differences paired by seed, with "
                "Student's t 95 % interval over the fine-tuning seeds (one pretraining seed):",
            "", *markdown.table(["task", "model", "per seed", "mean"], rows)]
