"""Transformer building blocks shared by the encoder and the decoder.

Every parameter carries Flax logical axis names (``embed``, ``heads``, ``kv``, ``mlp``,
``vocab``, ...); one rules table maps them to mesh axes. Parameters are float32; the
compute dtype is a module field (bfloat16 on accelerators). Attention logits and
softmax are always float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maelm_jax.config import options, schema
from maelm_jax.models import by_position, flash_attention
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
    # The Pallas kernel's tiles and variants (attention_impl "pallas" only).
    pallas: flash_attention.KernelOptions = flash_attention.KernelOptions()
    scan_layers: bool = False  # nn.scan over the layers (TransformerStack; see below)
    remat_policy: str = "none"  # one of REMAT_POLICIES
    # Added to the variance in every LayerNorm: fairseq RoBERTa's and MAE-LM's 1e-5;
    # an imported BERT keeps its 1e-12 (the outputs differ visibly for small activations).
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


def lookup(embed: nn.Embed, ids: jax.Array, table_axes: tuple,
           distinct: bool = False) -> jax.Array:
    """Embedding lookup from a table gathered along its FSDP-sharded width first.

    A gather from a table sharded along the embedding width makes XLA replicate the
    batch-sharded gradient in the backward pass; gathering the table just in time (what
    FSDP does for every weight) keeps the lookup and its gradient local. distinct: each
    row's ids are distinct (per-example positions), and the gradient is gathered and
    summed rather than scattered (by_position.take_rows).
    """
    table = nn.with_logical_constraint(embed.embedding, table_axes)
    if distinct and ids.shape[0] > 1:
        return by_position.take_rows(table, ids, jnp.dtype(embed.dtype).name)
    return jnp.take(table, ids, axis=0).astype(embed.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def logits_in(x: jax.Array, table: jax.Array, dtype: str) -> jax.Array:
    """x [..., D] against table [V, D] -> float32 logits [..., V], with all three dots (this
    one and the two of its gradient) on `dtype` operands accumulating in float32: the
    logits' cotangent enters the backward dots in `dtype` too, which the plain dot's
    transpose would do in float32."""
    return jnp.einsum("...d,vd->...v", x.astype(dtype), table.astype(dtype),
                      preferred_element_type=jnp.float32)


def _logits_in_forward(x, table, dtype):
    return logits_in(x, table, dtype), (x, table)


def _logits_in_backward(dtype, residuals, cotangent):
    x, table = residuals
    g = cotangent.astype(dtype)
    dx = jnp.einsum("...v,vd->...d", g, table.astype(dtype), preferred_element_type=jnp.float32)
    dtable = jnp.einsum("...v,...d->vd", g, x.astype(dtype), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dtable.astype(table.dtype)


logits_in.defvjp(_logits_in_forward, _logits_in_backward)


@jax.custom_vjp
def add_per_batch(x: jax.Array, shared: jax.Array) -> jax.Array:
    """x [B, ...] + shared [1, ...] (or [B, ...]): an addend computed once for the batch.

    The same as `x + shared`, but the gradient of `shared` is summed over the batch by a dot
    with a vector of ones. XLA's CPU backend turns the plain broadcast's transpose into a
    reduce over the leading axis, which it runs many times slower than this dot for arrays
    like the relative attention bias ([B, heads, n, m]); on TPU and GPU the dot costs as
    little as the reduce.
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
    it (a large share of the loss's backward pass on CPU); this one's gradient is the
    softmax minus a one-hot, fused.
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
    backward pass cost less on CPU, and the values agree to float32 round-off (1e-6).
    erf's lower relative precision for x < -4, where the output is below 1e-4, does not
    matter for an activation.
    """
    return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(0.5 ** 0.5, x.dtype)))


def layer_norm(name: str, dtype: Dtype, epsilon: float) -> nn.LayerNorm:
    """A LayerNorm whose statistics are float32 whatever `dtype` (flax computes them so);
    `epsilon` is the architecture's (StackConfig.layer_norm_eps)."""
    return nn.LayerNorm(
        epsilon=epsilon,
        dtype=dtype,
        name=name,
        scale_init=ones_init(("embed",)),
        bias_init=zeros_init(("embed",)),
    )


DTYPES = options.DTYPES  # the compute dtypes, declared in config/options.py


def resolve_dtype(name: Any, backend: str | None = None) -> jnp.dtype:
    """DTYPES' name (or a dtype) as a dtype; "auto" for this backend
    (jax.default_backend() unless given)."""
    if isinstance(name, str) and name == "auto":
        backend = backend or jax.default_backend()
        return jnp.dtype(jnp.bfloat16 if backend in ("gpu", "tpu") else jnp.float32)
    return jnp.dtype(name)


ATTENTION_IMPLS = options.ATTENTION_IMPLS  # what each means: config/options.py


def resolve_attention_impl(name: str, dtype: Dtype, backend: str | None = None, *,
                           attention_dropout: float = 0.0,
                           head_dims: tuple[int, ...] = ()) -> str:
    """ATTENTION_IMPLS' "auto" for this backend (jax.default_backend() unless given), a
    model whose stacks have heads of `head_dims` and the largest attention dropout
    `attention_dropout`. At half precision with attention dropout, where the kernels tile
    every stack's heads: the Pallas kernels on GPUs (Triton) and TPUs (Mosaic), which keep
    dropout inside; without dropout cuDNN's fused call on GPUs, the einsum path on TPUs
    (XLA fuses it well enough there, and the kernels' bias reads gain nothing); the einsum
    path elsewhere, and where the kernels cannot tile."""
    if name != "auto":
        return name
    backend = backend or jax.default_backend()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if backend not in ("gpu", "tpu") or not half:
        return "einsum"
    if attention_dropout > 0 and head_dims and all(map(schema.pallas_heads, head_dims)):
        return "pallas"
    return "cudnn" if backend == "gpu" else "einsum"


def length_multiple(cfg: StackConfig) -> int:
    """What the attention implementation wants a self-attention length to be a multiple
    of: the Pallas kernel's tiles; an even length for cuDNN (its fused attention refuses odd
    lengths with a bias in training); 1 for the others. The encoder pads its input to it
    once (padded keys masked) instead of every layer padding q, k, v and the bias."""
    if cfg.attention_impl == "pallas":
        return cfg.pallas.length_multiple
    return 2 if cfg.attention_impl == "cudnn" else 1


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

        bias: [B or 1, heads, n, m], a by_position.GridBias (read by position in the Pallas
        kernel, made whole for the other paths) or None. key_mask (True = attend) or None:
        [B, m] for a mask per key, or [B or 1, n, m] for one per query and key (a causal
        mask).
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
        on_grid = isinstance(bias, by_position.GridBias)
        if cfg.attention_impl == "pallas" and not diagnostics and not (
                on_grid and key_mask is not None and key_mask.ndim == 3):
            out = self._flash_attention(q, k, v, bias, key_mask, deterministic)
            return jnp.einsum("bqhd,hde->bqe", out, self._out_kernel()) + self._out_bias()
        if on_grid:  # made whole here: only the Pallas kernel reads a grid by position
            bias = bias.materialise(cfg.dtype)
        if key_mask is not None:  # [B or 1, 1 (heads), n or 1, m]
            key_mask = key_mask[:, None, None, :] if key_mask.ndim == 2 else key_mask[:, None]
        fused = (cfg.attention_impl in ("xla", "cudnn")
                 and (deterministic or cfg.attention_dropout == 0.0) and not diagnostics)
        if fused:
            n = q.shape[1]
            if cfg.attention_impl == "cudnn":
                q, k, v, bias, key_mask = _even_lengths(q, k, v, bias, key_mask)
            out = jax.nn.dot_product_attention(
                q, k, v, bias=None if bias is None else bias.astype(q.dtype), mask=key_mask,
                scale=1.0 / float(Dh) ** 0.5, implementation=cfg.attention_impl)[:, :n]
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
        call = functools.partial(flash_attention.attention, scale=1.0 / float(cfg.head_dim) ** 0.5,
                                 dropout_rate=rate, options=cfg.pallas, num_heads=cfg.num_heads)
        if bias is not None and not isinstance(bias, by_position.GridBias):
            bias = bias.astype(q.dtype)
        return _per_shard(call, q, k, v, bias, key_valid, seed)

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


def _per_shard(call, q, k, v, bias, key_valid, seed) -> jax.Array:
    """call(q, k, v, bias, key_valid, seed, row_offset=...) on each device's rows and heads.

    A pallas_call is opaque to XLA's SPMD partitioner, which would gather its operands onto
    every device and compute the whole attention there; under a mesh that splits the batch
    (or the heads, by the current logical rules) the kernel runs per shard in
    jax.shard_map instead, each told where its rows and heads start so that the dropout
    bits are the same whatever the mesh. q [B, n, H, D], k and v [B, m, H, D], bias
    [1 or B, H, n, m], a by_position.GridBias or None, key_valid [B, m] or None; the
    lengths stay whole.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return call(q, k, v, bias, key_valid, seed)

    def split(spec, size):
        """The mesh axes of `spec` if they split `size` evenly over more than one device
        (a batch of one row, as when the state is built, stays whole), else None."""
        names = (spec,) if isinstance(spec, str) else tuple(spec or ())
        ways = math.prod(mesh.shape[a] for a in names)
        return spec if ways > 1 and size % ways == 0 else None

    batch, _, heads, _ = nn.logical_to_mesh_axes(("batch", "length", "act_heads", "kv"))
    batch, heads = split(batch, q.shape[0]), split(heads, q.shape[2])
    if batch is None and heads is None:
        return call(q, k, v, bias, key_valid, seed)
    P = jax.sharding.PartitionSpec
    rows = P(batch, None, heads, None)
    if isinstance(bias, by_position.GridBias):  # the grid by head, the positions by row
        per_head = by_position.GridBias(P(heads, None, None), P(batch, None), P(batch, None),
                                        reach=bias.reach)
    else:
        per_head = None if bias is None else P(batch if bias.shape[0] > 1 else None, heads,
                                               None, None)

    def shard(q, k, v, bias, key_valid, seed):
        start = [jnp.zeros((), jnp.int32) if spec is None else
                 jax.lax.axis_index(spec) * size
                 for spec, size in ((batch, q.shape[0]), (heads, q.shape[2]))]
        return call(q, k, v, bias, key_valid, seed, row_offset=tuple(start))

    return jax.shard_map(shard, mesh=mesh, in_specs=(
        rows, rows, rows, per_head, None if key_valid is None else P(batch, None), P()),
        out_specs=rows, check_vma=False)(q, k, v, bias, key_valid, seed)


def _even_lengths(q, k, v, bias, mask):
    """q [B, n, H, D], k and v [B, m, H, D], bias [., H, n, m] and mask [., 1, n or 1, m]
    (or None) padded to even n and m (the mask to [., 1, n, m]), as cuDNN's fused attention
    wants them in training with a bias (a key mask is one to it). Padded keys are masked
    out; padded queries attend like the others (a fully masked row could give NaN, which
    the backward pass would spread through dK and dV even from rows sliced off). A no-op
    for the encoder, which pads its input."""
    n, m = q.shape[1], k.shape[1]
    pad_n, pad_m = n % 2, m % 2
    if not (pad_n or pad_m):
        return q, k, v, bias, mask

    def pad(x, widths, value=0):
        return jnp.pad(x, [(0, 0)] * (x.ndim - len(widths)) + list(widths),
                       constant_values=value)

    q = pad(q, [(0, pad_n), (0, 0), (0, 0)])
    k, v = (pad(x, [(0, pad_m), (0, 0), (0, 0)]) for x in (k, v))
    if bias is not None:
        bias = pad(bias, [(0, pad_n), (0, pad_m)])
    if mask is None:
        mask = jnp.ones((1, 1, 1, m), bool)
    # cuDNN turns the mask into a bias, which must span the queries.
    mask = jnp.broadcast_to(mask, mask.shape[:2] + (n, m))
    mask = pad(mask, [(0, pad_n), (0, 0)], True)  # queries: attend
    mask = pad(mask, [(0, pad_m)], False)  # keys: masked
    return q, k, v, bias, mask


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
