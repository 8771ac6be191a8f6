"""The pretraining objectives, by name (config.objective).

Each objective is one module implementing base.Objective; this registry is the only
place that lists them. Adding one: a module, and a line in _BUILT_IN (or `register` from
outside the package, as the tests do with a toy objective).
"""

from __future__ import annotations

from maelm_jax.objectives import base, maelm, mlm
from maelm_jax.objectives.base import Objective, masked_lm_sums

__all__ = ["Objective", "get", "masked_lm_sums", "names", "register", "unregister"]

_BUILT_IN = (maelm.MaeLm(), mlm.Mlm())
_REGISTRY: dict[str, base.Objective] = {o.name: o for o in _BUILT_IN}


def names() -> tuple[str, ...]:
    """The registered objectives' names, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> base.Objective:
    """The objective called `name`; KeyError (listing the known ones) for any other."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown objective {name!r}; expected one of "
                       f"{', '.join(names())}") from None


def register(objective: base.Objective) -> None:
    """Makes `objective` available as config.objective = objective.name."""
    if objective.name in _REGISTRY:
        raise ValueError(f"objective {objective.name!r} is already registered")
    _REGISTRY[objective.name] = objective


def unregister(name: str) -> None:
    """Removes a registered objective (the built-in ones stay)."""
    if any(o.name == name for o in _BUILT_IN):
        raise ValueError(f"objective {name!r} is built in")
    _REGISTRY.pop(name, None)
