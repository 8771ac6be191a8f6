"""The MAE-LM paper's Fig. 1 drawn from the study's recorded calls: what the README shows
beside the claims table, generated from the records like the tables (benchmarks/tables.py
writes them, tests/benchmarks/test_tables.py fails when one is out of date).

Fig. 1(a): every finished call's models, their rank per layer with and without [MASK];
Fig. 1(b): their [MASK] rows' rank per layer. The lines are the continuous rank_tau where
the record has spectra, its integer rank_tau otherwise, with the bootstrap band where
recorded (analysis/report.figures draws them, as the rank analysis of any run does).
"""

from __future__ import annotations

from maelm_jax.analysis import report as rank_report
from maelm_jax.infra import paths
from maelm_jax.pretrain.objectives import recipes

# Where the figures go, relative to the repository root, by their analysis/report name.
FILES = {"layers": "docs/figures/rank_layers.svg", "mask": "docs/figures/rank_mask.svg"}


def runs_of(records: list[tuple[str, dict]]) -> tuple[list[dict], float]:
    """The rank analysis runs of the records (where, study.json), each labelled by its
    model's name (and its call's, with several calls), and their tau."""
    analysed = [(where, r) for where, r in records if (r.get("rank") or {}).get("runs")]
    taus = {r["rank"]["tau"] for _, r in analysed}
    if len(taus) > 1:
        raise ValueError(f"the recorded calls' rank analyses differ in tau: {sorted(taus)}")
    out = []
    for where, record in analysed:
        call = paths.Path(where).stem
        for run in record["rank"]["runs"]:
            name = recipes.display_name(run["label"])
            out.append({**run, "label": name if len(analysed) == 1 else f"{name}, {call}"})
    return out, (taus.pop() if taus else 0.9)


def render(records: list[tuple[str, dict]]) -> dict[str, bytes]:
    """{path under the repository: SVG bytes} of Fig. 1(a) and 1(b)."""
    runs, tau = runs_of(records)
    drawn = rank_report.figures(runs, tau)
    return {FILES[name]: rank_report.svg_bytes(fig) for name, fig in drawn.items()}
