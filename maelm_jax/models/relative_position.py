"""Relative position bias from original (aligned) positions: the bucketing functions (T5's
and the official MAE-LM code's), the bias table's initialisations, and the module the
encoder and decoders share across their layers."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maelm_jax.config import options
from maelm_jax.models import by_position
from maelm_jax.models.layers import normal_init


def t5_relative_bucket(relative: jax.Array, num_buckets: int, max_distance: int,
                       xp: Any = jnp) -> jax.Array:
    """T5's bidirectional bucketing of `relative` = key_pos - query_pos (xp: jax.numpy, or
    numpy on the host).

    Half the buckets per sign; within a sign, exact buckets for small distances and
    log-spaced buckets up to `max_distance` (everything farther shares the last one).
    """
    half = num_buckets // 2
    bucket = (relative > 0).astype(xp.int32) * half
    distance = xp.abs(relative)
    max_exact = half // 2
    is_small = distance < max_exact
    # max(distance, 1) keeps log() finite where the small branch is chosen anyway.
    log_ratio = xp.log(xp.maximum(distance, 1).astype(xp.float32) / max_exact) / xp.log(
        max_distance / max_exact
    )
    large = max_exact + (log_ratio * (half - max_exact)).astype(xp.int32)
    large = xp.minimum(large, half - 1)
    return bucket + xp.where(is_small, distance, large)


def maelm_relative_bucket(relative: jax.Array, num_buckets: int, max_distance: int,
                          xp: Any = jnp) -> jax.Array:
    """The bucketing of the official MAE-LM code (fairseq's transformer_sentence_encoder);
    xp as for t5_relative_bucket.

    Same number of buckets as T5's, laid out differently: a signed, symmetric bucket
    (distance 0 in the middle, num_buckets - 1 of them used), exact below num_buckets / 4,
    log-spaced above with ceil() and boundaries log((max_distance - 1) / max_exact) where
    T5 uses floor() and log(max_distance / max_exact). The official code shifts the signed
    buckets by the most negative one met within its maximum length; we shift by its
    bound, num_buckets / 2 - 1, which is the same whenever the length reaches
    max_distance (the papers' 512 vs 128).
    """
    half = num_buckets // 2
    distance = xp.abs(relative)
    max_exact = half // 2
    is_small = distance < max_exact
    log_ratio = xp.log(xp.maximum(distance, 1).astype(xp.float32) / max_exact) / xp.log(
        (max_distance - 1) / max_exact
    )
    large = max_exact + xp.ceil(log_ratio * (half - 1 - max_exact)).astype(xp.int32)
    large = xp.minimum(large, half - 1)
    signed = xp.where(is_small, distance, large) * xp.sign(relative)
    return signed + half - 1


# Relative-position bucketing by name: T5's (the papers cite Raffel et al.) or the official
# MAE-LM code's.
BUCKET_FNS = {"t5": t5_relative_bucket, "maelm": maelm_relative_bucket}
assert tuple(BUCKET_FNS) == options.BUCKET_FNS


@functools.lru_cache(maxsize=64)
def relative_reach(bucket_fn: str, num_buckets: int, max_distance: int,
                   num_positions: int) -> int:
    """The distance R from which every relative distance d (|d| < num_positions) shares
    the bucket of +-R: the bias grid's diagonals are constant beyond, so 2 R + 1 values
    hold it whole (by_position.GridBias.reach). Computed on the host; one position of
    margin covers a device whose log rounds a bucket's edge the other way."""
    P = num_positions
    relative = np.arange(-(P - 1), P)
    buckets = BUCKET_FNS[bucket_fn](relative, num_buckets, max_distance, xp=np)
    changes = np.nonzero(buckets[1:] != buckets[:-1])[0]  # d = relative[i] to relative[i + 1]
    if not len(changes):
        return 1
    farthest = max(abs(int(relative[changes[0]])), int(relative[changes[-1] + 1]))
    return min(farthest + 1, P - 1)


REL_POS_INITS = options.REL_POS_INITS  # "normal" or "local" (see local_bias_init)
# The "local" prior's steepest slope is 2^-(LOCAL_SLOPE_EXPONENT / heads) per position and
# its shallowest 2^-LOCAL_SLOPE_EXPONENT: at least one head is nearly uniform.
LOCAL_SLOPE_EXPONENT = 4.0


def local_bias_init(max_distance: int, bucket_fn: str = "t5"):
    """A relative bias table [num_buckets, heads] that starts attention local: head h
    (1-based) of H adds -s_h * d to the logit of a key d positions away (d = the smallest
    distance in its bucket), s_h = 2^(-4 h / H), geometric slopes as in ALiBi.

    Why: zero-mean bias and small weights make attention start uniform, and a small model
    then sits on the unigram plateau until Adam, moving each bias entry about one learning
    rate per step, has built up a preference for neighbours (ln L / lr steps: 1,400 at
    L = 64, lr 3e-3). Started local, the table is still learned like any other weight.
    """

    def init(key, shape, dtype=jnp.float32):
        del key
        num_buckets, heads = shape
        relative = jnp.arange(-max_distance, max_distance + 1)
        buckets = BUCKET_FNS[bucket_fn](relative, num_buckets, max_distance)
        distance = jnp.full((num_buckets,), float(max_distance)).at[buckets].min(
            jnp.abs(relative).astype(jnp.float32))
        slopes = 2.0 ** (-LOCAL_SLOPE_EXPONENT * jnp.arange(1, heads + 1) / heads)
        return (-distance[:, None] * slopes[None, :]).astype(dtype)

    return nn.with_logical_partitioning(init, ("rel_buckets", "heads"))


# The largest position grid (heads x P x P values) a per-example bias is gathered from.
MAX_GRID = 1 << 26


class RelativePositionBias(nn.Module):
    """Relative position bias from original (aligned) positions, shared by all layers.

    Every bias is the table at each pair's bucket, in the compute `dtype`. A bias shared
    by the batch (positions [1, n]) takes it through a one-hot dot over the buckets, whose
    gradient is a dot too (a lookup's would scatter n x m x heads values into
    num_buckets x heads cells, atomic additions piling up on a GPU). One per example
    (MAE-LM and 3ML remove the [MASK]s, so every row keeps other positions) is gathered,
    when the positions are known to lie below `num_positions`, from the grid [heads, P, P]
    of every pair of positions (by_position.grid_bias: its gradient gathers and sums, no
    scatter);
    beyond MAX_GRID, from the table by bucket.
    """

    num_buckets: int
    max_distance: int
    num_heads: int
    table_init: str = "normal"  # one of REL_POS_INITS
    bucket_fn: str = "t5"  # one of BUCKET_FNS
    num_positions: int = 0  # positions lie in [0, num_positions); 0: unknown
    dtype: Any = jnp.float32  # the bias's (the compute dtype); the table stays float32
    # A per-example bias from the grid given as by_position.GridBias, for the Pallas
    # kernel to read by position, instead of made whole.
    as_grid: bool = False

    @nn.compact
    def __call__(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        """q_pos [B, n], k_pos [B, m] -> bias [B, heads, n, m] in `dtype` (or its
        by_position.GridBias, with `as_grid`)."""
        table = self.param(
            "rel_embedding",
            (local_bias_init(self.max_distance, self.bucket_fn) if self.table_init == "local"
             else normal_init(("rel_buckets", "heads"))),
            (self.num_buckets, self.num_heads),
            jnp.float32,
        )
        P = self.num_positions
        batch = max(q_pos.shape[0], k_pos.shape[0])
        if batch > 1 and 0 < P and self.num_heads * P * P <= MAX_GRID:
            grid = jnp.arange(P, dtype=jnp.int32)
            shared = self._table_dot(table, grid[None], grid[None])[0]  # [heads, P, P]
            q_pos = jnp.broadcast_to(q_pos, (batch, q_pos.shape[1]))
            k_pos = jnp.broadcast_to(k_pos, (batch, k_pos.shape[1]))
            bias = by_position.GridBias(shared, q_pos, k_pos, reach=relative_reach(
                self.bucket_fn, self.num_buckets, self.max_distance, P))
            return bias if self.as_grid else bias.materialise(self.dtype)
        if batch > 1:  # too many positions for a grid: the table by bucket
            buckets = BUCKET_FNS[self.bucket_fn](
                k_pos[:, None, :] - q_pos[:, :, None], self.num_buckets, self.max_distance)
            return jnp.transpose(table.astype(self.dtype)[buckets], (0, 3, 1, 2))
        return self._table_dot(table, q_pos, k_pos).astype(self.dtype)

    def _table_dot(self, table: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        """The table at every pair's bucket by a one-hot dot (float32): q_pos [1, n],
        k_pos [1, m] -> [1, heads, n, m]."""
        buckets = BUCKET_FNS[self.bucket_fn](
            k_pos[:, None, :] - q_pos[:, :, None], self.num_buckets, self.max_distance)
        one_hot = jax.nn.one_hot(buckets, self.num_buckets, dtype=jnp.float32)
        # Exact: a float32 dot would otherwise run as TF32 (GPUs) or bfloat16 passes (TPUs).
        return jnp.einsum("bnmk,kh->bhnm", one_hot, table, precision=jax.lax.Precision.HIGHEST)
