"""The tau-effective rank of an encoder's token representations (MAE-LM paper, Section 2.2,
Fig. 1 and Table 3), from Gram matrices summed on the devices.

Definition (the paper's, after Cai et al. 2021). For a representation matrix H (n tokens x
d) with singular values s_1 >= ... >= s_d,

    rank_tau(H) = the smallest k with (s_1^2 + ... + s_k^2) / (s_1^2 + ... + s_d^2) >= tau,

tau = 0.9 by default. The s_i^2 are the eigenvalues of the Gram matrix G = H^T H (d x d),
so H is never held: G is summed batch by batch on the devices (float32 products at the
highest precision, so a TPU does not round them to bfloat16), and only its eigenvalues are
computed, on the host in float64. As in the paper, H is not centred: the singular values
are those of H itself, its mean direction included. With the row sums and the row count
summed beside G, the centred matrix's Gram follows without a second pass,
(H - 1 mu^T)^T (H - 1 mu^T) = G - s s^T / n with s the row sum and mu = s / n: its rank
leaves out the mean direction, which a common offset of all representations (large in
small or collapsed models) would otherwise count as a dimension.

What `make_gram_step` sums, for every layer l = 0..L of the encoder (0: the embedding
output after its LayerNorm; l >= 1: the output of layer l, after its last LayerNorm in a
post-LN stack as in the paper; in a pre-LN stack the residual stream the next layer reads,
and for the last layer the output after the final LayerNorm):

* ``with_mask`` (Fig. 1(a), "Input w. [MASK]"): H^l, one row per token of inputs in which a
  fraction of the positions (15 %) is replaced by [MASK]; real and [MASK] tokens alike.
* ``without_mask`` (Fig. 1(a), "Input w/o [MASK]", and Table 3 at the last layer): the
  same sequences in their original form; real tokens only.
* ``mask_only`` (Fig. 1(b)): the rows of H^l at the [MASK] positions alone.

Every encoder reads the whole sequence, [MASK]s included, whatever objective trained it (an
MAE-LM encoder never sees a [MASK] in pretraining): Fig. 1 is about what [MASK] tokens do
inside an encoder. Padding rows are never counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maelm_jax.analysis import measures, spectrum
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import layers

STATS = measures.STATS


def effective_rank(squared_singular_values: np.ndarray, tau: float) -> int:
    """rank_tau from the s_i^2 (the eigenvalues of H^T H, in any order). Negative values
    (round-off of a Gram matrix's zero eigenvalues) count as 0; an all-zero H has rank 0."""
    return spectrum.integer_rank(squared_singular_values, tau)


def effective_rank_of_matrix(h: np.ndarray, tau: float) -> int:
    """rank_tau of an explicit [n, d] matrix through its singular values (small matrices)."""
    return effective_rank(np.linalg.svd(np.asarray(h, np.float64), compute_uv=False) ** 2, tau)


def hidden_states(encoder: encoder_lib.Encoder, params: Any, tokens: jax.Array,
                  key_mask: jax.Array) -> jax.Array:
    """The embedding output and every layer's output, [L + 1, B, n, d], for tokens [B, n]
    read at positions 0..n-1 (what the encoder sows into layers.HIDDEN_STATES)."""
    B, n = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))
    _, state = encoder.apply({"params": params}, tokens, positions, key_mask,
                             deterministic=True, mutable=[layers.HIDDEN_STATES])
    sown = state[layers.HIDDEN_STATES]
    return jnp.stack([*sown["embedding"], *sown["stack"]["layers"]])


def gram(h: jax.Array, weights: jax.Array) -> jax.Array:
    """sum_rows w * h h^T per layer: h [layers, B, n, d], weights [B, n] -> [layers, d, d]."""
    h = h.astype(jnp.float32)
    return jnp.einsum("lbnd,lbne->lde", h * weights[None, :, :, None], h,
                      precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)


def moments(h: jax.Array, weights: jax.Array) -> dict[str, jax.Array]:
    """What a statistic sums over batches: the Gram matrices ("gram" [layers, d, d]), the
    weighted row sums ("sum" [layers, d]) and the number of rows ("count" [])."""
    return {"gram": gram(h, weights),
            "sum": jnp.einsum("lbnd,bn->ld", h.astype(jnp.float32), weights,
                              precision=jax.lax.Precision.HIGHEST),
            "count": jnp.sum(weights)}


def zero_grams(num_layers: int, d_model: int) -> dict[str, dict[str, jax.Array]]:
    """Every statistic's `moments`, zero."""
    return {name: {"gram": jnp.zeros((num_layers + 1, d_model, d_model), jnp.float32),
                   "sum": jnp.zeros((num_layers + 1, d_model), jnp.float32),
                   "count": jnp.zeros((), jnp.float32)} for name in STATS}


def make_gram_step(encoder_cfg: encoder_lib.EncoderConfig) -> Callable:
    """Returns step(params, grams, batch) -> grams, adding one batch's `moments` to each
    statistic's.

    batch: "original" and "masked" [B, n] int32 (the same sequences, without and with
    [MASK]; the tokenizer's PAD, encoder_cfg.special.pad, pads both), "counted" [B, n]
    float32 (1 for the tokens that are rows of H: real tokens within the analysis's budget)
    and "is_mask" [B, n] float32 (1 at the counted [MASK] positions).
    """
    encoder = encoder_lib.Encoder(encoder_cfg)

    def step(params, grams, batch):
        key_mask = batch["original"] != encoder_cfg.special.pad
        with_mask = hidden_states(encoder, params, batch["masked"], key_mask)
        without_mask = hidden_states(encoder, params, batch["original"], key_mask)
        added = {
            "with_mask": moments(with_mask, batch["counted"]),
            "without_mask": moments(without_mask, batch["counted"]),
            "mask_only": moments(with_mask, batch["is_mask"]),
        }
        return jax.tree.map(jnp.add, grams, added)

    return step
