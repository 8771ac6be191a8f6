"""The rank analysis's outputs: rank.json, rank.md and the plots of the MAE-LM paper's Fig. 1.

* ``rank.json``: the settings and, per run, the integer rank_tau per layer of each
  statistic (maelm_jax/analysis/rank.py) with the number of rows n behind it (with
  ``center``, the same of the centred representations under "centred"); every layer's
  spectrum, the continuous, entropy and multi-tau ranks with their bootstrap intervals,
  the last layer's replicates and the [MASK] rows' energy outside the real tokens'
  subspace (analysis/measures.py); over runs, the paired differences. Written by `dumps`:
  indented, each list of numbers on one line.
* ``rank.md``: Table 3 (the last layer of every run, continuous ranks with intervals) and
  the paired differences, then Fig. 1's numbers per layer and the energy outside.
* ``rank_layers.png`` (Fig. 1(a)): the continuous rank_tau per layer with its bootstrap
  band, input with [MASK] (solid) and without (dashed), one colour per run;
  ``rank_mask.png`` (Fig. 1(b)): that of the [MASK] rows. With centred ranks, each has a
  second panel of them on the right. `figures` draws them for any list of runs: the
  README's figures of the study's records too (study/figures.py).
"""

from __future__ import annotations

import io
import json
import re

from maelm_jax.analysis import measures
from maelm_jax.infra import markdown as markdown_lib
from maelm_jax.infra import paths
from maelm_jax.workdirs import layout


def dumps(value) -> str:
    """JSON indented by 2, but a list of numbers on one line: a run's spectra are
    thousands of numbers, one per line otherwise."""
    return _NUMBER_LIST.sub(_collapse, json.dumps(value, indent=2))


def _collapse(match: re.Match) -> str:
    return "[" + ", ".join(part.strip() for part in match.group(1).split(",")) + "]"


# A list whose items are numbers (or null) only.
_NUMBER_LIST = re.compile(r"\[\s*((?:-?[\d.eE+-]+|null|NaN|-?Infinity)"
                          r"(?:,\s*(?:-?[\d.eE+-]+|null|NaN|-?Infinity))*)\s*\]")


def write_json(path: paths.Path, report: dict) -> None:
    paths.write_text(path, dumps(report) + "\n")


def continuous_ranks(run: dict, view: str, stat: str, tau: float) -> list[float]:
    """A run's continuous rank_tau per layer: stored, or recomputed from its spectra; an
    older record without either has its integer ranks."""
    stored = run.get("statistics", {}).get(view, {}).get(stat, {}).get("continuous")
    if stored is not None:
        return stored
    recomputed = measures.continuous_from_spectra(run, view, stat, tau)
    if recomputed is not None:
        return recomputed
    ranks = run if view == "uncentred" else run.get("centred", {})
    return [float(r) for r in ranks[stat]]


def _interval(run: dict, view: str, stat: str) -> list | None:
    """[layers][2]: the bootstrap interval of the continuous rank, if recorded."""
    return (run.get("statistics", {}).get(view, {}).get(stat, {}).get("interval", {})
            .get("continuous"))


def rank_text(run: dict, view: str, stat: str, tau: float, layer: int = -1) -> str:
    """`86.4 [85.1, 87.9]`: the continuous rank with its 95 % interval (if any)."""
    value = continuous_ranks(run, view, stat, tau)[layer]
    bounds = _interval(run, view, stat)
    return f"{value:.1f}" + ("" if bounds is None else
                             f" [{bounds[layer][0]:.1f}, {bounds[layer][1]:.1f}]")


def _cell(run: dict, view: str, stat: str, tau: float, layer: int) -> str:
    """A rank in a table: the continuous one with its interval, or (an older record) the
    integer one."""
    if "statistics" in run:
        return rank_text(run, view, stat, tau, layer)
    ranks = run if view == "uncentred" else run["centred"]
    return str(ranks[stat][layer])


def markdown(report: dict) -> str:
    tau = report["tau"]
    boot = report.get("bootstrap", {})
    lines = [
        f"# Effective rank (tau = {tau:g})",
        "",
        f"Source: {report['source_description']}; {report['mask_ratio']:.0%} of each "
        "sequence's positions set to [MASK] for the inputs with [MASK]. Ranks: the "
        "continuous rank_tau"
        + (f" with its {boot.get('level', 0.95):.0%} bootstrap interval over the analysed "
           f"sequences ({boot['replicates']} replicates of {boot['groups']} groups: the "
           "measurement's spread, not the pretraining seed's)" if boot.get("replicates")
           else "") + "; rank_tau is its ceiling.",
        "",
        "## Last layer (MAE-LM paper, Table 3)",
        "",
    ]
    centred = report.get("center", False)
    header = ["run", "kind", "d", "layers", "n tokens", f"rank_{tau:g} w/o [MASK]",
              "entropy rank w/o", "w. [MASK]", "[MASK] rows (n)"]
    if centred:
        header += ["centred: w/o [MASK]", "w. [MASK]", "[MASK] rows"]
    rows = []
    for run in report["runs"]:
        entropy = run.get("statistics", {}).get("uncentred", {}).get("without_mask", {}).get(
            "entropy")
        row = [run["label"], run["kind"], run["d_model"], run["num_layers"], run["tokens"],
               _cell(run, "uncentred", "without_mask", tau, -1),
               "—" if entropy is None else f"{entropy[-1]:.1f}",
               _cell(run, "uncentred", "with_mask", tau, -1),
               f"{_cell(run, 'uncentred', 'mask_only', tau, -1)} ({run['mask_tokens']})"]
        if centred:
            row += [_cell(run, "centred", stat, tau, -1)
                    for stat in ("without_mask", "with_mask", "mask_only")]
        rows.append(row)
    lines += markdown_lib.table(header, rows)
    if centred:
        lines += ["", "Centred: each statistic's mean row subtracted before the singular "
                  "values (the paper's ranks are uncentred)."]
    found = report.get("differences", [])
    if found:
        lines += ["", "## Differences at the last layer (paired: the same sequences and "
                  "bootstrap replicates)", ""]
        lines += markdown_lib.table(
            ["runs", "statistic", "view", "difference (95 %)"],
            [[f"{d['a']} minus {d['b']}", d["statistic"], d["view"],
              f"{d['difference']:+.1f} [{d['interval'][0]:+.1f}, {d['interval'][1]:+.1f}]"]
             for d in found])
    lines += ["", "## Per layer (Fig. 1; layer 0 is the embedding output)", ""]
    header = ["layer", "w. [MASK] (Fig. 1a)", "w/o [MASK] (Fig. 1a)", "[MASK] rows (Fig. 1b)"]
    if centred:
        header += ["centred: w. [MASK]", "w/o [MASK]", "[MASK] rows"]
    for run in report["runs"]:
        rows = []
        for layer in run["layers"]:
            row = [layer] + [_cell(run, "uncentred", stat, tau, layer)
                             for stat in ("with_mask", "without_mask", "mask_only")]
            if centred:
                row += [_cell(run, "centred", stat, tau, layer)
                        for stat in ("with_mask", "without_mask", "mask_only")]
            rows.append(row)
        lines += [f"### {run['label']}", "", *markdown_lib.table(header, rows), ""]
        outside = run.get("outside_energy")
        if outside:
            lines += ["The [MASK] rows' energy outside the real tokens' top-k subspace (k = "
                      f"their rank_{tau:g}), against the same share of held-out real tokens "
                      "(the null):", ""]
            lines += markdown_lib.table(
                ["layer", "k", "[MASK] rows outside", "held-out real tokens outside"],
                [[layer, outside["k"][i], f"{outside['mask'][i]:.3f}",
                  f"{outside['null'][i]:.3f}"] for i, layer in enumerate(run["layers"])])
            lines.append("")
    return "\n".join(lines)


def figures(runs: list[dict], tau: float) -> dict:
    """{"layers": Fig. 1(a), "mask": Fig. 1(b)} as matplotlib Figures: layers on x, the
    continuous rank_tau on y (integer ranks for an older record without spectra), one
    colour per run (its "label" in the legend), the bootstrap interval as a band where
    recorded; with centred ranks in every run, a second panel of them beside the paper's."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed
    from matplotlib.ticker import MaxNLocator

    centred = bool(runs) and all("centred" in run for run in runs)
    panels = (
        ("layers", (("with_mask", "-", "input w. [MASK]"),
                    ("without_mask", "--", "input w/o [MASK]")),
         "(a) token representations"),
        ("mask", (("mask_only", "-", "[MASK] tokens"),), "(b) [MASK] token representations"),
    )
    views = (("uncentred", ""),) + (("centred", ", centred"),) * centred
    out = {}
    for name, stats, title in panels:
        fig = Figure(figsize=(5.5 * len(views), 4.0), layout="constrained")
        for k, (view, suffix) in enumerate(views):
            ax = fig.add_subplot(1, len(views), k + 1)
            for i, run in enumerate(runs):
                color = f"C{i % 10}"
                for stat, style, what in stats:
                    label = run["label"] if len(stats) == 1 else f"{run['label']}: {what}"
                    ax.plot(run["layers"], continuous_ranks(run, view, stat, tau), style,
                            color=color, marker="o", markersize=3, label=label)
                    bounds = _interval(run, view, stat)
                    if bounds is not None:
                        low, high = zip(*bounds, strict=True)
                        ax.fill_between(run["layers"], low, high, color=color, alpha=0.15,
                                        linewidth=0)
            ax.set_xlabel("Layer")
            ax.set_ylabel(f"Effective rank (τ = {tau:g})")
            ax.set_title(title + suffix)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if k == 0:
                ax.legend(fontsize="small")
        out[name] = fig
    return out


def png_bytes(fig) -> bytes:
    png = io.BytesIO()  # matplotlib writes local files only; the path may be a bucket's
    fig.savefig(png, format="png", dpi=120)
    return png.getvalue()


def svg_bytes(fig) -> bytes:
    """The figure as SVG whose bytes depend on its data alone: no date, fixed element ids,
    text kept as text (not glyph outlines, which depend on the font files)."""
    import matplotlib

    svg = io.BytesIO()
    with matplotlib.rc_context({"svg.hashsalt": "maelm-jax", "svg.fonttype": "none"}):
        fig.savefig(svg, format="svg", metadata={"Date": None})
    return svg.getvalue()


def plot(report: dict, layers_path: paths.Path, mask_path: paths.Path) -> None:
    """Fig. 1(a) and 1(b) of the report's runs (`figures`) as PNG files."""
    drawn = figures(report["runs"], report["tau"])
    layers_path.write_bytes(png_bytes(drawn["layers"]))
    mask_path.write_bytes(png_bytes(drawn["mask"]))


def write(workdir: paths.Path, report: dict) -> list[paths.Path]:
    """All outputs into workdir; returns their paths."""
    paths.make_dirs(workdir)
    written = [workdir / name for name in (layout.RANK_JSON_FILE, layout.RANK_MARKDOWN_FILE,
                                            layout.RANK_LAYERS_PLOT, layout.RANK_MASK_PLOT)]
    write_json(written[0], report)
    paths.write_text(written[1], markdown(report) + "\n")
    plot(report, written[2], written[3])
    return written
