"""Pretraining objectives on one shared encoder: MAE-LM (and 3ML_self) and MLM.

* ``maelm``: the encoder reads only the tokens that are not removed [MASK]s, at their
    original positions; the decoder fills the full length with the [MASK] embedding and
    predicts the original tokens.
* ``mlm``: the RoBERTa-style baseline; the encoder reads the whole corrupted sequence and
    the LM head sits on the encoder.

Both run the LM head only at the k predicted positions.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from maelm_jax import masking, tokenizer
from maelm_jax.models import decoder as decoder_lib
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import heads

OBJECTIVES = ("maelm", "mlm")


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    objective: str
    encoder: encoder_lib.EncoderConfig
    decoder: Optional[decoder_lib.DecoderConfig]  # None for mlm


class PretrainModel(nn.Module):
    cfg: PretrainConfig

    def setup(self):
        cfg = self.cfg
        if cfg.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {cfg.objective!r}")
        self.encoder = encoder_lib.Encoder(cfg.encoder)
        self.decoder = decoder_lib.Decoder(cfg.decoder) if cfg.objective == "maelm" else None
        self.lm_head = heads.LmHead(
            cfg.encoder.stack.d_model, cfg.encoder.vocab_size, cfg.encoder.stack.dtype
        )

    def __call__(self, batch: masking.MaskedBatch, deterministic: bool = True) -> jax.Array:
        """Returns logits [B, k, vocab] (float32) at batch.pred_index."""
        if self.cfg.objective == "maelm":
            enc_tokens = masking.gather_tokens(batch.inputs, batch.enc_index)  # [B, n_enc]
            hidden = self.encoder(enc_tokens, batch.enc_index, deterministic=deterministic)
            mask_embedding = self.encoder.embed(jnp.int32(tokenizer.MASK_ID))
            shared_positions = (
                self.encoder.position_table()
                if self.cfg.decoder.share_positions
                else None
            )
            hidden = self.decoder(
                hidden, batch.enc_index, mask_embedding, shared_positions
            )  # [B, L, D_dec]
        else:
            B, L = batch.inputs.shape
            positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
            hidden = self.encoder(batch.inputs, positions, deterministic=deterministic)
        predicted = masking.gather_tokens(hidden, batch.pred_index)  # [B, k, D]
        return self.lm_head(predicted, self.encoder.attend)


def masked_lm_sums(
    logits: jax.Array, targets: jax.Array, weights: jax.Array
) -> dict[str, jax.Array]:
    """Sums over predicted tokens: cross-entropy, correct predictions, and the token count.

    Sums (not means) so that gradient accumulation and data parallelism divide once, by the
    number of predicted tokens in the global batch, as the paper's loss does.
    logits [B, k, V] float32; targets [B, k] int32; weights [B, k] float32.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {
        "loss_sum": jnp.sum(nll * weights),
        "correct_sum": jnp.sum(correct * weights),
        "count": jnp.sum(weights),
    }
