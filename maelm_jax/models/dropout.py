"""Dropout whose random bits cost a quarter of flax's.

flax's `nn.Dropout` draws one 32-bit uniform per element. With JAX's default
(partitionable) threefry, each of those costs a whole threefry2x32 hash, whose two 32-bit
output words are XORed into one. With dropout on the hidden states and the attention
probabilities, those hashes are a noticeable share of a small model's train step on a CPU.

Here every hash decides four elements: each of its two output words is split into two
16-bit halves and an element is dropped when its half is below round(rate * 2**16). The
rate is then exact to within 2**-17 (0.1 becomes 6554 / 65536 = 0.10000610), and each
element's decision is still a function of (key, its index) alone:

- the hash for elements [..., 4j : 4j + 4] of the last axis has the counter
  (index along the first axis, flat index of [..., j] in the other axes), so the bits do
  not depend on how the array is sharded and need no communication (as
  `jax_threefry_partitionable`'s own counters);
- keys of the other implementations (config.train.prng_impl "rbg", "unsafe_rbg") give two
  32-bit words per four elements from `jax.random.bits`, split the same way.
"""

from __future__ import annotations

import math

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

BITS = 16  # bits per element's decision
ELEMENTS_PER_HASH = 4  # two 32-bit words, two halves each


def _words(key: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Two uint32 arrays of `shape`: both output words of one hash per position."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):  # a raw jax.random.PRNGKey
        key = jax.random.wrap_key_data(key)
    if str(jax.random.key_impl(key)) != "threefry2x32":
        both = jax.random.bits(key, (2,) + shape, jnp.uint32)
        return both[0], both[1]
    rest = math.prod(shape[1:])
    if shape[0] >= 2 ** 32 or rest >= 2 ** 32:
        raise ValueError(f"dropout on an array of shape {shape}: more than 2**32 counters "
                         "along the first axis or across the others")
    # Counter (i, flat index in the other axes) for position (i, ...): distinct for every
    # position, and an iota, so each shard computes its own part.
    first = jax.lax.broadcasted_iota(jnp.uint32, shape, 0)
    flat = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in range(len(shape) - 1, 0, -1):
        flat = flat + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= shape[axis]
    k1, k2 = jax.random.key_data(key)
    return tuple(jex_random.threefry2x32_p.bind(k1, k2, first, flat))


def keep_mask(key: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """bool `shape`: True where an element is kept, with probability 1 - rate (to 2**-17).

    `key`: a typed key (jax.random.key) or a raw threefry one (jax.random.PRNGKey).
    """
    shape = tuple(shape)
    if not shape:
        raise ValueError("dropout needs an array of rank >= 1, got a scalar")
    last = shape[-1]
    groups = -(-last // ELEMENTS_PER_HASH)
    w1, w2 = _words(key, shape[:-1] + (groups,))
    threshold = np.uint32(round(rate * 2 ** BITS))
    low = np.uint32(2 ** BITS - 1)
    halves = (w1 & low, w1 >> BITS, w2 & low, w2 >> BITS)
    keep = jnp.stack([h >= threshold for h in halves], axis=-1)  # [..., groups, 4]
    return keep.reshape(shape[:-1] + (groups * ELEMENTS_PER_HASH,))[..., :last]


class Dropout(nn.Module):
    """Inverted dropout with `keep_mask`'s bits: x / (1 - rate) where kept, 0 elsewhere.

    The same interface as flax's nn.Dropout without broadcast_dims: `deterministic` on the
    module or the call (the call wins), the "dropout" RNG stream.
    """

    rate: float
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool | None = None) -> jax.Array:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or self.rate == 0.0:
            return x
        if self.rate == 1.0:
            return jnp.zeros_like(x)
        keep = keep_mask(self.make_rng("dropout"), self.rate, x.shape)
        return jnp.where(keep, x / jnp.asarray(1.0 - self.rate, x.dtype), jnp.zeros_like(x))
