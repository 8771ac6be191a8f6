"""The MLM pretraining model (RoBERTa's baseline): the encoder reads the whole corrupted
sequence, [MASK]s included, and the LM head sits on the encoder at the k predicted
positions (maelm_jax/pretrain/objectives/mlm.py is the objective that builds it from a config)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import heads
from maelm_jax.text import masking


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlmConfig:
    encoder: encoder_lib.EncoderConfig


class MlmModel(nn.Module):
    cfg: MlmConfig

    def setup(self):
        e = self.cfg.encoder
        self.encoder = encoder_lib.Encoder(e)
        self.lm_head = heads.LmHead(e.stack.d_model, e.vocab_size, e.stack.dtype,
                                    e.stack.layer_norm_eps)

    def __call__(self, batch: masking.MaskedBatch, deterministic: bool = True) -> jax.Array:
        """Logits [B, k, vocab] (float32) at batch.pred_index."""
        # One row for the whole batch: the relative bias is then computed once, [1, H, L, L].
        positions = jnp.arange(batch.inputs.shape[1], dtype=jnp.int32)[None]
        hidden = self.encoder(batch.inputs, positions, deterministic=deterministic)
        predicted = masking.gather_tokens(hidden, batch.pred_index)  # [B, k, D]
        return self.lm_head(predicted, self.encoder.attend)
