"""The rank analysis's outputs: rank.json, rank.md and the plots of the MAE-LM paper's Fig. 1.

* ``rank.json``: the settings and, per run, rank_tau per layer of each statistic
  (maelm_jax/analysis/rank.py) with the number of rows n behind it; with ``center``, the
  same of the centred representations under "centred".
* ``rank.md``: Table 3 (the last layer of every run), then Fig. 1's numbers per layer.
* ``rank_layers.png`` (Fig. 1(a)): rank_tau per layer, input with [MASK] (solid) and
  without (dashed), one colour per run. ``rank_mask.png`` (Fig. 1(b)): rank_tau of the
  [MASK] token representations per layer, one line per run. With centred ranks, each has
  a second panel of them on the right.
"""

from __future__ import annotations

import io
import json

from maelm_jax.infra import markdown as markdown_lib
from maelm_jax.infra import paths
from maelm_jax.workdirs import layout


def write_json(path: paths.Path, report: dict) -> None:
    paths.write_text(path, json.dumps(report, indent=2) + "\n")


def markdown(report: dict) -> str:
    tau = report["tau"]
    lines = [
        f"# Effective rank (tau = {tau:g})",
        "",
        f"Source: {report['source_description']}; {report['mask_ratio']:.0%} of each "
        "sequence's positions set to [MASK] for the inputs with [MASK].",
        "",
        "## Last layer (MAE-LM paper, Table 3)",
        "",
    ]
    centred = report.get("center", False)
    header = ["run", "kind", "d", "layers", "n tokens", f"rank_{tau:g} w/o [MASK]", "w. [MASK]",
              "[MASK] rows (n)"]
    if centred:
        header += ["centred: w/o [MASK]", "w. [MASK]", "[MASK] rows"]
    rows = []
    for run in report["runs"]:
        last = run["last_layer"]
        row = [run["label"], run["kind"], run["d_model"], run["num_layers"], run["tokens"],
               last["without_mask"], last["with_mask"],
               f"{last['mask_only']} ({run['mask_tokens']})"]
        if centred:
            c = run["centred"]["last_layer"]
            row += [c["without_mask"], c["with_mask"], c["mask_only"]]
        rows.append(row)
    lines += markdown_lib.table(header, rows)
    if centred:
        lines += ["", "Centred: each statistic's mean row subtracted before the singular "
                  "values (the paper's ranks are uncentred)."]
    lines += ["", "## Per layer (Fig. 1; layer 0 is the embedding output)", ""]
    header = ["layer", "w. [MASK] (Fig. 1a)", "w/o [MASK] (Fig. 1a)", "[MASK] rows (Fig. 1b)"]
    if centred:
        header += ["centred: w. [MASK]", "w/o [MASK]", "[MASK] rows"]
    for run in report["runs"]:
        rows = []
        for layer in run["layers"]:
            row = [layer, run["with_mask"][layer], run["without_mask"][layer],
                   run["mask_only"][layer]]
            if centred:
                c = run["centred"]
                row += [c["with_mask"][layer], c["without_mask"][layer], c["mask_only"][layer]]
            rows.append(row)
        lines += [f"### {run['label']}", "", *markdown_lib.table(header, rows), ""]
    return "\n".join(lines)


def plot(report: dict, layers_path: paths.Path, mask_path: paths.Path) -> None:
    """Fig. 1(a) and 1(b): layers on x, rank_tau on y, one colour per run; with centred
    ranks in the report, each figure has a second panel of them beside the paper's."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed
    from matplotlib.ticker import MaxNLocator

    tau = report["tau"]
    centred = bool(report["runs"]) and all("centred" in run for run in report["runs"])
    panels = (
        (layers_path, (("with_mask", "-", "input w. [MASK]"),
                       ("without_mask", "--", "input w/o [MASK]")),
         "(a) token representations"),
        (mask_path, (("mask_only", "-", "[MASK] tokens"),), "(b) [MASK] token representations"),
    )
    views = (("", lambda run: run),) + ((", centred", lambda run: run["centred"]),) * centred
    for path, stats, title in panels:
        fig = Figure(figsize=(5.5 * len(views), 4.0), layout="constrained")
        for k, (view, ranks) in enumerate(views):
            ax = fig.add_subplot(1, len(views), k + 1)
            for i, run in enumerate(report["runs"]):
                color = f"C{i % 10}"
                for stat, style, what in stats:
                    label = run["label"] if len(stats) == 1 else f"{run['label']}: {what}"
                    ax.plot(run["layers"], ranks(run)[stat], style, color=color, marker="o",
                            markersize=3, label=label)
            ax.set_xlabel("Layer")
            ax.set_ylabel(f"Effective rank (τ = {tau:g})")
            ax.set_title(title + view)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if k == 0:
                ax.legend(fontsize="small")
        png = io.BytesIO()  # matplotlib writes local files only; the path may be a bucket's
        fig.savefig(png, format="png", dpi=120)
        path.write_bytes(png.getvalue())


def write(workdir: paths.Path, report: dict) -> list[paths.Path]:
    """All outputs into workdir; returns their paths."""
    paths.make_dirs(workdir)
    written = [workdir / name for name in (layout.RANK_JSON_FILE, layout.RANK_MARKDOWN_FILE,
                                            layout.RANK_LAYERS_PLOT, layout.RANK_MASK_PLOT)]
    write_json(written[0], report)
    paths.write_text(written[1], markdown(report) + "\n")
    plot(report, written[2], written[3])
    return written
