"""The TPU (Mosaic) flash-attention kernels (models/flash_attention_tpu.py): in Pallas'
interpreter against the formula and against the GPU kernel's bits, and compiled by XLA:TPU
for real with libtpu's compile-only devices (maelm_jax/infra/topology.py; skipped where libtpu
is absent)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax.config.options import KernelOptions, OptionsError, TpuTile
from maelm_jax.models import by_position, relative_position
from maelm_jax.models import flash_attention as fa
from maelm_jax.models import flash_attention_tpu as ft
from maelm_jax.pretrain import setup as setup_lib

from test_flash_attention import SCALE, _inputs, reference
from tiny_config import TINY_VOCAB, tiny_config, tiny_model

pytestmark = pytest.mark.tier("integration")

SEED = jnp.array([123, 456], jnp.uint32)
DEFAULT = KernelOptions()


def tpu(q, k, v, bias, valid, rate, options=DEFAULT):
    return ft.attention(q, k, v, bias, valid, SEED, scale=SCALE, dropout_rate=rate,
                        options=options, interpret=True)


def check(q, k, v, bias, valid, rate, options=DEFAULT, atol=5e-5):
    """Outputs and gradients (q, k, v and the bias) against the formula with the kernels'
    keep mask; returns the kernel's gradients."""
    elements = options.hash_elements
    np.testing.assert_allclose(tpu(q, k, v, bias, valid, rate, options),
                               reference(q, k, v, bias, valid, SEED, rate, elements),
                               atol=atol, rtol=atol)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    got = jax.grad(lambda *a: jnp.sum(jnp.sin(tpu(*a[:3], a[3] if bias is not None else None,
                                                  valid, rate, options))), argnums)(
        q, k, v, bias)
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(reference(
        *a[:3], a[3] if bias is not None else None, valid, SEED, rate, elements))), argnums)(
        q, k, v, bias)
    for name, g, w in zip("q k v bias".split(), got, want, strict=False):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(g, w, atol=atol, rtol=atol, err_msg=name)
    return got


@pytest.mark.parametrize("rate", [0.0, 0.3])
@pytest.mark.parametrize("bias_batch, masked", [(1, True), (2, False), (None, True)])
def test_kernels_match_the_formula(rate, bias_batch, masked):
    """Ragged lengths (70 queries, 90 keys, padded to the 128-wide tiles inside), a bias
    shared by the batch (its gradient summed over the batch in the kernel) or per row, or
    none; keys masked per row."""
    q, k, v, bias = _inputs(bias_batch=bias_batch or 1)
    valid = (jnp.arange(90)[None] < jnp.array([[90], [77]])) if masked else None
    got = check(q, k, v, bias if bias_batch else None, valid, rate)
    if masked:  # a masked key takes no attention, so no gradient reaches it
        assert float(jnp.abs(got[1][1, 77:]).max()) == 0.0


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_fully_masked_rows(rate):
    """A row whose keys are all masked attends uniformly (max and log sum kept apart), and
    no gradient reaches its q or k."""
    q, k, v, bias = _inputs(B=2, n=64, m=64)
    valid = jnp.arange(64)[None] < jnp.array([[64], [0]])
    got = check(q, k, v, bias, valid, rate)
    assert float(jnp.abs(got[0][1]).max()) == 0.0
    assert float(jnp.abs(got[1][1]).max()) == 0.0


@pytest.mark.parametrize("options", [
    KernelOptions(hash_elements=2),
    KernelOptions(hash_elements=4, tpu_forward=TpuTile(256, 128), tpu_dkv=TpuTile(128, 256),
                  tpu_dq=TpuTile(128, 256)),
], ids=["2 elements per hash", "4 per hash, other tiles"])
def test_variants_match_the_formula(options):
    """Several query and key blocks per program (300 queries, 260 keys), dropout's bits
    shared by 2 or 4 keys, 4 rows sharing a bias."""
    q, k, v, bias = _inputs(B=4, n=300, m=260)
    valid = jnp.arange(260)[None] < jnp.array([[260], [33], [200], [1]])
    check(q, k, v, bias, valid, 0.3, options)


def test_half_precision_is_the_formula_within_bfloat16():
    q, k, v, bias = (x.astype(jnp.bfloat16) for x in _inputs(B=2, n=128, m=128))
    valid = jnp.arange(128)[None] < jnp.array([[128], [100]])
    out = tpu(q, k, v, bias, valid, 0.1)
    assert out.dtype == jnp.bfloat16
    want = reference(*(x.astype(jnp.float32) for x in (q, k, v, bias)), valid, SEED, 0.1)
    np.testing.assert_allclose(out.astype(jnp.float32), want, atol=3e-2, rtol=3e-2)


def test_the_tpu_and_gpu_kernels_drop_the_same_elements():
    """The same seed gives the same output and gradients on both kernels (the GPU's run in
    its interpreter): a run resumes exactly across GPUs, TPUs and the CPU."""
    q, k, v, bias = _inputs(B=2, n=100, m=100, bias_batch=2)
    valid = jnp.arange(100)[None] < jnp.array([[100], [64]])

    def loss(kernel, *a):
        return jnp.sum(jnp.sin(kernel.attention(*a, valid, SEED, scale=SCALE,
                                                dropout_rate=0.5, interpret=True)))

    for got, want in zip(jax.value_and_grad(lambda *a: loss(ft, *a), (0, 1, 2, 3))(q, k, v, bias),
                         jax.value_and_grad(lambda *a: loss(fa, *a), (0, 1, 2, 3))(q, k, v, bias),
                         strict=True):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


def _relative_grid(P: int, bucket_fn: str, heads: int = 2):
    """A relative bias grid [heads, P, P] as the model makes it, and its reach."""
    table = jax.random.normal(jax.random.PRNGKey(3), (32, heads))
    relative = jnp.arange(P)[None, :] - jnp.arange(P)[:, None]
    buckets = relative_position.BUCKET_FNS[bucket_fn](relative, 32, 128)
    grid = jnp.transpose(table[buckets], (2, 0, 1))
    return grid, relative_position.relative_reach(bucket_fn, 32, 128, P)


@pytest.mark.parametrize("bucket_fn", ["t5", "maelm"])
@pytest.mark.parametrize("P", [64, 200, 512])
def test_a_relative_grid_is_constant_beyond_its_reach(bucket_fn, P):
    """The device's bucketing (jax.numpy) agrees with the host's reach: every diagonal at
    or beyond +-reach holds the value of the diagonal at +-reach."""
    grid, reach = _relative_grid(P, bucket_fn)
    assert 0 < reach <= P - 1
    if reach < P - 1:
        d = np.arange(reach, P)
        np.testing.assert_array_equal(grid[:, 0, d], np.repeat(grid[:, 0, reach:reach + 1],
                                                              len(d), axis=1))
        np.testing.assert_array_equal(grid[:, d, 0], np.repeat(grid[:, reach:reach + 1, 0],
                                                              len(d), axis=1))


@pytest.mark.parametrize("reach", ["relative", "none"])
@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_a_bias_read_by_distance_is_the_grid_s(rate, reach):
    """A per-example bias given as a relative grid and positions (read by distance from
    one row per head, no [B, H, n, m] operand), or a grid without a reach (made whole):
    the outputs and gradients of the same bias given whole, the grid's gradient gathered
    back. Positions beyond the reach; padding repeats position 0."""
    P = 512
    grid, relative = _relative_grid(P, "t5")
    q, k, v, _ = _inputs(B=2, n=70, m=90)
    rng = np.random.default_rng(0)
    q_pos = jnp.asarray(np.stack([np.sort(rng.permutation(P)[:70]) for _ in range(2)]))
    k_pos = jnp.asarray(np.stack([np.sort(rng.permutation(P)[:90]) for _ in range(2)]))
    q_pos, k_pos = q_pos.at[:, 0].set(0), k_pos.at[:, 0].set(0)
    valid = jnp.arange(90)[None] < jnp.array([[90], [77]])

    def run(q, k, v, grid, by_position_):
        bias = (by_position.GridBias(grid, q_pos, k_pos,
                                     reach=relative if reach == "relative" else 0)
                if by_position_ else by_position.grid_bias(grid, q_pos, k_pos, "float32"))
        return tpu(q, k, v, bias, valid, rate)

    np.testing.assert_allclose(run(q, k, v, grid, True), run(q, k, v, grid, False),
                               atol=2e-5, rtol=2e-5)
    loss = lambda *a: jnp.sum(jnp.sin(run(*a)))  # noqa: E731
    got = jax.grad(loss, (0, 1, 2, 3))(q, k, v, grid, True)
    want = jax.grad(loss, (0, 1, 2, 3))(q, k, v, grid, False)
    for name, g, w in zip(("q", "k", "v", "grid"), got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=name)


def test_the_model_trains_alike_on_both_kernels(monkeypatch):
    """MAE-LM with attention dropout on the "pallas" path, its kernels the TPU's (in the
    interpreter) or the GPU's: the same outputs and gradients in training, and the
    gradient reaches the relative position table through the bias read by distance."""
    c = tiny_config("maelm")
    c.model.update(attention_dropout=0.2, scan_layers=True)
    _, batch, params = tiny_model(c)
    c.model.attention_impl = "pallas"
    flash = setup_lib.model(c, TINY_VOCAB)

    def loss(p):
        return jnp.sum(flash.apply({"params": p}, batch, deterministic=False,
                                   rngs={"dropout": jax.random.PRNGKey(1)}) ** 2)

    gpu = jax.value_and_grad(loss)(params)
    forward = lambda *a: ft.forward(*a[-11:], interpret=True)  # noqa: E731 (no `interpret`)
    backward = lambda *a: ft.backward(*a[-15:], interpret=True)  # noqa: E731
    monkeypatch.setitem(fa._KERNELS, "forward", (forward, forward))
    monkeypatch.setitem(fa._KERNELS, "backward", (backward, backward))
    tpu_ = jax.value_and_grad(loss)(params)
    for g, w in zip(jax.tree.leaves(tpu_), jax.tree.leaves(gpu), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
    table = tpu_[1]["encoder"]["relative_bias"]["rel_embedding"]
    assert float(jnp.abs(table).max()) > 0


def test_tiles_and_vmem_are_checked_with_one_line():
    opts = KernelOptions.from_fields({"tpu_dkv": "128x256", "tpu_vmem_limit_mb": 32},
                                     "config.model.pallas")
    assert opts.tpu_dkv == TpuTile(128, 256) and opts.tpu_key_multiple == 256
    assert KernelOptions.from_fields(opts.fields()) == opts
    for fields, message in (
            ({"tpu_dq": "64x128"}, "config.model.pallas.tpu_dq: block_q must be a multiple "
                                   "of 128"),
            ({"tpu_forward": "128x128:4:2"}, "config.model.pallas.tpu_forward: expected "
                                             "'block_qxblock_k'"),
            ({"tpu_vmem_limit_mb": 0}, "config.model.pallas.tpu_vmem_limit_mb: must be")):
        with pytest.raises(OptionsError, match="^" + message.replace(".", r"\.")):
            KernelOptions.from_fields(fields, "config.model.pallas")
    KernelOptions().check_tpu_vmem(512, 512, 64)  # BERT-base fits the default 16 MiB
    with pytest.raises(OptionsError, match=r"^config\.model\.pallas\.tpu_(forward|dkv|dq): "
                                           r"the TPU kernel needs about [\d.]+ MiB") as e:
        KernelOptions().check_tpu_vmem(16384, 16384, 128, "config.model.pallas")
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ compiled for TPU


@pytest.fixture(scope="module")
def topology():
    pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -r "
                        "requirements-tpu-check.txt): no compile-only TPU devices")
    from maelm_jax.infra import topology as topology_lib

    return topology_lib


def _compile_for(devices, fn, *specs):
    mesh = jax.sharding.Mesh(devices[:1], ("x",))
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(fn, in_shardings=tuple(one for _ in specs), out_shardings=one).lower(
        *specs).compile()


@pytest.mark.parametrize("name", ["v5e:2x2", "v4:2x2x1", "v5p:2x2x1", "v6e:2x2"])
def test_the_kernels_compile_for_tpus_at_bert_base_shapes(topology, name):
    """Forward, dK/dV and dQ of BERT-base attention (12 heads of 64, MAE-LM's 435 kept
    tokens of 512, bfloat16, dropout 0.1) with the bias read by distance compile with
    Mosaic for each generation libtpu takes: three kernels, none of them interpreted."""
    devices = topology.devices(name)
    B, n, H, D = 2, 435, 12, 64
    S = jax.ShapeDtypeStruct

    def loss(q, k, v, grid, q_pos, k_pos, valid, seed):
        bias = by_position.GridBias(grid, q_pos, k_pos,
                                    reach=relative_position.relative_reach("t5", 32, 128, 512))
        out = fa.attention(q, k, v, bias, valid, seed, scale=0.125, dropout_rate=0.1)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    act = S((B, n, H, D), jnp.bfloat16)
    compiled = _compile_for(devices, jax.grad(loss, (0, 1, 2, 3)), act, act, act,
                            S((H, 512, 512), jnp.float32), S((B, n), jnp.int32),
                            S((B, n), jnp.int32), S((B, n), jnp.bool_), S((2,), jnp.uint32))
    text = compiled.as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 3
    for kernel in ("forward", "dkv", "dq"):
        assert f"flash_attention_tpu_{kernel}" in text
    assert "triton" not in text
