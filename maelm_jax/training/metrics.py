"""Metric sinks: stdout (absl logging) and a JSONL file, the run's record, always; and the
trackers config.train.trackers names (`TRACKERS`): TensorBoard event files (the default)
and Weights & Biases. Every sink is a `Sink` and gets the same scalars at the same steps.

A tracker that cannot start (its package missing, its service refusing) is a one-line
`TrackerError` before the first step (`check_trackers` before the workdir is touched, the
writer's start after); one that fails later is a warning, and is left out from then on:
training never stops for a tracker, and metrics.jsonl keeps every line.

Both files grow line by line, which a bucket cannot do (an object is written whole), so
they are written through a `paths.LocalMirror` of the workdir: in place for a local
workdir, and for one in a bucket locally, then uploaded whole about every
`UPLOAD_SECONDS` while lines come, at every `flush` (the loops flush when they save a
checkpoint, so a resumed run finds every line up to its checkpoint) and on `close`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Protocol

from absl import logging

from maelm_jax.infra import errors, paths
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


class TrackerError(errors.UserError):
    """A tracker that cannot start (one line naming config.train.trackers)."""


FIELD = "config.train.trackers"


class Sink(Protocol):
    """Where a run's scalars go besides stdout and metrics.jsonl."""

    def write(self, split: str, step: int, scalars: dict[str, float]) -> None:
        """The scalars of `split` ("train", "eval", "dev") at `step` (host floats)."""

    def flush(self) -> None:
        """Everything written so far made durable (the loop calls it at each checkpoint)."""

    def close(self) -> None: ...


class TensorBoard:
    """Event files under <workdir>/tensorboard, one scalar per "split/name"."""

    def __init__(self, local: pathlib.Path, workdir: paths.Path, record: dict):
        del workdir, record
        self._tb = tensorboardX.SummaryWriter(str(local / layout.TENSORBOARD_DIR))

    def write(self, split: str, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self._tb.add_scalar(f"{split}/{name}", value, step)

    def flush(self) -> None:
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()


WANDB_PIP = "pip install -r requirements-trackers.txt"
WANDB_RUN_FILE = "wandb_run.json"  # under <workdir>/trackers: the W&B run this one continues


class WandB:
    """A Weights & Biases run (process 0 only, as every sink): the run's config and data
    fingerprint as its config, each scalar as "split/name" at its step. Its id is kept in
    <workdir>/trackers/wandb_run.json, so a resumed run continues the same W&B run; its
    local files are under <workdir>/trackers/wandb. W&B's own environment applies:
    WANDB_MODE=offline (nothing sent; `wandb sync` later), WANDB_PROJECT, WANDB_ENTITY,
    WANDB_API_KEY."""

    def __init__(self, local: pathlib.Path, workdir: paths.Path, record: dict):
        wandb = importlib.import_module("wandb")
        kept = workdir / layout.TRACKERS_DIR / WANDB_RUN_FILE
        known = json.loads(paths.read_text(kept)) if kept.is_file() else {}
        directory = local / layout.TRACKERS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(id=known.get("id"), resume="allow", dir=str(directory),
                              name=known.get("name") or paths.Path(workdir).name,
                              project=(known.get("project")
                                       or os.environ.get("WANDB_PROJECT", "maelm_jax")),
                              config=record)
        (directory / WANDB_RUN_FILE).write_text(json.dumps(
            {"id": self.run.id, "name": self.run.name, "project": self.run.project}),
            encoding="utf-8")
        logging.info("W&B run %s (%s)%s", self.run.id, self.run.name,
                     f": {self.run.url}" if getattr(self.run, "url", None) else
                     " offline: `wandb sync` uploads it later")

    def write(self, split: str, step: int, scalars: dict[str, float]) -> None:
        self.run.log({f"{split}/{name}": value for name, value in scalars.items()}, step=step)

    def flush(self) -> None:
        pass  # W&B's own process sends (or, offline, writes) as the lines come

    def close(self) -> None:
        self.run.finish()


# The trackers by name (config.train.trackers), and what each needs installed.
TRACKERS: dict[str, tuple[type, str | None]] = {
    "tensorboard": (TensorBoard, None),
    "wandb": (WandB, "wandb"),
}


def parse_trackers(spec: str) -> tuple[str, ...]:
    """config.train.trackers ("tensorboard,wandb"; "" for metrics.jsonl alone) as names."""
    return tuple(dict.fromkeys(name.strip() for name in spec.split(",") if name.strip()))


def check_trackers(spec: str) -> tuple[str, ...]:
    """The trackers `spec` names, each known and its package importable; else one line
    naming the field and what to do."""
    names = parse_trackers(spec)
    for name in names:
        if name not in TRACKERS:
            raise TrackerError(f"{FIELD}: expected a comma-separated list of "
                               f"{', '.join(TRACKERS)} (or empty), got {name!r}")
        package = TRACKERS[name][1]
        if package is not None and importlib.util.find_spec(package) is None:
            raise TrackerError(f"{FIELD}: {name!r} needs the {package} package, which is not "
                               f"installed: {WANDB_PIP}")
    return names


class MetricWriter:
    """Writes scalars per (split, step) to stdout, metrics.jsonl and every tracker. Only
    one process should hold a writer."""

    def __init__(self, workdir: paths.Path, resume_step: int = 0, enabled: bool = True,
                 trackers: tuple[str, ...] = ("tensorboard",), record: dict | None = None):
        """`trackers`: names in TRACKERS; `record`: what a tracker is told of the run (its
        config and data fingerprint)."""
        self.enabled = enabled
        if not enabled:  # processes other than 0 in a multi-process run
            return
        self._mirror = paths.LocalMirror(workdir, interval=UPLOAD_SECONDS)
        local_jsonl = self._mirror.local / layout.METRICS_FILE
        kept = _lines_up_to(workdir / layout.METRICS_FILE, resume_step)
        if kept is not None:
            local_jsonl.write_text(kept, encoding="utf-8")
        self._jsonl = open(local_jsonl, "a", encoding="utf-8")
        self._sinks: dict[str, Sink] = {}
        try:
            for name in trackers:
                try:
                    self._sinks[name] = TRACKERS[name][0](self._mirror.local, workdir,
                                                          record or {})
                except Exception as e:  # noqa: BLE001 - whatever a tracker raises
                    raise TrackerError(f"{FIELD}: {name} could not start: "
                                       f"{_one_line(e)}") from e
        except TrackerError:
            self.close()
            raise

    def _each(self, call: Callable[[Sink], None], step: int | None = None) -> None:
        """`call` on every sink; a sink that raises is warned about and left out."""
        for name, sink in list(self._sinks.items()):
            try:
                call(sink)
            except Exception as e:  # noqa: BLE001 - a tracker never stops training
                del self._sinks[name]
                logging.warning("tracker %s failed%s (%s) and is left out from here on; "
                                "metrics.jsonl keeps every line", name,
                                f" at step {step}" if step is not None else "", _one_line(e))

    def write(self, split: str, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        scalars = {k: float(v) for k, v in scalars.items()}
        self._jsonl.write(json.dumps({"split": split, "step": step, **scalars}) + "\n")
        self._jsonl.flush()
        self._each(lambda sink: sink.write(split, step, scalars), step)
        shown = "  ".join(f"{k}={_fmt(v)}" for k, v in scalars.items())
        logging.info("[%s] step %d  %s", split, step, shown)
        self._mirror.sync(force=False)

    def flush(self) -> None:
        """Makes everything written so far visible in the workdir (an upload for a
        workdir in a bucket; a local workdir already has it)."""
        if not self.enabled:
            return
        self._each(lambda sink: sink.flush())
        self._mirror.sync()

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        self._each(lambda sink: sink.close())
        self._sinks = {}
        self._mirror.close()


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."


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
