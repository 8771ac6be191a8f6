"""A jax.profiler trace of a window of a run's steps (config.train.profile_steps=START,COUNT),
and the per-op sum of a trace that the GPU suite (benchmarks/gpu_suite.py) reports too.

The window opens before step START is dispatched and closes after step START + COUNT - 1,
the device waited for at both ends (the trace holds those steps' work and no other), and
never before the session's first step has compiled (a window asked for earlier opens after
it). The trace goes to <workdir>/profile/plugins/profile/<time>/: an .xplane.pb for
TensorBoard's profile plugin (`tensorboard --logdir <workdir>/profile`) and a
perfetto_trace.json.gz for https://ui.perfetto.dev; the log says where and how to open
them, and sums the ops' time in one line.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
from typing import Any

import jax
from absl import logging

from maelm_jax.config import options
from maelm_jax.infra import paths
from maelm_jax.workdirs import layout

TOP_OPS = 5  # ops named in the summary line


def op_seconds(trace_dir: pathlib.Path) -> dict[str, float]:
    """Seconds spent in each XLA op (a fusion, kernel or thunk, by its HLO name) in the
    trace that `jax.profiler.trace(trace_dir, create_perfetto_trace=True)` wrote.

    Where the trace has a device process (a GPU's or TPU's "/device:..."), its ops are
    read there: from its "XLA Ops" line where it has one (one event per HLO op), else
    from all of its lines. A CPU has none: its ops are the events of the threads XLA ran
    them on, not of Python's threads (those with Python frames, "$file:line"), without
    the runtime's C++ functions and events ("Class::method", "end: ...", "MutexLock": an
    HLO name starts with a lower-case letter), nor a plugin's "/device:CUSTOM:..."
    process (libtpu's, on a host without a TPU). On a CPU a loop's time
    (`while`) holds its body's ops too."""
    found = sorted(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"{trace_dir}: no perfetto_trace.json.gz in the trace")
    trace = json.loads(gzip.open(found[-1]).read())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    # A GPU's or TPU's process; not a "/device:CUSTOM:..." line a plugin adds (libtpu's
    # on a host without a TPU), which holds no ops.
    devices = {pid for pid, name in processes.items()
               if "/device:" in name and "/device:CUSTOM" not in name}
    if devices:
        ops_lines = {key for key, name in threads.items()
                     if key[0] in devices and name == "XLA Ops"}

        def keep(e):
            key = (e["pid"], e.get("tid"))
            return key in ops_lines if ops_lines else e["pid"] in devices
    else:
        python = {(e["pid"], e.get("tid")) for e in events
                  if e.get("ph") == "X" and e["name"].startswith("$")}
        custom = {pid for pid, name in processes.items() if "/device:CUSTOM" in name}

        def keep(e):
            name = e["name"]
            return ((e["pid"], e.get("tid")) not in python and e["pid"] not in custom
                    and name[:1].islower() and not name.startswith("end: ")
                    and "::" not in name)
    seconds = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and keep(e):
            seconds[e["name"]] += e.get("dur", 0) / 1e6
    return dict(seconds)


def summary(ops: dict[str, float], steps: int, top: int = TOP_OPS) -> str:
    """The ops' time a step and the `top` ops by time, in one line."""
    total = sum(ops.values())
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
    shown = ", ".join(f"{name} {1e3 * s / steps:.2f} ms ({s / total:.0%})" for name, s in ranked
                      ) if total else "none"
    return f"{1e3 * total / steps:.2f} ms of ops a step; top: {shown}"


class Window:
    """The profiled window of one session's loop, a context manager around it:
    `before(step, state)` before a step is dispatched, `after(step, state)` after; however
    the loop ends, a trace still open is closed and kept."""

    def __init__(self, workdir: paths.Path, spec: str, first: int, traced: bool):
        """`spec`: train.profile_steps; `first`: the session's first step (it compiles);
        `traced`: whether this process traces (train.profile_all_processes, or process
        0)."""
        window = options.profile_window(spec)
        self.start = self.end = None
        self._mirror = self._active = None
        self._last = first
        if window is None or not traced:
            return
        start, count = window
        if start + count - 1 < first:
            return  # done by an earlier session of the run
        if start <= first:  # its own first step compiles: not in the trace
            logging.info("profile: step %d compiles the step; the trace starts at step %d",
                         first, first + 1)
        self.start = max(start, first + 1)
        self.end = start + count - 1
        if self.end < self.start:
            self.start = self.end = None
            return
        self._mirror = paths.LocalMirror(workdir / layout.PROFILE_DIR)
        self._where = workdir / layout.PROFILE_DIR

    def before(self, step: int, state: Any) -> None:
        if step != self.start:
            return
        jax.block_until_ready(state)  # the steps before it are not in the window
        paths.make_dirs(self._mirror.local)
        jax.profiler.start_trace(str(self._mirror.local), create_perfetto_trace=True)
        self._active = True

    def after(self, step: int, state: Any) -> None:
        self._last = step
        if step == self.end and self._active:
            jax.block_until_ready(state)  # the window's steps have run
            self._stop(self.end - self.start + 1)

    def _stop(self, steps: int) -> None:
        jax.profiler.stop_trace()
        self._active = False
        try:
            line = summary(op_seconds(self._mirror.local), steps)
        except (OSError, ValueError) as e:  # a trace without ops: still kept
            line = f"no per-op times ({e})"
        self._mirror.close()
        logging.info("profile of steps %d-%d in %s (open it with `tensorboard --logdir %s`, "
                     "its profile tab, or its perfetto_trace.json.gz in "
                     "https://ui.perfetto.dev): %s", self.start, self.start + steps - 1,
                     self._where, self._where, line)

    def __enter__(self) -> Window:
        return self

    def __exit__(self, *exc) -> None:
        """The loop has ended: a window still open (a stop request inside it) is closed
        after the last step dispatched."""
        if self._active:
            self._stop(max(self._last - self.start + 1, 1))
