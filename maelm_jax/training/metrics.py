"""Metric sinks: stdout (absl logging), TensorBoard event files and a JSONL file."""

from __future__ import annotations

import json
import math
import pathlib

from absl import logging
import tensorboardX


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: exp() of an early, huge loss overflows


class MetricWriter:
    """Writes scalars per (split, step). Only one process should hold a writer."""

    def __init__(self, workdir: pathlib.Path, resume_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        if not enabled:  # processes other than 0 in a multi-process run
            return
        self.jsonl_path = workdir / "metrics.jsonl"
        _truncate_after(self.jsonl_path, resume_step)
        self._jsonl = open(self.jsonl_path, "a")
        self._tb = tensorboardX.SummaryWriter(str(workdir / "tensorboard"))

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

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        self._tb.close()


def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"


def _truncate_after(path: pathlib.Path, step: int) -> None:
    """A resumed run repeats the steps after its checkpoint; drop their old records so
    the file holds one line per (split, step)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= step
    ]
    path.write_text("".join(line + "\n" for line in kept))
