"""Flash attention on TPUs (Pallas' Mosaic backend): the function of the GPU kernel
(models/flash_attention.py), with its relative bias, key mask and dropout inside, for
the TPU's vector and matrix units.

Why: without it every TPU step runs the einsum path, whose [B, heads, n, m] logits,
probabilities and dropout mask go through HBM in every layer, forward and backward. JAX's
own TPU kernels do not cover the papers' attention: `pallas/ops/tpu/flash_attention`
takes a bias only as a whole [B, heads, n, m] array and has no dropout; splash attention
has neither.

What each program does (FlashAttention-2, as the GPU kernel):

* forward, grid (batch, head, query block): the whole keys of its (batch, head) sit in
  VMEM and stream through an online softmax in blocks of `block_k`; it writes the output
  and each row's max and log row sum (apart, exact for fully masked rows).
* dkv, grid (head, key block, batch): the queries stream past one key block, which
  accumulates dK and dV and writes dS, the bias gradient: per row for a per-example bias,
  or summed over the batch (the innermost, sequential grid axis, so the block stays in
  VMEM between rows: deterministic, no atomics) for a bias shared by the batch.
* dq, grid (batch, head, query block): the keys stream past one query block.

Layout: the TPU tiles arrays by (8 sublanes x 128 lanes) in their last two dimensions, so
q, k and v go in as [B, heads, n, D] (transposed from the model's [B, n, heads, D]; XLA
folds that into the projections), per-query values along sublanes, per-key values along
lanes: the key mask and key positions as [B, 8, m] (a sublane tile of copies), the query
positions as [B, n, 128] (a lane tile of copies), the row statistics lane-dense as
[B, heads, 1, n] (transposed in the kernel from its [block_q, 1] columns).

The bias comes whole ([1 or B, heads, n, m], a tile per program) or, for MAE-LM's bias per
example, from its grid by position without a [B, heads, n, m] operand: a relative grid
(by_position.GridBias with a reach R) is one row per head of its 2 R + 1 diagonals,
bias[i, j] = row[clip(k_pos[j] - q_pos[i], -R, R) + R], read by the TPU's lane gather,
which reaches 128 values at a time (one gather per 128 values of the row, a select among
them). Its gradient is dS per row, gathered back to the grid as on the GPU
(by_position.grid_gradient). A grid without a reach is made whole first.

Dropout: the GPU kernel's bits (models/dropout_hash.py), element by element, so a run
resumes exactly across GPUs, TPUs and the CPU interpreter. The TPU's hardware PRNG
(pltpu.prng_random_bits) would be cheaper, but its bits differ between chips and libtpu
versions and the interpreter cannot draw them.

Tiles (KernelOptions.tpu_forward, tpu_dkv, tpu_dq): queries and keys in multiples of 128
(the lane width: the statistics' transposes and the lane gather), lengths padded here to
them. The kernels compile for TPU on any host (maelm_jax/infra/topology.py's compile-only
devices: tests/models/test_flash_attention_tpu.py) and run in Pallas' interpreter on a CPU.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maelm_jax.config.options import LANES, KernelOptions, TpuTile
from maelm_jax.models import by_position
from maelm_jax.models.dropout_hash import dropped_fraction, keep_elements, shard_row_stream

# The score of a masked key, as in the GPU kernel.
MASKED = -1e30
SUBLANES = 8
_DEFAULT_OPTIONS = KernelOptions()
# Contractions of the kernels' dots: a [x, d] . b [y, d] -> [x, y] ("nt"), a [x, d] .
# b [d, y] ("nn"), a [d, x] . b [d, y] -> [x, y] ("tn").
_NT, _NN, _TN = ((1,), (1,)), ((1,), (0,)), ((0,), (0,))


def _dot(a, b, contract) -> jax.Array:
    """A dot on the matrix unit with float32 accumulation."""
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------
# Pieces of a tile.


def _column(row_ref, rows) -> jax.Array:
    """A lane-dense statistic [1, n] ref read at `rows` as a column [len(rows), 1]."""
    row = row_ref[:, rows]  # [1, block]
    return jnp.transpose(jnp.broadcast_to(row, (LANES, row.shape[1])))[:, :1]


def _lane_row(column: jax.Array) -> jax.Array:
    """A column [block, 1] as a lane-dense row [1, block]."""
    return jnp.transpose(jnp.broadcast_to(column, (column.shape[0], LANES)))[:1, :]


def _distance_bias(row_ref, q_pos, k_pos, reach: int) -> jax.Array:
    """bias[i, j] = row[clip(k_pos[j] - q_pos[i], -reach, reach) + reach]: q_pos [bq, 1],
    k_pos [1, bk] int32, the row [1, W] (W a multiple of 128) in VMEM -> [bq, bk] float32.
    The lane gather reads one vreg's 128 values: one per 128 of the row, then a select."""
    index = jnp.clip(k_pos - q_pos, -reach, reach) + reach  # [bq, bk] in [0, 2 reach]
    chunks = row_ref.shape[1] // LANES
    lane, chunk = index & (LANES - 1), index >> 7
    parts = []
    for c in range(index.shape[1] // LANES):  # each 128 keys: a gather per chunk of the row
        keys = slice(c * LANES, (c + 1) * LANES)
        picked = None
        for r in range(chunks):
            values = jnp.broadcast_to(row_ref[:, r * LANES:(r + 1) * LANES],
                                      (index.shape[0], LANES))
            got = jnp.take_along_axis(values, lane[:, keys], axis=1,
                                      mode="promise_in_bounds")
            picked = got if picked is None else jnp.where(chunk[:, keys] == r, got, picked)
        parts.append(picked)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


class _Bias:
    """How a kernel reads its bias tile: absent, whole ([., n, m] tiles) or by distance."""

    def __init__(self, kind: str, reach: int = 0):
        self.kind, self.reach = kind, reach

    def tile(self, bias_ref, qpos_ref, kpos_ref, rows, keys) -> jax.Array | None:
        """[len(rows), len(keys)] float32 (rows and keys: slices of the refs' blocks)."""
        if self.kind == "none":
            return None
        if self.kind == "dense":
            return bias_ref[rows, keys].astype(jnp.float32)
        return _distance_bias(bias_ref, qpos_ref[rows, :1], kpos_ref[:1, keys], self.reach)


def _scores(q, k, bias, valid, scale) -> jax.Array:
    """[bq, bk] float32: scale q.k + bias, masked keys low. valid [1, bk] int (or None): 1
    a key, 0 a masked key (MASKED), -1 a key padded here (2 MASKED, so that a fully masked
    row attends uniformly over its own keys, as the formula's, not over the padding)."""
    s = _dot(q, k, _NT) * scale
    if bias is not None:
        s = s + bias
    if valid is not None:
        s = jnp.where(valid > 0, s, MASKED * (1 - valid).astype(jnp.float32))
    return s


def _kept(stream, query_start, key_start, shape, key_stride, rate, elements) -> jax.Array:
    """The tile's keep mask [bq, bk] (dropout_hash.keep_elements)."""
    queries = query_start + jax.lax.broadcasted_iota(jnp.int32, (shape[0], 1), 0)
    keys = key_start + jax.lax.broadcasted_iota(jnp.int32, (1, shape[1]), 1)
    return keep_elements(stream, queries, keys, key_stride, rate, elements)


def _dropout(x, kept, rate, elements) -> jax.Array:
    return jnp.where(kept, x * (1.0 / (1.0 - dropped_fraction(rate, elements))), 0.0)


# ----------------------------------------------------------------------------------------
# Kernels. Refs of absent inputs are None; all blocks are described in the calls below.


def _words(seed_ref) -> list[jax.Array]:
    """The seed's words from its [1, 4] SMEM ref (two-dimensional: under jax.vmap, a seed
    group's runs, Pallas adds a leading axis, which a one-dimensional SMEM array could not
    take)."""
    return [seed_ref[0, i] for i in range(4)]



def _forward_kernel(seed_ref, q_ref, k_ref, v_ref, bias_ref, qpos_ref, kpos_ref, valid_ref,
                    o_ref, max_ref, logsum_ref, *, bias, scale, rate, num_heads, key_stride,
                    elements, block_k):
    """Grid (batch, head, query block). q, o [bq, D]; k, v [m, D]; bias [bq, m], or the
    distance row [1, W] with qpos [bq, 128] and kpos [8, m]; valid [8, m]; max and logsum
    [1, bq]."""
    block_q, head_dim = q_ref.shape
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    stream = shard_row_stream(_words(seed_ref), b, h, num_heads)
    q = q_ref[...]
    rows = slice(None)

    def body(j, carry):
        acc, row_max, row_sum = carry
        start = pl.multiple_of(j * block_k, block_k)
        keys = pl.ds(start, block_k)
        s = _scores(q, k_ref[keys, :], bias.tile(bias_ref, qpos_ref, kpos_ref, rows, keys),
                    None if valid_ref is None else valid_ref[:1, keys], scale)
        new_max = jnp.maximum(row_max, s.max(axis=1, keepdims=True))
        p = jnp.exp(s - new_max)
        correction = jnp.exp(row_max - new_max)
        row_sum = correction * row_sum + p.sum(axis=1, keepdims=True)
        if rate:
            p = _dropout(p, _kept(stream, i * block_q, start, p.shape, key_stride, rate,
                                  elements), rate, elements)
        v = v_ref[keys, :]
        acc = correction * acc + _dot(p.astype(v.dtype), v, _NN)
        return acc, new_max, row_sum

    init = (jnp.zeros((block_q, head_dim), jnp.float32),
            jnp.full((block_q, 1), MASKED, jnp.float32), jnp.zeros((block_q, 1), jnp.float32))
    acc, row_max, row_sum = jax.lax.fori_loop(0, k_ref.shape[0] // block_k, body, init)
    o_ref[...] = (acc / row_sum).astype(o_ref.dtype)
    max_ref[...] = _lane_row(row_max)
    logsum_ref[...] = _lane_row(jnp.log(row_sum))


def _probabilities(s, row_max, logsum) -> jax.Array:
    """The softmax from the forward's statistics (columns [bq, 1])."""
    return jnp.exp((s - row_max) - logsum)


def _score_grad(p, dp, delta, valid) -> jax.Array:
    """dS = P (dP - delta), zero at masked keys."""
    ds = p * (dp - delta)
    return ds if valid is None else jnp.where(valid > 0, ds, 0.0)


def _dkv_kernel(seed_ref, q_ref, k_ref, v_ref, bias_ref, qpos_ref, kpos_ref, valid_ref,
                do_ref, max_ref, logsum_ref, delta_ref, dk_ref, dv_ref, *dbias_refs, bias,
                scale, rate, num_heads, key_stride, elements, block_q, accumulate):
    """Grid (head, key block, batch). q, do [n, D]; k, v, dk, dv [bk, D]; bias [n, bk], or
    the distance row [1, W] with qpos [n, 128] and kpos [8, bk]; valid [8, bk]; max,
    logsum, delta [1, n]; dbias [n, bk]: per row, or summed over the batch (`accumulate`:
    the same block for every row, zeroed at the first)."""
    dbias_ref = dbias_refs[0] if dbias_refs else None
    block_k, head_dim = k_ref.shape
    h, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    stream = shard_row_stream(_words(seed_ref), b, h, num_heads)
    k, v = k_ref[...], v_ref[...]
    valid = None if valid_ref is None else valid_ref[:1, :]
    keys = slice(None)
    if accumulate:
        @pl.when(b == 0)
        def _():
            dbias_ref[...] = jnp.zeros(dbias_ref.shape, dbias_ref.dtype)

    def body(i, carry):
        dk, dv = carry
        start = pl.multiple_of(i * block_q, block_q)
        rows = pl.ds(start, block_q)
        q, do = q_ref[rows, :], do_ref[rows, :]
        s = _scores(q, k, bias.tile(bias_ref, qpos_ref, kpos_ref, rows, keys), valid, scale)
        p = _probabilities(s, _column(max_ref, rows), _column(logsum_ref, rows))
        dp = _dot(do, v, _NT)
        p_dropped = p
        if rate:
            kept = _kept(stream, start, j * block_k, p.shape, key_stride, rate, elements)
            p_dropped, dp = _dropout(p, kept, rate, elements), _dropout(dp, kept, rate,
                                                                        elements)
        dv = dv + _dot(p_dropped.astype(do.dtype), do, _TN)
        ds = _score_grad(p, dp, _column(delta_ref, rows), valid)
        if accumulate:
            dbias_ref[rows, :] += ds
        elif dbias_ref is not None:
            dbias_ref[rows, :] = ds.astype(dbias_ref.dtype)
        dk = dk + _dot(ds.astype(q.dtype), q, _TN) * scale
        return dk, dv

    zeros = jnp.zeros((block_k, head_dim), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, q_ref.shape[0] // block_q, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(seed_ref, q_ref, k_ref, v_ref, bias_ref, qpos_ref, kpos_ref, valid_ref,
               do_ref, max_ref, logsum_ref, delta_ref, dq_ref, *, bias, scale, rate,
               num_heads, key_stride, elements, block_k):
    """Grid (batch, head, query block). q, do, dq [bq, D]; k, v [m, D]; bias as the
    forward's; max, logsum, delta [1, bq]."""
    block_q, head_dim = q_ref.shape
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    stream = shard_row_stream(_words(seed_ref), b, h, num_heads)
    q, do = q_ref[...], do_ref[...]
    everything = slice(None)
    row_max, logsum = _column(max_ref, everything), _column(logsum_ref, everything)
    delta = _column(delta_ref, everything)

    def body(j, dq):
        start = pl.multiple_of(j * block_k, block_k)
        keys = pl.ds(start, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        valid = None if valid_ref is None else valid_ref[:1, keys]
        s = _scores(q, k, bias.tile(bias_ref, qpos_ref, kpos_ref, everything, keys), valid,
                    scale)
        p = _probabilities(s, row_max, logsum)
        dp = _dot(do, v, _NT)
        if rate:
            dp = _dropout(dp, _kept(stream, i * block_q, start, p.shape, key_stride, rate,
                                    elements), rate, elements)
        ds = _score_grad(p, dp, delta, valid)
        return dq + _dot(ds.astype(k.dtype), k, _NN) * scale

    dq = jax.lax.fori_loop(0, k_ref.shape[0] // block_k, body,
                           jnp.zeros((block_q, head_dim), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


# ----------------------------------------------------------------------------------------
# Calls.


class _Operands:
    """One call's operands in the kernels' layout: q, k, v [B, H, n or m, D]; the bias
    (whole [1 or B, H, n, m], or the distance rows [H, 1, W]) and how it is read;
    positions qpos [B, n, 128], kpos [B, 8, m]; valid [B, 8, m] int32; lengths padded."""

    def __init__(self, q, k, v, bias, valid, seed, options: KernelOptions):
        B, n, H, D = q.shape
        m = k.shape[1]
        options.check_tpu_vmem(n, m, D, "model.pallas")
        self.n, self.m = n, m
        n_pad = _round_up(n, options.tpu_query_multiple)
        m_pad = _round_up(m, options.tpu_key_multiple)
        if m_pad != m and valid is None:
            valid = jnp.ones((B, m), bool)
        to_kernel = lambda x, size: jnp.transpose(_pad_to(x, 1, size), (0, 2, 1, 3))  # noqa: E731
        self.q, self.k, self.v = to_kernel(q, n_pad), to_kernel(k, m_pad), to_kernel(v, m_pad)
        self.valid = None if valid is None else _sublanes(_pad_to(valid.astype(jnp.int32), 1,
                                                                  m_pad, value=-1))
        self.qpos = self.kpos = None
        self.grid_bias = bias if isinstance(bias, by_position.GridBias) else None
        if self.grid_bias is not None and not bias.reach:  # not relative: made whole
            bias = bias.materialise(q.dtype)
        if isinstance(bias, by_position.GridBias):
            reach = _lane_reach(bias.reach, bias.grid.shape[1])
            self.bias = _distance_rows(bias.grid, reach, q.dtype)
            self.reader = _Bias("distance", reach)
            self.qpos = jnp.broadcast_to(_pad_to(bias.q_pos, 1, n_pad)[:, :, None],
                                         (B, n_pad, LANES)).astype(jnp.int32)
            self.kpos = _sublanes(_pad_to(bias.k_pos, 1, m_pad).astype(jnp.int32))
        elif bias is not None:
            self.bias = _pad_to(_pad_to(bias, 2, n_pad), 3, m_pad)
            self.reader = _Bias("dense")
        else:
            self.bias, self.reader = None, _Bias("none")
        self.seed = seed.reshape(1, 4)
        self.shape = (B, n_pad, m_pad, H, D)

    @property
    def shared(self) -> bool:
        """A whole bias shared by the batch (its gradient summed over it in the kernel)."""
        return self.reader.kind == "dense" and self.bias.shape[0] == 1

    def bias_specs(self, rows: int | None, keys: int | None, index) -> list:
        """BlockSpecs of (bias, qpos, kpos) for a program of `rows` queries (None: all)
        and `keys` keys (None: all); index(b, h, i, j) -> (batch, head, query block, key
        block) of the program's grid indices."""
        n, m = self.shape[1], self.shape[2]
        rows, keys = rows or n, keys or m
        if self.reader.kind == "none":
            return [None, None, None]
        if self.reader.kind == "dense":
            shared = self.bias.shape[0] == 1

            def tile(*grid):
                b, h, i, j = index(*grid)
                return (0 if shared else b, h, i, j)

            return [pl.BlockSpec((None, None, rows, keys), tile), None, None]

        def row(*grid):
            return (index(*grid)[1], 0, 0)

        def query_positions(*grid):
            b, _, i, _ = index(*grid)
            return (b, i, 0)

        def key_positions(*grid):
            b, _, _, j = index(*grid)
            return (b, 0, j)

        return [pl.BlockSpec((None, 1, self.bias.shape[2]), row),
                pl.BlockSpec((None, rows, LANES), query_positions),
                pl.BlockSpec((None, SUBLANES, keys), key_positions)]

    def args(self) -> tuple:
        return (self.seed, self.q, self.k, self.v, self.bias, self.qpos, self.kpos, self.valid)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _pad_to(x: jax.Array | None, axis: int, size: int, value=0) -> jax.Array | None:
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _sublanes(x: jax.Array) -> jax.Array:
    """[B, m] -> [B, 8, m]: per-key values as a sublane tile of copies."""
    return jnp.broadcast_to(x[:, None, :], (x.shape[0], SUBLANES, x.shape[1]))


def _lane_reach(reach: int, num_positions: int) -> int:
    """The widest reach (<= num_positions - 1) whose row fills as many 128-value chunks as
    `reach`'s: diagonals beyond `reach` are constant, so reading more of them is free and
    leaves a margin."""
    chunks = -(-(2 * reach + 1) // LANES)
    return max(reach, min((chunks * LANES - 1) // 2, num_positions - 1))


def _distance_rows(grid: jax.Array, reach: int, dtype) -> jax.Array:
    """A relative grid [H, P, P] as its diagonals -reach .. reach: [H, 1, W] float32 (W the
    next multiple of 128), values rounded to `dtype` as a whole bias would be."""
    above = grid[:, 0, :reach + 1]  # distance 0 .. reach: row 0
    below = grid[:, reach:0:-1, 0]  # distance -reach .. -1: column 0
    row = jnp.concatenate([below, above], axis=1).astype(dtype).astype(jnp.float32)
    return _pad_to(row, 1, _round_up(row.shape[1], LANES))[:, None, :]


def _params(semantics: tuple[str, ...], options: KernelOptions) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=options.tpu_vmem_limit_mb * 2 ** 20)


def _call(kernel, grid, in_specs, out_specs, out_shape, name, semantics, options, interpret,
          **static):
    return pl.pallas_call(functools.partial(kernel, **static), grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape, name=name,
                          interpret=interpret, compiler_params=_params(semantics, options))


_SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)


def _forward(ops: _Operands, scale, rate, key_stride, num_heads, options, interpret):
    B, n, m, H, D = ops.shape
    tile: TpuTile = options.tpu_forward
    bq = tile.block_q
    per_query = lambda b, h, i: (b, h, i, 0)  # noqa: E731
    whole = lambda b, h, i: (b, h, 0, 0)  # noqa: E731
    in_specs = [_SMEM,
                pl.BlockSpec((None, None, bq, D), per_query),
                pl.BlockSpec((None, None, m, D), whole),
                pl.BlockSpec((None, None, m, D), whole),
                *ops.bias_specs(bq, None, lambda b, h, i: (b, h, i, 0)),
                None if ops.valid is None else pl.BlockSpec((None, SUBLANES, m),
                                                            lambda b, h, i: (b, 0, 0))]
    stat = pl.BlockSpec((None, None, 1, bq), lambda b, h, i: (b, h, 0, i))
    return _call(
        _forward_kernel, (B, H, n // bq), in_specs,
        [pl.BlockSpec((None, None, bq, D), per_query), stat, stat],
        [jax.ShapeDtypeStruct((B, H, n, D), ops.q.dtype),
         jax.ShapeDtypeStruct((B, H, 1, n), jnp.float32),
         jax.ShapeDtypeStruct((B, H, 1, n), jnp.float32)],
        "flash_attention_tpu_forward", ("parallel",) * 3, options, interpret,
        bias=ops.reader, scale=scale, rate=rate, num_heads=num_heads, key_stride=key_stride,
        elements=options.hash_elements, block_k=tile.block_k,
    )(*ops.args())


def _dkv(ops: _Operands, residuals, scale, rate, key_stride, num_heads, options, interpret):
    d_out, row_max, logsum, delta = residuals
    B, n, m, H, D = ops.shape
    tile: TpuTile = options.tpu_dkv
    bk = tile.block_k
    accumulate = ops.shared
    whole = lambda h, j, b: (b, h, 0, 0)  # noqa: E731
    per_key = lambda h, j, b: (b, h, j, 0)  # noqa: E731
    stat = pl.BlockSpec((None, None, 1, n), lambda h, j, b: (b, h, 0, 0))
    in_specs = [_SMEM,
                pl.BlockSpec((None, None, n, D), whole),
                pl.BlockSpec((None, None, bk, D), per_key),
                pl.BlockSpec((None, None, bk, D), per_key),
                *ops.bias_specs(None, bk, lambda h, j, b: (b, h, 0, j)),
                None if ops.valid is None else pl.BlockSpec((None, SUBLANES, bk),
                                                            lambda h, j, b: (b, 0, j)),
                pl.BlockSpec((None, None, n, D), whole), stat, stat, stat]
    out_specs = [pl.BlockSpec((None, None, bk, D), per_key)] * 2
    out_shape = [jax.ShapeDtypeStruct(ops.k.shape, ops.k.dtype),
                 jax.ShapeDtypeStruct(ops.v.shape, ops.v.dtype)]
    if accumulate:  # float32, summed over the batch in the block
        out_specs.append(pl.BlockSpec((None, None, n, bk), lambda h, j, b: (0, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((1, H, n, m), jnp.float32))
    elif ops.bias is not None:  # per row, in the compute dtype (a whole bias's own)
        out_specs.append(pl.BlockSpec((None, None, n, bk), lambda h, j, b: (b, h, 0, j)))
        dtype = ops.q.dtype if ops.reader.kind == "distance" else ops.bias.dtype
        out_shape.append(jax.ShapeDtypeStruct((B, H, n, m), dtype))
    return _call(
        _dkv_kernel, (H, m // bk, B), in_specs, out_specs, out_shape,
        "flash_attention_tpu_dkv",
        ("parallel", "parallel", "arbitrary" if accumulate else "parallel"), options,
        interpret, bias=ops.reader, scale=scale, rate=rate, num_heads=num_heads,
        key_stride=key_stride, elements=options.hash_elements, block_q=tile.block_q,
        accumulate=accumulate,
    )(*ops.args(), d_out, row_max, logsum, delta)


def _dq(ops: _Operands, residuals, scale, rate, key_stride, num_heads, options, interpret):
    d_out, row_max, logsum, delta = residuals
    B, n, m, H, D = ops.shape
    tile: TpuTile = options.tpu_dq
    bq = tile.block_q
    per_query = pl.BlockSpec((None, None, bq, D), lambda b, h, i: (b, h, i, 0))
    whole = lambda b, h, i: (b, h, 0, 0)  # noqa: E731
    stat = pl.BlockSpec((None, None, 1, bq), lambda b, h, i: (b, h, 0, i))
    in_specs = [_SMEM, per_query,
                pl.BlockSpec((None, None, m, D), whole),
                pl.BlockSpec((None, None, m, D), whole),
                *ops.bias_specs(bq, None, lambda b, h, i: (b, h, i, 0)),
                None if ops.valid is None else pl.BlockSpec((None, SUBLANES, m),
                                                            lambda b, h, i: (b, 0, 0)),
                per_query, stat, stat, stat]
    return _call(
        _dq_kernel, (B, H, n // bq), in_specs, per_query,
        jax.ShapeDtypeStruct(ops.q.shape, ops.q.dtype), "flash_attention_tpu_dq",
        ("parallel",) * 3, options, interpret, bias=ops.reader, scale=scale, rate=rate,
        num_heads=num_heads, key_stride=key_stride, elements=options.hash_elements,
        block_k=tile.block_k,
    )(*ops.args(), d_out, row_max, logsum, delta)


def _from_kernel(x: jax.Array, length: int) -> jax.Array:
    """[B, H, padded, D] -> [B, length, H, D]."""
    return jnp.transpose(x, (0, 2, 1, 3))[:, :length]


def forward(q, k, v, bias, valid, words, scale, rate, key_stride, num_heads,
            options: KernelOptions, interpret: bool):
    """The forward kernel on the model's layout: q [B, n, H, D], k and v [B, m, H, D],
    bias (whole, a GridBias or None), valid [B, m] bool or None, words [4] uint32 (the
    seed's two words and the shard's first row and head) -> out [B, n, H, D] and the row
    max and log row sum [B, H, n] float32 (the GPU kernel's residuals, in its layout)."""
    ops = _Operands(q, k, v, bias, valid, words, options)
    out, row_max, logsum = _forward(ops, scale, rate, key_stride, num_heads, options,
                                    interpret)
    n = ops.n
    return _from_kernel(out, n), row_max[:, :, 0, :n], logsum[:, :, 0, :n]


def backward(q, k, v, bias, valid, words, out, row_max, logsum, d_out, scale, rate,
             key_stride, num_heads, options: KernelOptions, interpret: bool):
    """The dkv and dq kernels from `forward`'s residuals -> (dq, dk, dv, the bias's
    gradient: the grid's for a GridBias, or None)."""
    ops = _Operands(q, k, v, bias, valid, words, options)
    n, n_pad = ops.n, ops.shape[1]
    # rowsum(dO * O) = rowsum(dP~ * P~): the softmax's backward term.
    delta = jnp.einsum("bnhd,bnhd->bhn", d_out.astype(jnp.float32), out.astype(jnp.float32))
    lane_dense = lambda x: _pad_to(x, 2, n_pad)[:, :, None, :]  # noqa: E731 [B, H, 1, n]
    residuals = (jnp.transpose(_pad_to(d_out, 1, n_pad), (0, 2, 1, 3)), lane_dense(row_max),
                 lane_dense(logsum), lane_dense(delta))
    static = (scale, rate, key_stride, num_heads, options, interpret)
    grads = _dkv(ops, residuals, *static)
    dq = _dq(ops, residuals, *static)
    dq, dk, dv = (_from_kernel(dq, n), _from_kernel(grads[0], ops.m),
                  _from_kernel(grads[1], ops.m))
    dbias = None
    if ops.grid_bias is not None:  # dS per row gathered back to the grid, as on the GPU
        grid = ops.grid_bias
        d_grid = by_position.grid_gradient(
            grads[2][:, :, :n, :ops.m], grid.q_pos, grid.k_pos, grid.grid.shape[1]
        ).astype(grid.grid.dtype)
        dbias = d_grid
    elif bias is not None:
        dbias = grads[2][:, :, :n, :ops.m].astype(bias.dtype)
    return dq, dk, dv, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _attention(q, k, v, bias, valid, words, scale, rate, key_stride, num_heads, options,
               interpret):
    return forward(q, k, v, bias, valid, words, scale, rate, key_stride, num_heads, options,
                   interpret)[0]


def _attention_fwd(q, k, v, bias, valid, words, *static):
    out, row_max, logsum = forward(q, k, v, bias, valid, words, *static)
    return out, (q, k, v, bias, valid, words, out, row_max, logsum)


def _attention_bwd(*args):
    *static, residuals, d_out = args
    dq, dk, dv, dbias = backward(*residuals, d_out, *static)
    bias = residuals[3]
    if isinstance(bias, by_position.GridBias):  # integer positions: no gradient
        dbias = bias.cotangent(dbias)
    return dq, dk, dv, dbias, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: Any, key_valid: jax.Array | None,
              seed: jax.Array, *, scale: float, dropout_rate: float = 0.0,
              options: KernelOptions = _DEFAULT_OPTIONS, interpret: bool = False,
              row_offset: tuple[Any, Any] = (0, 0), num_heads: int | None = None) -> jax.Array:
    """models/flash_attention.attention's function with the TPU kernels (Mosaic), or in
    Pallas' interpreter with `interpret`; the same arguments and the same dropout bits.
    (flash_attention.attention takes these kernels by itself where a program is lowered
    for a TPU.)

    q [B, n, H, D], k and v [B, m, H, D]; bias [1 or B, H, n, m], a by_position.GridBias
    or None; key_valid [B, m] bool or None; seed [2] uint32. Returns [B, n, H, D] in q's
    dtype, differentiable in q, k, v and the bias.
    """
    words = jnp.concatenate([seed.astype(jnp.uint32).reshape(2),
                             jnp.asarray(row_offset, jnp.uint32).reshape(2)])
    return _attention(q, k, v, bias, key_valid, words, float(scale), float(dropout_rate),
                      k.shape[1], num_heads or q.shape[2], options, interpret)
