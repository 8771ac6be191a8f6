"""MLM, the RoBERTa-style baseline: the encoder reads the whole corrupted sequence,
[MASK]s included, and the LM head sits on the encoder at the k predicted positions."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from maelm_jax import flops, masking
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import heads
from maelm_jax.objectives import base


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlmConfig:
    encoder: encoder_lib.EncoderConfig


class MlmModel(nn.Module):
    cfg: MlmConfig

    def setup(self):
        e = self.cfg.encoder
        self.encoder = encoder_lib.Encoder(e)
        self.lm_head = heads.LmHead(e.stack.d_model, e.vocab_size, e.stack.dtype)

    def __call__(self, batch: masking.MaskedBatch, deterministic: bool = True) -> jax.Array:
        """Logits [B, k, vocab] (float32) at batch.pred_index."""
        # One row for the whole batch: the relative bias is then computed once, [1, H, L, L].
        positions = jnp.arange(batch.inputs.shape[1], dtype=jnp.int32)[None]
        hidden = self.encoder(batch.inputs, positions, deterministic=deterministic)
        predicted = masking.gather_tokens(hidden, batch.pred_index)  # [B, k, D]
        return self.lm_head(predicted, self.encoder.attend)


class Mlm(base.Objective):
    name = "mlm"
    removes_masks = False

    def model_config(self, config, encoder) -> MlmConfig:
        return MlmConfig(encoder=encoder)

    def model(self, model_cfg: MlmConfig) -> nn.Module:
        return MlmModel(model_cfg)

    def step_flops(self, config: ml_collections.ConfigDict, counts: masking.MaskCounts,
                   vocab_size: int) -> int:
        m = config.model
        return flops.mlm_step_flops(config.train.batch_size, m.num_layers, counts.seq_len,
                                    m.d_model, m.d_ff, counts.k, vocab_size)

    def validate(self, config, require) -> None:
        require(not config.model.misaligned_positions, "model.misaligned_positions",
                "False for objective mlm (its encoder reads every position; nothing to "
                "misalign)", config.model.misaligned_positions)
