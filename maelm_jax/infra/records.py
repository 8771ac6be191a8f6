"""Records of measurements: what a run measured, the machine it ran on and the project's
commit, for the benchmarks (benchmarks/: one JSON file per run, committed under
benchmarks/results/<benchmark>/, from which the tables of README.md and docs/ are
generated) and the study (each call's study.json names its machine the same way).

A record: {"benchmark", "date", "machine": `machine()`, ...the run's own figures}.
A machine: {"device", "devices", "platform", "cores", "jax", "commit", "matmul",
"matmul_gflops"}: the jitted matmul's speed, measured in the same process, is what the
absolute times beside it are read against. Records written before "devices" was recorded
lack it (they ran on one device), and the study's first calls recorded "device" as
"N x kind" without the matmul: `describe` names them all.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import subprocess
import time

import jax

from maelm_jax.infra import environment, timer

# git is asked from here: the package's own checkout, whatever the working directory.
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


def commit() -> str:
    """The project's commit: $MAELM_JAX_COMMIT (a copy of the tree without its history, as
    on a lent machine), else git's HEAD, with "+changes" when tracked files differ from it;
    "unknown" without git."""
    if environment.text("MAELM_JAX_COMMIT"):
        return environment.text("MAELM_JAX_COMMIT")
    try:
        head, dirty = (subprocess.run(command, capture_output=True, text=True, check=True,
                                      cwd=_PACKAGE_DIR, timeout=10).stdout.strip()
                       for command in (["git", "rev-parse", "HEAD"],
                                       ["git", "status", "--porcelain", "--untracked-files=no"]))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def on_accelerator() -> bool:
    return jax.default_backend() in ("gpu", "tpu")


def matmul_gflops(n: int = 2048, repeats: int = 5, dtype=jax.numpy.float32, calls: int = 1,
                  warmup_seconds: float = 0.0) -> float:
    """GFLOP/s of a jitted n x n matmul at `dtype`: the median of `repeats` timings of
    `calls` matmuls dispatched back to back, after `warmup_seconds` of them (at least one
    round).

    On a GPU a single 8192^3 product takes about 1.5 ms: timed one at a time right after
    start-up it measured an H200 at 461 and 629 TFLOP/s in two processes, its clocks still
    rising from idle and each call paying a host round trip; hence rounds of many calls
    after a second of warm-up there (machine_speed)."""
    x = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    matmul = jax.jit(jax.numpy.matmul)

    def round_of_calls():
        for _ in range(calls):
            y = matmul(x, x)
        return y

    end = time.perf_counter() + warmup_seconds
    while time.perf_counter() < end:
        jax.block_until_ready(round_of_calls())
    _, seconds = timer.timed(round_of_calls, repeats)
    return 2 * n ** 3 * calls / seconds / 1e9


def machine_speed() -> tuple[str, float]:
    """(what was measured, TFLOP/s): on a GPU or TPU a bf16 8192^3 matmul, the peak that
    MFU is measured against here (an H100 reaches about 800 TFLOP/s); on a CPU the fp32
    2048^3 matmul printed beside absolute CPU times."""
    if on_accelerator():
        return ("bf16 jitted 8192x8192 matmul",
                matmul_gflops(8192, 10, jax.numpy.bfloat16, calls=20,
                              warmup_seconds=1.0) / 1e3)
    return "fp32 jitted 2048x2048 matmul", matmul_gflops() / 1e3


def describe_speed(what: str, tflops: float) -> str:
    """`machine_speed`'s measurement as a line to print."""
    if on_accelerator():
        return (f"{what}: {tflops:.0f} TFLOP/s (median of 10 rounds of 20 after 1 s of "
                f"warm-up; the MFU peak here)")
    return f"{what}: {1e3 * tflops:.1f} GFLOP/s (median of 5)"


def machine(speed: tuple[str, float] | None = None) -> dict:
    """The machine a figure was measured on: its device kind and count, platform, cores,
    jax version, commit and the jitted matmul's speed (`speed`, machine_speed's (what,
    TFLOP/s) measured in the same run, else measured now)."""
    what, tflops = speed or machine_speed()
    return {"device": jax.devices()[0].device_kind, "devices": jax.device_count(),
            "platform": jax.default_backend(), "cores": os.cpu_count(),
            "jax": jax.__version__, "commit": commit(), "matmul": what,
            "matmul_gflops": round(tflops * 1e3, 1)}


def describe(m: dict) -> str:
    """A machine as the tables name it: `2 x NVIDIA H100 80GB HBM3, 672,627 GFLOP/s, jax
    0.11.2`; a CPU with its cores; what a record lacks is left out."""
    devices = f"{m['devices']} x " if m.get("devices", 1) > 1 else ""
    cores = f", {m['cores']} cores" if m.get("platform") == "cpu" else ""
    speed = f", {m['matmul_gflops']:,.0f} GFLOP/s" if "matmul_gflops" in m else ""
    return f"{devices}{m.get('device', '?')}{cores}{speed}, jax {m.get('jax', '?')}"


def write(benchmark: str, figures: dict, directory: pathlib.Path,
          machine_facts: dict | None = None) -> pathlib.Path:
    """Writes benchmark's record of `figures` (JSON-able) to
    directory/<benchmark>/<date>_<device>_<commit>.json with `machine_facts` (default:
    `machine()`, measured now); returns the path."""
    facts = machine_facts if machine_facts is not None else machine()
    now = datetime.datetime.now(datetime.UTC)
    record = {"benchmark": benchmark, "date": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
              "machine": facts, **figures}
    device = re.sub(r"[^A-Za-z0-9]+", "-", facts["device"]).strip("-").lower()
    stem = pathlib.Path(directory) / benchmark / (
        f"{now:%Y%m%dT%H%M%S}_{device}_{facts['commit'][:8]}")
    path, n = stem.with_suffix(".json"), 1
    while path.exists():  # two runs within a second: both kept
        path, n = stem.with_name(f"{stem.name}-{n}.json"), n + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read(benchmark: str, directory: pathlib.Path) -> list[dict]:
    """Every record of `benchmark` under `directory`, oldest first."""
    found = [json.loads(p.read_text())
             for p in sorted((pathlib.Path(directory) / benchmark).glob("*.json"))]
    return sorted(found, key=lambda r: r["date"])
