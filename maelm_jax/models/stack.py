"""Transformer stacks: the encoder's and self decoder's layer (post-LN or pre-LN), the cross
decoders' layer, rematerialisation policies, and the stack of layers (per layer or under
nn.scan). The blocks they are built of are in layers.py.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maelm_jax.config import options
from maelm_jax.models import flash_attention
from maelm_jax.models.dropout import Dropout
from maelm_jax.models.layers import (
    HIDDEN_STATES,
    FeedForward,
    MultiHeadAttention,
    StackConfig,
    layer_norm,
)


class TransformerLayer(nn.Module):
    """Bidirectional self-attention + MLP, post-LN (default) or pre-LN."""

    cfg: StackConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        bias: jax.Array | None,
        key_mask: jax.Array | None,
        deterministic: bool,
    ) -> jax.Array:
        """x [B, n, D] -> [B, n, D]."""
        cfg = self.cfg
        drop = Dropout(cfg.dropout)
        attn = MultiHeadAttention(cfg, name="attention")
        mlp = FeedForward(cfg, name="mlp")
        ln_attn = layer_norm("ln_attention", cfg.dtype, cfg.layer_norm_eps)
        ln_mlp = layer_norm("ln_mlp", cfg.dtype, cfg.layer_norm_eps)
        if cfg.pre_ln:
            h = ln_attn(x)
            x = x + drop(attn(h, h, bias, key_mask, deterministic), deterministic=deterministic)
            x = x + drop(mlp(ln_mlp(x), deterministic), deterministic=deterministic)
        else:
            x = ln_attn(
                x + drop(attn(x, x, bias, key_mask, deterministic), deterministic=deterministic)
            )
            x = ln_mlp(x + drop(mlp(x, deterministic), deterministic=deterministic))
        return nn.with_logical_constraint(x, ("batch", "length", "act_embed"))


SELF_ATTENTION_KINDS = ("bidirectional", "causal", "none")


class CrossTransformerLayer(nn.Module):
    """Self-attention among the queries, cross-attention to a context, MLP.

    `self_attention` is "bidirectional" (3ML_cross and MAE-LM's "bi. self-attention +
    cross-attention"), "causal" (each query sees the queries up to itself: the BART-like
    "uni. self-attention + cross-attention") or "none" (MAE-LM's "cross-attention" only
    decoder). Post-LN or pre-LN as the stack's config says.
    """

    cfg: StackConfig
    self_attention: str = "bidirectional"

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        context: jax.Array,
        self_bias: jax.Array | None,
        cross_bias: jax.Array | None,
        deterministic: bool,
    ) -> jax.Array:
        """x [B, n, D] (queries, in ascending position order), context [B, m, D] -> [B, n, D].

        self_bias [B or 1, heads, n, n] and cross_bias [B or 1, heads, n, m], or None.
        """
        cfg = self.cfg
        if self.self_attention not in SELF_ATTENTION_KINDS:
            raise ValueError(f"self_attention must be one of {SELF_ATTENTION_KINDS}, "
                             f"got {self.self_attention!r}")
        def drop(y):
            return Dropout(cfg.dropout)(y, deterministic=deterministic)
        cross_attn = MultiHeadAttention(cfg, name="cross_attention")
        mlp = FeedForward(cfg, name="mlp")
        ln_cross = layer_norm("ln_cross_attention", cfg.dtype, cfg.layer_norm_eps)
        ln_mlp = layer_norm("ln_mlp", cfg.dtype, cfg.layer_norm_eps)
        if self.self_attention != "none":
            n = x.shape[1]
            # Queries are sorted by position, so "earlier" is the lower triangle.
            causal = jnp.tril(jnp.ones((1, n, n), bool)) if self.self_attention == "causal" \
                else None
            self_attn = MultiHeadAttention(cfg, name="self_attention")
            ln_self = layer_norm("ln_self_attention", cfg.dtype, cfg.layer_norm_eps)
            if cfg.pre_ln:
                h = ln_self(x)
                x = x + drop(self_attn(h, h, self_bias, causal, deterministic))
            else:
                x = ln_self(x + drop(self_attn(x, x, self_bias, causal, deterministic)))
        if cfg.pre_ln:
            x = x + drop(cross_attn(ln_cross(x), context, cross_bias, None, deterministic))
            x = x + drop(mlp(ln_mlp(x), deterministic))
        else:
            x = ln_cross(x + drop(cross_attn(x, context, cross_bias, None, deterministic)))
            x = ln_mlp(x + drop(mlp(x, deterministic)))
        return nn.with_logical_constraint(x, ("batch", "length", "act_embed"))


# Each of options.REMAT_POLICIES (what each keeps: config/options.py) as its jax.checkpoint
# policy; "auto" is resolved by models/builder.py before a stack is built.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(flash_attention.RESIDUALS_NAME)),
}
assert tuple(REMAT_POLICIES) == tuple(p for p in options.REMAT_POLICIES if p != "auto")


def remat_layer(layer_cls: type, policy: str, scanned: bool, deterministic_argnum: int = 4
                ) -> type:
    """`layer_cls` rematerialised per `policy` (REMAT_POLICIES), or as it is for "none".

    Its __call__'s argument `deterministic` (position `deterministic_argnum`, self being 0)
    is static. Inside nn.scan the
    rematerialised graph cannot be merged with the forward's (XLA's CSE), so prevent_cse
    is off there as jax.checkpoint advises.
    """
    if policy == "none":
        return layer_cls
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat policy {policy!r}: resolve 'auto' first (builder.encoder)")
    return nn.remat(layer_cls, policy=REMAT_POLICIES[policy], prevent_cse=not scanned,
                    static_argnums=(deterministic_argnum,))


class _ScannedLayer(nn.Module):
    """One TransformerLayer as an nn.scan body: (x, bias, key_mask) -> (x, x or None)."""

    cfg: StackConfig
    deterministic: bool
    collect: bool  # also return each layer's output (for the hidden-state analysis)

    @nn.compact
    def __call__(self, x, bias, key_mask):
        layer_cls = remat_layer(TransformerLayer, self.cfg.remat_policy, scanned=True)
        x = layer_cls(self.cfg, name="layer")(x, bias, key_mask, self.deterministic)
        return x, (x if self.collect else None)


class TransformerStack(nn.Module):
    """`num_layers` Transformer layers; pre-LN stacks end with a final LayerNorm.

    With cfg.scan_layers the layers run under nn.scan: one layer is traced and compiled
    whatever the depth, and its parameters are stacked on a leading "layers" axis
    (models/layer_layout.py converts between the two layouts).
    """

    cfg: StackConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        bias: jax.Array | None,
        key_mask: jax.Array | None,
        deterministic: bool,
    ) -> jax.Array:
        cfg = self.cfg
        # Each layer's output is sown for the effective-rank analysis (a no-op unless the
        # collection is mutable). Pre-LN: the residual stream the next layer reads, and for
        # the last layer the stack's output after ln_final.
        if cfg.scan_layers:
            collect = self.is_mutable_collection(HIDDEN_STATES)
            scan = nn.scan(
                _ScannedLayer,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, outputs = scan(cfg, deterministic, collect, name="scan")(x, bias, key_mask)
            if cfg.pre_ln:
                x = layer_norm("ln_final", cfg.dtype, cfg.layer_norm_eps)(x)
            if collect:
                for i in range(cfg.num_layers - 1):
                    self.sow(HIDDEN_STATES, "layers", outputs[i])
                self.sow(HIDDEN_STATES, "layers", x)
            return x
        layer_cls = remat_layer(TransformerLayer, cfg.remat_policy, scanned=False)
        for i in range(cfg.num_layers):
            x = layer_cls(cfg, name=f"layer_{i}")(x, bias, key_mask, deterministic)
            if cfg.pre_ln and i == cfg.num_layers - 1:
                x = layer_norm("ln_final", cfg.dtype, cfg.layer_norm_eps)(x)
            self.sow(HIDDEN_STATES, "layers", x)
        return x
