"""Our Flax parameters under the names and layouts of the export's PyTorch modules
(export/remote/modeling_maelm.py), both ways: the export writes a run's parameters as that
model's state dict, and an imported Hugging Face encoder (sources/huggingface.py) is
renamed onto those names and read back into a Flax tree through the same mapping.

The PyTorch modules mirror the Flax ones and keep their names, so the mapping is local:
``layer_<i>`` becomes ``layers.<i>``; a Dense ``kernel`` [in, out] becomes a Linear
``weight`` [out, in]; an attention projection's ``query_kernel`` [D, heads, head_dim] and
``query_bias`` [heads, head_dim] become ``query.weight`` [heads * head_dim, D] and
``query.bias``, ``out_kernel`` [heads, head_dim, D] becomes ``out.weight``; a LayerNorm's
``scale`` and an Embed's ``embedding`` become ``weight``. A fine-tuning run's ``head``
is the classifier (``classifier``) or the span head's projection (``qa_outputs``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

_LAYER = re.compile(r"^layer_(\d+)$")
_PROJECTIONS = ("query", "key", "value", "out")


def _leaf(name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """(PyTorch name, array) of one Flax parameter leaf."""
    for proj in _PROJECTIONS:
        if name == f"{proj}_kernel":
            if proj == "out":  # [heads, head_dim, D] -> [D, heads * head_dim]
                return f"{proj}.weight", value.reshape(-1, value.shape[-1]).T
            return f"{proj}.weight", value.reshape(value.shape[0], -1).T  # [D, H, Dh] -> [H*Dh, D]
        if name == f"{proj}_bias":
            return f"{proj}.bias", value.reshape(-1)
    if name == "kernel":
        return "weight", value.T
    if name in ("scale", "embedding"):
        return "weight", value
    if name == "rel_embedding":
        return "rel_embedding.weight", value
    return name, value  # biases, the LM head's output bias, the cross decoder's [MASK]


def _from_leaf(name: str, value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The Flax leaf `name` of `shape` from its PyTorch array (the inverse of _leaf)."""
    if name.endswith("_kernel") or name == "kernel":
        # [H*Dh, D] -> [D, H, Dh]; out [D, H*Dh] -> [H, Dh, D]; a Linear's [out, in] -> [in, out]
        value = value.T
    return value.reshape(shape)


def _module(key: str, prefix: list[str], head: str | None) -> str:
    if not prefix and key == "head":
        return head or "head"
    if prefix == ["qa_outputs"] and key == "out":
        return ""
    match = _LAYER.match(key)
    return f"layers.{match.group(1)}" if match else key


def _leaves(tree: Mapping, head: str | None, prefix: list[str] | None = None):
    """(PyTorch module names, Flax leaf name, leaf) of every leaf of `tree`."""
    prefix = prefix or []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, head, prefix + [_module(key, prefix, head)])
        else:
            yield [p for p in prefix if p], key, value


def state_dict(params: dict, head: str | None = None) -> dict[str, np.ndarray]:
    """Flattened PyTorch names -> float32 arrays (C-contiguous, as safetensors writes them).

    params: a run's parameters in the per-layer layout ({"encoder": ..., ...}).
    head: for a fine-tuning run, what its "head" is in PyTorch: "classifier" or
    "qa_outputs" (the span head's one Dense, whose module name is dropped).
    """
    out: dict[str, np.ndarray] = {}
    for modules, key, value in _leaves(params, head):
        name, array = _leaf(key, np.asarray(value))
        out[".".join(modules + [name])] = np.ascontiguousarray(array, dtype=np.float32)
    return out


def from_state_dict(state: Mapping[str, np.ndarray], template: Mapping
                    ) -> tuple[dict, list[str]]:
    """(the Flax tree of `template`'s structure with the arrays of `state` (float32), the
    PyTorch names of its leaves that `state` lacks, left out of the tree).

    state: PyTorch names (as state_dict writes them) -> arrays. template: the Flax tree
    to fill, in the per-layer layout; its leaves need only a shape (arrays or shape
    structs). An array of another size than its leaf is a ValueError naming it.
    """
    def fill(tree: Mapping, prefix: list[str]) -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, Mapping):
                sub = fill(value, prefix + [_module(key, prefix, None)])
                if sub:
                    out[key] = sub
                continue
            name, _ = _leaf(key, np.zeros((1,) * len(value.shape)))
            full = ".".join([p for p in prefix if p] + [name])
            if full not in state:
                missing.append(full)
                continue
            array = np.asarray(state[full], np.float32)
            if array.size != int(np.prod(value.shape)):
                raise ValueError(f"{full} has shape {tuple(array.shape)}, which does not "
                                 f"give {tuple(value.shape)}")
            out[key] = _from_leaf(key, array, tuple(value.shape))
        return out

    missing: list[str] = []
    return fill(template, []), missing
