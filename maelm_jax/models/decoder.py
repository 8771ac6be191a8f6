"""The shallow decoders, dropped after pretraining: MAE-LM / 3ML_self and 3ML_cross.

``Decoder`` (kind "self", MAE-LM and 3ML_self) sees the full length L: encoder outputs
scattered back to their original positions and the [MASK] word embedding everywhere else,
plus its own absolute positions 0..L-1 and its own embedding LayerNorm (then dropout, as
every layer's). Bidirectional self-attention; no dropout by default (the MAE-LM paper
found dropout-free decoding slightly more stable; 3ML uses 0.1 on the whole model).

``CrossDecoder`` (kind "cross", 3ML_cross, 3ML Section 3 and Fig. 2 right) sees only the
removed [MASK] positions: a learned [MASK] vector in the decoder's own space plus the
decoder's position embedding at each one's original position. Each layer is bidirectional
self-attention among them, cross-attention to the (projected) encoder outputs, and an MLP.
MAE-LM's Table 2 "decoder attention" ablations are the same decoder with causal
self-attention among the [MASK]s (kind "causal_cross", BART-like) or none ("cross_only").
The official MAE-LM code can also feed such a decoder the whole sequence; we keep the
[MASK]-only input for every cross kind, so that they differ from each other in the
attention alone and keep 3ML_cross's static, shorter decoder length.

Table 2's "enc. w. [MASK], dec. resets [MASK]" is `reset_masks`: with masking.delta > 0 the
self decoder puts the [MASK] embedding back at the [MASK]s the encoder read, instead of
the encoder's outputs there.

By default the decoder has no relative position bias and its own position table, as in the
paper. Two options of the official code help a small decoder learn to read a masked
position's neighbours sooner (see docs/plateau.md): a T5
relative position bias of the decoder's own (`rel_pos_buckets`, the official
`--decoder-rel-pos`) and the encoder's position table shared with the decoder
(`share_positions`, the official `--share-pos-emb`).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from maelm_jax.config import options
from maelm_jax.models import layers, relative_position
from maelm_jax.models import stack as stack_lib
from maelm_jax.models.dropout import Dropout
from maelm_jax.text import masking

KINDS = options.DECODER_KINDS
# The decoder's self-attention among the [MASK] queries, per cross kind.
CROSS_SELF_ATTENTION = {"cross": "bidirectional", "causal_cross": "causal", "cross_only": "none"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    stack: layers.StackConfig
    seq_len: int
    kind: str = "self"  # KINDS: "self" (MAE-LM, 3ML_self), "cross" (3ML_cross), ...
    rel_pos_buckets: int = 0  # 0 = no relative position bias (the paper's decoder)
    rel_pos_max_distance: int = 128
    rel_pos_init: str = "normal"  # relative_position.REL_POS_INITS
    rel_pos_bucket_fn: str = "t5"  # relative_position.BUCKET_FNS
    share_positions: bool = False  # use the encoder's absolute position table
    reset_masks: bool = False  # self kind: [MASK] embedding at the encoder's [MASK]s


class Decoder(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(
        self,
        enc_out: jax.Array,
        enc_index: jax.Array,
        mask_embedding: jax.Array,
        encoder_positions: jax.Array | None = None,
        deterministic: bool = True,
        reset: jax.Array | None = None,
    ) -> jax.Array:
        """enc_out [B, n_enc, D_enc] at positions enc_index [B, n_enc]; mask_embedding [D_enc].

        encoder_positions: the encoder's position table [>= L, D_dec], required when
        `share_positions` is set. reset [B, L] bool: positions whose input is the [MASK]
        embedding whatever the encoder gave (`reset_masks`). Returns [B, L, D_dec].
        """
        cfg = self.cfg
        stack, L = cfg.stack, cfg.seq_len
        B = enc_out.shape[0]
        proj = _projection(self, enc_out.shape[-1], stack)
        if proj is not None:
            # Being linear, projecting the encoder outputs and the [MASK] row separately
            # equals projecting the scattered buffer, at n_enc instead of L rows.
            enc_out, mask_embedding = proj(enc_out), proj(mask_embedding)
        buffer = jnp.broadcast_to(mask_embedding.astype(stack.dtype), (B, L, stack.d_model))
        x = masking.scatter_tokens(buffer, enc_index, enc_out.astype(stack.dtype))
        if reset is not None:
            x = jnp.where(reset[..., None], buffer, x)
        x = x + _position_table(self, cfg, encoder_positions)[None]
        # Sown (a no-op unless the "intermediates" collection is mutable) for diagnostics.
        self.sow("intermediates", "input", x)
        x = layers.layer_norm("ln_embed", stack.dtype, stack.layer_norm_eps)(x)
        # As after the encoder's embedding LayerNorm (and the fairseq encoder stack that the
        # official decoder reuses): 3ML's dropout covers the whole model; 0 for MAE-LM.
        x = Dropout(stack.dropout)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        bias = None
        if cfg.rel_pos_buckets:
            positions = jnp.arange(L, dtype=jnp.int32)[None]
            bias = relative_position.RelativePositionBias(
                cfg.rel_pos_buckets, cfg.rel_pos_max_distance, stack.num_heads, cfg.rel_pos_init,
                cfg.rel_pos_bucket_fn, dtype=stack.dtype, name="relative_bias",
            )(positions, positions)  # [1, heads, L, L], broadcast over the batch
        return stack_lib.TransformerStack(stack, name="stack")(x, bias, None, deterministic)


def _position_table(module: nn.Module, cfg: DecoderConfig,
                    encoder_positions: jax.Array | None) -> jax.Array:
    """The decoder's absolute position table [L, D_dec]: its own, or the encoder's."""
    stack, L = cfg.stack, cfg.seq_len
    if cfg.share_positions:
        if encoder_positions is None:
            raise ValueError("share_positions needs the encoder's position table")
        return encoder_positions[:L].astype(stack.dtype)
    # The whole table as it is (every position in order): no lookup, whose gradient would
    # be a scatter-add of L rows.
    return nn.Embed(
        L,
        stack.d_model,
        dtype=stack.dtype,
        name="position_embeddings",
        embedding_init=layers.normal_init(("positions", "dec_embed")),
        parent=module,
    ).embedding.astype(stack.dtype)


def _projection(module: nn.Module, d_enc: int, stack: layers.StackConfig) -> nn.Dense | None:
    """3ML's linear layer from the encoder width to the decoder's; None if they are equal."""
    if d_enc == stack.d_model:
        return None
    return nn.Dense(
        stack.d_model,
        dtype=stack.dtype,
        name="projection",
        kernel_init=layers.normal_init(("embed", "dec_embed")),
        bias_init=layers.zeros_init(("dec_embed",)),
        parent=module,
    )


class CrossDecoder(nn.Module):
    """3ML_cross and its kin: [MASK] queries attend to the encoder outputs (and, unless
    kind is "cross_only", to each other)."""

    cfg: DecoderConfig

    @nn.compact
    def __call__(
        self,
        enc_out: jax.Array,
        enc_index: jax.Array,
        dec_index: jax.Array,
        encoder_positions: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """enc_out [B, n_enc, D_enc] at original positions enc_index [B, n_enc]; the removed
        [MASK]s at original positions dec_index [B, n_de]. Returns [B, n_de, D_dec]."""
        cfg = self.cfg
        stack = cfg.stack
        proj = _projection(self, enc_out.shape[-1], stack)
        context = (proj(enc_out) if proj is not None else enc_out).astype(stack.dtype)
        # The paper's [MASK] "in a latent space", disentangled from the word embeddings.
        mask_vector = self.param(
            "mask_embedding", layers.normal_init(("dec_embed",)), (stack.d_model,), jnp.float32
        )
        table = _position_table(self, cfg, encoder_positions)
        x = mask_vector.astype(stack.dtype) + jnp.take(table, dec_index, axis=0)
        x = layers.layer_norm("ln_embed", stack.dtype, stack.layer_norm_eps)(x)
        x = Dropout(stack.dropout)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        self_bias = cross_bias = None
        if cfg.rel_pos_buckets:
            relative = relative_position.RelativePositionBias(
                cfg.rel_pos_buckets, cfg.rel_pos_max_distance, stack.num_heads, cfg.rel_pos_init,
                cfg.rel_pos_bucket_fn, num_positions=cfg.seq_len, dtype=stack.dtype,
                as_grid=stack.attention_impl == "pallas", name="relative_bias",
            )
            self_bias, cross_bias = relative(dec_index, dec_index), relative(dec_index, enc_index)
        # Cross-attention decoders are shallow (3ML: 2 layers) and are not scanned; they
        # rematerialise like the stacks do.
        layer_cls = stack_lib.remat_layer(stack_lib.CrossTransformerLayer, stack.remat_policy,
                                       scanned=False, deterministic_argnum=5)
        for i in range(stack.num_layers):
            x = layer_cls(stack, CROSS_SELF_ATTENTION[cfg.kind], name=f"layer_{i}")(
                x, context, self_bias, cross_bias, deterministic)
        if stack.pre_ln:
            x = layers.layer_norm("ln_final", stack.dtype, stack.layer_norm_eps)(x)
        return x
