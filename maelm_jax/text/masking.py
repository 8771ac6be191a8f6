"""Static-shape masking for MAE-LM, 3ML and MLM, run inside the jitted train step.

Every sequence gets the same counts (a Python-int `MaskCounts`), so every array below has a
shape fixed by the config and XLA compiles the train step once:

* ``k`` positions are predicted; of these ``k_mask`` become ``[MASK]``, ``k_random`` a
    random token and ``k_keep`` stay unchanged (MAE-LM: 100/0/0, 3ML: 80/10/10).
* ``k_in_enc`` of the ``[MASK]`` tokens stay in the encoder (the MAE-LM paper's delta
    ablation); the other ``k_mask - k_in_enc`` are removed from it, so the encoder reads
    ``n_enc = L - (k_mask - k_in_enc)`` tokens.

Sampling: uniform scores -> ``argsort`` -> the first ``k`` positions are corrupted, the
remaining positions, sorted, are the encoder's ``enc_index``. No boolean indexing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from maelm_jax.text import tokenizer


def round_half_up(x: float) -> int:
    """Python's round() is banker's rounding; counts should not flip between even/odd L."""
    return int(math.floor(x + 0.5))


@dataclasses.dataclass(frozen=True)
class MaskCounts:
    """Per-sequence counts, all Python ints (they decide array shapes)."""

    seq_len: int
    k: int  # predicted positions
    k_mask: int  # of which replaced by [MASK]
    k_random: int  # of which replaced by a random token
    k_keep: int  # of which left unchanged
    k_in_enc: int  # [MASK] tokens that stay in the encoder (delta ablation)
    remove_masked: bool  # MAE-LM/3ML: [MASK] tokens leave the encoder; MLM: they stay

    @property
    def k_removed(self) -> int:
        """[MASK] positions left out of the encoder."""
        return self.k_mask - self.k_in_enc if self.remove_masked else 0

    @property
    def n_enc(self) -> int:
        """Encoder input length."""
        return self.seq_len - self.k_removed

    @classmethod
    def create(
        cls,
        seq_len: int,
        mask_ratio: float,
        mask_frac: float = 1.0,
        random_frac: float = 0.0,
        delta: float = 0.0,
        remove_masked: bool = True,
    ) -> MaskCounts:
        """Derives the counts; raises ValueError naming the offending setting."""
        if not 0.0 < mask_ratio < 1.0:
            raise ValueError(f"masking.mask_ratio must be in (0, 1), got {mask_ratio}")
        for name, v in (("mask_frac", mask_frac), ("random_frac", random_frac), ("delta", delta)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"masking.{name} must be in [0, 1], got {v}")
        if mask_frac + random_frac > 1.0 + 1e-9:
            raise ValueError(
                "masking.mask_frac + masking.random_frac must be <= 1, got "
                f"{mask_frac} + {random_frac}"
            )
        k = round_half_up(mask_ratio * seq_len)
        if k < 1:
            raise ValueError(
                f"masking.mask_ratio={mask_ratio} with data.seq_len={seq_len} predicts "
                "k < 1 tokens per sequence; raise either"
            )
        k_mask = round_half_up(mask_frac * k)
        k_random = min(round_half_up(random_frac * k), k - k_mask)
        k_keep = k - k_mask - k_random
        k_in_enc = round_half_up(delta * k_mask)
        counts = cls(seq_len, k, k_mask, k_random, k_keep, k_in_enc, remove_masked)
        if counts.n_enc < 1:
            raise ValueError(
                f"masking.mask_ratio={mask_ratio} leaves an encoder length of "
                f"{counts.n_enc} < 1 token; lower it"
            )
        return counts


class MaskedBatch(NamedTuple):
    """One corrupted batch. All index arrays are sorted along the last axis.

    inputs:     [B, L] int32   corrupted tokens ([MASK] / random substituted)
    enc_index:  [B, n_enc] int32  original positions the encoder reads
    pred_index: [B, k] int32   positions whose original token is predicted
    targets:    [B, k] int32   original tokens at pred_index
    weights:    [B, k] float32 1 for a real target, 0 for padding (short sequences only)
    category:   [B, k] int32   how each predicted position was corrupted: MASKED ([MASK]),
                               RANDOM (a random token) or UNCHANGED, aligned with pred_index
                               (None in batches built by hand; the models never read it)
    """

    inputs: jax.Array
    enc_index: jax.Array
    pred_index: jax.Array
    targets: jax.Array
    weights: jax.Array
    category: jax.Array | None = None


# Values of MaskedBatch.category, and the names evaluation reports them under (the 3ML
# paper's Tables 1 and 2c give perplexity separately for each).
MASKED, RANDOM, UNCHANGED = 0, 1, 2
CATEGORY_NAMES = ("mask", "random", "unchanged")


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, index, axis=1)


def _scatter_set(x: jax.Array, index: jax.Array, values: jax.Array,
                 ascending: bool = False) -> jax.Array:
    """x[b, index[b, j]] = values[b, j] (values broadcast over j); a row's indices are
    distinct (and `ascending`), which XLA is told: a plain scatter, not JAX's path for
    repeated indices (a buffer of ids and a scatter-add)."""
    rows = jnp.arange(x.shape[0])[:, None]
    return x.at[rows, index].set(values, unique_indices=True, indices_are_sorted=ascending)


def apply_mask(
    key: jax.Array, tokens: jax.Array, counts: MaskCounts, vocab_size: int,
    special: tokenizer.SpecialIds,
) -> MaskedBatch:
    """Samples the corruption of `tokens` [B, L] with exactly `counts` per sequence;
    `special`: the tokenizer's ids (PAD is never predicted, MASK is inserted).

    Padding sorts after every real token, so it is chosen only when a sequence holds
    fewer than k real tokens (never in packed pretraining blocks), and then weighs 0.
    """
    B, L = tokens.shape
    if L != counts.seq_len:
        raise ValueError(f"tokens have length {L}, masking counts were built for {counts.seq_len}")
    c = counts
    score_key, random_key = jax.random.split(key)
    is_pad = tokens == special.pad
    scores = jax.random.uniform(score_key, (B, L)) + is_pad.astype(jnp.float32)
    order = jnp.argsort(scores, axis=1).astype(jnp.int32)

    # order[:, :k] are corrupted: first [MASK] (the first k_in_enc of which stay in the
    # encoder), then random tokens, then unchanged ones.
    mask_pos = order[:, : c.k_mask]
    random_pos = order[:, c.k_mask : c.k_mask + c.k_random]

    inputs = _scatter_set(tokens, mask_pos, jnp.int32(special.mask))
    if c.k_random:
        random_tokens = random_ordinary_tokens(random_key, (B, c.k_random), vocab_size,
                                               special)
        inputs = _scatter_set(inputs, random_pos, random_tokens)

    # The first k_in_enc [MASK] positions stay in the encoder (delta); the rest leave it.
    if c.remove_masked:
        keep_enc = jnp.concatenate([order[:, : c.k_in_enc], order[:, c.k_mask :]], axis=1)
    else:
        keep_enc = order
    enc_index = jnp.sort(keep_enc, axis=1)
    # order[:, :k] is [MASK] x k_mask, random x k_random, unchanged x k_keep; sorting the
    # positions carries each one's category along.
    category = jnp.concatenate(
        [jnp.full((B, n), value, jnp.int32)
         for value, n in ((MASKED, c.k_mask), (RANDOM, c.k_random), (UNCHANGED, c.k_keep))],
        axis=1,
    )
    pred_index, category = jax.lax.sort((order[:, : c.k], category), dimension=1, num_keys=1)
    targets = _gather(tokens, pred_index)
    weights = (targets != special.pad).astype(jnp.float32)
    return MaskedBatch(
        inputs.astype(jnp.int32), enc_index, pred_index, targets.astype(jnp.int32), weights,
        category,
    )


def random_ordinary_tokens(key: jax.Array, shape: tuple[int, ...], vocab_size: int,
                           special: tokenizer.SpecialIds) -> jax.Array:
    """Uniform int32 ids of `shape` over the vocabulary bar the special ids: a draw over
    vocab_size - #special values, each moved past the special ids at or below it. With
    the special ids first (SentencePiece's 0-4), this draws what randint(key, shape,
    #special, vocab_size) draws."""
    ids = special.ids
    x = jax.random.randint(key, shape, 0, vocab_size - len(ids), jnp.int32)
    for s in ids:  # ascending: each step skips one special id
        x = jnp.where(x >= s, x + 1, x)
    return x


def gather_tokens(x: jax.Array, index: jax.Array) -> jax.Array:
    """[B, L, ...] gathered at index [B, n] -> [B, n, ...]."""
    if x.ndim == 2:
        return _gather(x, index)
    return jnp.take_along_axis(x, index[..., None], axis=1)


def scatter_tokens(buffer: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
    """buffer [B, L, D] with values [B, n, D] written at positions index [B, n], distinct
    and ascending in each row (the encoder's kept positions)."""
    return _scatter_set(buffer, index, values, ascending=True)
