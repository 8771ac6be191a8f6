"""The shallow MAE-LM / 3ML_self decoder, dropped after pretraining.

It sees the full length L: encoder outputs scattered back to their original positions and
the [MASK] word embedding everywhere else, plus its own absolute positions 0..L-1 and its
own embedding LayerNorm. Bidirectional self-attention, no relative bias, no dropout (the
MAE-LM paper found dropout-free decoding slightly more stable).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import flax.linen as nn

from maelm_jax import masking
from maelm_jax.models import layers


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    stack: layers.StackConfig
    seq_len: int


class Decoder(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(
        self, enc_out: jax.Array, enc_index: jax.Array, mask_embedding: jax.Array
    ) -> jax.Array:
        """enc_out [B, n_enc, D_enc] at positions enc_index [B, n_enc]; mask_embedding [D_enc].

        Returns decoder states [B, L, D_dec].
        """
        stack, L = self.cfg.stack, self.cfg.seq_len
        B = enc_out.shape[0]
        if enc_out.shape[-1] != stack.d_model:
            # 3ML: a linear projection bridges the widths. Being linear, projecting the encoder
            # outputs and the [MASK] row separately equals projecting the scattered buffer, at
            # n_enc instead of L rows.
            proj = nn.Dense(
                stack.d_model,
                dtype=stack.dtype,
                name="projection",
                kernel_init=layers.normal_init(("embed", "dec_embed")),
                bias_init=layers.zeros_init(("dec_embed",)),
            )
            enc_out, mask_embedding = proj(enc_out), proj(mask_embedding)
        buffer = jnp.broadcast_to(mask_embedding.astype(stack.dtype), (B, L, stack.d_model))
        x = masking.scatter_tokens(buffer, enc_index, enc_out.astype(stack.dtype))
        positions = nn.Embed(
            L,
            stack.d_model,
            dtype=stack.dtype,
            name="position_embeddings",
            embedding_init=layers.normal_init(("positions", "dec_embed")),
        )
        x = x + positions(jnp.arange(L))[None]
        x = layers.layer_norm("ln_embed", stack.dtype)(x)
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        return layers.TransformerStack(stack, name="stack")(x, None, None, True)
