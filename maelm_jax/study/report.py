"""The study's outputs: study.json, study.md and its plots.

* ``study.json``: everything the table and plots show (so that it alone redraws them,
  maelm_jax/study/merge.py), each model's config, what the machine was, and the digests
  that say which studies' parts can be merged; while the study is unfinished (a time
  limit or a preemption stopped it), "finished": false and the parts done and left.
* ``study.md``: one row per model (pretraining eval loss and accuracy next to the unigram
  baseline, and at the fixed mask ratio every objective is evaluated at, last-layer
  rank_tau with and without [MASK], the GLUE medians and their average, wall time,
  training FLOPs, MFU) and one for the from-scratch control; claim (c) decided in this
  call by its fixed rules (study/claims.py), uncentred and centred; then each task's
  per-seed scores.
* ``loss_curves.png``: every model's train and eval loss against the step.
* ``rank_layers.png``: the rank analysis's Fig. 1(a) plot (every model, with and without
  [MASK], uncentred and centred), copied next to the table.
* ``glue_medians.png``: a bar chart of the GLUE medians per task and model.
"""

from __future__ import annotations

import io
import json

import numpy as np

from maelm_jax.infra import markdown as markdown_lib
from maelm_jax.infra import paths, records
from maelm_jax.pretrain.objectives import recipes
from maelm_jax.study import claims, plateau
from maelm_jax.training import metrics as metrics_lib
from maelm_jax.workdirs import layout

_CONTROL = "scratch"


def _name(model: str) -> str:
    """How the report writes a model: the papers' name, or the control's."""
    return "from scratch (control)" if model == _CONTROL else recipes.display_name(model)


def pretraining_record(workdir: paths.Path) -> dict:
    """What the report shows of a pretraining workdir: its last eval (loss, accuracy,
    unigram baseline), its loss curves ([step, loss] per log line) and the median MFU of
    its train logs (logged where the device's peak is known)."""
    evals, train = metrics_lib.read(workdir, "eval"), metrics_lib.read(workdir, "train")
    out = {"curves": {split: [[r["step"], r["loss"]] for r in rows if "loss" in r]
                      for split, rows in (("train", train), ("eval", evals))}}
    if evals:
        keys = ("step", "loss", "accuracy", "mask_loss", "mask_accuracy", "unigram_accuracy",
                "fixed_loss", "fixed_accuracy")
        out.update({f"eval_{k}" if k != "step" else k: evals[-1][k] for k in keys
                    if k in evals[-1]})
    mfus = [r["mfu"] for r in train if "mfu" in r]
    if mfus:
        out["mfu"] = float(np.median(mfus))
    return out


def plateau_lines(result: dict) -> list[str]:
    """A warning naming each model that ended on the unigram plateau (none: no lines)."""
    stuck = [n for n in result["models"]
             if plateau.on_plateau(result["pretraining"].get(n, {}))]
    if not stuck:
        return []
    each = ", ".join(
        f"{_name(n)} ({100 * result['pretraining'][n]['eval_mask_accuracy']:.1f} % against "
        f"{100 * result['pretraining'][n]['eval_unigram_accuracy']:.1f} %)" for n in stuck)
    return ["", f"**On the unigram plateau** at the end of pretraining ([MASK] accuracy under "
                f"{plateau.PLATEAU_FACTOR:g}x that of always predicting the most frequent piece): "
                f"{each}. What follows of it measures a model that learnt word frequencies, "
                f"not its objective (docs/plateau.md)."]


def _fmt(value, spec: str = ".2f", empty: str = "—") -> str:
    return empty if value is None else format(value, spec)


def _tasks(result: dict) -> list[str]:
    return sorted({t for per_task in result["glue"].values() for t in per_task})


def table(result: dict) -> list[str]:
    """The study's table: a row per model (its [MASK] loss and accuracy beside the unigram
    baseline, last-layer ranks, the GLUE medians and their average, wall time, training
    FLOPs, MFU) and one per control; Markdown lines."""
    names, glue = result["models"], result["glue"]
    tasks = _tasks(result)
    rank = {r["path"]: r["last_layer"] for r in result["rank"]["runs"]}
    centred = {r["path"]: r.get("centred", {}).get("last_layer", {})
               for r in result["rank"]["runs"]}
    # Loss and accuracy at train.eval_mask_ratio, the same for every objective (records
    # from before it have none, and keep their table).
    fixed = any("eval_fixed_loss" in result["pretraining"][n] for n in names)
    header = (["model", "[MASK] loss", "[MASK] acc. %", "unigram acc. %"]
              + (["loss at the fixed ratio", "acc. % at the fixed ratio"] if fixed else [])
              + ["rank (no [MASK])", "rank (with [MASK])", "centred rank (no [MASK])",
                 "centred rank (with [MASK])"]
              + tasks + (["GLUE avg."] if tasks else [])
              + ["pretraining time", "training FLOPs", "MFU"])
    rows = []
    for n in names:
        p = result["pretraining"][n]
        r, c = rank.get(p["workdir"], {}), centred.get(p["workdir"], {})
        scores = [glue.get(n, {}).get(t, {}).get("median") for t in tasks]
        row = [_name(n), _fmt(p.get("eval_mask_loss")),
               _fmt(None if p.get("eval_mask_accuracy") is None
                    else 100 * p["eval_mask_accuracy"], ".1f"),
               _fmt(None if p.get("eval_unigram_accuracy") is None
                    else 100 * p["eval_unigram_accuracy"], ".1f")]
        if fixed:
            row += [_fmt(p.get("eval_fixed_loss")),
                    _fmt(None if p.get("eval_fixed_accuracy") is None
                         else 100 * p["eval_fixed_accuracy"], ".1f")]
        row += [_fmt(r.get("without_mask"), "d"), _fmt(r.get("with_mask"), "d"),
               _fmt(c.get("without_mask"), "d"), _fmt(c.get("with_mask"), "d")]
        row += [_fmt(s, ".1f") for s in scores]
        if tasks:
            row.append(_fmt(float(np.mean(scores)) if None not in scores else None, ".1f"))
        row += [_fmt(None if p.get("seconds") is None else p["seconds"] / 60, ".1f") + " min",
                _fmt(p.get("train_flops"), ".3g"),
                "—" if p.get("mfu") is None else f"{100 * p['mfu']:.1f} %"]
        rows.append(row)
    for n in result.get("controls", []):
        scores = [glue.get(n, {}).get(t, {}).get("median") for t in tasks]
        row = [_name(n)] + ["—"] * (9 if fixed else 7) + [_fmt(s, ".1f") for s in scores]
        if tasks:
            row.append(_fmt(float(np.mean(scores)) if None not in scores else None, ".1f"))
        row += ["—", "—", "—"]
        rows.append(row)
    return markdown_lib.table(header, rows)


def markdown(result: dict) -> str:
    names, glue, tasks = result["models"], result["glue"], _tasks(result)
    tau = result["rank"]["tau"]
    lines = [f"# {result.get('title', 'Study')}", ""]
    if not result.get("finished", True):
        lines += [f"**Not finished**: {len(result['parts_done'])} of "
                  f"{len(result['parts_done']) + len(result['parts_left'])} parts done; "
                  f"left: {', '.join(result['parts_left'])}. The same command continues.", ""]
    lines += ["Same corpus, tokenizer, token budget, optimiser settings and seed for every "
              "model; rank_tau with tau = "
              + ("(not yet analysed)" if tau is None else f"{tau:g}") + " on held-out blocks "
              "(last encoder layer; centred: the mean row subtracted first); GLUE: dev medians "
              f"over seeds {result['seeds']}"
              + (f" from {result['glue_dir']}" if result["glue_dir"] else
                 " (no glue_dir given: no fine-tuning)") + ".", ""]
    parts = result.get("parts", [])
    if parts:
        lines += ["Run on " + "; ".join(
            (f"{', '.join(map(_name, p['models'] + p['controls']))}: " if len(parts) > 1 else "")
            + records.describe(p) for p in parts) + ".", ""]
    lines += (table(result) + plateau_lines(result) + claims.call_lines(result)
              + claims.finetuned_lines(result))
    if tasks:
        lines += ["", "Per seed (dev, the task's metric):", ""]
        for t in tasks:
            for n in names + result.get("controls", []):
                entry = glue.get(n, {}).get(t)
                if entry:
                    seeds = ", ".join(f"{v:.1f}" for v in entry["per_seed"].values())
                    lines.append(f"- {t} {entry['metric']}, {_name(n)}: {seeds} "
                                 f"(median {entry['median']:.1f}; {entry['seconds'] / 60:.1f} min)")
    lines += ["", f"![losses]({layout.STUDY_LOSS_PLOT})", f"![rank]({layout.RANK_LAYERS_PLOT})"]
    if tasks:
        lines.append(f"![glue]({layout.STUDY_GLUE_PLOT})")
    return "\n".join(lines) + "\n"


def plot(result: dict, root: paths.Path) -> list[paths.Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, n in enumerate(result["models"]):
        curves = result["pretraining"][n].get("curves", {})
        # Eval points marked: a short run has one, which a line alone would not show.
        for split, style, marker in (("train", ":", None), ("eval", "-", "o")):
            if curves.get(split):
                steps, losses = zip(*curves[split], strict=True)
                ax.plot(steps, losses, style, color=f"C{i}", marker=marker, markersize=4,
                        label=f"{_name(n)} {split}")
    ax.set_xlabel("step")
    ax.set_ylabel("masked-token loss (nats)")
    ax.legend(fontsize=8)
    written.append(_save(plt, fig, root / layout.STUDY_LOSS_PLOT))

    rank_plot = root / layout.STUDY_RANK_DIR / layout.RANK_LAYERS_PLOT
    if rank_plot.is_file():
        rank_plot.copy(root / layout.RANK_LAYERS_PLOT, overwrite=True)
        written.append(root / layout.RANK_LAYERS_PLOT)

    glue, tasks = result["glue"], _tasks(result)
    if tasks:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        shown = result["models"] + result.get("controls", [])
        width = 0.8 / len(shown)
        for i, n in enumerate(shown):
            values = [glue.get(n, {}).get(t, {}).get("median", np.nan) for t in tasks]
            ax.bar(np.arange(len(tasks)) + i * width, values, width, label=_name(n))
        ax.set_xticks(np.arange(len(tasks)) + 0.4 - width / 2)
        ax.set_xticklabels(tasks)
        ax.set_ylabel("dev median (accuracy, MCC or Spearman, x100)")
        # Below the axes: inside, the legend hides the tallest bars.
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
        written.append(_save(plt, fig, root / layout.STUDY_GLUE_PLOT))
    return written


def _save(plt, fig, path: paths.Path) -> paths.Path:
    fig.tight_layout()
    png = io.BytesIO()  # matplotlib writes local files only; the path may be a bucket's
    fig.savefig(png, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    path.write_bytes(png.getvalue())
    return path


def write(root: paths.Path, result: dict) -> list[paths.Path]:
    paths.write_text(root / layout.STUDY_JSON_FILE, json.dumps(result, indent=2) + "\n")
    paths.write_text(root / layout.STUDY_MARKDOWN_FILE, markdown(result))
    return [root / layout.STUDY_JSON_FILE, root / layout.STUDY_MARKDOWN_FILE, *plot(result, root)]
