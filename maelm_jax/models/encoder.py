"""The encoder: the only network kept for fine-tuning.

Input: token ids plus each token's *original* position ("aligned" positions). MAE-LM
feeds only the kept tokens, so positions skip the removed [MASK] slots; MLM and
fine-tuning feed the whole sequence with positions 0..L-1. Learned absolute position
embeddings plus an embedding LayerNorm, and a T5 relative position bias computed from the
same original positions and shared by all layers (as in the official MAE-LM code).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from maelm_jax.models import layers
from maelm_jax.models import relative_position


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    stack: layers.StackConfig
    vocab_size: int
    max_positions: int
    rel_pos_buckets: int = 32  # 0 disables the relative position bias
    rel_pos_max_distance: int = 128
    rel_pos_init: str = "normal"  # relative_position.REL_POS_INITS; only matters before training
    rel_pos_bucket_fn: str = "t5"  # relative_position.BUCKET_FNS


class Encoder(nn.Module):
    """Token + aligned position embeddings -> LayerNorm -> Transformer stack."""

    cfg: EncoderConfig

    def setup(self):
        cfg, stack = self.cfg, self.cfg.stack
        self.word_embeddings = nn.Embed(
            cfg.vocab_size,
            stack.d_model,
            dtype=stack.dtype,
            embedding_init=layers.normal_init(("vocab", "embed")),
        )
        self.position_embeddings = nn.Embed(
            cfg.max_positions,
            stack.d_model,
            dtype=stack.dtype,
            embedding_init=layers.normal_init(("positions", "embed")),
        )
        self.ln_embed = layers.layer_norm("ln_embed", stack.dtype)
        self.dropout = nn.Dropout(stack.dropout)
        self.relative_bias = (
            relative_position.RelativePositionBias(
                cfg.rel_pos_buckets, cfg.rel_pos_max_distance, stack.num_heads,
                cfg.rel_pos_init, cfg.rel_pos_bucket_fn,
            )
            if cfg.rel_pos_buckets
            else None
        )
        self.stack = layers.TransformerStack(stack)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        key_mask: Optional[jax.Array] = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """tokens [B, n] int32; positions [B, n] int32, or [1, n] when every row has the same
        (then the relative bias is computed once for the batch); key_mask [B, n] bool
        (True = real token) or None.

        Returns hidden states [B, n, d_model].
        """
        x = self.embed(tokens) + layers.lookup(self.position_embeddings, positions,
                                               ("positions", None))
        x = self.ln_embed(x)
        self.sow(layers.HIDDEN_STATES, "embedding", x)  # "layer 0" of the rank analysis
        x = self.dropout(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        bias = self.relative_bias(positions, positions) if self.relative_bias else None
        return self.stack(x, bias, key_mask, deterministic)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Word embeddings only (the decoder's [MASK] row comes from this shared table)."""
        return layers.lookup(self.word_embeddings, tokens, ("vocab", None))

    def position_table(self) -> jax.Array:
        """The absolute position embeddings [max_positions, d_model] (shared with the decoder
        when model.decoder.share_positions is set)."""
        return self.position_embeddings.embedding

    def attend(self, x: jax.Array) -> jax.Array:
        """[..., d_model] -> [..., vocab] logits against the tied word embeddings (float32)."""
        table = self.word_embeddings.embedding
        return jnp.einsum("...d,vd->...v", x.astype(jnp.float32), table.astype(jnp.float32))
