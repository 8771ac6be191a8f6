"""A run's Flax parameters as the exported PyTorch model's state dict (remote/modeling_maelm.py).

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
from typing import Any

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


def state_dict(params: dict, head: str | None = None) -> dict[str, np.ndarray]:
    """Flattened PyTorch names -> float32 arrays (C-contiguous, as safetensors writes them).

    params: a run's parameters in the per-layer layout ({"encoder": ..., ...}).
    head: for a fine-tuning run, what its "head" is in PyTorch: "classifier" or
    "qa_outputs" (the span head's one Dense, whose module name is dropped).
    """
    out: dict[str, np.ndarray] = {}

    def walk(tree: Any, prefix: list[str]) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, prefix + [_module(key, prefix)])
                continue
            name, array = _leaf(key, np.asarray(value))
            parts = [p for p in prefix if p] + [name]
            out[".".join(parts)] = np.ascontiguousarray(array, dtype=np.float32)

    def _module(key: str, prefix: list[str]) -> str:
        if not prefix and key == "head":
            return head or "head"
        if prefix == ["qa_outputs"] and key == "out":
            return ""
        match = _LAYER.match(key)
        return f"layers.{match.group(1)}" if match else key

    walk(params, [])
    return out
