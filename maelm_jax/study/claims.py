"""Claim (c) of the MAE-LM paper decided by rules fixed before the call, in each call and
over calls.

The paper's Fig. 1(a) and Table 3, as two rules on a call's rank analysis (rank_tau per
layer of the real tokens' representations, study.json's "rank"), each decided on the
ranks as the paper defines them ("uncentred") and on the centred ones (the mean row
subtracted; docs/analysis.md):

(c1) MLM's real-token rank without [MASK] in the input is below its rank with [MASK] at
     the last layer, and that gap (with minus without) is larger at the last layer than
     at the first. The first layer is the first transformer layer, layer 1: layer 0 is the
     embeddings, where [MASK] is one row of a lookup table and no context has been mixed
     in yet, so a gap there says nothing of what pretraining made of the layers.
(c2) MAE-LM's last-layer rank (input without [MASK]) is above MLM's.

A rule is "not measured" in a call, with the reason, when a model it needs has no rank
analysis there or ended pretraining on the unigram plateau (study/plateau.py): the ranks of
a model that learnt word frequencies say nothing of its objective. Over calls
(`pooled`), a one-sided sign test over the calls where the rule is measured: shown when
P(at least k of n hold | each holds with probability 1/2) < 0.05, which takes 5 calls
out of 5 (7 of 8, 9 of 10, ...); fewer calls cannot show it, and the table says how many
held.
"""

from __future__ import annotations

from maelm_jax.infra import markdown
from maelm_jax.pretrain.objectives import recipes
from maelm_jax.study import budget, plateau

FIRST_LAYER = 1  # the first transformer layer (0 is the embeddings)
VIEWS = ("uncentred", "centred")
SIGNIFICANCE = 0.05
RULES = {
    "c1": "MLM's real-token rank is lower without [MASK] at the last layer, the gap (with "
          "minus without) larger there than at layer 1",
    "c2": "MAE-LM's last-layer rank (no [MASK]) is above MLM's",
}


def _not_measured(reason: str) -> dict:
    return {"holds": None, "status": f"not measured ({reason})"}


def _verdict(holds: bool, figures: dict) -> dict:
    return {"holds": holds, "status": "holds" if holds else "does not hold", **figures}


def _ranks(record: dict, models: list[str], view: str) -> dict[str, dict] | str:
    """model -> {"layers", "with_mask", "without_mask"} in `view`, or why not."""
    runs = {r["label"]: r for r in (record.get("rank") or {}).get("runs", [])}
    for m in models:  # first what would make any view meaningless
        if plateau.on_plateau(record.get("pretraining", {}).get(m, {})):
            return f"{recipes.display_name(m)} stayed on the unigram plateau"
    out = {}
    for m in models:
        if m not in runs:
            return f"no rank analysis of {recipes.display_name(m)}"
        ranks = runs[m] if view == "uncentred" else runs[m].get("centred")
        if not ranks:
            return f"no centred ranks of {recipes.display_name(m)}"
        out[m] = {"layers": runs[m]["layers"], "with_mask": ranks["with_mask"],
                  "without_mask": ranks["without_mask"]}
    return out


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
    figures = {"with_mask": w[-1], "without_mask": wo[-1], "gap_first": w[first] - wo[first],
               "gap_last": w[-1] - wo[-1], "last_layer": mlm["layers"][-1]}
    return _verdict(wo[-1] < w[-1] and figures["gap_last"] > figures["gap_first"], figures)


def c2(record: dict, view: str = "uncentred") -> dict:
    """Rule (c2) in one call: MAE-LM's and MLM's last-layer ranks without [MASK], with
    MAE-LM's FLOPs per step relative to MLM's (the comparison is at equal steps, not equal
    compute)."""
    found = _ranks(record, ["mlm", "maelm"], view)
    if isinstance(found, str):
        return _not_measured(found)
    maelm, mlm = found["maelm"]["without_mask"][-1], found["mlm"]["without_mask"][-1]
    return _verdict(maelm > mlm, {
        "maelm": maelm, "mlm": mlm, "difference": maelm - mlm,
        "flops_per_step": budget.flops_per_step_ratio(record, "maelm", "mlm")})


def decide(record: dict) -> dict:
    """{rule: {view: decision}} for one call: rules c1 and c2, views uncentred, centred."""
    return {"c1": {v: c1(record, v) for v in VIEWS}, "c2": {v: c2(record, v) for v in VIEWS}}


def sign_test(decisions: list[dict]) -> dict:
    """One rule over calls: how many of the calls measuring it hold, and the one-sided
    sign test's p (each call holding with probability 1/2 under the null)."""
    from scipy import stats

    measured = [d for d in decisions if d["holds"] is not None]
    if not measured:
        reasons = sorted({d["status"][len("not measured ("):-1] for d in decisions})
        return {"n": 0, "held": 0, "p": None, "status":
                f"not measured ({'; '.join(reasons)})" if reasons else "not measured"}
    n, held = len(measured), sum(bool(d["holds"]) for d in measured)
    p = float(stats.binomtest(held, n, 0.5, alternative="greater").pvalue)
    return {"n": n, "held": held, "p": p,
            "status": "shown" if p < SIGNIFICANCE else "not shown"}


def pooled(records: list[dict]) -> dict:
    """Claim (c) over the calls of one design: per rule and view, the sign test."""
    per_call = [decide(r) for r in records]
    return {"claim": "MLM's real-token rank is lower without [MASK], the gap growing with "
                     "depth (Fig. 1a); MAE-LM's last layer has a higher rank than MLM's "
                     "(Table 3)",
            "rules": dict(RULES), "per_call": per_call,
            **{rule: {v: sign_test([d[rule][v] for d in per_call]) for v in VIEWS}
               for rule in RULES}}


# --------------------------------------------------------------------------- reports

def c1_text(d: dict) -> str:
    """(c1) in one cell: `w. 74 / w/o 64; gap -2 at layer 1, 10 at layer 6: holds`."""
    if d["holds"] is None:
        return d["status"]
    return (f"w. {d['with_mask']} / w/o {d['without_mask']}; gap {d['gap_first']:+g} at layer "
            f"{FIRST_LAYER}, {d['gap_last']:+g} at layer {d['last_layer']}: {d['status']}")


def c2_text(d: dict) -> str:
    """(c2) in one cell: `MAE-LM 80 vs MLM 64 (+16), at 1.16x MLM's FLOPs per step: holds`."""
    if d["holds"] is None:
        return d["status"]
    flops = ("" if d["flops_per_step"] is None else
             f", at {d['flops_per_step']:.2f}x MLM's FLOPs per step")
    return f"MAE-LM {d['maelm']} vs MLM {d['mlm']} ({d['difference']:+g}){flops}: {d['status']}"


def call_lines(record: dict) -> list[str]:
    """study.md's claim (c) section: each rule, uncentred and centred, with its figures."""
    decisions = decide(record)
    rows = [[f"({rule}) {RULES[rule]}", text(decisions[rule]["uncentred"]),
             text(decisions[rule]["centred"])] for rule, text in (("c1", c1_text), ("c2", c2_text))]
    return ["", f"Claim (c), decided by rules fixed before the call (layer {FIRST_LAYER} is "
                "the first transformer layer; ranks of the real tokens):", "",
            *markdown.table(["rule", "uncentred", "centred"], rows)]
