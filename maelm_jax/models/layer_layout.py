"""The two parameter layouts of a Transformer stack, and the conversion between them.

Per layer (model.scan_layers=False, and every checkpoint written before the option):
``stack/{layer_0, layer_1, ..., ln_final}``. Stacked (model.scan_layers=True, flax
``nn.scan`` over the layers): ``stack/{scan/layer, ln_final}`` where every leaf under
``scan/layer`` has a leading axis of length num_layers (logical axis name "layers").

The conversion works on any pytree that holds parameter-shaped dicts: parameters, Adam's
moments inside an optimiser state, a whole train state, and on arrays and
jax.ShapeDtypeStruct leaves alike, so a checkpoint of either layout restores into a
model of the other (checkpoint.Checkpointer.restore) and fine-tuning reads both.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

STACK = "stack"  # the Transformer stacks' module name in the encoder and the decoder
SCANNED = "scan"  # the scanned layers inside a stack (nn.scan module)
SCANNED_LAYER = "layer"  # the one (stacked) layer module inside SCANNED
LAYER_AXIS = "layers"  # the stacked leaves' leading logical axis
_PER_LAYER = re.compile(r"^layer_(\d+)$")


def is_stacked(tree: Any) -> bool | None:
    """True if the tree's Transformer stacks are stacked, False if per layer, None if it
    holds no stack. Works on nested dicts of any leaves (e.g. orbax's metadata tree)."""
    if isinstance(tree, dict):
        stack = tree.get(STACK)
        if isinstance(stack, dict):
            if SCANNED in stack:
                return True
            if any(_PER_LAYER.match(k) for k in stack):
                return False
        for value in tree.values():
            found = is_stacked(value)
            if found is not None:
                return found
        return None
    if isinstance(tree, (list, tuple)):
        for value in tree:
            found = is_stacked(value)
            if found is not None:
                return found
        return None
    if hasattr(tree, "__dataclass_fields__"):  # flax struct dataclasses (the train state)
        return is_stacked([getattr(tree, f) for f in tree.__dataclass_fields__])
    return None


def _map_stacks(tree: Any, fn: Callable[[dict], dict]) -> Any:
    """`tree` with fn applied to every Transformer stack's dict."""
    def holds_stack(x):
        return isinstance(x, dict) and isinstance(x.get(STACK), dict)
    return jax.tree.map(lambda x: {**x, STACK: fn(x[STACK])} if holds_stack(x) else x,
                        tree, is_leaf=holds_stack)


def _stack_leaves(*leaves):
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    if isinstance(first, np.ndarray):
        return np.stack(leaves)
    return jnp.stack(leaves)


def _unstack_leaf(x, i: int):
    if isinstance(x, jax.ShapeDtypeStruct):
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)
    return x[i]


def _stack_dict_to_stacked(stack: dict) -> dict:
    if SCANNED in stack:
        return stack
    layers = sorted((int(m.group(1)), k) for k in stack if (m := _PER_LAYER.match(k)))
    rest = {k: v for k, v in stack.items() if not _PER_LAYER.match(k)}
    stacked = jax.tree.map(_stack_leaves, *[stack[k] for _, k in layers])
    return {SCANNED: {SCANNED_LAYER: stacked}, **rest}


def _stack_dict_to_per_layer(stack: dict) -> dict:
    if SCANNED not in stack:
        return stack
    stacked = stack[SCANNED][SCANNED_LAYER]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    rest = {k: v for k, v in stack.items() if k != SCANNED}
    per_layer = {f"layer_{i}": jax.tree.map(lambda x, i=i: _unstack_leaf(x, i), stacked)
                 for i in range(num_layers)}
    return {**per_layer, **rest}


def to_stacked(tree: Any) -> Any:
    """Per-layer stacks -> stacked ones (stacked ones are left as they are)."""
    return _map_stacks(tree, _stack_dict_to_stacked)


def to_per_layer(tree: Any) -> Any:
    """Stacked stacks -> per-layer ones (per-layer ones are left as they are)."""
    return _map_stacks(tree, _stack_dict_to_per_layer)


def to_layout(tree: Any, stacked: bool) -> Any:
    return to_stacked(tree) if stacked else to_per_layer(tree)
