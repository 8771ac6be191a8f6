"""Transformer building blocks shared by the encoder and the decoder.

Every parameter carries Flax logical axis names (``embed``, ``heads``, ``kv``, ``mlp``,
``vocab``, ...); one rules table maps them to mesh axes. Parameters are float32; the
compute dtype is a module field (bfloat16 on accelerators). Attention logits and
softmax are always float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maelm_jax.models import flash_attention
from maelm_jax.models.dropout import Dropout

Dtype = Any

# Both papers (and BERT/RoBERTa) initialise dense and embedding weights N(0, 0.02).
INIT_STD = 0.02
# The collection the stacks sow their layers' outputs into (the encoder also sows its
# embedding output): model.apply(..., mutable=[HIDDEN_STATES]) returns them.
HIDDEN_STATES = "hidden_states"


def normal_init(axes: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.normal(INIT_STD), axes)


def zeros_init(axes: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def ones_init(axes: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackConfig:
    """Architecture of one Transformer stack (encoder or decoder)."""

    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int
    dropout: float = 0.0
    attention_dropout: float = 0.0
    pre_ln: bool = False  # post-LN (BERT/RoBERTa, MAE-LM) unless set
    dtype: Dtype = jnp.float32  # compute dtype
    activation_dropout: float = 0.0  # on the MLP's hidden units; 0 in fairseq RoBERTa/MAE-LM
    attention_impl: str = "einsum"  # one of ATTENTION_IMPLS, resolved (never "auto")
    scan_layers: bool = False  # nn.scan over the layers (TransformerStack; see below)
    remat_policy: str = "none"  # one of REMAT_POLICIES

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


def lookup(embed: nn.Embed, ids: jax.Array, table_axes: tuple) -> jax.Array:
    """Embedding lookup from a table gathered along its FSDP-sharded width first.

    A gather from a table sharded along the embedding width makes XLA replicate the
    batch-sharded gradient in the backward pass; gathering the table just in time (what
    FSDP does for every weight) keeps the lookup and its gradient local.
    """
    table = nn.with_logical_constraint(embed.embedding, table_axes)
    return jnp.take(table, ids, axis=0).astype(embed.dtype)


@jax.custom_vjp
def add_per_batch(x: jax.Array, shared: jax.Array) -> jax.Array:
    """x [B, ...] + shared [1, ...] (or [B, ...]): an addend computed once for the batch.

    The same as `x + shared`, but the gradient of `shared` is summed over the batch by a dot
    with a vector of ones. XLA's CPU backend turns the plain broadcast's transpose into a
    reduce over the leading axis, which it runs 20-60x slower than this dot for arrays like
    the relative attention bias ([32, 4, 128, 128]: 21 ms against 0.4 ms on 2 cores, 4 % of
    an MLM train step); on TPU and GPU the dot costs as little as the reduce.
    """
    return x + shared


def _add_per_batch_fwd(x, shared):
    return x + shared, shared.shape[0]


def _add_per_batch_bwd(shared_rows, g):
    if shared_rows == g.shape[0]:
        return g, g
    ones = jnp.ones((g.shape[0],), g.dtype)
    total = jnp.tensordot(ones, g, axes=1, preferred_element_type=jnp.float32)
    return g, total[None].astype(g.dtype)


add_per_batch.defvjp(_add_per_batch_fwd, _add_per_batch_bwd)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits [..., V], targets [...] int -> [...] float32: -log softmax(logits)[target].

    The target's logit is picked by comparison with an iota rather than by
    take_along_axis, whose gradient materialises a zero [..., V] array and scatters into
    it (a quarter of the loss's backward pass at [32, 19, 8000] on CPU); this one's
    gradient is the softmax minus a one-hot, fused.
    """
    logits = logits.astype(jnp.float32)
    is_target = jnp.arange(logits.shape[-1]) == targets[..., None].astype(jnp.int32)
    target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - target_logit


def gelu(x: jax.Array) -> jax.Array:
    """The exact GELU, x * Phi(x), written as fairseq and PyTorch write it:
    0.5 x (1 + erf(x / sqrt 2)).

    `jax.nn.gelu(approximate=False)` computes the same function through erfc, which XLA
    expands into two rational approximations and an exponential; with erf the forward and
    backward pass cost half as much on CPU ([32, 128, 1024]: 32 against 61 ms, 2 cores),
    and the values agree to float32 round-off (1e-6). erf's lower relative precision for
    x < -4, where the output is below 1e-4, does not matter for an activation.
    """
    return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(0.5 ** 0.5, x.dtype)))


def layer_norm(name: str, dtype: Dtype) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=1e-5,
        dtype=dtype,
        name=name,
        scale_init=ones_init(("embed",)),
        bias_init=zeros_init(("embed",)),
    )


# Compute dtypes (parameters, optimiser state, softmax, LayerNorm statistics and the loss
# stay float32). "auto": bfloat16 on GPUs and TPUs, whose matrix units run it several
# times faster than float32, and float32 on CPUs, where bfloat16 is emulated and slower.
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(name: Any, backend: str | None = None) -> jnp.dtype:
    """DTYPES' name (or a dtype) as a dtype; "auto" for this backend
    (jax.default_backend() unless given)."""
    if isinstance(name, str) and name == "auto":
        backend = backend or jax.default_backend()
        return jnp.dtype(jnp.bfloat16 if backend in ("gpu", "tpu") else jnp.float32)
    return jnp.dtype(name)


# How attention is computed. "einsum": our own two einsums and a float32 softmax, the
# reference. "xla" / "cudnn": jax.nn.dot_product_attention with that implementation (cuDNN's
# fused kernel needs a GPU and bfloat16 or float16); with attention dropout in training
# they fall back to the einsum path, which materialises the probabilities. "pallas": our
# flash-attention kernel (models/flash_attention.py) with the bias, the key mask and
# dropout inside, bits drawn from the layer's "dropout" stream as every other dropout (a
# GPU kernel; Pallas' interpreter on a CPU, for tests). "auto": "cudnn" on GPUs at half
# precision, "einsum" elsewhere (on CPU and TPU XLA compiles both alike). The attention
# diagnostics, which read the probabilities, always take the einsum path.
ATTENTION_IMPLS = ("auto", "einsum", "xla", "cudnn", "pallas")


def resolve_attention_impl(name: str, dtype: Dtype, backend: str | None = None) -> str:
    """ATTENTION_IMPLS' "auto" for this backend (jax.default_backend() unless given)."""
    if name != "auto":
        return name
    backend = backend or jax.default_backend()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if backend == "gpu" and half else "einsum"


class MultiHeadAttention(nn.Module):
    """Multi-head attention with an additive bias and a boolean key mask."""

    cfg: StackConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        context: jax.Array,
        bias: jax.Array | None,
        key_mask: jax.Array | None,
        deterministic: bool,
    ) -> jax.Array:
        """x [B, n, D] attends to context [B, m, D].

        bias: [B, heads, n, m] or None. key_mask (True = attend) or None: [B, m] for a
        mask per key, or [B or 1, n, m] for one per query and key (a causal mask).
        Returns [B, n, D].
        """
        cfg = self.cfg

        H, Dh = cfg.num_heads, cfg.head_dim

        def project(name: str, inputs: jax.Array) -> jax.Array:
            """[B, n, D] -> [B, n, heads, head_dim]."""
            w = self.param(f"{name}_kernel", normal_init(("embed", "heads", "kv")),
                           (inputs.shape[-1], H, Dh), jnp.float32)
            b = self.param(f"{name}_bias", zeros_init(("heads", "kv")), (H, Dh), jnp.float32)
            return jnp.einsum("bnd,dhk->bnhk", inputs.astype(cfg.dtype), w.astype(cfg.dtype)) \
                + b.astype(cfg.dtype)

        q = project("query", x)
        k = project("key", context)
        v = project("value", context)
        q = nn.with_logical_constraint(q, ("batch", "length", "act_heads", "kv"))
        diagnostics = self.is_mutable_collection("intermediates")
        if cfg.attention_impl == "pallas" and not diagnostics:
            out = self._flash_attention(q, k, v, bias, key_mask, deterministic)
            return jnp.einsum("bqhd,hde->bqe", out, self._out_kernel()) + self._out_bias()
        if key_mask is not None:  # [B or 1, 1 (heads), n or 1, m]
            key_mask = key_mask[:, None, None, :] if key_mask.ndim == 2 else key_mask[:, None]
        fused = (cfg.attention_impl in ("xla", "cudnn")
                 and (deterministic or cfg.attention_dropout == 0.0) and not diagnostics)
        if fused:
            out = jax.nn.dot_product_attention(
                q, k, v, bias=None if bias is None else bias.astype(q.dtype), mask=key_mask,
                scale=1.0 / float(Dh) ** 0.5, implementation=cfg.attention_impl)
        else:
            dropout = Dropout(cfg.attention_dropout, deterministic=deterministic)
            out = self._einsum_attention(q, k, v, bias, key_mask, dropout)
        return jnp.einsum("bqhd,hde->bqe", out, self._out_kernel()) + self._out_bias()

    def _out_kernel(self) -> jax.Array:
        """The output projection [heads, head_dim, D] in the compute dtype."""
        cfg = self.cfg
        return self.param("out_kernel", normal_init(("heads", "kv", "embed")),
                          (cfg.num_heads, cfg.head_dim, cfg.d_model), jnp.float32
                          ).astype(cfg.dtype)

    def _out_bias(self) -> jax.Array:
        return self.param("out_bias", zeros_init(("embed",)), (self.cfg.d_model,),
                          jnp.float32).astype(self.cfg.dtype)

    def _flash_attention(self, q, k, v, bias, key_mask, deterministic: bool) -> jax.Array:
        """The Pallas kernel: dropout inside, its seed from the "dropout" stream.

        A per-key mask [B, m] goes in as it is; a per-query one ([B or 1, n, m], causal)
        is folded into the bias.
        """
        cfg = self.cfg
        rate = 0.0 if deterministic else cfg.attention_dropout
        seed = (jax.random.bits(self.make_rng("dropout"), (2,), jnp.uint32) if rate
                else jnp.zeros((2,), jnp.uint32))
        key_valid = None
        if key_mask is not None and key_mask.ndim == 2:
            key_valid = jnp.broadcast_to(key_mask, (q.shape[0], k.shape[1]))
        elif key_mask is not None:
            blocked = jnp.where(key_mask[:, None], 0.0, flash_attention.MASKED)
            blocked = jnp.broadcast_to(blocked, blocked.shape[:1] + (cfg.num_heads,)
                                       + blocked.shape[2:])
            bias = blocked if bias is None else bias.astype(jnp.float32) + blocked
        return flash_attention.attention(
            q, k, v, None if bias is None else bias.astype(q.dtype), key_valid, seed,
            scale=1.0 / float(cfg.head_dim) ** 0.5, dropout_rate=rate)

    def _einsum_attention(self, q, k, v, bias, key_mask, dropout: Dropout) -> jax.Array:
        """q [B, n, H, Dh], k and v [B, m, H, Dh] -> [B, n, H, Dh]; float32 logits and softmax."""
        cfg = self.cfg
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        logits = logits / jnp.sqrt(cfg.head_dim)
        if bias is not None:
            logits = add_per_batch(logits, bias.astype(logits.dtype))
        if key_mask is not None:
            logits = jnp.where(key_mask, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1)
        # Sown (a no-op unless "intermediates" is mutable) for the attention diagnostics.
        self.sow("intermediates", "probs", probs)
        return jnp.einsum("bhqk,bkhd->bqhd", dropout(probs).astype(cfg.dtype), v)


class FeedForward(nn.Module):
    """Position-wise MLP: dense -> GELU -> dropout -> dense."""

    cfg: StackConfig

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        cfg = self.cfg
        h = nn.Dense(
            cfg.d_ff,
            dtype=cfg.dtype,
            name="wi",
            kernel_init=normal_init(("embed", "mlp")),
            bias_init=zeros_init(("mlp",)),
        )(x)
        h = gelu(h)  # fairseq/BERT use the exact (erf) GELU, not the tanh approximation
        h = nn.with_logical_constraint(h, ("batch", "length", "act_mlp"))
        h = Dropout(cfg.activation_dropout)(h, deterministic=deterministic)
        return nn.Dense(
            cfg.d_model,
            dtype=cfg.dtype,
            name="wo",
            kernel_init=normal_init(("mlp", "embed")),
            bias_init=zeros_init(("embed",)),
        )(h)


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
        ln_attn, ln_mlp = layer_norm("ln_attention", cfg.dtype), layer_norm("ln_mlp", cfg.dtype)
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
        ln_cross = layer_norm("ln_cross_attention", cfg.dtype)
        ln_mlp = layer_norm("ln_mlp", cfg.dtype)
        if self.self_attention != "none":
            n = x.shape[1]
            # Queries are sorted by position, so "earlier" is the lower triangle.
            causal = jnp.tril(jnp.ones((1, n, n), bool)) if self.self_attention == "causal" \
                else None
            self_attn = MultiHeadAttention(cfg, name="self_attention")
            ln_self = layer_norm("ln_self_attention", cfg.dtype)
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


# What a layer keeps for the backward pass (jax.checkpoint policies); the rest is
# recomputed. "none": no rematerialisation, everything is kept. "full": only the layer's
# input, the whole layer is recomputed (least memory, about one more forward). "dots":
# the matmul outputs (recomputes the cheap element-wise work: LayerNorm, GELU, softmax,
# dropout). "dots_no_batch": only the matmuls against weights (recomputes attention's
# score and weighted-sum matmuls too), MaxText's usual choice for large models.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


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
                x = layer_norm("ln_final", cfg.dtype)(x)
            if collect:
                for i in range(cfg.num_layers - 1):
                    self.sow(HIDDEN_STATES, "layers", outputs[i])
                self.sow(HIDDEN_STATES, "layers", x)
            return x
        layer_cls = remat_layer(TransformerLayer, cfg.remat_policy, scanned=False)
        for i in range(cfg.num_layers):
            x = layer_cls(cfg, name=f"layer_{i}")(x, bias, key_mask, deterministic)
            if cfg.pre_ln and i == cfg.num_layers - 1:
                x = layer_norm("ln_final", cfg.dtype)(x)
            self.sow(HIDDEN_STATES, "layers", x)
        return x
