"""The shallow MAE-LM / 3ML_self decoder, dropped after pretraining.

It sees the full length L: encoder outputs scattered back to their original positions and
the [MASK] word embedding everywhere else, plus its own absolute positions 0..L-1 and its
own embedding LayerNorm. Bidirectional self-attention, no dropout (the MAE-LM paper found
dropout-free decoding slightly more stable).

By default the decoder has no relative position bias and its own position table, as in the
paper. Two options of the official code help a small decoder learn to read a masked
position's neighbours sooner (see the README's notes on the unigram plateau): a T5
relative position bias of the decoder's own (`rel_pos_buckets`, the official
`--decoder-rel-pos`) and the encoder's position table shared with the decoder
(`share_positions`, the official `--share-pos-emb`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from maelm_jax import masking
from maelm_jax.models import layers


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    stack: layers.StackConfig
    seq_len: int
    rel_pos_buckets: int = 0  # 0 = no relative position bias (the paper's decoder)
    rel_pos_max_distance: int = 128
    share_positions: bool = False  # use the encoder's absolute position table


class Decoder(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(
        self,
        enc_out: jax.Array,
        enc_index: jax.Array,
        mask_embedding: jax.Array,
        encoder_positions: Optional[jax.Array] = None,
    ) -> jax.Array:
        """enc_out [B, n_enc, D_enc] at positions enc_index [B, n_enc]; mask_embedding [D_enc].

        encoder_positions: the encoder's position table [>= L, D_dec], required when
        `share_positions` is set. Returns decoder states [B, L, D_dec].
        """
        cfg = self.cfg
        stack, L = cfg.stack, cfg.seq_len
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
        if cfg.share_positions:
            if encoder_positions is None:
                raise ValueError("share_positions needs the encoder's position table")
            position_table = encoder_positions[:L].astype(stack.dtype)
        else:
            position_table = nn.Embed(
                L,
                stack.d_model,
                dtype=stack.dtype,
                name="position_embeddings",
                embedding_init=layers.normal_init(("positions", "dec_embed")),
            )(jnp.arange(L))
        x = x + position_table[None]
        # Sown (a no-op unless the "intermediates" collection is mutable) for diagnostics.
        self.sow("intermediates", "input", x)
        x = layers.layer_norm("ln_embed", stack.dtype)(x)
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        bias = None
        if cfg.rel_pos_buckets:
            positions = jnp.arange(L, dtype=jnp.int32)[None]
            bias = layers.RelativePositionBias(
                cfg.rel_pos_buckets, cfg.rel_pos_max_distance, stack.num_heads,
                name="relative_bias",
            )(positions, positions)  # [1, heads, L, L], broadcast over the batch
        return layers.TransformerStack(stack, name="stack")(x, bias, None, True)
