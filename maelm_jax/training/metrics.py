"""Metric sinks: stdout (absl logging), TensorBoard event files and a JSONL file.

Both files grow line by line, which a bucket cannot do (an object is written whole), so
they are written through a `paths.LocalMirror` of the workdir: in place for a local
workdir, and for one in a bucket locally, then uploaded whole about every
`UPLOAD_SECONDS` while lines come, at every `flush` (the loops flush when they save a
checkpoint, so a resumed run finds every line up to its checkpoint) and on `close`.
"""

from __future__ import annotations

import importlib
import json
import math
import sys

from absl import logging

from maelm_jax.infra import paths
from maelm_jax.workdirs import layout

UPLOAD_SECONDS = 60.0


def _tensorboardx():
    """tensorboardX, imported without its optional backends: when PyTorch is installed
    (the export's parity checks use it) tensorboardX imports it to accept torch tensors,
    and Cloud Storage's client to write to gs:// itself, together about two seconds in
    every process that writes metrics. This writer gives it floats and local files (a
    bucket workdir is mirrored, above), so neither is needed; an optional import that
    fails is how tensorboardX learns a backend is absent. Modules already imported are
    used as they are."""
    if "tensorboardX" in sys.modules:
        return sys.modules["tensorboardX"]
    hidden = [name for name in ("torch", "google.cloud.storage") if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import name` raises ImportError
    try:
        return importlib.import_module("tensorboardX")
    finally:
        for name in hidden:
            del sys.modules[name]


tensorboardX = _tensorboardx()


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: exp() of an early, huge loss overflows


class MetricWriter:
    """Writes scalars per (split, step). Only one process should hold a writer."""

    def __init__(self, workdir: paths.Path, resume_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        if not enabled:  # processes other than 0 in a multi-process run
            return
        self._mirror = paths.LocalMirror(workdir, interval=UPLOAD_SECONDS)
        local_jsonl = self._mirror.local / layout.METRICS_FILE
        kept = _lines_up_to(workdir / layout.METRICS_FILE, resume_step)
        if kept is not None:
            local_jsonl.write_text(kept, encoding="utf-8")
        self._jsonl = open(local_jsonl, "a", encoding="utf-8")
        self._tb = tensorboardX.SummaryWriter(str(self._mirror.local / layout.TENSORBOARD_DIR))

    def write(self, split: str, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        scalars = {k: float(v) for k, v in scalars.items()}
        for name, value in scalars.items():
            self._tb.add_scalar(f"{split}/{name}", value, step)
        self._jsonl.write(json.dumps({"split": split, "step": step, **scalars}) + "\n")
        self._jsonl.flush()
        shown = "  ".join(f"{k}={_fmt(v)}" for k, v in scalars.items())
        logging.info("[%s] step %d  %s", split, step, shown)
        self._mirror.sync(force=False)

    def flush(self) -> None:
        """Makes everything written so far visible in the workdir (an upload for a
        workdir in a bucket; a local workdir already has it)."""
        if not self.enabled:
            return
        self._tb.flush()
        self._mirror.sync()

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        self._tb.close()
        self._mirror.close()


def read(workdir: paths.Path, split: str) -> list[dict]:
    """The rows of a run's metrics.jsonl whose split is `split` ("train", "eval", "dev"),
    in order; [] when the run has written none."""
    path = workdir / layout.METRICS_FILE
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in paths.read_text(path).splitlines() if line.strip()]
    return [r for r in rows if r.get("split") == split]


def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"


def _lines_up_to(path: paths.Path, step: int) -> str | None:
    """The file's lines of steps up to `step`, or None if there is no file: a resumed run
    repeats the steps after its checkpoint, so their old records are dropped and the file
    holds one line per (split, step)."""
    if not path.exists():
        return None
    return "".join(line + "\n" for line in paths.read_text(path).splitlines()
                   if line.strip() and json.loads(line)["step"] <= step)
