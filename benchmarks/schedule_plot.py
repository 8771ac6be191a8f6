r"""The plot of the learning-rate schedules in docs/watching.md (docs/schedules.svg), drawn
from the schedule code itself (maelm_jax/training/optimizer.py), never by hand.

    python benchmarks/schedule_plot.py            # rewrites docs/schedules.svg
    python benchmarks/schedule_plot.py --check    # exit 1 if it is out of date

Every shape of train.lr_schedule over 1000 steps with a warmup of 100, WSD's
decay_fraction 0.2 and min_lr_ratio 0.1, and a WSD run whose time budget re-planned its end
to step 1300 at step 400 (only its decay moves). The SVG is written without a date, with
its text as text and a fixed hash salt, so that the same code draws the same bytes
(tests/benchmarks/test_schedule_plot.py fails when it is out of date).
"""

from __future__ import annotations

import argparse
import io
import sys

import ml_collections
import numpy as np

from benchmarks import REPO_ROOT
from maelm_jax.training import optimizer

PLOT = REPO_ROOT / "docs" / "schedules.svg"
PEAK, WARMUP, STEPS = 1.0, 100, 1000


def _train(shape: str) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({
        "learning_rate": PEAK, "warmup_steps": WARMUP, "num_steps": STEPS,
        "lr_schedule": shape, "decay_fraction": 0.2, "min_lr_ratio": 0.1})


def curves() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(steps, rates) of each line of the plot, computed as the run's step computes them."""
    out = {}
    for shape in optimizer.SCHEDULES:
        steps = np.arange(0, STEPS + 1)
        schedule = np.asarray(optimizer.shaped(_train(shape)), np.float64)
        out[shape] = steps, optimizer.learning_rate_at(steps.astype(np.float64), schedule, np)
    first = optimizer.shaped(_train("wsd"))
    moved = optimizer.with_decay_end(first, 400, 1300)
    steps = np.arange(0, 1301)
    rates = np.where(steps <= 400,
                     optimizer.learning_rate_at(steps.astype(np.float64), np.asarray(first), np),
                     optimizer.learning_rate_at(steps.astype(np.float64), np.asarray(moved), np))
    out["wsd, re-planned at step 400 to end at 1300"] = steps, rates
    return out


def render() -> str:
    """The plot as SVG text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"svg.hashsalt": "maelm_jax", "svg.fonttype": "none"}):
        fig, ax = plt.subplots(figsize=(7.0, 3.6))
        for name, (steps, rates) in curves().items():
            ax.plot(steps, rates, label=name, linestyle="--" if "re-planned" in name else "-")
        ax.set_xlabel("step (updates done)")
        ax.set_ylabel("learning rate / train.learning_rate")
        ax.set_title("train.lr_schedule: warmup 100 of 1000 steps, min_lr_ratio 0.1",
                     fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg", metadata={"Date": None})
        plt.close(fig)
    return buffer.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="only say whether the plot is out of date (exit 1 if so)")
    args = parser.parse_args(argv)
    svg = render()
    current = PLOT.read_text() if PLOT.exists() else ""
    if args.check:
        if svg != current:
            print(f"{PLOT}: out of date with the schedule code; run python "
                  "benchmarks/schedule_plot.py", file=sys.stderr)
            return 1
        return 0
    if svg != current:
        PLOT.write_text(svg)
        print(f"rewrote {PLOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
