r"""A run trained to a time budget, as a user starts one: its plan against the wall time it
took, recorded.

    python benchmarks/time_budget.py [--minutes=3] [--config=configs/pretrain/quickstart.py] \
        [-- --config.x=y]

Runs ``python main.py --config=<config> --workdir=<fresh directory>
--config.train.time_budget_minutes=<minutes> --config.train.num_steps=<cap>`` cold
(cold_run.py: a process of its own, an empty compilation cache), the cap far above what
the minutes hold, so that the plan, not the cap, decides. Recorded: the budget and its
margin, the plan (steps, tokens, the measured step, evaluation and checkpoint, the seconds
before the plan, the predicted end, and the re-plans the run made from its own rate) and
the process's wall time from start to exit (Python and JAX starting, which the run's own
clock does not see, included), beside the jitted fp32 matmul's speed. A run that plans
well ends before its budget: within the prediction plus the margin.

Each run writes its record (recording.py) to --record_dir; docs/performance.md's table is
generated from the committed ones (`python benchmarks/tables.py`).
"""

from __future__ import annotations

import json
import pathlib
import tempfile

from absl import app, flags

from benchmarks import cold_run, recording
from maelm_jax.infra import cli
from maelm_jax.workdirs import layout

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("config", "configs/pretrain/quickstart.py", "The config main.py runs.")
    flags.DEFINE_float("minutes", 3.0, "The run's time budget.", lower_bound=0.5)
    flags.DEFINE_integer("cap", 1_000_000, "config.train.num_steps: the cap of the plan.",
                         lower_bound=1)
    recording.define_flag("time_budget")


def measure(config: str, minutes: float, cap: int, extra: list[str]) -> dict:
    """Runs main.py on `config` to a budget of `minutes` in a fresh workdir and compilation
    cache; its plan and wall time."""
    args = [f"--config={config}", f"--config.train.time_budget_minutes={minutes}",
            f"--config.train.num_steps={cap}", "--config.train.fill_mask_examples=0", *extra]
    with tempfile.TemporaryDirectory() as scratch:
        workdir = pathlib.Path(scratch) / "run"
        timed = cold_run.run_main([*args, f"--workdir={workdir}"], pathlib.Path(scratch) / "jax",
                                  "time_budget.py")
        plan = json.loads((workdir / layout.PLAN_FILE).read_text())
        rows = [json.loads(line) for line in (workdir / layout.METRICS_FILE).read_text()
                .splitlines()]
    trained = max(r["step"] for r in rows if r["split"] == "train")
    return {"command": " ".join(["python", "main.py", *args, "--workdir=runs/budgeted"]),
            "plan": plan, "trained_steps": trained, **timed,
            "within_budget": timed["seconds"] <= plan["budget_seconds"]}


def main(argv):
    r = measure(FLAGS.config, FLAGS.minutes, FLAGS.cap, argv[1:])
    p = r["plan"]
    revisions = p.get("revisions", [])
    predicted = (revisions[-1] if revisions else p)["predicted_seconds"]
    print(f"{r['command']}: planned {p['steps']} steps, re-planned {len(revisions)} times "
          f"(trained {r['trained_steps']}), "
          f"predicted {predicted:.0f} s + margin {p['margin_seconds']:.0f} s of "
          f"{p['budget_seconds']:.0f} s; the process took {r['seconds']:.0f} s"
          f"{'' if r['within_budget'] else ': OVER BUDGET'}")
    recording.save("time_budget", r)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.forwarding_flags_parser)
