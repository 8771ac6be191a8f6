"""The Pallas flash-attention kernel (models/flash_attention.py), run by Pallas' interpreter
on the CPU: the same outputs and gradients as the einsum formula with the same keep mask,
masking, padding of ragged lengths, dropout's statistics, and the model's "pallas" path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax.models import flash_attention as fa
from maelm_jax.models import layers
from maelm_jax.pretrain import setup as setup_lib

from tiny_config import TINY_VOCAB, tiny_config, tiny_model

pytestmark = pytest.mark.tier("integration")

SCALE = 0.25


def reference(q, k, v, bias, key_valid, seed, rate, elements=1):
    """The formula, with the kernel's keep mask: softmax(scale q.k + bias), keys masked
    (a fully masked row attends uniformly, as the einsum path's `where` makes it), the
    probabilities dropped out and rescaled by the kept fraction, times v."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * SCALE
    if bias is not None:
        s = s + bias
    if key_valid is not None:
        s = jnp.where(key_valid[:, None, None, :], s, fa.MASKED)
    p = jax.nn.softmax(s, axis=-1)
    if rate:
        kept = 1 - fa.dropped_fraction(rate, elements)
        p = jnp.where(fa.keep_mask(seed, p.shape, rate, elements), p / kept, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _inputs(B=2, n=70, m=90, H=2, D=16, bias_batch=1):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (B, n, H, D))
    k = jax.random.normal(keys[1], (B, m, H, D))
    v = jax.random.normal(keys[2], (B, m, H, D))
    bias = jax.random.normal(keys[3], (bias_batch, H, n, m))
    return q, k, v, bias


DEFAULT = fa.KernelOptions()


def _check_against_the_formula(q, k, v, bias, valid, rate, options=DEFAULT):
    """Outputs and the gradients in q, k, v (and the bias) of the kernel against the
    formula's, with the kernel's keep mask; returns the kernel's gradients."""
    seed = jnp.array([123, 456], jnp.uint32)
    elements = options.hash_elements
    out = fa.attention(q, k, v, bias, valid, seed, scale=SCALE, dropout_rate=rate,
                       options=options)
    want = reference(q, k, v, bias, valid, seed, rate, elements)
    assert out.shape == q.shape
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    kernel = lambda *a: jnp.sum(jnp.sin(fa.attention(  # noqa: E731
        *a[:3], a[3] if bias is not None else None, valid, seed, scale=SCALE,
        dropout_rate=rate, options=options)))
    formula = lambda *a: jnp.sum(jnp.sin(reference(  # noqa: E731
        *a[:3], a[3] if bias is not None else None, valid, seed, rate, elements)))
    got = jax.grad(kernel, argnums)(q, k, v, bias)
    expected = jax.grad(formula, argnums)(q, k, v, bias)
    for name, g, e in zip("q k v bias".split(), got, expected, strict=False):
        assert g.shape == e.shape, name
        assert g.dtype == e.dtype, name
        np.testing.assert_allclose(g, e, atol=5e-5, rtol=5e-5, err_msg=name)
    return got


@pytest.mark.parametrize("rate", [0.0, 0.3])
@pytest.mark.parametrize("bias_batch, masked", [(1, True), (2, False), (None, True)])
def test_kernel_matches_the_formula_forward_and_backward(rate, bias_batch, masked):
    """Lengths that fill no whole block (70 queries, 90 keys: padded inside), a bias shared
    by the batch or per row (or none), keys masked per row."""
    q, k, v, bias = _inputs(bias_batch=bias_batch or 1)
    bias = bias if bias_batch else None
    valid = (jnp.arange(90)[None] < jnp.array([[90], [77]])) if masked else None
    got = _check_against_the_formula(q, k, v, bias, valid, rate)
    if masked:  # a masked key takes no attention, so no gradient reaches it
        assert float(jnp.abs(got[1][1, 77:]).max()) == 0.0
        assert float(jnp.abs(got[2][1, 77:]).max()) == 0.0


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_fully_masked_rows(rate):
    """A batch row whose keys are all masked attends uniformly over them (the einsum path's
    softmax of equal scores), in the backward pass too: dV gets 1/m of each query's dO,
    and no gradient reaches q, k or the bias (their scores are replaced). The forward kept
    max + log m in one float32 once, which rounds back to the max: p came out 1, not 1/m."""
    q, k, v, bias = _inputs(B=2, n=64, m=64)
    valid = jnp.arange(64)[None] < jnp.array([[64], [0]])
    got = _check_against_the_formula(q, k, v, bias, valid, rate)
    assert float(jnp.abs(got[0][1]).max()) == 0.0
    assert float(jnp.abs(got[1][1]).max()) == 0.0


# The variants the GPU measurement chooses between: each computes the formula.
VARIANTS = {
    "bias_grad rows": fa.KernelOptions(bias_grad="rows"),
    "bias_grad batch, 1 group": fa.KernelOptions(bias_grad="batch", bias_grad_groups=1),
    "bias_grad batch, 2 groups": fa.KernelOptions(bias_grad="batch", bias_grad_groups=2),
    # Its own kernel, summing 2 rows a program in registers, on other tiles than dK/dV's.
    "bias_grad kernel, 2 groups": fa.KernelOptions(bias_grad="kernel", bias_grad_groups=2,
                                                   dq=fa.Tile(16, 32)),
    "2 elements per hash": fa.KernelOptions(hash_elements=2),
    "4 elements per hash, other tiles": fa.KernelOptions(
        forward=fa.Tile(32, 64), dkv=fa.Tile(16, 32, 2, 3), dq=fa.Tile(64, 16, 8, 1),
        hash_elements=4),
    # MAE-LM's 109 kept tokens of 128: every block 16 (pretraining's encoder at L 128).
    "tiles fitted to 109 tokens": fa.KernelOptions().fitted(109),
}


def test_tiles_fit_the_length_with_the_least_padding():
    """The blocks shrink to the power of two that pads a length least (the largest on
    ties), never above the configured ones."""
    padded = {n: -(-n // fa.KernelOptions().fitted(n).length_multiple)
              * fa.KernelOptions().fitted(n).length_multiple for n in (109, 87, 435, 512, 17)}
    assert padded == {109: 112, 87: 96, 435: 448, 512: 512, 17: 32}
    assert fa.KernelOptions().fitted(512) == fa.KernelOptions()
    wide = fa.KernelOptions(forward=fa.Tile(128, 64, 8, 3))
    assert wide.fitted(256).forward == fa.Tile(128, 64, 8, 3)  # nothing to shrink
    assert wide.fitted(109).forward == fa.Tile(16, 16, 8, 3)  # warps and stages kept


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_variants_match_the_formula(variant):
    """4 rows, a bias shared by the batch (summed inside by groups of rows, or per row),
    keys masked, dropout on: outputs and gradients of q, k, v and the bias."""
    q, k, v, bias = _inputs(B=4, n=40, m=50)
    valid = jnp.arange(50)[None] < jnp.array([[50], [33], [50], [1]])
    _check_against_the_formula(q, k, v, bias, valid, 0.3, VARIANTS[variant])


def test_bias_gradient_groups():
    """A shared bias's gradient is summed over the batch in the kernel by the largest
    divisor of the batch that the option allows; a per-example bias keeps one per row."""
    opts = fa.KernelOptions(bias_grad_groups=4)
    assert fa.bias_grad_groups(32, 1, opts) == 4
    assert fa.bias_grad_groups(6, 1, opts) == 3
    assert fa.bias_grad_groups(32, 32, opts) == 32
    assert fa.bias_grad_groups(32, None, opts) == 32
    assert fa.bias_grad_groups(32, 1, fa.KernelOptions(bias_grad="rows")) == 32
    # "kernel": the dK/dV kernel runs a program per row; the dbias kernel sums groups.
    kernel = fa.KernelOptions(bias_grad="kernel", bias_grad_groups=4)
    assert fa.bias_grad_groups(32, 1, kernel) == 32 and fa.row_groups(6, kernel) == 3


@pytest.mark.parametrize("elements", fa.HASH_ELEMENTS)
def test_kernel_keep_tiles_are_the_keep_mask(elements):
    """The kernels' tile of bits (one hash spread over `elements` keys by a reshape) is the
    element-wise keep mask at those indices."""
    seed = jnp.array([5, 6], jnp.uint32)
    whole = fa.keep_mask(seed, (2, 3, 64, 96), 0.4, elements)
    stream = fa.row_stream(seed[0], seed[1], jnp.int32(1), jnp.int32(2), 3)
    tile = fa.keep(stream, 16 + jnp.arange(16), 32, 32, 96, 0.4, elements)
    np.testing.assert_array_equal(tile, whole[1, 2, 16:32, 32:64])


def test_options_parse_and_name_the_bad_field():
    opts = fa.KernelOptions.from_fields({"forward": "128x64:4:3", "hash_elements": 4},
                                        "config.model.pallas")
    assert opts.forward == fa.Tile(128, 64, 4, 3) and opts.hash_elements == 4
    assert fa.KernelOptions.from_fields(opts.fields()) == opts
    assert opts.length_multiple == 128
    for fields, message in (
            ({"dq": "64x48:4:2"}, "config.model.pallas.dq: block_k must be a power of two"),
            ({"dkv": "64x64"}, "config.model.pallas.dkv: expected 'block_qxblock_k"),
            ({"hash_elements": 3}, "config.model.pallas.hash_elements: must be one of"),
            ({"bias_grad": "atomic"}, "config.model.pallas.bias_grad: must be one of"),
            ({"tiles": 1}, "config.model.pallas.tiles: unknown option")):
        with pytest.raises(fa.OptionsError, match="^" + message.replace(".", r"\.")):
            fa.KernelOptions.from_fields(fields, "config.model.pallas")


@pytest.mark.parametrize("elements", fa.HASH_ELEMENTS)
def test_keep_mask_statistics_and_independence(elements):
    rate = 0.1
    mask = np.asarray(fa.keep_mask(jnp.array([1, 2], jnp.uint32), (4, 3, 128, 128), rate,
                                   elements))
    n = mask.size
    dropped = 1 - mask.mean()
    rate = fa.dropped_fraction(rate, elements)  # 26/256 with 8 bits per element
    assert abs(dropped - rate) < 4 * np.sqrt(rate * (1 - rate) / n)
    # Rows (batch, head) and neighbouring elements are independent: pairs dropped together
    # as often as chance says.
    flat = mask.reshape(12, -1)
    for a, b in ((flat[0], flat[1]), (flat[:, :-1].ravel(), flat[:, 1:].ravel())):
        both = np.mean(~a & ~b)
        assert abs(both - rate ** 2) < 5 * np.sqrt(rate ** 2 / a.size)
    other = np.asarray(fa.keep_mask(jnp.array([1, 3], jnp.uint32), (4, 3, 128, 128), rate,
                                    elements))
    assert np.mean(other != mask) > 0.15  # another seed, other bits


def test_dropout_is_unbiased_and_its_output_varies_as_expected():
    """Over many seeds the dropped-out output averages to the plain one; a uniform
    attention over m keys of constant values 1 gives outputs of variance rate/(1-rate)/m."""
    q, k, v, bias = _inputs(B=1, n=64, m=64, H=1, D=16)
    rate, seeds = 0.2, 64
    plain = fa.attention(q, k, v, bias, None, jnp.zeros(2, jnp.uint32), scale=SCALE)
    outs = jnp.stack([fa.attention(q, k, v, bias, None, jnp.array([s, 7], jnp.uint32),
                                   scale=SCALE, dropout_rate=rate) for s in range(seeds)])
    spread = jnp.std(outs, axis=0) / np.sqrt(seeds)
    assert float(jnp.mean(jnp.abs(outs.mean(0) - plain) / (spread + 1e-6))) < 1.5
    ones = jnp.ones_like(v)
    flat = fa.attention(jnp.zeros_like(q), k, ones, None, None, jnp.array([9, 9], jnp.uint32),
                        scale=SCALE, dropout_rate=rate)
    np.testing.assert_allclose(float(jnp.var(flat[..., 0])), rate / (1 - rate) / 64, rtol=0.3)


def _pallas_and_einsum(objective="maelm", **model):
    c = tiny_config(objective)
    c.model.update(model)
    plain, batch, params = tiny_model(c)
    c.model.attention_impl = "pallas"
    flash = setup_lib.model(c, TINY_VOCAB)
    return plain, flash, batch, params


@pytest.mark.parametrize("scan", [False, True])
def test_model_on_the_pallas_path(scan):
    """MAE-LM with attention dropout, per-layer or scanned layers: the deterministic forward
    is the einsum path's; in training the output is a function of the dropout key, and the
    gradient reaches the relative position table through the kernel's bias gradient."""
    plain, flash, batch, params = _pallas_and_einsum(
        "maelm", attention_dropout=0.2, scan_layers=scan)
    np.testing.assert_allclose(flash.apply({"params": params}, batch, deterministic=True),
                               plain.apply({"params": params}, batch, deterministic=True),
                               atol=1e-5, rtol=1e-5)
    run = lambda key: flash.apply({"params": params}, batch, deterministic=False,  # noqa: E731
                                  rngs={"dropout": jax.random.PRNGKey(key)})
    np.testing.assert_array_equal(run(1), run(1))  # a function of the dropout key
    assert not np.allclose(run(1), run(2), atol=1e-5)
    grads = jax.grad(lambda p: jnp.sum(flash.apply(
        {"params": p}, batch, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})
        ** 2))(params)
    table = grads["encoder"]["relative_bias"]["rel_embedding"]
    assert float(jnp.abs(table).max()) > 0  # the bias gradient reaches the bucket table


def test_causal_mask_is_folded_into_the_bias():
    cfg = layers.StackConfig(num_layers=1, d_model=32, num_heads=2, d_ff=64,
                             attention_impl="pallas")
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 10, 32))
    causal = jnp.tril(jnp.ones((1, 10, 10), bool))
    attn = layers.MultiHeadAttention(cfg)
    params = attn.init(jax.random.PRNGKey(1), x, x, None, causal, True)
    got = attn.apply(params, x, x, None, causal, True)
    plain = layers.MultiHeadAttention(layers.StackConfig(num_layers=1, d_model=32, num_heads=2,
                                                         d_ff=64))
    np.testing.assert_allclose(got, plain.apply(params, x, x, None, causal, True), atol=1e-5)


def test_sharded_kernel_is_the_single_device_kernel():
    """On a mesh that splits the batch 4 ways and the heads 2 ways the kernel runs per
    shard (jax.shard_map; XLA cannot partition a pallas_call), each shard offsetting its
    dropout rows and heads: an attention layer with a shared bias, a key mask and dropout
    gives the outputs and gradients of one device, and the kernel sees [2, n, 1, D] blocks.
    (Shards that all started at row 0 would drop alike.)"""
    from maelm_jax.infra import sharding

    cfg = layers.StackConfig(num_layers=1, d_model=32, num_heads=2, d_ff=64,
                             attention_dropout=0.3, attention_impl="pallas")
    attn = layers.MultiHeadAttention(cfg)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (8, 24, 32))
    bias = jax.random.normal(keys[1], (1, 2, 24, 24))
    key_mask = jnp.arange(24)[None] < jnp.arange(8, 24, 2)[:, None]
    params = attn.init(keys[2], x, x, bias, key_mask, True)
    traced = []
    real = fa.attention

    def spy(q, *args, **kwargs):
        traced.append(q.shape)
        return real(q, *args, **kwargs)

    def run(shape):
        mesh = sharding.make_mesh(shape, jax.devices()[:int(np.prod(shape))])
        rules = sharding.rules_from_config(sharding.DEFAULT_RULES)

        def loss(params, x):
            out = attn.apply(params, x, x, bias, key_mask, False,
                             rngs={"dropout": jax.random.PRNGKey(7)})
            return jnp.sum(jnp.sin(out)), out

        traced.clear()
        with pytest.MonkeyPatch.context() as patch, sharding.activate(mesh, rules):
            patch.setattr(fa, "attention", spy)
            x_on_mesh = jax.device_put(x, sharding.batch_sharding(mesh))
            (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x_on_mesh)
        assert traced == [(8 // shape[0], 24, 2 // shape[2], 16)], traced
        return out, grads

    out, grads = run((4, 1, 2))
    want, want_grads = run((1, 1, 1))
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def _matches_the_dense_bias(run, q, k, v, table):
    """run(q, k, v, table, on_grid) read by position (True) gives the output and the
    gradients (of q, k, v and the table the bias is made from) of the same bias given
    whole (False); returns the loss differentiated."""
    np.testing.assert_allclose(run(q, k, v, table, True), run(q, k, v, table, False),
                               atol=2e-5, rtol=2e-5)
    loss = lambda *a: jnp.sum(jnp.sin(run(*a)))  # noqa: E731
    got = jax.grad(loss, (0, 1, 2, 3))(q, k, v, table, True)
    want = jax.grad(loss, (0, 1, 2, 3))(q, k, v, table, False)
    for name, g, e in zip(("q", "k", "v", "table"), got, want, strict=True):
        np.testing.assert_allclose(g, e, atol=5e-5, rtol=5e-5, err_msg=name)
    assert float(jnp.abs(got[3]).max()) > 0
    return loss


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_a_bias_read_from_its_grid_by_position_is_the_dense_one(rate):
    """A per-example bias given as its grid and positions (by_position.GridBias: every
    tile read from the grid [H, P, P] inside the kernels): the outputs and gradients of q,
    k and v of the same bias given whole, and the grid's gradient is the dense bias's
    gathered back. Ragged lengths (70 queries, 90 keys, padded inside), keys masked, rows
    whose padding repeats position 0 after a real 0."""
    from maelm_jax.models import by_position

    q, k, v, _ = _inputs(B=2, n=70, m=90)
    P = 128
    rng = np.random.default_rng(0)
    q_pos = jnp.asarray(np.stack([np.sort(rng.permutation(P)[:70]) for _ in range(2)]))
    k_pos = jnp.asarray(np.stack([np.sort(rng.permutation(P)[:90]) for _ in range(2)]))
    q_pos, k_pos = q_pos.at[:, 0].set(0), k_pos.at[:, 0].set(0)
    grid = jax.random.normal(jax.random.PRNGKey(5), (2, P, P))
    valid = jnp.arange(90)[None] < jnp.array([[90], [77]])
    seed = jnp.array([123, 456], jnp.uint32)

    def run(q, k, v, grid, on_grid):
        bias = (by_position.GridBias(grid, q_pos, k_pos) if on_grid
                else by_position.grid_bias(grid, q_pos, k_pos, "float32"))
        return fa.attention(q, k, v, bias, valid, seed, scale=SCALE, dropout_rate=rate)

    _matches_the_dense_bias(run, q, k, v, grid)


def test_a_relative_bias_read_by_distance_and_its_grid_gradient():
    """A relative grid (a function of r - p, constant beyond a reach of 20) read from its
    row of diagonals by distance in the kernels, with dropout: the outputs and gradients of
    the same bias given whole; the grid's gradient is summed over the batch by its own
    kernel (the CUDA export's tensors: tests/benchmarks/test_program_cost.py)."""
    from maelm_jax.models import by_position

    q, k, v, _ = _inputs(B=2, n=70, m=90)
    P, reach = 128, 20
    rng = np.random.default_rng(1)
    q_pos = jnp.asarray(np.stack([np.sort(rng.permutation(P)[:70]) for _ in range(2)]))
    k_pos = jnp.asarray(np.stack([np.sort(rng.permutation(P)[:90]) for _ in range(2)]))
    diagonals = jax.random.normal(jax.random.PRNGKey(7), (2, 2 * reach + 1))
    distance = jnp.clip(jnp.arange(P)[None, :] - jnp.arange(P)[:, None], -reach, reach)
    valid = jnp.arange(90)[None] < jnp.array([[90], [61]])
    seed = jnp.array([9, 10], jnp.uint32)

    def run(q, k, v, diagonals, on_grid):
        grid = diagonals[:, distance + reach]
        bias = (by_position.GridBias(grid, q_pos, k_pos, reach=reach) if on_grid
                else by_position.grid_bias(grid, q_pos, k_pos, "float32"))
        return fa.attention(q, k, v, bias, valid, seed, scale=SCALE, dropout_rate=0.2)

    loss = _matches_the_dense_bias(run, q, k, v, diagonals)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, 3), static_argnums=4)(q, k, v, diagonals, True))
    assert "flash_attention_grid_dbias" in jaxpr
