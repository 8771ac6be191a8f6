"""The pretraining objectives, by name (config.objective).

Each objective is one module implementing base.Objective; this registry is the only
place that lists them. Adding one: a module, and a line in _BUILT_IN (or `register` from
outside the package, as the tests do with a toy objective). Importing the registry imports
no Flax (base.py says why).
"""

from __future__ import annotations

from typing import Any

from maelm_jax.config import schema
from maelm_jax.pretrain.objectives import base, maelm, mlm
from maelm_jax.pretrain.objectives.base import Objective, category, masked_lm_sums, per_token

__all__ = ["Objective", "category", "defaults", "fields", "get", "masked_lm_sums", "names",
           "per_token", "register", "unregister"]

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
    """Makes `objective` available as config.objective = objective.name (its fields join
    the pretraining config's defaults and validation)."""
    if objective.name in _REGISTRY:
        raise ValueError(f"objective {objective.name!r} is already registered")
    _merge(defaults(), objective.defaults().to_dict(), objective.name)  # clashes refused now
    _REGISTRY[objective.name] = objective


def unregister(name: str) -> None:
    """Removes a registered objective (the built-in ones stay)."""
    if any(o.name == name for o in _BUILT_IN):
        raise ValueError(f"objective {name!r} is built in")
    _REGISTRY.pop(name, None)


def _merge(into: dict, fields: dict, owner: str, prefix: str = "") -> None:
    """`fields` (nested dicts) written into `into`; a field two objectives declare with
    different defaults is refused (each field has one meaning)."""
    for key, value in fields.items():
        if isinstance(value, dict):
            node = into.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"objective {owner!r}: {prefix}{key} is a field elsewhere")
            _merge(node, value, owner, f"{prefix}{key}.")
        elif key in into and into[key] != value:
            raise ValueError(f"objective {owner!r}: {prefix}{key} defaults to {value!r}, "
                             f"another objective's to {into[key]!r}")
        else:
            into[key] = value


def defaults() -> dict[str, Any]:
    """Every registered objective's own fields with their defaults, as nested dicts (for
    config.pretrain_defaults())."""
    out: dict[str, Any] = {}
    for objective in _REGISTRY.values():
        _merge(out, objective.defaults().to_dict(), objective.name)
    return out


def fields() -> dict[str, schema.Field]:
    """Every registered objective's field table (for config.validate)."""
    return {name: field for objective in _REGISTRY.values()
            for name, field in objective.fields().items()}

