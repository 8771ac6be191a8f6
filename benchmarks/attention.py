r"""Attention alone, on the machine at hand: the Pallas kernel checked against the einsum
reference, and every implementation timed forward + backward.

    python benchmarks/attention.py [--batch=32 --length=512 --heads=12 --head_dim=64 \
        --dropout=0.1 --dtype=bfloat16]

Checks (printed with their figures, each "ok" or "FAILED"):
* without dropout, the Pallas kernel's output and its gradients in q, k, v and the bias
  against the einsum path's at the compute dtype (bf16: relative error of the norms
  within 2e-2);
* with dropout, the kept fraction of the attention probabilities (values one-hot per key
  read them out: each output element is one dropped-out probability) within 4 sigma of
  1 - rate, and outputs of uniform attention over constant values with mean 1 and
  variance rate / (1 - rate) / m within 10 %;
* that the forward and backward kernels drop the same elements: for o = P~ v, the
  gradient in v must be P~^T do, with P~ read from the forward's output.
Then times jitted forward + backward (the gradient of a sum) at the given shapes with a
relative bias [1, heads, L, L] for: einsum with dropout (the materialised path), cuDNN
without dropout (jax.nn.dot_product_attention; GPU only), and Pallas with dropout. Medians
of --repeats after a warm-up, synchronised.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from maelm_jax import cli
from maelm_jax.models import flash_attention as fa
from maelm_jax.models import layers

import harness

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 32, "Batch size.", lower_bound=1)
flags.DEFINE_integer("length", 512, "Query and key length.", lower_bound=1)
flags.DEFINE_integer("heads", 12, "Heads.", lower_bound=1)
flags.DEFINE_integer("head_dim", 64, "Head size (a power of two >= 16 for the kernel).",
                     lower_bound=16)
flags.DEFINE_float("dropout", 0.1, "Attention dropout rate.", lower_bound=0.0, upper_bound=0.9)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype.")
flags.DEFINE_integer("repeats", 20, "Timed calls per implementation.", lower_bound=1)


def _einsum(q, k, v, bias, key, rate):
    """The reference: our einsum path (layers.MultiHeadAttention._einsum_attention's
    formula) with flax-style dropout on the probabilities."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    s = s / np.sqrt(q.shape[-1]) + bias
    p = jax.nn.softmax(s, axis=-1)
    if rate:
        p = jnp.where(jax.random.bernoulli(key, 1 - rate, p.shape), p / (1 - rate), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(q.dtype), v)


def _pallas(q, k, v, bias, key, rate):
    seed = jax.random.bits(key, (2,), jnp.uint32)
    return fa.attention(q, k, v, bias.astype(q.dtype), None, seed,
                        scale=1 / np.sqrt(q.shape[-1]), dropout_rate=rate)


def _cudnn(q, k, v, bias, key, rate):
    del key, rate  # no dropout in the fused call
    return jax.nn.dot_product_attention(q, k, v, bias=bias.astype(q.dtype),
                                        implementation="cudnn")


def _report(name: str, ok: bool, detail: str) -> bool:
    print(f"{'ok    ' if ok else 'FAILED'} {name}: {detail}", flush=True)
    return ok


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(dtype) -> bool:
    B, L, H, D = 4, 256, 4, FLAGS.head_dim
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v = (jax.random.normal(key, (B, L, H, D), dtype) for key in keys[:3])
    bias = 0.5 * jax.random.normal(keys[3], (1, H, L, L), jnp.float32)
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    ok = True
    loss = lambda f: lambda *a: jnp.sum(  # noqa: E731
        f(*a, keys[4], 0.0).astype(jnp.float32) * jnp.cos(jnp.arange(D)))
    for name, got, want in zip(
            ("output", "d q", "d k", "d v", "d bias"),
            (_pallas(q, k, v, bias, keys[4], 0.0),
             *jax.jit(jax.grad(loss(_pallas), (0, 1, 2, 3)))(q, k, v, bias)),
            (_einsum(q, k, v, bias, keys[4], 0.0),
             *jax.jit(jax.grad(loss(_einsum), (0, 1, 2, 3)))(q, k, v, bias)), strict=False):
        error = _relative(got, want)
        ok &= _report(f"pallas vs einsum, no dropout, {name}", error <= tolerance,
                      f"relative error {error:.2e} (<= {tolerance:g})")

    rate, m = FLAGS.dropout or 0.1, D  # m keys, as many as the head has dimensions
    one_hot = jnp.broadcast_to(jnp.eye(m, D, dtype=dtype)[None, :, None, :], (B, m, H, D))
    zeros = jnp.zeros((B, L, H, D), dtype)
    flat_bias = jnp.zeros((1, H, L, m))
    probs = jax.jit(lambda key: _pallas(zeros, zeros[:, :m], one_hot, flat_bias, key, rate))(
        keys[4]).astype(jnp.float32)  # [B, L, H, m]: each element 0 or 1 / (m (1 - rate))
    kept = float(jnp.mean(probs > 0))
    sigma = np.sqrt(rate * (1 - rate) / probs.size)
    ok &= _report("kept fraction", abs(kept - (1 - rate)) <= 4 * sigma,
                  f"{kept:.5f} (expected {1 - rate:.5f} +- {4 * sigma:.5f})")
    ones = jnp.ones((B, m, H, D), dtype)
    out = jax.jit(lambda key: _pallas(zeros, zeros[:, :m], ones, flat_bias, key, rate))(
        keys[4]).astype(jnp.float32)[..., 0]
    variance = rate / (1 - rate) / m
    ok &= _report("uniform attention's output", abs(float(out.mean()) - 1) < 0.01
                  and abs(float(out.var()) / variance - 1) < 0.1,
                  f"mean {float(out.mean()):.4f} (1), variance {float(out.var()):.5f} "
                  f"({variance:.5f})")
    # v's gradient is P~^T do: P~ as the forward dropped it, read out with one-hot values.
    do = jax.random.normal(keys[3], (B, L, H, D), jnp.float32)
    qq, kk = (0.3 * jax.random.normal(key, (B, n, H, D), dtype) for key, n in
              zip(keys[:2], (L, m), strict=False))
    dv = jax.jit(jax.grad(lambda v_: jnp.sum(_pallas(qq, kk, v_, flat_bias, keys[4], rate)
                                              .astype(jnp.float32) * do)))(one_hot)
    p_dropped = jax.jit(lambda: _pallas(qq, kk, one_hot, flat_bias, keys[4], rate))()
    expected = jnp.einsum("bqhk,bqhd->bkhd", p_dropped.astype(jnp.float32), do)
    error = _relative(dv, expected)
    ok &= _report("forward and backward drop the same elements", error <= tolerance,
                  f"relative error of d v against P~^T do {error:.2e}")
    return ok


def timings(dtype) -> None:
    B, L, H, D = FLAGS.batch, FLAGS.length, FLAGS.heads, FLAGS.head_dim
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    q, k, v = (jax.random.normal(key, (B, L, H, D), dtype) for key in keys[:3])
    bias = 0.5 * jax.random.normal(keys[3], (1, H, L, L), jnp.float32)
    sides = {"einsum, dropout": (_einsum, FLAGS.dropout),
             "pallas, dropout": (_pallas, FLAGS.dropout)}
    if jax.default_backend() == "gpu" and dtype == jnp.bfloat16:
        sides["cudnn, no dropout"] = (_cudnn, 0.0)
    flops = 4 * B * H * L * L * D * 3  # two matmuls forward, four backward
    print(f"forward + backward, B={B}, L={L}, heads={H}, head_dim={D}, {FLAGS.dtype}, "
          f"bias [1, heads, L, L]:")
    for name, (f, rate) in sides.items():
        step = jax.jit(jax.grad(lambda q_, k_, v_, b_, key, f=f, rate=rate: jnp.sum(
            f(q_, k_, v_, b_, key, rate).astype(jnp.float32)), (0, 1, 2, 3)))
        jax.block_until_ready(step(q, k, v, bias, keys[4]))
        times = []
        for r in range(FLAGS.repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(q, k, v, bias, jax.random.fold_in(keys[4], r)))
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        print(f"  {name:18s} {ms:8.2f} ms  ({flops / ms / 1e9:6.1f} TFLOP/s of matmuls)",
              flush=True)


def main(argv) -> None:
    del argv
    dtype = jnp.dtype(FLAGS.dtype)
    print(harness.device_line() + f"; kernel tiles {fa.BLOCK_Q} x {fa.BLOCK_K}; "
          f"layers.ATTENTION_IMPLS {layers.ATTENTION_IMPLS}")
    ok = check(dtype)
    timings(dtype)
    if not ok:
        cli.fail("a check failed (see above)", cli.program())


if __name__ == "__main__":
    app.run(main, flags_parser=cli.tool_flags_parser)
