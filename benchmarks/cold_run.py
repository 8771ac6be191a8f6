"""main.py run as a new user runs it, in a process of its own with an empty compilation
cache (a first run compiles everything): its wall seconds and peak resident memory.

Not a benchmark itself: quickstart.py, time_budget.py, plateau.py and laptop_study.py
import it.
"""

from __future__ import annotations

import os
import pathlib
import resource
import subprocess
import sys
import time

from benchmarks import REPO_ROOT


def run_main(args: list[str], cache_dir: pathlib.Path, script: str) -> dict:
    """Runs `python main.py *args` from the repository root with `cache_dir` as the
    compilation cache; {"seconds", "peak_gb"}. A failed run exits, naming `script` and
    main.py's last line."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache_dir)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "main.py", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{script}: main.py exited {done.returncode}: {last}")
    # ru_maxrss: the largest child's peak, in KiB on Linux (bytes on macOS).
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024
    return {"seconds": round(seconds, 1), "peak_gb": round(peak_bytes / 2**30, 2)}
