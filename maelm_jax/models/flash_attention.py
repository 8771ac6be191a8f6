"""Flash attention with an additive bias, a key mask and dropout inside the kernel (Pallas).

Why: attention dropout on the einsum path materialises the [B, heads, n, m] probabilities
and their dropout mask in every layer, a large share of a BERT-base train step's time;
cuDNN's fused kernel keeps dropout inside, but draws its bits from a generator whose seed
is a compile-time constant and whose offset XLA advances per execution of each call site:
masks are then not a function of (seed, step), so a resumed run differs, and under nn.scan
the backward pass (which runs the layers in reverse) reads other offsets than the forward
did. Here the dropout bits are a hash of a traced seed (drawn from the layer's "dropout"
stream, as every other dropout) and of each element's (batch, head, query, key) index: the
same in the forward and backward kernels, the same for a resumed run, different for every
layer under nn.scan.

The kernels follow FlashAttention-2 (Dao, 2023) on Pallas' **Triton** backend, chosen
explicitly by compiler params (a `pallas_call` without them goes to Mosaic GPU on jax
0.10, where these kernels do not lower):

* forward, one program per (query block, batch, head): the key blocks stream through an
  online softmax; o = sum_k dropout(p_k) v_k / rowsum(p), with p = exp(s - running max)
  and s = scale q.k + bias, masked keys at MASKED (computed in base 2: exp2 of s / ln 2,
  the scale folded into one multiply, as FlashAttention-2's Triton kernels do). Dropout
  multiplies the normalised probabilities, so it applies to the numerator only. It also
  writes each row's max and log row sum (kept apart: a fully masked row has max MASKED,
  and MASKED + log m rounds back to MASKED in float32, which would make the backward
  recompute p = 1, not 1/m).
* backward, two kernels: per key block, dK, dV and the bias gradient; per query block,
  dQ. Both recompute p from the row statistics and the keep mask from the hash, with
  dS = P * (dropout'(dO V^T) - rowsum(dO * O)), zero at masked keys; the bias gradient
  is dS itself.

The bias is [1 or B, heads, n, m], or a by_position.GridBias: a per-example bias read
by position from its grid [heads, P, P] (MAE-LM's relative bias at each row's kept
positions), or where the grid is relative from its row of diagonals [heads, W] by
distance (a few KB a head). Its gradient (KernelOptions.bias_grad): a dense per-example
bias gets dS per row in the bias's own dtype; a GridBias's grid gets its gradient from a
kernel of its own over the grid's tiles (_grid_dbias_kernel: each row's queries and keys
at the tile's positions gathered, P and dP formed again, summed over the batch in
registers), so no per-example dS is ever in memory; a bias shared by the batch ([1, ...],
the relative position bias of a full-length encoder) either has dS summed over the batch
inside the dkv kernel ("batch": each program loops over a group of rows and accumulates
its [n, block_k] column; `bias_grad_groups` groups, summed by XLA, deterministic, no
atomics), by a kernel of its own in registers ("kernel": no read-modify-write in the dkv
loop), or written per row in float32 and summed by XLA ("rows", the [B, heads, n, m]
round trip, kept to measure against).

Dropout bits (KernelOptions.hash_elements): models/dropout_hash.py, shared with the TPU
kernel (models/flash_attention_tpu.py), which draws the same mask.

Lengths: n and m must be multiples of the tiles' (KernelOptions.length_multiple); the
encoder pads its input once to that multiple (models/encoder.py). Other callers' lengths
are padded here (padded keys masked out) and the result sliced. On a CPU the same kernels
run in Pallas' interpreter (slowly; for tests): the choice is made when the program is
lowered (jax.lax.platform_dependent), so a program exported for CUDA on a CPU host holds
the Triton kernels.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# The kernel's options are plain data (config/options.py), so configs check them without
# importing this kernel; re-exported for the kernel's callers.
from maelm_jax.config.options import (  # noqa: F401 (re-exported)
    BIAS_GRADS,
    HASH_ELEMENTS,
    KernelOptions,
    OptionsError,
    Tile,
)
from maelm_jax.models import by_position, flash_attention_tpu
from maelm_jax.models.dropout_hash import (  # noqa: F401 (re-exported: the kernel's bits)
    dropped_fraction,
    keep,
    keep_elements,
    keep_mask,
    row_stream,
    shard_row_stream,
)

# The score of a masked key: large and finite, so a fully masked row has no NaN.
MASKED = -1e30
# Scores in base 2 (exp(x) = 2^(x log2 e)): _scores.
LOG2_E = 1.4426950408889634
# The name of the kernel's output and row statistics, for remat policies (models/stack.py).
RESIDUALS_NAME = "attention_kernel"
_DEFAULT_OPTIONS = KernelOptions()


def _compiler_params(tile: Tile) -> plgpu.CompilerParams:
    """Triton's launch parameters for `tile` (they also pin the Triton backend: without
    them jax 0.10 lowers a pallas_call for Mosaic GPU)."""
    return plgpu.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages)


# ----------------------------------------------------------------------------------------
# Kernels.


def _scores(q, k, bias, valid, scale):
    """[block_q, block_k] float32 scores of one tile in base 2: (scale q.k + bias) / ln 2,
    masked keys low, so that exp2 of them (one instruction on NVIDIA GPUs, where exp is
    a multiply and exp2) gives the softmax's numerators: the softmax's scale folded into
    the dot's and the bias's single multiply. The row statistics are in base 2 too.
    bias: the tile [block_q, block_k] or None; valid: the keys' [block_k] int or None."""
    s = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * (scale * LOG2_E)
    if bias is not None:
        s = s + bias.astype(jnp.float32) * LOG2_E
    if valid is not None:
        s = jnp.where(valid[None, :] != 0, s, MASKED)
    return s


def _dropout(x, kept, rate, elements):
    """x at the kept elements, scaled by the inverse of the kept fraction; 0 elsewhere."""
    if not rate:
        return x
    return jnp.where(kept, x * (1.0 / (1.0 - dropped_fraction(rate, elements))), 0.0)


def _position_tile(table_ref, q_positions, k_positions, reach: int):
    """A per-example bias tile [block_q, block_k] read at the tile's positions: from a
    relative grid's row of diagonals [W] by distance (`reach` > 0: a few KB a head, which
    stays in L1), else from the grid [P, P] itself."""
    if reach:
        distance = k_positions[None, :] - q_positions[:, None]
        return table_ref[jnp.clip(distance, -reach, reach) + reach]
    return table_ref[q_positions[:, None], k_positions[None, :]]


def _forward_kernel(seed_ref, q_ref, k_ref, v_ref, bias_ref, qpos_ref, kpos_ref, valid_ref,
                    o_ref, max_ref, logsum_ref, *, scale, rate, num_heads, key_stride,
                    elements, block_k, reach):
    """Grid (query block, batch, head). q [block_q, D], k and v [m, D], valid [m]; the bias
    [block_q, m], or its grid [P, P] (its row of diagonals [W] where `reach`) with qpos
    [block_q] and kpos [m]; o [block_q, D], max and logsum [block_q]."""
    block_q, head_dim = q_ref.shape
    num_keys = k_ref.shape[0]
    stream = shard_row_stream(seed_ref, pl.program_id(1), pl.program_id(2), num_heads)
    queries = pl.program_id(0) * block_q + jnp.arange(block_q)
    q = q_ref[...]
    q_positions = None if qpos_ref is None else qpos_ref[...]

    def body(j, carry):
        acc, row_max, row_sum = carry
        keys = pl.ds(j * block_k, block_k)
        bias = (None if bias_ref is None else bias_ref[:, keys] if qpos_ref is None
                else _position_tile(bias_ref, q_positions, kpos_ref[keys], reach))
        s = _scores(q, k_ref[keys, :], bias, None if valid_ref is None else valid_ref[keys],
                    scale)
        new_max = jnp.maximum(row_max, s.max(axis=1))
        p = jnp.exp2(s - new_max[:, None])
        correction = jnp.exp2(row_max - new_max)
        row_sum = correction * row_sum + p.sum(axis=1)
        if rate:
            p = _dropout(p, keep(stream, queries, j * block_k, block_k, key_stride, rate,
                                 elements), rate, elements)
        v = v_ref[keys, :]
        acc = correction[:, None] * acc + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return acc, new_max, row_sum

    init = (jnp.zeros((block_q, head_dim), jnp.float32),
            jnp.full((block_q,), MASKED, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    acc, row_max, row_sum = jax.lax.fori_loop(0, num_keys // block_k, body, init)
    o_ref[...] = (acc / row_sum[:, None]).astype(o_ref.dtype)
    max_ref[...] = row_max
    logsum_ref[...] = jnp.log2(row_sum)


def _probabilities(s, row_max, logsum):
    """p = 2^(s - max - log2 sum) [block_q, block_k]: the softmax from the forward's row
    statistics (base 2, as the scores; max and log sum apart, exact for fully masked
    rows)."""
    return jnp.exp2((s - row_max[:, None]) - logsum[:, None])


def _score_grad(p, dp, delta, valid):
    """dS = P (dP - delta), zero at masked keys (their scores do not depend on q, k or the
    bias, as in the einsum path's `where`)."""
    ds = p * (dp - delta[:, None])
    return ds if valid is None else jnp.where(valid[None, :] != 0, ds, 0.0)


def _dkv_kernel(seed_ref, q_ref, k_ref, v_ref, bias_ref, qpos_ref, kpos_ref, valid_ref,
                do_ref, max_ref, logsum_ref, delta_ref, dk_ref, dv_ref, *dbias_refs, scale,
                rate, num_heads, key_stride, elements, block_q, shared_bias, accumulate,
                barrier, reach):
    """Grid (key block, head, batch group) over R = B / groups rows each.

    q and do [R, n, D]; k, v, dk, dv [R, block_k, D]; valid [R, block_k]; max, logsum,
    delta [R, n]; bias [R, n, block_k], or [n, block_k] when shared by the batch, or the
    grid [P, P] (its row of diagonals [W] where `reach`) with qpos [R, n] and kpos
    [R, block_k]; dbias (dbias_refs: its one output for a dense bias whose gradient this
    kernel forms): [n, block_k] accumulated over the R rows when `accumulate`, else
    [R, n, block_k] per row.
    """
    dbias_ref = dbias_refs[0] if dbias_refs else None
    rows, block_k, head_dim = k_ref.shape
    num_queries = q_ref.shape[1]
    j, head, group = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    def row(r, _):
        stream = shard_row_stream(seed_ref, group * rows + r, head, num_heads)
        k, v = k_ref[r], v_ref[r]
        valid = None if valid_ref is None else valid_ref[r]

        def body(i, carry):
            dk, dv = carry
            queries = pl.ds(i * block_q, block_q)
            q, do = q_ref[r, queries, :], do_ref[r, queries, :]
            bias = None
            if qpos_ref is not None:
                bias = _position_tile(bias_ref, qpos_ref[r, queries], kpos_ref[r], reach)
            elif bias_ref is not None:
                bias = bias_ref[queries, :] if shared_bias else bias_ref[r, queries, :]
            p = _probabilities(_scores(q, k, bias, valid, scale), max_ref[r, queries],
                               logsum_ref[r, queries])
            dp = plgpu.dot(do, v, trans_b=True).astype(jnp.float32)
            if rate:
                kept = keep(stream, i * block_q + jnp.arange(block_q), j * block_k, block_k,
                            key_stride, rate, elements)
                p_dropped, dp = _dropout(p, kept, rate, elements), _dropout(dp, kept, rate,
                                                                           elements)
            else:
                p_dropped = p
            dv = dv + plgpu.dot(p_dropped.astype(do.dtype), do, trans_a=True
                                ).astype(jnp.float32)
            ds = _score_grad(p, dp, delta_ref[r, queries], valid)
            if dbias_ref is not None and accumulate:
                # Read back what this program wrote for the previous row (the load at the
                # first row reads unwritten memory, discarded by the where); the barrier
                # orders the threads' global stores before the next row's loads.
                before = dbias_ref[queries, :]
                dbias_ref[queries, :] = jnp.where(r > 0, before, 0.0) + ds
                if barrier:
                    plgpu.debug_barrier()
            elif dbias_ref is not None:
                dbias_ref[r, queries, :] = ds.astype(dbias_ref.dtype)
            dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True).astype(jnp.float32) * scale
            return dk, dv

        zeros = jnp.zeros((block_k, head_dim), jnp.float32)
        dk, dv = jax.lax.fori_loop(0, num_queries // block_q, body, (zeros, zeros))
        dk_ref[r] = dk.astype(dk_ref.dtype)
        dv_ref[r] = dv.astype(dv_ref.dtype)
        return 0

    jax.lax.fori_loop(0, rows, row, 0)


def _dbias_kernel(seed_ref, q_ref, k_ref, v_ref, bias_ref, valid_ref, do_ref, max_ref,
                  logsum_ref, delta_ref, dbias_ref, *, scale, rate, num_heads, key_stride,
                  elements):
    """Grid (query block, key block, head, batch group) over R = B / groups rows each: the
    gradient of a bias shared by the batch (KernelOptions.bias_grad "kernel"), summed over
    the group's rows in registers and written once, so the dK/dV kernel neither computes
    it nor reads back and rewrites a tile of memory per row behind a barrier; the price is
    the two matmuls of P and dP again.

    q and do [R, block_q, D]; k and v [R, block_k, D]; the bias tile [block_q, block_k];
    valid [R, block_k]; max, logsum, delta [R, block_q]; dbias [block_q, block_k] float32.
    """
    rows, block_q, _ = q_ref.shape
    block_k = k_ref.shape[1]
    i, j, head, group = (pl.program_id(axis) for axis in range(4))
    queries = i * block_q + jnp.arange(block_q)
    bias = bias_ref[...]

    def row(r, total):
        stream = shard_row_stream(seed_ref, group * rows + r, head, num_heads)
        valid = None if valid_ref is None else valid_ref[r]
        p = _probabilities(_scores(q_ref[r], k_ref[r], bias, valid, scale), max_ref[r],
                           logsum_ref[r])
        dp = plgpu.dot(do_ref[r], v_ref[r], trans_b=True).astype(jnp.float32)
        if rate:
            dp = _dropout(dp, keep(stream, queries, j * block_k, block_k, key_stride, rate,
                                   elements), rate, elements)
        return total + _score_grad(p, dp, delta_ref[r], valid)

    dbias_ref[...] = jax.lax.fori_loop(0, rows, row,
                                       jnp.zeros((block_q, block_k), jnp.float32))


def _grid_dbias_kernel(seed_ref, q_ref, k_ref, v_ref, grid_ref, qrow_ref, krow_ref,
                       valid_ref, do_ref, max_ref, logsum_ref, delta_ref, dgrid_ref, *, scale,
                       rate, num_heads, key_stride, elements):
    """Grid (query position block, key position block, head): the gradient of a per-example
    bias read from its grid by position (MAE-LM's relative bias at each row's kept
    positions), summed over the batch in registers and written once per tile of the grid,
    so that no per-example dS [B, heads, n, m] is ever in memory. Each row's queries and
    keys at the tile's positions are gathered (qrow, krow: the row's query and key at
    each position, -1 where it has none) and P and dP formed again from them.

    q and do [B, n, D]; k and v [B, m, D]; the grid tile [block_p, block_r]; qrow
    [B, block_p]; krow [B, block_r]; valid [B, m]; max, logsum, delta [B, n]; dgrid
    [block_p, block_r] float32.
    """
    rows, _, head_dim = q_ref.shape
    head = pl.program_id(2)
    bias = grid_ref[...]
    dims = jnp.arange(head_dim)[None, :]

    def row(r, total):
        stream = shard_row_stream(seed_ref, r, head, num_heads)
        qi, ki = qrow_ref[r], krow_ref[r]
        here = (qi >= 0)[:, None] & (ki >= 0)[None, :]
        qi, ki = jnp.maximum(qi, 0), jnp.maximum(ki, 0)
        if valid_ref is not None:
            here = here & (valid_ref[r, ki] != 0)[None, :]
        valid = here.astype(jnp.int32)
        q, d_out = q_ref[r, qi[:, None], dims], do_ref[r, qi[:, None], dims]
        k, v = k_ref[r, ki[:, None], dims], v_ref[r, ki[:, None], dims]
        s = _scores(q, k, bias, None, scale)
        s = jnp.where(valid != 0, s, MASKED)
        p = _probabilities(s, max_ref[r, qi], logsum_ref[r, qi])
        dp = plgpu.dot(d_out, v, trans_b=True).astype(jnp.float32)
        if rate:
            kept = keep_elements(stream, qi[:, None], ki[None, :], key_stride, rate, elements)
            dp = _dropout(dp, kept, rate, elements)
        ds = p * (dp - delta_ref[r, qi][:, None])
        return total + jnp.where(valid != 0, ds, 0.0)

    dgrid_ref[...] = jax.lax.fori_loop(0, rows, row, jnp.zeros(bias.shape, jnp.float32))


def _dq_kernel(seed_ref, q_ref, k_ref, v_ref, bias_ref, qpos_ref, kpos_ref, valid_ref,
               do_ref, max_ref, logsum_ref, delta_ref, dq_ref, *, scale, rate, num_heads,
               key_stride, elements, block_k, reach):
    """Grid (query block, batch, head). q, do, dq [block_q, D]; k, v [m, D]; bias
    [block_q, m], or the grid [P, P] with qpos [block_q] and kpos [m]; valid [m]; max,
    logsum, delta [block_q]."""
    block_q, head_dim = q_ref.shape
    num_keys = k_ref.shape[0]
    stream = shard_row_stream(seed_ref, pl.program_id(1), pl.program_id(2), num_heads)
    queries = pl.program_id(0) * block_q + jnp.arange(block_q)
    q, do = q_ref[...], do_ref[...]
    row_max, logsum, delta = max_ref[...], logsum_ref[...], delta_ref[...]
    q_positions = None if qpos_ref is None else qpos_ref[...]

    def body(j, dq):
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        valid = None if valid_ref is None else valid_ref[keys]
        bias = (None if bias_ref is None else bias_ref[:, keys] if qpos_ref is None
                else _position_tile(bias_ref, q_positions, kpos_ref[keys], reach))
        s = _scores(q, k, bias, valid, scale)
        p = _probabilities(s, row_max, logsum)
        dp = plgpu.dot(do, v, trans_b=True).astype(jnp.float32)
        if rate:
            dp = _dropout(dp, keep(stream, queries, j * block_k, block_k, key_stride, rate,
                                   elements), rate, elements)
        ds = _score_grad(p, dp, delta, valid)
        return dq + plgpu.dot(ds.astype(k.dtype), k).astype(jnp.float32) * scale

    dq = jax.lax.fori_loop(0, num_keys // block_k, body,
                           jnp.zeros((block_q, head_dim), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


# ----------------------------------------------------------------------------------------
# Calls.


def _call(kernel, tile: Tile, grid, in_specs, out_specs, out_shape, name: str,
          interpret: bool, **static):
    """The kernel as a function of its inputs (None for an absent bias or mask), on Triton
    or in Pallas' interpreter."""
    if "barrier" in static:  # Triton's barrier; the interpreter runs one thread
        static["barrier"] = not interpret
    return pl.pallas_call(functools.partial(kernel, **static), grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape, interpret=interpret,
                          name=name, compiler_params=_compiler_params(tile))


def _by_platform(kind: str, interpret: bool | None, static: tuple, *args):
    """The `kind` ("forward" or "backward") of the kernels on `args` (then `static`): the
    Triton kernels, Pallas' interpreter on a CPU or the TPU kernels
    (models/flash_attention_tpu.py), chosen when the program is lowered; `interpret`
    (True / False) forces the GPU kernels, interpreted or not."""
    gpu, tpu = _KERNELS[kind]
    if interpret is not None:
        return gpu(interpret, *args, *static)
    leaves, tree = jax.tree.flatten(args)
    # Each branch gets the leaves and rebuilds the arguments (None stays None).
    branch = lambda f: lambda *xs: f(*jax.tree.unflatten(tree, xs), *static)  # noqa: E731
    return jax.lax.platform_dependent(
        *leaves, cpu=branch(functools.partial(gpu, True)), tpu=branch(tpu),
        default=branch(functools.partial(gpu, False)))


def _parts(bias) -> tuple:
    """(what the kernels read the bias from, query positions, key positions, reach) of a
    call's bias: a dense bias as it is; a GridBias's grid [H, P, P], or where it is
    relative its row of diagonals [H, W] (`_diagonals`) with its reach."""
    if not isinstance(bias, by_position.GridBias):
        return bias, None, None, 0
    reach = min(bias.reach, bias.grid.shape[1] - 1)
    if reach:
        return _diagonals(bias.grid, reach), bias.q_pos, bias.k_pos, reach
    return bias.grid, bias.q_pos, bias.k_pos, 0


def _diagonals(grid: jax.Array, reach: int) -> jax.Array:
    """A relative grid [H, P, P] (a function of r - p, constant beyond +-reach) as its
    diagonals -reach .. reach: [H, W] float32, diagonal d at d + reach, W the next power of
    two (Triton's blocks; the rest repeats the last diagonal, never read)."""
    above = grid[:, 0, :reach + 1]  # distances 0 .. reach: row 0
    below = grid[:, reach:0:-1, 0]  # distances -reach .. -1: column 0
    row = jnp.concatenate([below, above], axis=1).astype(jnp.float32)
    width = 1 << (2 * reach).bit_length()
    return jnp.pad(row, ((0, 0), (0, width - row.shape[1])), mode="edge")


def _table_spec(table, index_map) -> pl.BlockSpec:
    """A head's grid [P, P] or row of diagonals [W], whole, at `index_map`'s head."""
    return pl.BlockSpec((None, *table.shape[1:]),
                        lambda *ids: (index_map(*ids), *(0,) * (table.ndim - 1)))


def _query_bias_specs(bias, qpos, bq: int, m: int) -> list:
    """The forward's and dQ's BlockSpecs of the bias (or its grid or row of diagonals) and
    the positions, over the grid (query block, batch, head)."""
    if qpos is not None:
        return [_table_spec(bias, lambda i, b, h: h),
                pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                pl.BlockSpec((None, m), lambda i, b, h: (b, 0))]
    if bias is None:
        return [None, None, None]
    bias_row = (lambda b: b) if bias.shape[0] > 1 else (lambda b: 0)
    return [pl.BlockSpec((None, None, bq, m), lambda i, b, h: (bias_row(b), h, i, 0)),
            None, None]


def _forward(q, k, v, bias, qpos, kpos, reach, valid, seed, scale, rate, key_stride,
             num_heads, options, interpret):
    B, n, H, D = q.shape
    m = k.shape[1]
    tile = options.forward
    bq = tile.block_q
    in_specs = [
        pl.BlockSpec((4,), lambda i, b, h: (0,)),
        pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, m, None, D), lambda i, b, h: (b, 0, h, 0)),
        pl.BlockSpec((None, m, None, D), lambda i, b, h: (b, 0, h, 0)),
        *_query_bias_specs(bias, qpos, bq, m),
        None if valid is None else pl.BlockSpec((None, m), lambda i, b, h: (b, 0)),
    ]
    row_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    return _call(
        _forward_kernel, tile, (n // bq, B, H), in_specs,
        [pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)), row_spec, row_spec],
        [jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct((B, H, n), jnp.float32),
         jax.ShapeDtypeStruct((B, H, n), jnp.float32)],
        "flash_attention_forward", interpret, scale=scale, rate=rate, num_heads=num_heads,
        key_stride=key_stride, elements=options.hash_elements, block_k=tile.block_k,
        reach=reach,
    )(seed, q, k, v, bias, qpos, kpos, valid)


def bias_grad_groups(batch: int, bias_batch: int | None, options: KernelOptions) -> int:
    """Programs over the batch in the dkv kernel: one per row, unless a bias shared by the
    batch has its gradient summed inside ("batch"): then `row_groups`."""
    if (bias_batch is None or bias_batch == batch
            or options.bias_grad in ("rows", "kernel")):
        return batch
    return row_groups(batch, options)


def row_groups(batch: int, options: KernelOptions) -> int:
    """The groups of rows a shared bias's gradient is summed in (by the dkv kernel, or by
    the dbias kernel of "kernel"): the largest divisor of the batch that is at most
    options.bias_grad_groups; XLA adds the groups' float32 partial sums."""
    return max(g for g in range(1, min(batch, options.bias_grad_groups) + 1)
               if batch % g == 0)


def _dkv(args, shapes, scale, rate, key_stride, num_heads, options, interpret, reach):
    """dK, dV and a dense bias's gradient (None for a bias read by position: `_grid_dbias`
    forms its grid's)."""
    seed, q, k, v, bias, qpos, kpos, valid, d_out, row_max, logsum, delta = args
    B, n, H, D = shapes
    m = k.shape[1]
    tile = options.dkv
    bk = tile.block_k
    on_grid = qpos is not None
    groups = bias_grad_groups(B, None if bias is None else B if on_grid else bias.shape[0],
                              options)
    R = B // groups
    shared = bias is not None and not on_grid and bias.shape[0] == 1 and B > 1
    # "kernel": a kernel of its own sums the shared bias's gradient (_dbias below).
    separate = shared and options.bias_grad == "kernel"
    accumulate = shared and R > 1 and not separate
    per_row = lambda j, h, g: (g, 0, h, 0)  # noqa: E731
    key_rows = lambda j, h, g: (g, j, h, 0)  # noqa: E731
    stats = pl.BlockSpec((R, None, n), lambda j, h, g: (g, h, 0))
    position_specs = [None, None]
    if bias is None:
        bias_spec = None
    elif on_grid:
        bias_spec = _table_spec(bias, lambda j, h, g: h)
        position_specs = [pl.BlockSpec((R, n), lambda j, h, g: (g, 0)),
                          pl.BlockSpec((R, bk), lambda j, h, g: (g, j))]
    elif shared:
        bias_spec = pl.BlockSpec((None, None, n, bk), lambda j, h, g: (0, h, 0, j))
    else:
        bias_spec = pl.BlockSpec((R, None, n, bk), lambda j, h, g: (g, h, 0, j))
    in_specs = [pl.BlockSpec((4,), lambda j, h, g: (0,)),
                pl.BlockSpec((R, n, None, D), per_row),
                pl.BlockSpec((R, bk, None, D), key_rows),
                pl.BlockSpec((R, bk, None, D), key_rows),
                bias_spec, *position_specs,
                None if valid is None else pl.BlockSpec((R, bk), lambda j, h, g: (g, j)),
                pl.BlockSpec((R, n, None, D), per_row), stats, stats, stats]
    out_specs = [pl.BlockSpec((R, bk, None, D), key_rows)] * 2
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if bias is not None and not separate and not on_grid:
        if accumulate:  # one float32 column per group, summed over its rows
            out_specs.append(pl.BlockSpec((None, None, n, bk), lambda j, h, g: (g, h, 0, j)))
            out_shape.append(jax.ShapeDtypeStruct((groups, H, n, m), jnp.float32))
        else:  # per row: in the bias's dtype for a per-example bias, else float32 to sum
            out_specs.append(pl.BlockSpec((R, None, n, bk), lambda j, h, g: (g, h, 0, j)))
            out_shape.append(jax.ShapeDtypeStruct(
                (B, H, n, m), jnp.float32 if shared else bias.dtype))
    grads = _call(
        _dkv_kernel, tile, (m // bk, H, groups), in_specs, out_specs, out_shape,
        "flash_attention_dkv", interpret, scale=scale, rate=rate, num_heads=num_heads,
        key_stride=key_stride, elements=options.hash_elements, block_q=tile.block_q,
        shared_bias=shared, accumulate=accumulate, barrier=True, reach=reach,
    )(*args)
    dk, dv = grads[0], grads[1]
    dbias = None
    if separate:
        dbias = _dbias(args, shapes, scale, rate, key_stride, num_heads, options,
                       interpret).astype(bias.dtype)
    elif bias is not None and not on_grid:
        dbias = grads[2]
        if dbias.shape[0] != bias.shape[0]:
            dbias = dbias.sum(axis=0, keepdims=True)
        dbias = dbias.astype(bias.dtype)
    return dk, dv, dbias


def _dbias(args, shapes, scale, rate, key_stride, num_heads, options, interpret, reach=0):
    """The gradient [1, H, n, m] of a bias shared by the batch, by _dbias_kernel on the dQ
    kernel's tile: float32 per group of rows, the groups summed by XLA."""
    seed, q, k, v, bias, qpos, kpos, valid, d_out, row_max, logsum, delta = args
    B, n, H, D = shapes
    m = k.shape[1]
    tile = options.dq
    bq, bk = tile.block_q, tile.block_k
    groups = row_groups(B, options)
    R = B // groups
    queries = pl.BlockSpec((R, bq, None, D), lambda i, j, h, g: (g, i, h, 0))
    keys = pl.BlockSpec((R, bk, None, D), lambda i, j, h, g: (g, j, h, 0))
    stats = pl.BlockSpec((R, None, bq), lambda i, j, h, g: (g, h, i))
    in_specs = [pl.BlockSpec((4,), lambda i, j, h, g: (0,)), queries, keys, keys,
                pl.BlockSpec((None, None, bq, bk), lambda i, j, h, g: (0, h, i, j)),
                None if valid is None else pl.BlockSpec((R, bk), lambda i, j, h, g: (g, j)),
                queries, stats, stats, stats]
    partial = _call(
        _dbias_kernel, tile, (n // bq, m // bk, H, groups), in_specs,
        pl.BlockSpec((None, None, bq, bk), lambda i, j, h, g: (g, h, i, j)),
        jax.ShapeDtypeStruct((groups, H, n, m), jnp.float32), "flash_attention_dbias",
        interpret, scale=scale, rate=rate, num_heads=num_heads, key_stride=key_stride,
        elements=options.hash_elements,
    )(seed, q, k, v, bias, valid, d_out, row_max, logsum, delta)
    return partial.sum(axis=0, keepdims=True)


def _position_rows(positions: jax.Array, size: int) -> jax.Array:
    """[B, size] int32: each row's index at each position of `positions` [B, n] (its first
    occurrence: padding repeats position 0 after a real 0), -1 where the row has none."""
    B, n = positions.shape
    first = jnp.full((B, size), n, jnp.int32).at[
        jnp.arange(B)[:, None], positions].min(jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32),
                                                               (B, n)))
    return jnp.where(first == n, -1, first)


def _grid_dbias(bias: by_position.GridBias, args, shapes, scale, rate, key_stride, num_heads,
                options, interpret):
    """A GridBias's grid's gradient [H, P, P] by _grid_dbias_kernel on the dQ kernel's tile
    (the grid padded to it), with no per-example dS in memory."""
    seed, q, k, v, _, qpos, kpos, valid, d_out, row_max, logsum, delta = args
    B, n, H, D = shapes
    m = k.shape[1]
    grid = bias.grid
    P = grid.shape[1]
    bp, br = options.dq.block_q, options.dq.block_k
    Pq, Pr = -(-P // bp) * bp, -(-P // br) * br
    table = jnp.pad(grid, ((0, 0), (0, Pq - P), (0, Pr - P)))
    qrow, krow = _position_rows(qpos, Pq), _position_rows(kpos, Pr)
    rows = lambda size: pl.BlockSpec((B, size, None, D), lambda i, j, h: (0, 0, h, 0))  # noqa: E731
    stats = pl.BlockSpec((B, None, n), lambda i, j, h: (0, h, 0))
    in_specs = [pl.BlockSpec((4,), lambda i, j, h: (0,)), rows(n), rows(m), rows(m),
                pl.BlockSpec((None, bp, br), lambda i, j, h: (h, i, j)),
                pl.BlockSpec((B, bp), lambda i, j, h: (0, i)),
                pl.BlockSpec((B, br), lambda i, j, h: (0, j)),
                None if valid is None else pl.BlockSpec((B, m), lambda i, j, h: (0, 0)),
                rows(n), stats, stats, stats]
    d_grid = _call(
        _grid_dbias_kernel, options.dq, (Pq // bp, Pr // br, H), in_specs,
        pl.BlockSpec((None, bp, br), lambda i, j, h: (h, i, j)),
        jax.ShapeDtypeStruct((H, Pq, Pr), jnp.float32), "flash_attention_grid_dbias",
        interpret, scale=scale, rate=rate, num_heads=num_heads, key_stride=key_stride,
        elements=options.hash_elements,
    )(seed, q, k, v, table, qrow, krow, valid, d_out, row_max, logsum, delta)
    return d_grid[:, :P, :P].astype(grid.dtype)


def _dq(args, shapes, scale, rate, key_stride, num_heads, options, interpret, reach):
    seed, q, k, v, bias, qpos, kpos, valid, d_out, row_max, logsum, delta = args
    B, n, H, D = shapes
    m = k.shape[1]
    tile = options.dq
    bq = tile.block_q
    query_rows = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0))
    stats = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    in_specs = [pl.BlockSpec((4,), lambda i, b, h: (0,)), query_rows,
                pl.BlockSpec((None, m, None, D), lambda i, b, h: (b, 0, h, 0)),
                pl.BlockSpec((None, m, None, D), lambda i, b, h: (b, 0, h, 0)),
                *_query_bias_specs(bias, qpos, bq, m),
                None if valid is None else pl.BlockSpec((None, m), lambda i, b, h: (b, 0)),
                query_rows, stats, stats, stats]
    return _call(
        _dq_kernel, tile, (n // bq, B, H), in_specs, query_rows,
        jax.ShapeDtypeStruct(q.shape, q.dtype), "flash_attention_dq", interpret, scale=scale,
        rate=rate, num_heads=num_heads, key_stride=key_stride, elements=options.hash_elements,
        block_k=tile.block_k, reach=reach,
    )(*args)


def _gpu_forward(interpret, q, k, v, bias, valid, seed, scale, rate, key_stride, num_heads,
                 options):
    """-> out [B, n, H, D] and the row max and log sum [B, H, n]."""
    return _forward(q, k, v, *_parts(bias), valid, seed, scale, rate, key_stride, num_heads,
                    options, interpret)


def _gpu_backward(interpret, q, k, v, bias, valid, seed, out, row_max, logsum, d_out, scale,
                  rate, key_stride, num_heads, options):
    """-> dq, dk, dv and the bias's gradient (the grid's for a GridBias) or None."""
    # rowsum(dO * O) = rowsum(dP~ * P~): the softmax's backward term, [B, H, n].
    delta = jnp.einsum("bnhd,bnhd->bhn", d_out.astype(jnp.float32), out.astype(jnp.float32))
    table, qpos, kpos, reach = _parts(bias)
    args = (seed, q, k, v, table, qpos, kpos, valid, d_out, row_max, logsum, delta)
    static = (q.shape, scale, rate, key_stride, num_heads, options, interpret, reach)
    dk, dv, dbias = _dkv(args, *static)
    if isinstance(bias, by_position.GridBias):
        dbias = _grid_dbias(bias, args, *static[:-1])
    return _dq(args, *static), dk, dv, dbias


def _tpu_forward(*args):
    return flash_attention_tpu.forward(*args, interpret=False)


def _tpu_backward(*args):
    return flash_attention_tpu.backward(*args, interpret=False)


_KERNELS = {"forward": (_gpu_forward, _tpu_forward), "backward": (_gpu_backward, _tpu_backward)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _attention(q, k, v, bias, valid, seed, scale, rate, key_stride, num_heads, options,
               interpret):
    return _attention_fwd(q, k, v, bias, valid, seed, scale, rate, key_stride, num_heads,
                          options, interpret)[0]


def _attention_fwd(q, k, v, bias, valid, seed, scale, rate, key_stride, num_heads, options,
                   interpret):
    out, row_max, logsum = _by_platform(
        "forward", interpret, (scale, rate, key_stride, num_heads, options), q, k, v, bias,
        valid, seed)
    # Named, so that a remat policy can keep them ("dots_attention"): the backward then
    # reads the forward's output and row statistics instead of running the forward again.
    out, row_max, logsum = (checkpoint_name(x, RESIDUALS_NAME) for x in (out, row_max, logsum))
    return out, (q, k, v, bias, valid, seed, out, row_max, logsum)


def _attention_bwd(scale, rate, key_stride, num_heads, options, interpret, residuals, d_out):
    bias = residuals[3]
    dq, dk, dv, dbias = _by_platform(
        "backward", interpret, (scale, rate, key_stride, num_heads, options), *residuals,
        d_out)
    if isinstance(bias, by_position.GridBias):  # integer positions: no gradient
        dbias = bias.cotangent(dbias)
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
              dropout_rate: float = 0.0, options: KernelOptions = _DEFAULT_OPTIONS,
              interpret: bool | None = None, row_offset: tuple[Any, Any] = (0, 0),
              num_heads: int | None = None) -> jax.Array:
    """softmax(scale q.k + bias, keys where key_valid), dropped out at dropout_rate, times v.

    q [B, n, H, D], k and v [B, m, H, D] (D a power of two >= 16); bias [1 or B, H, n, m],
    a by_position.GridBias (each tile read from its grid by position: no [B, H, n, m]
    operand) or None; key_valid [B, m] bool or None; seed [2] uint32, the dropout bits' seed (unused
    at rate 0). options: tiles and variants (KernelOptions). interpret: Pallas' interpreter
    (True) or Triton (False); by default the interpreter on a CPU and Triton elsewhere,
    decided when the program is lowered. Lengths that are not multiples of the tiles are
    padded here (padded keys masked) and the result sliced.
    row_offset, num_heads: for a shard of a larger call (jax.shard_map), its first batch
    row and head in the whole, and the whole's heads (default: this call's), so that the
    dropout bits do not depend on how the call is split.
    Returns [B, n, H, D] in q's dtype. Differentiable in q, k, v and bias.
    """
    n, m = q.shape[1], k.shape[1]
    n_pad = -(-n // options.query_multiple) * options.query_multiple
    m_pad = -(-m // options.key_multiple) * options.key_multiple
    if m_pad != m and key_valid is None:
        key_valid = jnp.ones((k.shape[0], m), bool)
    valid = None if key_valid is None else _pad_to(key_valid.astype(jnp.int32), 1, m_pad)
    q = _pad_to(q, 1, n_pad)
    k, v = _pad_to(k, 1, m_pad), _pad_to(v, 1, m_pad)
    if isinstance(bias, by_position.GridBias):  # padding at position 0, after the others
        bias = bias._replace(q_pos=_pad_to(bias.q_pos, 1, n_pad),
                             k_pos=_pad_to(bias.k_pos, 1, m_pad))
    elif bias is not None:
        bias = _pad_to(_pad_to(bias, 2, n_pad), 3, m_pad)
    words = jnp.concatenate([seed.astype(jnp.uint32).reshape(2),
                             jnp.asarray(row_offset, jnp.uint32).reshape(2)])
    out = _attention(q, k, v, bias, valid, words, float(scale), float(dropout_rate), m,
                     num_heads or q.shape[2], options, interpret)
    return out[:, :n]
