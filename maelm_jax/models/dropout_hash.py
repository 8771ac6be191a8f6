"""Attention dropout's keep mask as a hash of each element's index: the bits both
flash-attention kernels (models/flash_attention.py on GPUs, models/flash_attention_tpu.py
on TPUs) draw, and their reference.

Why a hash: a generator whose state advances per call would make the mask depend on how
often and where a kernel runs (backward passes in reverse under nn.scan, a resumed run).
Here the mask is a function of a traced seed (drawn from the layer's "dropout" stream)
and each element's (batch, head, query, key) index alone: the same in the forward and
backward kernels, on every mesh, on GPU, TPU and in the interpreter, and for a resumed run.

Bits: one 32-bit lowbias32 hash per element (24 bits decide it), or one hash for 2 or 4
neighbouring keys (16 or 8 bits each, as FlashAttention-2 does with Philox); the rate is
then quantised to 2**-bits and the kept values are scaled by the kept fraction actually
used, so the expectation stays exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# lowbias32 (C. Wellons): a 32-bit integer hash with full avalanche.
_MIX1, _MIX2, _GOLDEN = np.uint32(0x7FEB352D), np.uint32(0x846CA68B), np.uint32(0x9E3779B9)


def mix(x: jax.Array) -> jax.Array:
    """lowbias32 of uint32 x, element-wise."""
    x = x ^ (x >> 16)
    x = x * _MIX1
    x = x ^ (x >> 15)
    x = x * _MIX2
    return x ^ (x >> 16)


def row_stream(seed0: jax.Array, seed1: jax.Array, batch: jax.Array, head: jax.Array,
               num_heads: int) -> jax.Array:
    """uint32: the hash state of one (batch, head) row of attention matrices, from the two
    words of the call's seed; batch and head index the whole batch and all heads (a shard
    adds its offsets), num_heads is the model's."""
    row = (batch * num_heads + head).astype(jnp.uint32)
    return mix(mix(row * _GOLDEN ^ seed0) ^ seed1)


def shard_row_stream(words, batch: jax.Array, head: jax.Array, num_heads: int) -> jax.Array:
    """row_stream of a kernel's (batch, head) within its shard: `words` (a [4] uint32 ref
    or array) holds the seed's two words and the shard's first batch row and head."""
    return row_stream(words[0], words[1], words[2] + batch.astype(jnp.uint32),
                      words[3] + head.astype(jnp.uint32), num_heads)


def bits(elements: int) -> int:
    """Bits of a hash that decide one element when `elements` share it."""
    return min(24, 32 // elements)


def threshold(rate: float, elements: int) -> int:
    """An element is dropped when its bits are below this."""
    return round(rate * 2 ** bits(elements))


def dropped_fraction(rate: float, elements: int = 1) -> float:
    """The dropout rate the kernels really apply: `rate` quantised to the bits per element."""
    return threshold(rate, elements) / 2 ** bits(elements)


def keep(stream: jax.Array, queries: jax.Array, key_start: jax.Array, block_k: int,
         key_stride: int, rate: float, elements: int = 1) -> jax.Array:
    """bool [len(queries), block_k]: which elements of keys key_start .. + block_k dropout
    keeps, a function of the row's stream and each (query, key) index alone.

    Key k reads the bits [(k % e) * bits, (k % e + 1) * bits) of the hash of the counter
    query * ceil(key_stride / e) + k // e (e = elements; key_start a multiple of e). One
    hash is computed per e keys and its bits spread by a reshape (the GPU kernel's form).
    """
    b, e = bits(elements), elements
    groups = jnp.asarray(key_start) // e + jnp.arange(block_k // e)
    counter = (queries[:, None] * (-(-key_stride // e)) + groups[None, :]).astype(jnp.uint32)
    hashed = mix(counter ^ stream)
    cut = np.uint32(threshold(rate, elements))
    if e == 1:
        return (hashed >> (32 - b)) >= cut
    shifts = (jnp.arange(e) * b).astype(jnp.uint32)
    parts = (hashed[:, :, None] >> shifts[None, None, :]) & np.uint32(2 ** b - 1)
    return parts.reshape(len(queries), block_k) >= cut


def keep_elements(stream: jax.Array, queries: jax.Array, keys: jax.Array, key_stride: int,
                  rate: float, elements: int = 1) -> jax.Array:
    """`keep` element by element, without a reshape (the TPU kernel's form and the
    reference): queries [q, 1] and keys [1, k] (int32 indices, broadcast) -> bool [q, k].
    A key shares its hash with the e - 1 others of its group, and so hashes it again."""
    b, e = bits(elements), elements
    # Shifts and masks, not // and % (e is a power of two, keys >= 0): Mosaic lowers a
    # signed division only when it knows the TPU's kind, which a CPU host does not.
    shift = e.bit_length() - 1
    counter = (queries * (-(-key_stride // e)) + (keys >> shift)).astype(jnp.uint32)
    hashed = mix(counter ^ stream)
    if e == 1:
        part = hashed >> (32 - b)
    else:
        part = (hashed >> ((keys & (e - 1)) * b).astype(jnp.uint32)) & np.uint32(2 ** b - 1)
    return part >= np.uint32(threshold(rate, elements))


def keep_mask(seed: jax.Array, shape: tuple[int, int, int, int], rate: float,
              elements: int = 1) -> jax.Array:
    """bool [B, heads, n, m]: the whole keep mask the kernels apply, for tests and checks."""
    B, H, n, m = shape
    queries, keys = jnp.arange(n)[:, None], jnp.arange(m)[None, :]
    streams = jax.vmap(lambda b: jax.vmap(lambda h: row_stream(seed[0], seed[1], b, h, H))(
        jnp.arange(H)))(jnp.arange(B))
    return jax.vmap(jax.vmap(lambda s: keep_elements(s, queries, keys, m, rate, elements)))(
        streams)
