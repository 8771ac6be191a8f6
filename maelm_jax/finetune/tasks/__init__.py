"""The fine-tuning task kinds, by name, and the task a config asks for (config.task).

Each kind is one folder whose task.py implements base.Task (GLUE: glue/; SQuAD 2.0:
squad/), beside its examples, metrics and outputs; this registry is the only place that
lists them. Adding one: a class (a module or a folder), and a line in _BUILT_IN (or
`register` from outside the package, as the tests do with a toy kind).
"""

from __future__ import annotations

import ml_collections

from maelm_jax.finetune.tasks import base
from maelm_jax.finetune.tasks.base import (
    BatchOutputs,
    ExportHead,
    FinetuneConfigError,
    RunEval,
    Split,
    Task,
)
from maelm_jax.finetune.tasks.glue.task import GlueTask
from maelm_jax.finetune.tasks.squad.task import SquadTask
from maelm_jax.text import tokenizer as tokenizer_lib

__all__ = ["BatchOutputs", "ExportHead", "FinetuneConfigError", "GlueTask", "RunEval",
           "Split", "SquadTask", "Task", "get", "kind_for", "kinds", "make_task", "names",
           "register", "unregister"]

_BUILT_IN: tuple[type[base.Task], ...] = (GlueTask, SquadTask)
_REGISTRY: dict[str, type[base.Task]] = {k.kind: k for k in _BUILT_IN}


def names() -> tuple[str, ...]:
    """The registered kinds' names, in registration order."""
    return tuple(_REGISTRY)


def kinds() -> tuple[type[base.Task], ...]:
    """The registered kinds, in registration order."""
    return tuple(_REGISTRY.values())


def get(kind: str) -> type[base.Task]:
    """The kind called `kind`; KeyError (listing the known ones) for any other."""
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise KeyError(f"unknown task kind {kind!r}; expected one of {', '.join(names())}"
                       ) from None


def _known_tasks() -> str:
    described = [k.describe() for k in kinds()]
    return described[0] if len(described) == 1 else (
        f"{', '.join(described[:-1])} or {described[-1]}")


def kind_for(task: str) -> type[base.Task]:
    """The kind that serves config.task = `task`; a one-line FinetuneConfigError naming the
    known tasks for any other."""
    for k in kinds():
        if k.serves(task):
            return k
    raise FinetuneConfigError(f"config.task: expected {_known_tasks()}, got {task!r}")


def make_task(config: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
              max_len: int) -> base.Task:
    """The run's task, its splits read and encoded (config validated)."""
    return kind_for(config.task)(config, tok, max_len)


def register(kind: type[base.Task]) -> None:
    """Makes `kind`'s tasks available as config.task values, and its fields part of every
    fine-tuning config."""
    if kind.kind in _REGISTRY:
        raise ValueError(f"task kind {kind.kind!r} is already registered")
    taken = [t for t in kind.task_names() for k in kinds() if k.serves(t)]
    if taken:
        raise ValueError(f"task kind {kind.kind!r}: config.task {taken[0]!r} is already served")
    _REGISTRY[kind.kind] = kind


def unregister(kind: str) -> None:
    """Removes a registered kind (the built-in ones stay)."""
    if any(k.kind == kind for k in _BUILT_IN):
        raise ValueError(f"task kind {kind!r} is built in")
    _REGISTRY.pop(kind, None)
