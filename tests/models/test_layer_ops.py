"""The model's cheaper primitives against the plain formulas they replace: dropout's packed
random bits, the batch-shared add, the cross-entropy and the GELU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from maelm_jax.models import dropout, layers

pytestmark = pytest.mark.tier("integration")


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_keep_mask_drops_at_the_rate_and_independently(rate):
    keep = np.asarray(dropout.keep_mask(jax.random.key(0), rate, (64, 128, 256)))
    n = keep.size
    dropped = 1.0 - keep.mean()
    assert abs(dropped - rate) < 4 * np.sqrt(rate * (1 - rate) / n)
    # The four elements one hash decides are as independent as any others: two neighbours
    # along the last axis (same hash) and two a hash apart are both dropped at rate**2.
    flat = ~keep.reshape(-1, 4)
    for a, b in [(0, 1), (1, 2), (2, 3)]:
        both = np.mean(flat[:, a] & flat[:, b])
        assert abs(both - rate ** 2) < 5 * np.sqrt(rate ** 2 / flat.shape[0])
    apart = np.mean(~keep[..., :-4] & ~keep[..., 4:])
    assert abs(apart - rate ** 2) < 5 * np.sqrt(rate ** 2 / n)


def test_keep_mask_is_a_function_of_key_and_shape():
    key = jax.random.key(3)
    a = dropout.keep_mask(key, 0.1, (8, 6, 7))  # a last axis not divisible by 4
    assert a.shape == (8, 6, 7) and a.dtype == jnp.bool_
    np.testing.assert_array_equal(a, dropout.keep_mask(key, 0.1, (8, 6, 7)))
    assert not np.array_equal(a, dropout.keep_mask(jax.random.key(4), 0.1, (8, 6, 7)))
    # A raw key (fine-tuning's jax.random.PRNGKey) is the typed threefry key's data.
    np.testing.assert_array_equal(
        a, dropout.keep_mask(jax.random.key_data(key), 0.1, (8, 6, 7)))
    for impl in ("rbg", "unsafe_rbg"):
        m = dropout.keep_mask(jax.random.key(3, impl=impl), 0.5, (16, 64))
        assert m.shape == (16, 64) and 0.35 < float(m.mean()) < 0.65


@pytest.mark.parametrize("spec", [P("d"), P(None, None, "d"), P("d", None, None)])
def test_keep_mask_does_not_depend_on_sharding(spec):
    """Sharded along any axis (the last one too, where four elements share a hash), each
    device computes its own part of the very same mask."""
    mesh = jax.make_mesh((8,), ("d",))
    key = jax.random.key(5)
    expected = dropout.keep_mask(key, 0.1, (8, 16, 64))
    sharded = jax.jit(lambda k: dropout.keep_mask(k, 0.1, (8, 16, 64)),
                      out_shardings=NamedSharding(mesh, spec))(key)
    assert sharded.sharding.spec == spec
    np.testing.assert_array_equal(sharded, expected)


def test_dropout_module_scales_kept_values_and_is_off_when_deterministic():
    x = jnp.arange(1.0, 4097.0).reshape(4, 1024)
    module = dropout.Dropout(0.25)
    y = module.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    kept = np.asarray(y) != 0
    np.testing.assert_allclose(np.asarray(y)[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)
    assert 0.2 < 1 - kept.mean() < 0.3
    np.testing.assert_array_equal(module.apply({}, x, deterministic=True), x)
    np.testing.assert_array_equal(
        dropout.Dropout(0.0).apply({}, x, deterministic=False), x)  # needs no RNG


@pytest.mark.parametrize("rows", [1, 3])
def test_add_per_batch_is_a_broadcast_add_with_its_gradient(rows):
    x = jax.random.normal(jax.random.key(0), (3, 4, 5, 5))
    shared = jax.random.normal(jax.random.key(1), (rows, 4, 5, 5))
    weights = jax.random.normal(jax.random.key(2), x.shape)
    def loss(add):
        return lambda a, b: jnp.sum(jnp.tanh(add(a, b)) * weights)
    np.testing.assert_allclose(layers.add_per_batch(x, shared), x + shared)
    got = jax.grad(loss(layers.add_per_batch), argnums=(0, 1))(x, shared)
    want = jax.grad(loss(jnp.add), argnums=(0, 1))(x, shared)
    for g, w in zip(got, want, strict=False):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_cross_entropy_is_minus_the_log_softmax_at_the_target():
    logits = jax.random.normal(jax.random.key(0), (2, 7, 50)) * 3
    targets = jax.random.randint(jax.random.key(1), (2, 7), 0, 50)

    def reference(z):
        log_probs = jax.nn.log_softmax(z, axis=-1)
        return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]

    np.testing.assert_allclose(layers.cross_entropy(logits, targets), reference(logits),
                               rtol=1e-5)
    np.testing.assert_allclose(
        jax.grad(lambda z: jnp.sum(layers.cross_entropy(z, targets)))(logits),
        jax.grad(lambda z: jnp.sum(reference(z)))(logits), rtol=1e-5, atol=1e-7)


def test_gelu_is_the_exact_gelu_with_its_gradient():
    x = jnp.concatenate([jnp.linspace(-12.0, 12.0, 4001),
                         3.0 * jax.random.normal(jax.random.key(0), (4096,))])

    def exact(v):
        return jax.nn.gelu(v, approximate=False)

    np.testing.assert_allclose(layers.gelu(x), exact(x), rtol=1e-6, atol=2e-6)
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(layers.gelu(v)))(x),
                               jax.grad(lambda v: jnp.sum(exact(v)))(x), rtol=1e-6, atol=4e-6)
    # Not the tanh approximation, which is 5e-4 away near |x| = 2.
    assert float(jnp.max(jnp.abs(layers.gelu(x) - jax.nn.gelu(x, approximate=True)))) > 1e-4
    # bfloat16 in, bfloat16 out (the compute dtype on accelerators).
    assert layers.gelu(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("mask_kind", ["none", "per key", "per query and key"])
def test_even_lengths_for_cudnn_change_nothing(mask_kind):
    """cuDNN's fused attention wants even lengths: odd ones are padded (padded keys masked,
    padded queries sliced off). Checked with XLA's implementation of the same call, which
    runs here: outputs and the gradients of q, k, v and the bias as without padding."""
    B, n, m, H, D = 2, 5, 7, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (B, n, H, D))
    k, v = (jax.random.normal(key, (B, m, H, D)) for key in keys[1:3])
    bias = jax.random.normal(keys[3], (1, H, n, m))
    mask = {"none": None,
            "per key": (jnp.arange(m) < jnp.array([[7], [4]]))[:, None, None, :],
            "per query and key": jnp.tril(jnp.ones((n, m), bool))[None, None]}[mask_kind]

    def attend(q, k, v, bias, even):
        args = layers._even_lengths(q, k, v, bias, mask) if even else (q, k, v, bias, mask)
        if even:
            assert args[0].shape[1] % 2 == 0 and args[1].shape[1] % 2 == 0
        out = jax.nn.dot_product_attention(*args[:3], bias=args[3], mask=args[4],
                                           implementation="xla")
        return out[:, :n]

    loss = lambda even: lambda *a: jnp.sum(jnp.sin(attend(*a, even)))  # noqa: E731
    np.testing.assert_allclose(attend(q, k, v, bias, True), attend(q, k, v, bias, False),
                               atol=1e-6)
    for got, want in zip(jax.grad(loss(True), (0, 1, 2, 3))(q, k, v, bias),
                         jax.grad(loss(False), (0, 1, 2, 3))(q, k, v, bias), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
