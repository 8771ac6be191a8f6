"""Config fields declared once: each field's type and allowed values, and the checks that
pretraining, fine-tuning (and any later config kind) run over their own tables.

A table maps a dotted field name (``"model.dropout"``) to a `Field`. `check` turns the
first problem into one line naming the field, e.g. ``config.model.dropout: expected a
number in [0, 1), got 1.5``; it also refuses fields that the config kind's defaults do not
have (a mistyped ``--config.masking.mask_ration``), and suggests the nearest name.
`resolve_paths` makes every `path` field absolute against the current directory, once,
before anything reads it (orbax, for one, needs absolute paths).

The sections several config kinds share (the encoder, the optimiser, the mesh) are
declared once, defaults beside these fields, in maelm_jax/config/sections.py; each kind adds
its own (``FIELDS`` in maelm_jax/pretrain/config.py and maelm_jax/finetune/config.py; a
later kind, e.g. an analysis config, builds its table from the same helpers and calls
`check` with its own defaults and error class). Cross-field rules stay in the kind's
``validate``, bar a transformer stack's (``d_model`` a multiple of ``num_heads``, ...),
which the encoder and the MAE-LM decoder share: `stack_rules`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from maelm_jax.infra import paths


@dataclasses.dataclass(frozen=True)
class Field:
    """One config field: accepted Python types, an extra check, and the words for both."""

    types: tuple[type, ...]
    expected: str  # "a number in [0, 1)", shown after "expected"
    ok: Callable[[Any], bool] = lambda value: True
    path: bool = False  # a filesystem path: resolved against the current directory
    subtree: bool = False  # a mapping whose own fields are checked elsewhere

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) and bool not in self.types:
            return False  # True is an int to Python, not to a user
        if not isinstance(value, self.types):
            return False
        if float in self.types and isinstance(value, (int, float)) and not isinstance(
                value, bool) and not math.isfinite(value):
            return False
        return self.ok(value)


def integer(low: int | None = None, high: int | None = None) -> Field:
    """An int in [low, high] (either bound may be absent)."""
    if low is not None and high is not None:
        words = f"an int in [{low}, {high}]"
    elif low is not None:
        words = f"an int >= {low}"
    elif high is not None:
        words = f"an int <= {high}"
    else:
        words = "an int"
    return Field((int,), words, lambda v: (low is None or v >= low) and (high is None or v <= high))


def number(low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False) -> Field:
    """A finite int or float within the bounds; ``*_open`` excludes the bound itself."""
    if low is not None and high is not None:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        words = f"a number in {left}{low:g}, {high:g}{right}"
    elif low is not None:
        words = f"a number {'>' if low_open else '>='} {low:g}"
    elif high is not None:
        words = f"a number {'<' if high_open else '<='} {high:g}"
    else:
        words = "a finite number"

    def ok(v):
        above = low is None or (v > low if low_open else v >= low)
        below = high is None or (v < high if high_open else v <= high)
        return above and below

    return Field((int, float), words, ok)


def rate() -> Field:
    """Dropout-like rates: [0, 1)."""
    return number(0.0, 1.0, high_open=True)


def choice(*values: Any) -> Field:
    shown = ", ".join(repr(v) for v in values)
    return Field(tuple({type(v) for v in values}), f"one of {shown}", lambda v: v in values)


def boolean() -> Field:
    return Field((bool,), "True or False")


def text(words: str = "a string") -> Field:
    return Field((str,), words)


def path(words: str = "a path (relative to the current directory) or empty") -> Field:
    return Field((str,), words, path=True)


def sequence_of(item: Field, min_len: int = 0, words: str | None = None) -> Field:
    """A tuple or list whose every element `item` accepts."""
    words = words or f"a tuple of {item.expected.removeprefix('a ').removeprefix('an ')}s"
    return Field((tuple, list), words,
                 lambda v: len(v) >= min_len and all(item.accepts(x) for x in v))


def free_form(words: str) -> Field:
    """A subtree with its own checks elsewhere (e.g. data.sources): any fields allowed."""
    return Field((Mapping, ml_collections.ConfigDict), words, subtree=True)


def requirer(error: type[Exception]) -> Callable[[bool, str, str, Any], None]:
    """require(cond, field, expected, got): raises `error`("config.<field>: expected
    <expected>, got <got>") unless `cond` ("nothing" for an empty value): the one form of
    every config kind's rules between fields."""
    def require(cond: bool, field: str, expected: str, got: Any) -> None:
        if not cond:
            shown = "nothing" if got in ("", (), None) else repr(got)
            raise error(f"config.{field}: expected {expected}, got {shown}")
    return require


def pallas_heads(head_dim: int) -> bool:
    """Whether the Pallas kernel can tile heads of `head_dim`: a power of two >= 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


# ------------------------------------------------------------------- shared declarations

def stack_fields(prefix: str) -> dict[str, Field]:
    """A transformer stack's sizes (the encoder's, the decoder's)."""
    return {f"{prefix}.{name}": integer(1) for name in ("num_layers", "d_model", "num_heads",
                                                        "d_ff")}


def stack_rules(stack: Any, prefix: str, attention_impl: str,
                require: Callable[[bool, str, str, Any], None]) -> None:
    """The rules between a stack's fields (`stack_fields` and the relative bias's) under
    `prefix`; `require(cond, field, expected, got)` raises the kind's one-line error."""
    require(stack.d_model % stack.num_heads == 0, f"{prefix}.d_model",
            f"a multiple of {prefix}.num_heads={stack.num_heads}", stack.d_model)
    head_dim = stack.d_model // stack.num_heads
    require(attention_impl != "pallas" or pallas_heads(head_dim),
            f"{prefix}.num_heads",
            f"heads of a power-of-two size >= 16 with model.attention_impl='pallas' (the "
            f"kernel's tiles; {prefix}.d_model={stack.d_model})", stack.num_heads)
    require(stack.rel_pos_buckets == 0
            or (stack.rel_pos_buckets >= 4 and stack.rel_pos_buckets % 2 == 0),
            f"{prefix}.rel_pos_buckets", "0 (off) or an even int >= 4", stack.rel_pos_buckets)
    require(stack.rel_pos_max_distance > stack.rel_pos_buckets // 4,
            f"{prefix}.rel_pos_max_distance",
            f"an int > rel_pos_buckets / 4 = {stack.rel_pos_buckets // 4}",
            stack.rel_pos_max_distance)


# ------------------------------------------------------------------- checks

def over_defaults(defaults: dict, recorded: dict) -> dict:
    """A recorded config (plain dicts, e.g. a run's config.json) over the defaults of its
    kind, recursively: a field recorded before it existed counts at its default."""
    out = dict(defaults)
    for key, value in recorded.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            value = over_defaults(out[key], value)
        out[key] = value
    return out


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted name -> value for every leaf (a ConfigDict or dict is not a leaf)."""
    if isinstance(tree, ml_collections.ConfigDict):
        tree = {key: tree[key] for key in tree.keys()}
    if isinstance(tree, Mapping) and (tree or not prefix):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _lookup(config: Any, name: str) -> tuple[bool, Any]:
    """(found, value) of a dotted field."""
    node = config
    for part in name.split("."):
        if not isinstance(node, (ml_collections.ConfigDict, Mapping)) or part not in node:
            return False, None
        node = node[part]
    return True, node


def unknown_fields(config: Any, defaults: Any, table: Mapping[str, Field]) -> list[str]:
    """Dotted names in `config` that neither its defaults nor `table` know (fields under a
    `free_form` entry are that entry's business)."""
    free = [name for name, f in table.items() if f.subtree]
    known = set(_flatten(defaults)) | set(table)
    return sorted(
        name for name in _flatten(config)
        if name not in known and not any(name == p or name.startswith(p + ".") for p in free))


def _fields_of_section(name: str, known: list[str]) -> str:
    """"; <section> has <its fields>" for an unknown dotted `name`, from the known names."""
    section = name.rsplit(".", 1)[0] if "." in name else ""
    prefix = f"{section}." if section else ""
    fields = sorted({k[len(prefix):].split(".")[0] for k in known if k.startswith(prefix)})
    if not fields:
        return f"; {section} has no such field"
    return f"; {section or 'the config'} has {', '.join(fields)}"


def check(config: Any, table: Mapping[str, Field], defaults: Any,
          error: Callable[[str], Exception]) -> None:
    """Raises `error(one line)` for the first unknown field, missing field, or value of the
    wrong type or out of its range."""
    for name in unknown_fields(config, defaults, table):
        known = sorted(set(_flatten(defaults)) | set(table))
        # A field put in the wrong section (config.num_epochs): every section that has it.
        leaf = name.rsplit(".", 1)[-1]
        close = ([k for k in known if k.rsplit(".", 1)[-1] == leaf][:3]
                 or difflib.get_close_matches(name, known, n=1, cutoff=0.75))
        hint = (f"; did you mean {' or '.join(f'config.{c}' for c in close)}?" if close
                else _fields_of_section(name, known))
        raise error(f"config.{name}: unknown field{hint}")
    for name, field in table.items():
        found, value = _lookup(config, name)
        if not found:
            raise error(f"config.{name}: missing (config files start from the defaults)")
        if not field.accepts(value):
            raise error(f"config.{name}: expected {field.expected}, got {value!r}")


def absolute_spec(value: Any, field: str) -> Any:
    """A path spec that may be comma-separated or a list (corpus sources), each part made
    absolute (`paths.absolute`; URIs such as ``gs://`` unchanged)."""
    if isinstance(value, str):
        return ",".join(paths.absolute(part.strip(), field) for part in value.split(",")
                        if part.strip())
    if isinstance(value, (list, tuple)):
        return type(value)(paths.absolute(str(part), field) for part in value)
    return value


def resolve_paths(config: ml_collections.ConfigDict,
                  table: Mapping[str, Field]) -> ml_collections.ConfigDict:
    """A copy of `config` with every `path` field of `table` absolute against the current
    directory (call once, when the run starts, before anything uses a path)."""
    resolved = config.copy_and_resolve_references()
    for name, field in table.items():
        found, value = _lookup(resolved, name)
        if field.path and found and isinstance(value, str):
            holder, _, leaf = name.rpartition(".")
            node = resolved
            for part in holder.split(".") if holder else ():
                node = node[part]
            node[leaf] = paths.absolute(value, f"config.{name}")
    return resolved
