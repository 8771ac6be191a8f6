"""Calls of one study design pooled, and what they show of the papers' claims:
`pool(config, workdir)`.

    python main.py --config=configs/study/pool.py --workdir=runs/pool \
        [--config.inputs=benchmarks/results/study]

Each input is a study's study.json (a call's record), a directory of them, or a study's
workdir. Records pool when they share a pretraining design (`design`: the pretraining
config but its seed and step cap, the planned tokens per model, the step scales, the
fine-tuning recipe, the tokenizer and the prepared corpus). The planned tokens, not the
configured steps: a call sizes its steps to its machine (study/sizing.py), so two calls of
one config may train on different budgets, and those are listed, not pooled; a design
that pins its steps pools across machines. Each claim is computed on the finished records
that hold what it needs:

(a) pretraining beats the same encoder fine-tuned from scratch by >= 5 points, on SST-2
    and on the GLUE average (MAE-LM 4.1's premise; every pretrained model against the
    control);
(b) MAE-LM >= MLM on the GLUE average (MAE-LM Table 1);
(c) the MAE-LM paper's mechanism: MLM's [MASK] rows grow in rank with depth (Fig. 1b),
    MLM's real-token representations have a lower effective rank when [MASK] is absent
    from the input, the gap growing with depth (Fig. 1a), and MAE-LM's last layer a
    higher rank than MLM's (Table 3) and than MAE-LM's with [MASK] in the encoder: rules
    (c0), (c1) (per call, then a one-sided sign test over calls), (c2) and (c2') (an
    interval over pretraining seeds), uncentred and centred (study/claims.py);
(d) 3ML_self matches MLM's GLUE average at <= 0.75x its training FLOPs (3ML Fig. 5).

A difference is paired: the same call, fine-tuning seed and task, model against model.
With several calls (pretraining seeds) the 95 % interval is Student's t over the calls'
mean differences; with one call, over the fine-tuning seeds (which leaves out how
pretraining varies: the text says so). A claim is "shown" when its interval's bound
clears the threshold, "not shown" when it does not, "not measured" when no record holds
what it needs; (b) and (d) are non-inferiority claims within 1 point unless the lower
bound clears 0. A model that ended pretraining on the unigram plateau measures no claim of
its objective (study/plateau.py). Beside every MAE-LM against MLM comparison: MAE-LM's
training FLOPs per step relative to MLM's. `markdown` is the README's "What to expect on
one GPU" block too, which benchmarks/tables.py renders from the committed records
(benchmarks/results/study/): the pooled claims per design, then every call, finished or
not, on its own (study/calls.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics

import ml_collections
from absl import logging

from maelm_jax.config import schema
from maelm_jax.infra import errors, paths
from maelm_jax.infra import markdown as markdown_lib
from maelm_jax.pretrain.objectives import recipes
from maelm_jax.study import budget, calls, claims, plateau
from maelm_jax.workdirs import guard as workdir_lib
from maelm_jax.workdirs import layout

# What no call of one GPU can reach, and why.
OUT_OF_REACH = (
    "the papers' magnitudes: MAE-LM base is about 7.7e19 training FLOPs, some 120 H100-hours "
    "per model",
    "MNLI, QQP and a full RTE: not in the data at hand",
    "Table 3's ranks after fine-tuning on MNLI and SQuAD 2.0",
)
# Points by which pretraining must beat the control (a); the margin of non-inferiority
# (b, d); the FLOPs budget of (d).
PRETRAINING_MARGIN = 5.0
NON_INFERIORITY = 1.0
FLOPS_RATIO = 0.75


class PoolError(errors.UserError):
    """Inputs that are not study records; the message names the input."""


def pool_defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "study_pool"  # main.py dispatches on it
    c.inputs = "benchmarks/results/study"  # records, directories of them, study workdirs
    return c


FIELDS = {
    "mode": schema.choice("study_pool"),
    "inputs": schema.Field((str, list, tuple), "records, directories of them or study "
                           "workdirs, comma-separated", lambda v: bool(v)),
}


def read_records(inputs, finished: bool = True) -> list[tuple[str, dict]]:
    """(where, study.json contents) of every finished call the inputs hold (with
    finished=False: of every unfinished one, which the claims leave out)."""
    items = inputs.split(",") if isinstance(inputs, str) else list(inputs)
    out = []
    for item in (i.strip() for i in items if i.strip()):
        given = paths.resolve(item, "config.inputs")
        files = ([given] if given.is_file() else
                 [given / layout.STUDY_JSON_FILE] if (given / layout.STUDY_JSON_FILE).is_file()
                 else sorted(given.glob("*.json")) if given.is_dir() else None)
        if files is None:
            raise PoolError(f"config.inputs: {item} does not exist")
        for file in files:
            try:
                record = json.loads(paths.read_text(file))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise PoolError(f"config.inputs: {file} cannot be read as JSON ({e})") from None
            if not isinstance(record, dict) or "identity" not in record or "glue" not in record:
                raise PoolError(f"config.inputs: {file} is not a study's record (no identity)")
            if bool(record.get("finished")) == finished:
                out.append((str(file), record))
            elif finished:
                logging.warning("study pool: %s is an unfinished call, left out", file)
    return out


def design(record: dict) -> str:
    """A short digest of what calls must share to pool: the pretraining design (its seed
    and step cap left out), the planned tokens per model (the base tokens and the step
    scales, study/budget.py: so calls that took different models still pool), fine-tuning
    recipe, tokenizer and prepared corpus."""
    settings = json.loads(json.dumps(record["identity"]["settings"]))
    settings["pretrain"].pop("seed", None)
    settings["pretrain"].get("train", {}).pop("num_steps", None)
    finetune = {k: v for k, v in settings["finetune"].items() if k != "seeds_per_program"}
    key = {"pretrain": settings["pretrain"], "step_scale": settings.get("step_scale", {}),
           "base_tokens": budget.base_tokens(record),
           "finetune": finetune, "tokenizer": record["identity"]["tokenizer_sha256"],
           "data": record["identity"]["data_fingerprint"]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


# ----------------------------------------------------------------- paired differences

def _t95(n: int) -> float:
    """Student's t at 97.5 % for n - 1 degrees of freedom."""
    from scipy import stats

    return float(stats.t.ppf(0.975, n - 1))


def interval(values: list[float]) -> tuple[float, float, float] | None:
    """(mean, lower, upper) 95 % of `values`; None for fewer than 2."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = _t95(len(values)) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def _per_seed(record: dict, model: str, tasks: list[str]) -> dict[str, float]:
    """Fine-tuning seed -> the model's mean score over `tasks` (seeds every task has)."""
    glue = record["glue"].get(model, {})
    if not all(t in glue for t in tasks):
        return {}
    seeds = set.intersection(*(set(glue[t]["per_seed"]) for t in tasks))
    return {s: statistics.fmean(glue[t]["per_seed"][s] for t in tasks) for s in sorted(seeds)}


def paired(records: list[dict], model: str, reference: str, tasks: list[str]) -> dict | None:
    """model minus reference on the mean of `tasks`, paired by call and seed, with its
    95 % interval over calls (or over seeds, with one call); None when no record holds
    both."""
    per_call = []
    for record in records:
        a, b = _per_seed(record, model, tasks), _per_seed(record, reference, tasks)
        common = sorted(set(a) & set(b))
        if common:
            per_call.append([a[s] - b[s] for s in common])
    if not per_call:
        return None
    if len(per_call) > 1:
        values, over = [statistics.fmean(d) for d in per_call], "calls"
    else:
        values, over = per_call[0], "fine-tuning seeds"
    found = interval(values)
    mean = statistics.fmean(values)
    return {"difference": mean, "lower": found[1] if found else None,
            "upper": found[2] if found else None, "over": over, "n": len(values),
            "tasks": list(tasks)}


def _common_tasks(records: list[dict], *models: str) -> list[str]:
    """The tasks every record holding all `models` fine-tuned them all on."""
    holding = [r for r in records if all(m in r["glue"] for m in models)]
    if not holding:
        return []
    common = set.intersection(*(set.intersection(*(set(r["glue"][m]) for m in models))
                                for r in holding))
    order = [t for r in holding for m in models for t in r["glue"][m]]
    return sorted(common, key=order.index)


def _status(diff: dict | None, threshold: float, strict: float | None = None) -> str:
    """"shown" when the interval's lower bound clears `threshold` ("shown (>= 0)" when it
    clears `strict` too), "not shown" otherwise, "not measured" without a difference."""
    if diff is None:
        return "not measured"
    if diff["lower"] is None:
        return "not shown (one observation: no interval)"
    if strict is not None and diff["lower"] >= strict:
        return "shown (>= 0)"
    if diff["lower"] >= threshold:
        return "shown" if strict is None else f"shown (within {-threshold:g} point)"
    return "not shown"


# ------------------------------------------------------------------------- the claims

def _plateaued(records: list[dict], *models: str) -> list[str]:
    """Which of `models` ended pretraining on the unigram plateau in some call: a claim
    about them would measure a model that never used context (study/report.py)."""
    return [m for m in models
            if any(plateau.on_plateau(r["pretraining"].get(m, {})) for r in records)]


def _names(models: list[str]) -> str:
    return " and ".join(recipes.display_name(m) for m in models)


def _plateau_status(stuck: list[str]) -> str:
    return f"not measured ({_names(stuck)} stayed on the unigram plateau)"


def claim_a(records: list[dict]) -> dict:
    out = {"claim": "pretraining beats the same encoder from scratch by >= 5 points on "
                    "SST-2 and on the GLUE average", "models": {}}
    with_control = [r for r in records if "scratch" in r["glue"]]
    statuses = []
    for model in ("mlm", "maelm", "3ml_self", "3ml_cross"):
        tasks = _common_tasks(with_control, model, "scratch")
        if not tasks:
            continue
        sst2 = paired(with_control, model, "scratch", ["SST-2"]) if "SST-2" in tasks else None
        avg = paired(with_control, model, "scratch", tasks)
        both = [_status(d, PRETRAINING_MARGIN) for d in (sst2, avg)]
        out["models"][model] = {"SST-2": sst2, "GLUE average": avg}
        if model in ("mlm", "maelm") and not _plateaued(with_control, model):
            statuses += both
    out["status"] = ("not measured" if not statuses or "not measured" in statuses else
                     "shown" if all(s == "shown" for s in statuses) else "not shown")
    stuck = _plateaued(with_control, "mlm", "maelm")
    if stuck:  # the claim is of pretraining that worked: those that did not are named
        out["status"] += f" ({_names(stuck)} left out: stayed on the unigram plateau)"
    return out


def claim_b(records: list[dict]) -> dict:
    tasks = _common_tasks(records, "maelm", "mlm")
    diff = paired(records, "maelm", "mlm", tasks) if tasks else None
    stuck = _plateaued(records, "maelm", "mlm")
    ratios = [budget.flops_per_step_ratio(r, "maelm", "mlm") for r in records]
    return {"claim": "MAE-LM >= MLM on the GLUE average", "difference": diff,
            "flops_per_step": sorted({round(x, 2) for x in ratios if x is not None}),
            "status": (_plateau_status(stuck) if stuck
                       else _status(diff, -NON_INFERIORITY, 0.0))}


def claim_d(records: list[dict]) -> dict:
    tasks = _common_tasks(records, "3ml_self", "mlm")
    diff = paired(records, "3ml_self", "mlm", tasks) if tasks else None
    ratios = [r["pretraining"]["3ml_self"]["train_flops"] / r["pretraining"]["mlm"]["train_flops"]
              for r in records if {"3ml_self", "mlm"} <= set(r["pretraining"])
              and r["pretraining"]["mlm"].get("train_flops")]
    out = {"claim": "3ML_self matches MLM's GLUE average at <= 0.75x its training FLOPs",
           "difference": diff, "flops_ratio": max(ratios) if ratios else None}
    stuck = _plateaued(records, "3ml_self", "mlm")
    if ratios and max(ratios) > FLOPS_RATIO + 0.01:
        out["status"] = f"not measured (3ML_self trained on {max(ratios):.2f}x MLM's FLOPs)"
    elif stuck:
        out["status"] = _plateau_status(stuck)
    else:
        out["status"] = _status(diff, -NON_INFERIORITY, 0.0)
    return out


def pool_records(records: list[tuple[str, dict]]) -> list[dict]:
    """Every design's calls and claims."""
    designs: dict[str, list[tuple[str, dict]]] = {}
    for where, record in records:
        designs.setdefault(design(record), []).append((where, record))
    out = []
    for key, members in designs.items():
        rs = [r for _, r in members]
        out.append({
            "design": key,
            "calls": [calls.summary(where, r, key) for where, r in members],
            "claims": {"a": claim_a(rs), "b": claim_b(rs), "c": claims.pooled(rs),
                       "d": claim_d(rs)},
            "out_of_reach": list(OUT_OF_REACH)})
    return out


# --------------------------------------------------------------------------- reports

def _diff_text(diff: dict | None) -> str:
    if diff is None:
        return "—"
    bound = ("" if diff["lower"] is None else
             f" [{diff['lower']:+.1f}, {diff['upper']:+.1f}]")
    return f"{diff['difference']:+.1f}{bound} ({diff['n']} {diff['over']})"


def _sign_text(test: dict) -> str:
    return ("—" if not test["n"] else
            f"{test['held']} of {test['n']} call(s) hold, p = {test['p']:.2g}")


def _flops_text(ratios: list[float]) -> str:
    """MAE-LM's FLOPs per step relative to MLM's, over a design's calls."""
    if not ratios:
        return ""
    shown = f"{ratios[0]:.2f}x" if len(ratios) == 1 else f"{ratios[0]:.2f}-{ratios[-1]:.2f}x"
    return f"; MAE-LM at {shown} MLM's FLOPs per step"


def _claim_rows(found: dict) -> list[list[str]]:
    a, b, c, d = found["a"], found["b"], found["c"], found["d"]
    a_here = "; ".join(f"{m}: SST-2 {_diff_text(v['SST-2'])}, GLUE avg. "
                       f"{_diff_text(v['GLUE average'])}" for m, v in a["models"].items()) or "—"
    d_here = _diff_text(d["difference"]) + (
        f" at {d['flops_ratio']:.2f}x MLM's FLOPs" if d["flops_ratio"] else "")
    rows = [["(a)", a["claim"], a_here, a["status"]],
            ["(b)", b["claim"], _diff_text(b["difference"]) + _flops_text(b["flops_per_step"]),
             b["status"]]]
    for rule in claims.RULES:
        text = _sign_text if rule in claims.SIGN_RULES else claims.over_seeds_text
        here = "; ".join(f"{v}: {text(c[rule][v])}" for v in claims.VIEWS)
        status = "; ".join(f"{v}: {c[rule][v]['status']}" for v in claims.VIEWS)
        rows.append([f"({rule})", c["rules"][rule], here, status])
    return rows + [["(d)", d["claim"], d_here, d["status"]]]


def markdown(pooled: list[dict], unfinished: list[tuple[str, dict]] = ()) -> str:
    """The pooled claims: per design its calls and a row per claim; then every call on its
    own (study/calls.py), the unfinished (`read_records(..., finished=False)`) too; then
    the unfinished calls, each on a line."""
    unfinished = list(unfinished)
    each = ([c for p in pooled for c in p["calls"]]
            + [calls.summary(where, r, design(r)) for where, r in unfinished])
    lines = []
    if not pooled:
        lines += ["No finished study call is recorded yet: the claims are not measured. "
                  "`benchmarks/gpu_study.sh` runs `configs/study/gpu.py:one_call` on a lent "
                  "GPU; commit its study.json under `benchmarks/results/study/`.", ""]
    for p in pooled:
        named = "; ".join(calls.call_text(c["title"], c["pretrain_seed"], c["machine"],
                                     f"{c['seconds'] or 0:.0f} s") for c in p["calls"])
        lines += [f"Design {p['design']}: {len(p['calls'])} call(s): {named}.", "",
                  *markdown_lib.table(["claim", "the papers",
                                       "here: difference [95 % interval]", "status"],
                                      _claim_rows(p["claims"])), "",
                  f"Claim (c): {claims.TABLE_3}.", "",
                  "Out of reach here: " + "; ".join(p["out_of_reach"]) + ".", ""]
    if each:
        lines += ["Each call on its own, finished or not (tokens: the planned pretraining "
                  "tokens, steps x batch x length; FLOPs/step vs MLM: training FLOPs per step "
                  "at the call's shape; minus control: the pretrained model minus the "
                  "from-scratch control in points, the mean over fine-tuning seeds). A call "
                  "pools only with calls of its design: the same planned tokens per model "
                  "among the rest.", "", *calls.tables(each), ""]
    return "\n".join(lines + [line + "\n" for line in calls.unfinished_lines(unfinished)])


def pool(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
    """Pools the records of config.inputs into <workdir>/pool.json and pool.md; returns
    the pooled designs."""
    schema.check(config, FIELDS, pool_defaults(), PoolError)
    records = read_records(config.inputs)
    unfinished = read_records(config.inputs, finished=False)
    pooled = pool_records(records)
    root = paths.resolve(workdir, "--workdir")
    workdir_lib.claim(root, "study_pool", "pool the calls")
    with workdir_lib.all_or_nothing(root):
        paths.make_dirs(root)
        layout.write_config(root, config)
        paths.write_text(root / layout.POOL_JSON_FILE, json.dumps(pooled, indent=2))
        paths.write_text(root / layout.POOL_MARKDOWN_FILE, markdown(pooled, unfinished))
    logging.info("study pool: %d call(s) in %d design(s); %s", len(records), len(pooled),
                 root / layout.POOL_MARKDOWN_FILE)
    return pooled
