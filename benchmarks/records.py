"""Benchmark records: what a benchmark script measured and the machine it ran on, as one
JSON file per run under benchmarks/results/<benchmark>/ (committed). The tables in
README.md and docs/ are generated from them (tables.py), so no figure in the prose is
typed by hand and none goes stale without a test saying so.

A record: {"benchmark", "date", "machine": {device, cores, jax, commit, the jitted
matmul's speed}, ...the script's own figures}.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import subprocess

from absl import flags

from maelm_jax import cli, environment

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
REPO_ROOT = RESULTS_DIR.parents[1]


def commit() -> str:
    """The project's commit: $MAELM_JAX_COMMIT (a copy of the tree without its history, as
    on a lent machine), else git's HEAD, with "+changes" when the tree differs from it."""
    if environment.text("MAELM_JAX_COMMIT"):
        return environment.text("MAELM_JAX_COMMIT")
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=REPO_ROOT, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=REPO_ROOT,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def machine(speed: tuple[str, float] | None = None) -> dict:
    """The machine a figure was measured on: its device, cores, jax version, commit and
    the jitted matmul's speed (`speed`, harness.machine_speed's (what, TFLOP/s) measured
    in the same run, else measured now: fp32 2048^3 on a CPU, bf16 8192^3 on an
    accelerator), which absolute times are read against."""
    import jax

    import harness

    what, tflops = speed or harness.machine_speed()
    return {"device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
            "cores": os.cpu_count(), "jax": jax.__version__, "commit": commit(),
            "matmul": what, "matmul_gflops": round(tflops * 1e3, 1)}


def write(benchmark: str, figures: dict, directory: pathlib.Path = RESULTS_DIR,
          machine_facts: dict | None = None) -> pathlib.Path:
    """Writes benchmark's record of `figures` (JSON-able) to
    directory/<benchmark>/<date>_<device>_<commit>.json; returns the path."""
    facts = machine_facts if machine_facts is not None else machine()
    now = datetime.datetime.now(datetime.UTC)
    record = {"benchmark": benchmark, "date": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
              "machine": facts, **figures}
    device = re.sub(r"[^A-Za-z0-9]+", "-", facts["device"]).strip("-").lower()
    stem = directory / benchmark / f"{now:%Y%m%dT%H%M%S}_{device}_{facts['commit'][:8]}"
    path, n = stem.with_suffix(".json"), 1
    while path.exists():  # two runs within a second: both kept
        path, n = stem.with_name(f"{stem.name}-{n}.json"), n + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def define_flag(benchmark: str) -> None:
    """--record_dir: where a run of `benchmark` writes its record."""
    flags.DEFINE_string("record_dir", str(RESULTS_DIR), "Where this run's record goes "
                        f"(<dir>/{benchmark}/<date>_<device>_<commit>.json; the tables in "
                        "README and docs/ are generated from the committed ones); '' for none.")
    cli.directory_flag("record_dir")


def save(benchmark: str, figures: dict, speed: tuple[str, float] | None = None
         ) -> pathlib.Path | None:
    """Writes `figures` as benchmark's record to --record_dir (none when it is empty) with
    the machine (`speed` as for `machine`) and prints where; returns the path."""
    if not flags.FLAGS.record_dir:
        return None
    path = write(benchmark, figures, pathlib.Path(flags.FLAGS.record_dir),
                 machine(speed) if speed else None)
    print(f"record: {path}")
    return path


def read(benchmark: str, directory: pathlib.Path = RESULTS_DIR) -> list[dict]:
    """Every record of `benchmark`, oldest first."""
    found = [json.loads(p.read_text()) for p in sorted((directory / benchmark).glob("*.json"))]
    return sorted(found, key=lambda r: r["date"])
