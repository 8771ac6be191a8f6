"""The MAE-LM pretraining model (MAE-LM, 3ML_self, 3ML_cross): the encoder reads only the
tokens that are not removed [MASK]s, and a shallow decoder, dropped after pretraining,
predicts every corrupted token (maelm_jax/pretrain/objectives/maelm.py is the objective that builds
it from a config).

`MaeLmConfig.decoder.kind` picks the decoder (models/decoder.py):

* ``self`` (MAE-LM, 3ML_self): fills the full length with the [MASK] embedding and the
    encoder's outputs, and predicts every corrupted token from there;
* ``cross`` (3ML_cross) and MAE-LM Table 2's ``causal_cross`` / ``cross_only``: reads only
    the removed [MASK]s and attends to the encoder; the other predicted tokens (random,
    unchanged, [MASK]s kept in the encoder) are predicted from the encoder's outputs, all
    with the same prediction layer.

`misaligned_positions` is MAE-LM Table 2's "misaligned position encoding": the encoder
reads its tokens at consecutive positions 0..n_enc-1 (absolute and relative alike)
instead of their original ones; the decoder keeps the original positions. The LM head
runs only at the k predicted positions.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from maelm_jax.models import decoder as decoder_lib
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import heads, layers
from maelm_jax.text import masking


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaeLmConfig:
    encoder: encoder_lib.EncoderConfig
    decoder: decoder_lib.DecoderConfig
    misaligned_positions: bool = False  # encoder positions 0..n_enc-1


class MaeLmModel(nn.Module):
    cfg: MaeLmConfig

    def setup(self):
        cfg = self.cfg
        self.encoder = encoder_lib.Encoder(cfg.encoder)
        self.decoder_to_encoder = None
        if cfg.decoder.kind == "self":
            self.decoder = decoder_lib.Decoder(cfg.decoder)
        else:
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
        stack = cfg.encoder.stack
        self.lm_head = heads.LmHead(stack.d_model, cfg.encoder.vocab_size, stack.dtype,
                                    stack.layer_norm_eps)

    def __call__(self, batch: masking.MaskedBatch, deterministic: bool = True) -> jax.Array:
        """Returns logits [B, k, vocab] (float32) at batch.pred_index."""
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
        mask_id = self.cfg.encoder.special.mask
        mask_embedding = self.encoder.embed_token(mask_id)
        reset = batch.inputs == mask_id if self.cfg.decoder.reset_masks else None
        hidden = self.decoder(
            hidden, batch.enc_index, mask_embedding, shared_positions, deterministic, reset
        )  # [B, L, D_dec]
        predicted = masking.gather_tokens(hidden, batch.pred_index)  # [B, k, D]
        return self.lm_head(predicted, self.encoder.attend)

    def _cross_logits(self, batch, hidden, shared_positions, deterministic) -> jax.Array:
        """The cross kinds: removed [MASK]s predicted from the decoder, the other predicted
        tokens from the encoder's outputs. Logits [B, k, vocab] in batch.pred_index order."""
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
    """Where a cross decoder's model predicts each of the k tokens (all static shapes).

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
