"""Pretraining objectives on one shared encoder: MAE-LM (and 3ML_self) and MLM.

* ``maelm``: the encoder reads only the tokens that are not removed [MASK]s, at their
    original positions; the decoder fills the full length with the [MASK] embedding and
    predicts the original tokens.
* ``mlm``: the RoBERTa-style baseline; the encoder reads the whole corrupted sequence and
    the LM head sits on the encoder.

`misaligned_positions` is MAE-LM Table 2's "misaligned position encoding": the encoder
reads its tokens at consecutive positions 0..n_enc-1 (absolute and relative alike)
instead of their original ones; the decoder keeps the original positions.

Both run the LM head only at the k predicted positions.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from maelm_jax import masking, tokenizer
from maelm_jax.models import decoder as decoder_lib
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import heads, layers

OBJECTIVES = ("maelm", "mlm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    objective: str
    encoder: encoder_lib.EncoderConfig
    decoder: decoder_lib.DecoderConfig | None  # None for mlm
    misaligned_positions: bool = False  # maelm: encoder positions 0..n_enc-1


class PretrainModel(nn.Module):
    cfg: PretrainConfig

    def setup(self):
        cfg = self.cfg
        if cfg.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {cfg.objective!r}")
        self.encoder = encoder_lib.Encoder(cfg.encoder)
        self.decoder = None
        self.decoder_to_encoder = None
        if cfg.objective == "maelm" and cfg.decoder.kind != "self":
            self.decoder = decoder_lib.CrossDecoder(cfg.decoder)
            if cfg.decoder.stack.d_model != cfg.encoder.stack.d_model:
                # The shared prediction layer reads the encoder's width (3ML App. D, the
                # d_de x d_en term of eq. 4's decoder prediction).
                self.decoder_to_encoder = nn.Dense(
                    cfg.encoder.stack.d_model,
                    dtype=cfg.encoder.stack.dtype,
                    kernel_init=layers.normal_init(("dec_embed", "embed")),
                    bias_init=layers.zeros_init(("embed",)),
                )
        elif cfg.objective == "maelm":
            self.decoder = decoder_lib.Decoder(cfg.decoder)
        self.lm_head = heads.LmHead(
            cfg.encoder.stack.d_model, cfg.encoder.vocab_size, cfg.encoder.stack.dtype
        )

    def __call__(self, batch: masking.MaskedBatch, deterministic: bool = True) -> jax.Array:
        """Returns logits [B, k, vocab] (float32) at batch.pred_index."""
        if self.cfg.objective == "maelm":
            enc_tokens = masking.gather_tokens(batch.inputs, batch.enc_index)  # [B, n_enc]
            enc_positions = batch.enc_index
            if self.cfg.misaligned_positions:
                # One row for the whole batch: the relative bias is then computed once.
                enc_positions = jnp.arange(enc_tokens.shape[1], dtype=jnp.int32)[None]
            hidden = self.encoder(enc_tokens, enc_positions, deterministic=deterministic)
            shared_positions = (
                self.encoder.position_table() if self.cfg.decoder.share_positions else None
            )
            if self.cfg.decoder.kind != "self":
                return self._cross_logits(batch, hidden, shared_positions, deterministic)
            mask_embedding = self.encoder.embed(jnp.int32(tokenizer.MASK_ID))
            reset = batch.inputs == tokenizer.MASK_ID if self.cfg.decoder.reset_masks else None
            hidden = self.decoder(
                hidden, batch.enc_index, mask_embedding, shared_positions, deterministic, reset
            )  # [B, L, D_dec]
        else:
            L = batch.inputs.shape[1]
            # One row for the whole batch: the relative bias is then computed once, [1, H, L, L].
            positions = jnp.arange(L, dtype=jnp.int32)[None]
            hidden = self.encoder(batch.inputs, positions, deterministic=deterministic)
        predicted = masking.gather_tokens(hidden, batch.pred_index)  # [B, k, D]
        return self.lm_head(predicted, self.encoder.attend)


    def _cross_logits(self, batch, hidden, shared_positions, deterministic) -> jax.Array:
        """3ML_cross (and the other cross kinds): removed [MASK]s predicted from the decoder,
        the other predicted tokens (random, unchanged, and [MASK]s kept in the encoder) from
        the encoder's outputs, all with the same prediction layer. Logits [B, k, vocab] in
        batch.pred_index order."""
        split = split_predictions(batch)
        parts = []
        if split.dec_index.shape[1]:
            dec = self.decoder(hidden, batch.enc_index, split.dec_index, shared_positions,
                               deterministic)  # [B, n_de, D_dec]
            parts.append(self.decoder_to_encoder(dec) if self.decoder_to_encoder else dec)
        parts.append(masking.gather_tokens(hidden, split.enc_slot))  # [B, k - n_de, D_enc]
        predicted = masking.gather_tokens(jnp.concatenate(parts, axis=1), split.inverse)
        return self.lm_head(predicted, self.encoder.attend)


class PredictionSplit(NamedTuple):
    """Where 3ML_cross predicts each of the k tokens (all static shapes).

    dec_index: [B, n_de] original positions of the removed [MASK]s, ascending
    enc_slot:  [B, k - n_de] index into the encoder's sequence of the other predicted tokens
    inverse:   [B, k] permutation from [decoder part; encoder part] back to pred_index order
    """

    dec_index: jax.Array
    enc_slot: jax.Array
    inverse: jax.Array


def split_predictions(batch: masking.MaskedBatch) -> PredictionSplit:
    B, L = batch.inputs.shape
    n_de = L - batch.enc_index.shape[1]  # removed [MASK]s: a Python int
    rows = jnp.arange(B)[:, None]
    n_enc = batch.enc_index.shape[1]
    slot = jnp.full((B, L), -1, jnp.int32).at[rows, batch.enc_index].set(
        jnp.broadcast_to(jnp.arange(n_enc, dtype=jnp.int32), (B, n_enc))
    )
    pred_slot = masking.gather_tokens(slot, batch.pred_index)  # [B, k], -1 = removed
    # Removed first, each group in ascending position order (a stable sort of sorted input).
    order = jnp.argsort((pred_slot >= 0).astype(jnp.int32), axis=1, stable=True)
    dec_index = masking.gather_tokens(batch.pred_index, order[:, :n_de])
    enc_slot = masking.gather_tokens(pred_slot, order[:, n_de:])
    return PredictionSplit(dec_index, enc_slot, jnp.argsort(order, axis=1).astype(jnp.int32))


def masked_lm_sums(
    logits: jax.Array, targets: jax.Array, weights: jax.Array,
    category: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Sums over predicted tokens: cross-entropy, correct predictions, and the token count.

    Sums (not means) so that gradient accumulation and data parallelism divide once, by the
    number of predicted tokens in the global batch, as the paper's loss does.
    logits [B, k, V] float32; targets [B, k] int32; weights [B, k] float32.
    With `category` [B, k] (masking.MaskedBatch.category; evaluation passes it, the train
    step does not), also the same three sums per category as [3] arrays indexed by
    masking.MASKED / RANDOM / UNCHANGED: "category_loss_sum", "category_correct_sum",
    "category_count".
    """
    nll = layers.cross_entropy(logits, targets)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    sums = {
        "loss_sum": jnp.sum(nll * weights),
        "correct_sum": jnp.sum(correct * weights),
        "count": jnp.sum(weights),
    }
    if category is not None:
        one_hot = jax.nn.one_hot(category, len(masking.CATEGORY_NAMES)) * weights[..., None]
        sums["category_loss_sum"] = jnp.einsum("bk,bkc->c", nll, one_hot)
        sums["category_correct_sum"] = jnp.einsum("bk,bkc->c", correct, one_hot)
        sums["category_count"] = jnp.sum(one_hot, axis=(0, 1))
    return sums
