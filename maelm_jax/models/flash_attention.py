"""Flash attention with an additive bias, a key mask and dropout inside the kernel (Pallas).

Why: attention dropout on the einsum path materialises the [B, heads, n, m] probabilities
and their dropout mask in every layer, which cost 36-40 ms of a 91 ms BERT-base train step
on an H100; cuDNN's fused kernel keeps dropout inside, but draws its bits from a
generator whose seed is a compile-time constant and whose offset XLA advances per
execution of each call site: masks are then not a function of (seed, step), so a resumed
run differs, and under nn.scan the backward pass (which runs the layers in reverse) reads
other offsets than the forward did. Here the dropout bits are a hash of a traced seed
(drawn from the layer's "dropout" stream, as every other dropout) and of each element's
(batch, head, query, key) index: the same in the forward and backward kernels, the same
for a resumed run, different for every layer under nn.scan.

The kernels follow FlashAttention-2 (Dao, 2023) on Pallas' Triton backend (GPU):

* forward, one program per (query block, batch, head): the key blocks stream through an
  online softmax; o = sum_k dropout(p_k) v_k / rowsum(p), with p = exp(s - running max)
  and s = scale q.k + bias, masked keys at -1e30. Dropout multiplies the normalised
  probabilities, so it applies to the numerator only. It also writes the row's
  log-sum-exp for the backward pass.
* backward, two kernels: per key block, dK, dV and dbias; per query block, dQ. Both
  recompute p from the log-sum-exp and the keep mask from the hash, with
  dS = P * (dropout'(dO V^T) - rowsum(dO * O)), the bias gradient being dS itself.

The bias is [1 or B, heads, n, m] (the relative position bias), its gradient is written
per batch row in float32 and summed over the batch where the bias was broadcast. Padded
lengths: the wrapper pads n and m up to whole blocks (padded keys masked out) and slices
the result, so the encoder's n_enc (L minus the removed [MASK]s) need not be a multiple
of anything. On a CPU the same kernels run in Pallas' interpret mode (slowly; for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Tile sizes (queries x keys) of every kernel: 64 x 64 keeps a float32 score tile, the
# bias tile and the keep mask in registers at head_dim 64. To be tuned on the GPU.
BLOCK_Q = 64
BLOCK_K = 64
# The score of a masked key: large and finite, so a fully masked (padded) row has no NaN.
MASKED = -1e30
# lowbias32 (C. Wellons): a 32-bit integer hash with full avalanche.
_MIX1, _MIX2, _GOLDEN = np.uint32(0x7FEB352D), np.uint32(0x846CA68B), np.uint32(0x9E3779B9)
_BITS = 24  # bits of each element's hash that decide it (the rate is exact to 2**-24)


def _mix(x: jax.Array) -> jax.Array:
    x = x ^ (x >> 16)
    x = x * _MIX1
    x = x ^ (x >> 15)
    x = x * _MIX2
    return x ^ (x >> 16)


def row_stream(seed0: jax.Array, seed1: jax.Array, batch: jax.Array, head: jax.Array,
               num_heads: int) -> jax.Array:
    """uint32: the hash state of one (batch, head) row of attention matrices, from the two
    words of the call's seed."""
    row = (batch * num_heads + head).astype(jnp.uint32)
    return _mix(_mix(row * _GOLDEN ^ seed0) ^ seed1)


def keep(stream: jax.Array, queries: jax.Array, keys: jax.Array, key_stride: int,
         rate: float) -> jax.Array:
    """bool [len(queries), len(keys)]: which elements dropout keeps, with probability
    1 - rate, a function of the row's stream and each (query, key) index alone (the
    counter query * key_stride + key, key_stride being the unpadded number of keys)."""
    counter = (queries[:, None] * key_stride + keys[None, :]).astype(jnp.uint32)
    threshold = np.uint32(round(rate * 2 ** _BITS))
    return (_mix(counter ^ stream) >> (32 - _BITS)) >= threshold


def keep_mask(seed: jax.Array, shape: tuple[int, int, int, int], rate: float) -> jax.Array:
    """bool [B, heads, n, m]: the whole keep mask the kernels apply, for tests and checks."""
    B, H, n, m = shape
    streams = jax.vmap(lambda b: jax.vmap(lambda h: row_stream(seed[0], seed[1], b, h, H))(
        jnp.arange(H)))(jnp.arange(B))
    return jax.vmap(jax.vmap(lambda s: keep(s, jnp.arange(n), jnp.arange(m), m, rate)))(streams)


def _scores(q, k, bias_ref, valid_ref, q_slice, k_slice, scale):
    """[block_q, block_k] float32 scores of one tile: scale q.k + bias, masked keys low."""
    s = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * scale
    if bias_ref is not None:
        s = s + bias_ref[q_slice, k_slice].astype(jnp.float32)
    if valid_ref is not None:
        s = jnp.where(valid_ref[k_slice][None, :] != 0, s, MASKED)
    return s


def _program(seed_ref, num_heads: int, block: int):
    """This program's (dropout stream, its block of the grid's first axis as a slice and
    as indices) for a grid (block, batch, head)."""
    i = pl.program_id(0)
    stream = row_stream(seed_ref[0], seed_ref[1], pl.program_id(1), pl.program_id(2),
                        num_heads)
    return stream, pl.ds(i * block, block), i * block + jnp.arange(block)


def _forward_kernel(seed_ref, q_ref, k_ref, v_ref, bias_ref, valid_ref, o_ref, lse_ref, *,
                    scale, rate, num_heads, key_stride):
    block_q, head_dim = q_ref.shape
    num_keys = k_ref.shape[0]
    stream, q_slice, queries = _program(seed_ref, num_heads, BLOCK_Q)
    q = q_ref[...]

    def body(j, carry):
        acc, row_max, row_sum = carry
        k_slice = pl.ds(j * BLOCK_K, BLOCK_K)
        s = _scores(q, k_ref[k_slice, :], bias_ref, valid_ref, q_slice, k_slice, scale)
        new_max = jnp.maximum(row_max, s.max(axis=1))
        p = jnp.exp(s - new_max[:, None])
        correction = jnp.exp(row_max - new_max)
        row_sum = correction * row_sum + p.sum(axis=1)
        if rate:
            kept = keep(stream, queries, j * BLOCK_K + jnp.arange(BLOCK_K), key_stride, rate)
            p = jnp.where(kept, p * (1.0 / (1.0 - rate)), 0.0)
        v = v_ref[k_slice, :]
        acc = correction[:, None] * acc + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return acc, new_max, row_sum

    init = (jnp.zeros((block_q, head_dim), jnp.float32),
            jnp.full((block_q,), MASKED, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    acc, row_max, row_sum = jax.lax.fori_loop(0, num_keys // BLOCK_K, body, init)
    o_ref[...] = (acc / row_sum[:, None]).astype(o_ref.dtype)
    lse_ref[...] = row_max + jnp.log(row_sum)


def _dropped_grad(dp, stream, queries, keys, key_stride, rate):
    """dP from dP~ = dO V^T through the dropout of the probabilities."""
    if not rate:
        return dp
    kept = keep(stream, queries, keys, key_stride, rate)
    return jnp.where(kept, dp * (1.0 / (1.0 - rate)), 0.0)


def _dkv_kernel(seed_ref, q_ref, k_ref, v_ref, bias_ref, valid_ref, do_ref, lse_ref,
                delta_ref, dk_ref, dv_ref, *dbias_refs, scale, rate, num_heads, key_stride):
    """One key block: dK and dV over every query block, and the bias gradient's column
    (dbias_refs: the one output [n, BLOCK_K] of it when there is a bias)."""
    dbias_ref = dbias_refs[0] if dbias_refs else None
    num_queries, head_dim = q_ref.shape
    stream, k_slice, keys = _program(seed_ref, num_heads, BLOCK_K)
    k, v = k_ref[k_slice, :], v_ref[k_slice, :]

    def body(i, carry):
        dk, dv = carry
        q_slice = pl.ds(i * BLOCK_Q, BLOCK_Q)
        queries = i * BLOCK_Q + jnp.arange(BLOCK_Q)
        q, do = q_ref[q_slice, :], do_ref[q_slice, :]
        p = jnp.exp(_scores(q, k, bias_ref, valid_ref, q_slice, k_slice, scale)
                    - lse_ref[q_slice][:, None])
        dp = plgpu.dot(do, v, trans_b=True).astype(jnp.float32)
        if rate:
            kept = keep(stream, queries, keys, key_stride, rate)
            p_dropped = jnp.where(kept, p * (1.0 / (1.0 - rate)), 0.0)
            dp = jnp.where(kept, dp * (1.0 / (1.0 - rate)), 0.0)
        else:
            p_dropped = p
        dv = dv + plgpu.dot(p_dropped.astype(do.dtype), do, trans_a=True).astype(jnp.float32)
        ds = p * (dp - delta_ref[q_slice][:, None])
        if dbias_ref is not None:
            dbias_ref[q_slice, :] = ds
        dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True).astype(jnp.float32) * scale
        return dk, dv

    zeros = jnp.zeros((BLOCK_K, head_dim), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, num_queries // BLOCK_Q, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(seed_ref, q_ref, k_ref, v_ref, bias_ref, valid_ref, do_ref, lse_ref,
               delta_ref, dq_ref, *, scale, rate, num_heads, key_stride):
    """One query block: dQ over every key block."""
    block_q, head_dim = q_ref.shape
    num_keys = k_ref.shape[0]
    stream, q_slice, queries = _program(seed_ref, num_heads, BLOCK_Q)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(j, dq):
        k_slice = pl.ds(j * BLOCK_K, BLOCK_K)
        keys = j * BLOCK_K + jnp.arange(BLOCK_K)
        k, v = k_ref[k_slice, :], v_ref[k_slice, :]
        p = jnp.exp(_scores(q, k, bias_ref, valid_ref, q_slice, k_slice, scale) - lse[:, None])
        dp = _dropped_grad(plgpu.dot(do, v, trans_b=True).astype(jnp.float32), stream, queries,
                           keys, key_stride, rate)
        ds = p * (dp - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k).astype(jnp.float32) * scale

    dq = jax.lax.fori_loop(0, num_keys // BLOCK_K, body,
                           jnp.zeros((block_q, head_dim), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, name, **static):
    return pl.pallas_call(functools.partial(kernel, **static), grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape, interpret=interpret,
                          name=name)


def _input_specs(B, H, n, m, D, bias, valid, q_block: bool, do: bool = False):
    """BlockSpecs of (seed, q, k, v, bias, valid[, do, lse, delta]) for a grid (block, b,
    h): q (and do, lse, delta) by query block when `q_block`, else whole; the rest whole."""
    rows = BLOCK_Q if q_block else n
    q_index = (lambda i, b, h: (b, i, h, 0)) if q_block else (lambda i, b, h: (b, 0, h, 0))
    r_index = (lambda i, b, h: (b, h, i)) if q_block else (lambda i, b, h: (b, h, 0))
    bias_batch = None if bias is None else bias.shape[0]
    specs = [
        pl.BlockSpec((2,), lambda i, b, h: (0,)),
        pl.BlockSpec((None, rows, None, D), q_index),
        pl.BlockSpec((None, m, None, D), lambda i, b, h: (b, 0, h, 0)),
        pl.BlockSpec((None, m, None, D), lambda i, b, h: (b, 0, h, 0)),
        None if bias is None else pl.BlockSpec(
            (None, None, n, m), lambda i, b, h: (b if bias_batch > 1 else 0, h, 0, 0)),
        None if valid is None else pl.BlockSpec((None, m), lambda i, b, h: (b, 0)),
    ]
    if do:
        specs += [pl.BlockSpec((None, rows, None, D), q_index),
                  pl.BlockSpec((None, None, rows), r_index),
                  pl.BlockSpec((None, None, rows), r_index)]
    return specs


def _forward(q, k, v, bias, valid, seed, scale, rate, key_stride, interpret):
    B, n, H, D = q.shape
    m = k.shape[1]
    out, lse = _call(
        _forward_kernel, (n // BLOCK_Q, B, H),
        _input_specs(B, H, n, m, D, bias, valid, q_block=True),
        [pl.BlockSpec((None, BLOCK_Q, None, D), lambda i, b, h: (b, i, h, 0)),
         pl.BlockSpec((None, None, BLOCK_Q), lambda i, b, h: (b, h, i))],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, n), jnp.float32)],
        interpret, "flash_attention_forward", scale=scale, rate=rate, num_heads=H,
        key_stride=key_stride,
    )(seed, q, k, v, bias, valid)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _attention(q, k, v, bias, valid, seed, scale, rate, key_stride, interpret):
    return _forward(q, k, v, bias, valid, seed, scale, rate, key_stride, interpret)[0]


def _attention_fwd(q, k, v, bias, valid, seed, scale, rate, key_stride, interpret):
    out, lse = _forward(q, k, v, bias, valid, seed, scale, rate, key_stride, interpret)
    return out, (q, k, v, bias, valid, seed, out, lse)


def _attention_bwd(scale, rate, key_stride, interpret, residuals, d_out):
    q, k, v, bias, valid, seed, out, lse = residuals
    B, n, H, D = q.shape
    m = k.shape[1]
    # rowsum(dO * O) = rowsum(dP~ * P~): the softmax's backward term, [B, H, n].
    delta = jnp.einsum("bnhd,bnhd->bhn", d_out.astype(jnp.float32), out.astype(jnp.float32))
    static = dict(scale=scale, rate=rate, num_heads=H, key_stride=key_stride)
    args = (seed, q, k, v, bias, valid, d_out, lse, delta)
    out_specs = [pl.BlockSpec((None, BLOCK_K, None, D), lambda j, b, h: (b, j, h, 0))] * 2
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if bias is not None:
        out_specs.append(pl.BlockSpec((None, None, n, BLOCK_K), lambda j, b, h: (b, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((B, H, n, m), jnp.float32))
    grads = _call(_dkv_kernel, (m // BLOCK_K, B, H),
                  _input_specs(B, H, n, m, D, bias, valid, q_block=False, do=True),
                  out_specs, out_shape, interpret, "flash_attention_dkv", **static)(*args)
    dk, dv = grads[0], grads[1]
    dbias = None
    if bias is not None:
        dbias = grads[2]
        dbias = (dbias if bias.shape[0] == B else dbias.sum(axis=0, keepdims=True))
        dbias = dbias.astype(bias.dtype)
    dq = _call(_dq_kernel, (n // BLOCK_Q, B, H),
               _input_specs(B, H, n, m, D, bias, valid, q_block=True, do=True),
               pl.BlockSpec((None, BLOCK_Q, None, D), lambda i, b, h: (b, i, h, 0)),
               jax.ShapeDtypeStruct(q.shape, q.dtype), interpret, "flash_attention_dq",
               **static)(*args)
    return dq, dk, dv, dbias, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _pad_to(x: jax.Array | None, axis: int, size: int, value=0) -> jax.Array | None:
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
              key_valid: jax.Array | None, seed: jax.Array, *, scale: float,
              dropout_rate: float = 0.0, interpret: bool | None = None) -> jax.Array:
    """softmax(scale q.k + bias, keys where key_valid), dropped out at dropout_rate, times v.

    q [B, n, H, D], k and v [B, m, H, D] (D a power of two >= 16 on a GPU); bias
    [1 or B, H, n, m] or None; key_valid [B, m] bool or None; seed [2] uint32, the dropout
    bits' seed (unused at rate 0). interpret: Pallas' interpreter (default: on a CPU).
    Returns [B, n, H, D] in q's dtype. Differentiable in q, k, v and bias.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    n, m = q.shape[1], k.shape[1]
    n_pad, m_pad = -(-n // BLOCK_Q) * BLOCK_Q, -(-m // BLOCK_K) * BLOCK_K
    if m_pad != m and key_valid is None:
        key_valid = jnp.ones((k.shape[0], m), bool)
    valid = None if key_valid is None else _pad_to(key_valid.astype(jnp.int32), 1, m_pad)
    q = _pad_to(q, 1, n_pad)
    k, v = _pad_to(k, 1, m_pad), _pad_to(v, 1, m_pad)
    if bias is not None:
        bias = _pad_to(_pad_to(bias, 2, n_pad), 3, m_pad)
    out = _attention(q, k, v, bias, valid, seed.astype(jnp.uint32), float(scale),
                     float(dropout_rate), m, bool(interpret))
    return out[:, :n]
