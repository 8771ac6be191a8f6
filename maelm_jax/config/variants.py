"""The one syntax of config variants: ``file.py:name,key=value,...``.

A config file may offer named variants (presets) and a few options; the text after the
colon of ``--config=configs/pretrain/3ml.py:cross_large,mask=0.5`` selects them:

* the first item, if it has no ``=``, is the variant's name (the file's default if absent);
* every other item is ``key=value`` for one of the file's options, converted to the
  option's type (int, float, bool or str); an option with a fixed set of values may also
  be given by its value alone (``glue.py:rte,large,3ml`` = ``rte,size=large,paper=3ml``).

Config files call `parse` in `get_config(arg)`; `apply` sets dotted config fields from a
variant's table of changes; `load` builds the config a ``file.py:variant`` string names
(what ``--config`` does, for scripts and tests).
"""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections


class VariantError(ValueError):
    """A config-file variant string that the file does not offer; one-line message."""


def _convert(key: str, text: str, default: Any) -> Any:
    kind = type(default)
    if kind is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise VariantError(f"variant option {key}: expected true or false, got {text}")
    try:
        return kind(text)
    except ValueError:
        raise VariantError(
            f"variant option {key}: expected {kind.__name__}, got {text}") from None


def parse(arg: str | None, names: Sequence[str] | None, default: str,
          options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """Splits `arg` into (variant name, options with defaults filled in).

    names: the variants the file offers (None: any name, which the file then checks);
    default: the one used when `arg` names none.
    options: option name -> default value (its type converts the text), or a tuple of the
    allowed strings (the first is the default).
    """
    options = dict(options or {})
    items = [item.strip() for item in (arg or "").split(",") if item.strip()]
    name = default
    if items and "=" not in items[0]:
        name = items.pop(0)
    if names is not None and name not in names:
        raise VariantError(f"unknown config variant {name!r}; expected one of "
                           f"{', '.join(names)}")
    values = {k: v[0] if isinstance(v, tuple) else v for k, v in options.items()}
    for item in items:
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep:
            key, text = _option_of_value(item, options), item
        if key not in options:
            offered = ", ".join(options) if options else "none"
            raise VariantError(f"unknown variant option {key!r}; this file offers: {offered}")
        allowed = options[key]
        if isinstance(allowed, tuple):
            if text not in allowed:
                raise VariantError(f"variant option {key}: expected one of "
                                   f"{', '.join(allowed)}, got {text}")
            values[key] = text
        else:
            values[key] = _convert(key, text, allowed)
    return name, values


def require_none(arg: str | None) -> None:
    """For config files that offer no variants or options: text after the colon is a
    mistake, not something to ignore."""
    if arg:
        raise VariantError(f"config variant {arg!r}: this file offers no variants or options")


def _option_of_value(value: str, options: Mapping[str, Any]) -> str:
    """The option whose fixed values include `value` (a bare item after the name)."""
    owners = [k for k, v in options.items() if isinstance(v, tuple) and value in v]
    if len(owners) != 1:
        raise VariantError(f"config variant item {value!r}: expected key=value after the "
                           "variant name")
    return owners[0]


def apply(config: ml_collections.ConfigDict, changes: Mapping[str, Any]) -> None:
    """Sets each dotted field (e.g. "model.decoder.kind") of `config`; the field must exist."""
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node[part]
        if leaf not in node:
            raise KeyError(f"variant sets unknown config field {dotted!r}")
        node[leaf] = value


def load(spec: str) -> ml_collections.ConfigDict:
    """The config of ``path/to/file.py[:variant]``, as ``--config`` would build it."""
    path, _, arg = spec.partition(":")
    file = pathlib.Path(path)
    module_spec = importlib.util.spec_from_file_location(f"_config_{file.stem}", file)
    if module_spec is None or not file.is_file():
        raise VariantError(f"config file {path}: not found")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)
