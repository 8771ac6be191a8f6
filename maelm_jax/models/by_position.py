"""Lookups by position whose gradients gather and sum instead of scattering.

A lookup's gradient is a scatter-add: every looked-up row's cotangent added into its
table row, B additions per cell where the batch repeats positions, atomic additions on a
GPU whose order (so whose float sum) changes from run to run. Where each row of the batch
holds distinct positions (MAE-LM's and 3ML's kept tokens: their original positions),
each table row's gradient is instead the cotangent at the one place its position occurs
in each row (`first_index`), gathered back and summed over the batch in float32: no
scatter, no atomics, the same sum on every run (exact resume).

Padding appended after a row's positions may repeat one of them (the encoder pads with
position 0): its cotangent is zero (padded keys are masked, padded rows dropped), and the
first occurrence, the real one, is the one read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


def first_index(ids: jax.Array, num_ids: int) -> jax.Array:
    """[B, n] ids -> [B, num_ids]: the index of each id's first occurrence in its row, n
    where it does not occur (a compare and a min over [B, n, num_ids]: no scatter)."""
    n = ids.shape[1]
    hit = ids[:, :, None] == jnp.arange(num_ids, dtype=ids.dtype)
    return jnp.min(jnp.where(hit, jnp.arange(n, dtype=jnp.int32)[None, :, None], n), axis=1)


def rows_at_first_index(cotangent: jax.Array, ids: jax.Array, num_ids: int,
                            axis: int) -> jax.Array:
    """For each id, the slice of `cotangent` [B, ..., n (at `axis`), ...] at the index where
    the id first occurs in its row (zero where it does not): [B, ..., num_ids, ...] in the
    cotangent's dtype. A gather, no scatter."""
    at = first_index(ids, num_ids)  # [B, num_ids]
    shape = [1] * cotangent.ndim
    shape[0], shape[axis] = at.shape
    index = jnp.minimum(at, ids.shape[1] - 1).reshape(shape)
    picked = jnp.take_along_axis(cotangent, index, axis=axis)
    return jnp.where((at < ids.shape[1]).reshape(shape), picked,
                     jnp.zeros((), cotangent.dtype))


def sum_over_batch(x: jax.Array) -> jax.Array:
    """x [B, ...] summed over its leading axis in float32 (a dot with ones, which makes no
    float32 copy of x)."""
    return jnp.tensordot(jnp.ones(x.shape[0], x.dtype), x, axes=1,
                         preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def take_rows(table: jax.Array, ids: jax.Array, dtype: str) -> jax.Array:
    """table [V, D] at ids [B, n] (distinct in each row) -> [B, n, D] in `dtype` (a name);
    its gradient gathers each id's row of the cotangent and sums the batch."""
    return jnp.take(table, ids, axis=0).astype(dtype)


def _take_rows_forward(table, ids, dtype):
    # The table itself is kept only for its shape (a zero-size slice of it).
    return jnp.take(table, ids, axis=0).astype(dtype), (ids, table[:, :0])


def _take_rows_backward(dtype, residuals, cotangent):
    ids, empty = residuals
    rows = rows_at_first_index(cotangent, ids, empty.shape[0], axis=1)  # [B, V, D]
    return sum_over_batch(rows).astype(empty.dtype), None


take_rows.defvjp(_take_rows_forward, _take_rows_backward)



@functools.partial(jax.tree_util.register_dataclass, data_fields=["grid", "q_pos", "k_pos"],
                   meta_fields=["reach"])
@dataclasses.dataclass(frozen=True)
class GridBias:
    """A per-example bias kept as the grid it is read from: bias[b, h, i, j] =
    grid[h, q_pos[b, i], k_pos[b, j]]. The Pallas kernels read its tiles by position
    (models/flash_attention.py, models/flash_attention_tpu.py), so the [B, heads, n, m]
    bias never exists; elsewhere `materialise` makes it.

    reach (static): 0, or the grid is relative, grid[h, p, r] a function of r - p alone,
    constant for r - p >= reach and for r - p <= -reach: then a row of 2 reach + 1 values
    holds it whole (the TPU kernel reads that row by distance).
    """

    grid: jax.Array  # [heads, P, P] float32
    q_pos: jax.Array  # [B, n] int32, distinct in each row
    k_pos: jax.Array  # [B, m] int32, distinct in each row
    reach: int = 0

    def _replace(self, **changes) -> GridBias:
        return dataclasses.replace(self, **changes)

    def cotangent(self, d_grid: jax.Array) -> GridBias:
        """The cotangent of this bias whose grid's is `d_grid` (the positions, integers,
        have none)."""
        return GridBias(d_grid, *(np.zeros(p.shape, jax.dtypes.float0)
                                  for p in (self.q_pos, self.k_pos)), reach=self.reach)

    def materialise(self, dtype) -> jax.Array:
        """The bias [B, heads, n, m] in `dtype`."""
        return grid_bias(self.grid, self.q_pos, self.k_pos, jnp.dtype(dtype).name)


def gather_grid(grid: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                dtype) -> jax.Array:
    """grid [heads, P, P], q_pos [B, n], k_pos [B, m] -> [B, heads, n, m] in `dtype`."""
    rows = jnp.take(grid.astype(dtype), q_pos, axis=1)  # [heads, B, n, P]
    bias = jnp.take_along_axis(rows, k_pos[None, :, None, :], axis=3)  # [heads, B, n, m]
    return jnp.transpose(bias, (1, 0, 2, 3))


def grid_gradient(cotangent: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                  num_positions: int) -> jax.Array:
    """The grid's gradient [heads, P, P] (float32) from a bias's cotangent [B, heads, n, m]:
    each cell (h, p, r) the batch's cotangents at the row where p first occurs and the
    column where r does, summed."""
    rows = rows_at_first_index(cotangent, q_pos, num_positions, axis=2)  # [B, h, P, m]
    cells = rows_at_first_index(rows, k_pos, num_positions, axis=3)  # [B, h, P, P]
    return sum_over_batch(cells)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grid_bias(grid: jax.Array, q_pos: jax.Array, k_pos: jax.Array, dtype: str) -> jax.Array:
    """The bias [B, heads, n, m] of GridBias(grid, q_pos, k_pos), born in the compute
    `dtype` (a name) from the float32 grid; its gradient is `grid_gradient`."""
    return gather_grid(grid, q_pos, k_pos, dtype)


def _grid_bias_forward(grid, q_pos, k_pos, dtype):
    # The grid is kept only for its size (a zero-size slice of it).
    return gather_grid(grid, q_pos, k_pos, dtype), (q_pos, k_pos, grid[0, :, :0])


def _grid_bias_backward(dtype, residuals, cotangent):
    q_pos, k_pos, empty = residuals
    return grid_gradient(cotangent, q_pos, k_pos, empty.shape[0]), None, None


grid_bias.defvjp(_grid_bias_forward, _grid_bias_backward)
