"""Each recorded call of the study on its own: what the README's "What to expect on one
GPU" shows per call, beside the pooled claims (study/pool.py).

A call's sizing sets every model's steps on its machine, so calls differ in what they
trained on; pooled, that would be lost. Per call and model: the planned tokens (steps x
batch x length), the [MASK] accuracy against the unigram baseline (docs/plateau.md), the
training FLOPs per step relative to MLM's at the call's shape, and the pretrained model
minus the from-scratch control per task (claim (a): its trend against tokens across calls
is the question one call cannot answer); per call, claim (c)'s rules (study/claims.py).
Unfinished calls are listed too: what they reached was measured, though the claims leave
them out.
"""

from __future__ import annotations

import statistics

from maelm_jax.infra import markdown, paths, records
from maelm_jax.pretrain.objectives import recipes
from maelm_jax.study import budget, claims, plateau

CONTROL = "scratch"


def minus_control(record: dict, model: str, task: str) -> float | None:
    """model minus the control on `task`, the mean over the fine-tuning seeds both have."""
    glue = record.get("glue", {})
    a = glue.get(model, {}).get(task, {}).get("per_seed", {})
    b = glue.get(CONTROL, {}).get(task, {}).get("per_seed", {})
    common = sorted(set(a) & set(b))
    return statistics.fmean(a[s] - b[s] for s in common) if common else None


def machine(record: dict) -> dict:
    """The machine a call ran on (its first part's: records.machine)."""
    return record["parts"][0] if record.get("parts") else {}


def summary(where: str, record: dict, design: str) -> dict:
    """What the tables show of one call (and pool.json holds of it)."""
    tasks = list(record.get("glue", {}).get(CONTROL, {}))
    done, left = record.get("parts_done", []), record.get("parts_left", [])
    models = {}
    for m in record["models"]:
        p = record.get("pretraining", {}).get(m, {})
        models[m] = {
            "planned_steps": budget.planned_steps(record, m),
            "planned_tokens": budget.planned_tokens(record, m), "step": p.get("step"),
            "mask_accuracy": p.get("eval_mask_accuracy"),
            "unigram_accuracy": p.get("eval_unigram_accuracy"),
            "on_plateau": plateau.on_plateau(p),
            "flops_per_step_vs_mlm": budget.flops_per_step_ratio(record, m, "mlm"),
            "minus_control": {t: minus_control(record, m, t) for t in tasks}}
    return {"record": where, "title": record.get("title"),
            "pretrain_seed": record.get("pretrain_seed"), "machine": machine(record),
            "design": design, "finished": bool(record.get("finished")),
            "parts": [len(done), len(done) + len(left)],
            "seconds": record.get("seconds"),
            "predicted_seconds": (record.get("sizing") or {}).get(
                "predicted_seconds", {}).get("total"),
            "models": models, "claim_c": claims.decide(record)}


def call_text(title, seed, machine: dict, *more: str) -> str:
    """A call as the tables name it: its title, pretraining seed and machine (and `more`)."""
    return (f"{title} (pretraining seed {seed}, {records.describe(machine)}, "
            f"commit {str(machine.get('commit', '?'))[:10]}"
            + "".join(f", {m}" for m in more) + ")")


def unfinished_lines(unfinished: list[tuple[str, dict]]) -> list[str]:
    """A line per unfinished call: recorded, so what it measured is kept, but left out of
    the claims (a part it did not reach would bias them)."""
    return [f"Unfinished, left out of the claims: "
            f"{call_text(r.get('title'), r.get('pretrain_seed'), machine(r))}, "
            f"{len(r.get('parts_done', []))} of "
            f"{len(r.get('parts_done', [])) + len(r.get('parts_left', []))} parts done "
            f"(`{paths.Path(where).name}`)." for where, r in unfinished]


def _name(call: dict) -> str:
    stem = paths.Path(call["record"]).stem
    return f"`{stem}`" + ("" if call["finished"] else
                          f" (unfinished: {call['parts'][0]} of {call['parts'][1]} parts)")


def _number(value, spec: str, empty: str = "—") -> str:
    return empty if value is None else format(value, spec)


def _tokens(n: int | None) -> str:
    return "—" if n is None else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _accuracy(s: dict) -> str:
    """`32.2 (4.6)`: [MASK] accuracy and the unigram baseline's, in %."""
    if s["mask_accuracy"] is None:
        return "—"
    unigram = _number(None if s["unigram_accuracy"] is None else 100 * s["unigram_accuracy"],
                      ".1f")
    return (f"{100 * s['mask_accuracy']:.1f} ({unigram})"
            + (", on the plateau" if s["on_plateau"] else ""))


def tables(calls: list[dict]) -> list[str]:
    """Markdown: a row per call and model (the call named on its first), then claim (c)'s
    rules per call."""
    if not calls:
        return []
    tasks = list(dict.fromkeys(t for c in calls for m in c["models"].values()
                               for t in m["minus_control"]))
    header = (["call", "design", "model", "tokens (steps)", "[MASK] acc. % (unigram %)",
               "FLOPs/step vs MLM"] + [f"{t} minus control" for t in tasks])
    rows = []
    for c in calls:
        for i, (m, s) in enumerate(c["models"].items()):
            flops = s["flops_per_step_vs_mlm"]
            row = [_name(c) if i == 0 else "", c["design"] if i == 0 else "",
                   recipes.display_name(m),
                   f"{_tokens(s['planned_tokens'])} ({_number(s['planned_steps'], 'd')})",
                   _accuracy(s), "—" if flops is None else f"{flops:.2f}x"]
            row += [_number(s["minus_control"].get(t), "+.1f") for t in tasks]
            rows.append(row)
    claim_c = [[_name(c) if i == 0 else "", f"({rule})",
                *(claims.TEXTS[rule](c["claim_c"][rule][v]) for v in claims.VIEWS)]
               for c in calls for i, rule in enumerate(claims.RULES)]
    return [*markdown.table(header, rows), "",
            f"Claim (c) per call (layer {claims.FIRST_LAYER} is the first transformer layer; a "
            "model on the unigram plateau measures nothing; continuous ranks where the record "
            "has them, with the bootstrap interval of the measurement, not of the pretraining "
            "seed):", "",
            *markdown.table(["call", "rule", "uncentred", "centred"], claim_c)]
