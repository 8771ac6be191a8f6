"""Model properties the papers rely on."""

import math

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax.infra import sharding
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import layers, relative_position
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.pretrain import steps as pretrain_steps
from maelm_jax.text import masking, tokenizer
from maelm_jax.training import optimizer

from tiny_config import TINY_VOCAB, tiny_config, tiny_model

pytestmark = pytest.mark.tier("integration")

VOCAB = 97  # a size no other dimension has, to spot vocabulary-sized arrays


def single_device_mesh():
    return sharding.make_mesh((1, 1, 1), jax.devices()[:1])


def _batch(counts, seed=0, batch=3):
    tokens = jax.random.randint(
        jax.random.PRNGKey(seed), (batch, counts.seq_len), tokenizer.NUM_SPECIAL, VOCAB
    )
    return masking.apply_mask(jax.random.PRNGKey(seed + 1), tokens, counts, VOCAB,
                              tokenizer.SENTENCEPIECE_IDS)


def _model(objective="maelm", **overrides):
    c = tiny_config(objective)
    for key, value in overrides.items():
        c.model[key] = value
    counts = pretrain_config.mask_counts(c)
    return setup_lib.model(c, VOCAB), counts, c


@pytest.mark.parametrize("pre_ln", [False, True])
def test_compacted_encoder_equals_full_encoder_with_attention_mask(pre_ln):
    """MAE-LM's encoder over the kept tokens equals a full-length encoder (same weights)
    whose removed positions are hidden from attention: removing [MASK] is exact."""
    stack = layers.StackConfig(num_layers=2, d_model=32, num_heads=4, d_ff=64, dropout=0.1,
                               pre_ln=pre_ln)
    enc = encoder_lib.Encoder(encoder_lib.EncoderConfig(
        stack=stack, vocab_size=VOCAB, max_positions=40, rel_pos_buckets=8,
        rel_pos_max_distance=16))
    counts = masking.MaskCounts.create(40, 0.3)
    b = _batch(counts)
    params = enc.init(jax.random.PRNGKey(0), b.inputs[:, :4], b.enc_index[:, :4])
    compact_tokens = masking.gather_tokens(b.inputs, b.enc_index)
    compact = enc.apply(params, compact_tokens, b.enc_index)

    B, L = b.inputs.shape
    positions = jnp.broadcast_to(jnp.arange(L), (B, L))
    key_mask = jnp.zeros((B, L), bool).at[jnp.arange(B)[:, None], b.enc_index].set(True)
    full = enc.apply(params, b.inputs, positions, key_mask)
    np.testing.assert_allclose(
        compact, masking.gather_tokens(full, b.enc_index), atol=2e-5, rtol=2e-5
    )
    # And the mask matters: without it the full encoder sees the [MASK] tokens.
    unmasked = enc.apply(params, b.inputs, positions)
    assert not np.allclose(compact, masking.gather_tokens(unmasked, b.enc_index), atol=1e-3)


def _all_avals(jaxpr):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_avals(sub)


@pytest.mark.parametrize("objective", ["maelm", "mlm"])
def test_lm_head_runs_only_at_predicted_positions(objective):
    model, counts, _ = _model(objective)
    b = _batch(counts)
    params = model.init(jax.random.PRNGKey(0), b)
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, b))(params).jaxpr
    vocab_shapes = {a.shape for a in _all_avals(jaxpr) if a.shape and a.shape[-1] == VOCAB}
    # Per-token vocabulary-sized arrays exist for the k predicted positions only, never
    # for all L (or n_enc) positions.
    B, k = b.pred_index.shape
    assert (B, k, VOCAB) in vocab_shapes
    per_token = [s for s in vocab_shapes if len(s) == 3 and s[0] == B]
    assert all(s[1] == k for s in per_token), vocab_shapes


def test_encoder_length_is_static_and_smaller_for_maelm():
    for objective, expected in (("maelm", 32 - 5), ("mlm", 32)):  # k = round(0.15*32) = 5
        model, counts, _ = _model(objective)
        assert counts.n_enc == expected


def test_decoder_has_no_dropout_and_encoder_does():
    model, counts, _ = _model("maelm", dropout=0.0, attention_dropout=0.0)
    b = _batch(counts)
    params = model.init(jax.random.PRNGKey(0), b)
    def run(seed):
        return model.apply(
            params, b, deterministic=False, rngs={"dropout": jax.random.PRNGKey(seed)}
        )
    np.testing.assert_array_equal(run(1), run(2))  # only the encoder could drop anything
    model, counts, _ = _model("maelm", dropout=0.3)
    params = model.init(jax.random.PRNGKey(0), b)
    def run(seed):
        return model.apply(
            params, b, deterministic=False, rngs={"dropout": jax.random.PRNGKey(seed)}
        )
    assert not np.allclose(run(1), run(2))


def test_decoder_sees_mask_embedding_at_removed_positions():
    """Changing the original token under a removed [MASK] changes nothing (the encoder
    never reads it); changing a kept token does."""
    model, counts, _ = _model("maelm", dropout=0.0, attention_dropout=0.0)
    b = _batch(counts)
    params = model.init(jax.random.PRNGKey(0), b)
    base = model.apply(params, b)
    removed = int(np.setdiff1d(np.arange(counts.seq_len), np.asarray(b.enc_index[0]))[0])
    kept = int(b.enc_index[0, 0])
    def poke(pos):
        return b._replace(inputs=b.inputs.at[0, pos].set(7))
    np.testing.assert_array_equal(model.apply(params, poke(removed)), base)
    assert not np.allclose(model.apply(params, poke(kept))[0], base[0])


def test_narrow_decoder_gets_a_projection():
    c = tiny_config("maelm")
    c.model.decoder.d_model = 16
    c.model.decoder.num_heads = 2
    counts = pretrain_config.mask_counts(c)
    model = setup_lib.model(c, VOCAB)
    b = _batch(counts)
    params = model.init(jax.random.PRNGKey(0), b)["params"]
    assert params["decoder"]["projection"]["kernel"].value.shape == (32, 16)
    assert params["lm_head"]["dense"]["kernel"].value.shape == (16, 32)
    assert model.apply({"params": params}, b).shape == (3, counts.k, VOCAB)


def _reference_bucket(relative: int, num_buckets: int, max_distance: int) -> int:
    """T5's _relative_position_bucket (bidirectional), written out for one integer."""
    n = -relative
    num_buckets //= 2
    ret = num_buckets if n < 0 else 0
    n = abs(n)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = max_exact + int(
        np.log(n / max_exact) / np.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return ret + min(val, num_buckets - 1)


@pytest.mark.parametrize("buckets, distance", [(32, 128), (64, 128), (128, 256)])
def test_t5_relative_buckets_match_reference(buckets, distance):
    rel = np.arange(-600, 601)
    got = np.asarray(relative_position.t5_relative_bucket(jnp.asarray(rel), buckets, distance))
    want = np.array([_reference_bucket(int(r), buckets, distance) for r in rel])
    np.testing.assert_array_equal(got, want)
    assert got.min() == 0 and got.max() == buckets - 1


def _official_maelm_bucket(rel: np.ndarray, num_buckets: int, max_distance: int,
                           max_len: int) -> np.ndarray:
    """The official MAE-LM code's bucketing (fairseq transformer_sentence_encoder.py,
    relative_position_bucket, then shifted by the minimum over a max_len x max_len grid),
    transcribed to numpy as an independent reference."""
    def signed(r):
        sign, half, n = np.sign(r), num_buckets // 2, np.abs(r)
        max_exact = half // 2
        with np.errstate(divide="ignore"):
            large = max_exact + np.ceil(np.log(n / max_exact)
                                        / math.log((max_distance - 1) / max_exact)
                                        * (half - 1 - max_exact))
        large = np.minimum(large, half - 1)
        return (np.where(n < max_exact, n, large) * sign).astype(np.int64)

    grid = np.arange(max_len)[None, :] - np.arange(max_len)[:, None]
    return signed(rel) - signed(grid).min()


@pytest.mark.parametrize("buckets, distance", [(32, 128), (64, 128), (128, 256)])
def test_official_maelm_buckets_match_reference(buckets, distance):
    rel = np.arange(-511, 512)
    got = np.asarray(relative_position.maelm_relative_bucket(jnp.asarray(rel), buckets, distance))
    np.testing.assert_array_equal(got, _official_maelm_bucket(rel, buckets, distance, 512))
    # Symmetric around distance 0, num_buckets - 1 of them used; not T5's layout.
    assert got.min() == 0 and got.max() == buckets - 2
    np.testing.assert_array_equal(got - got[511], -(got[::-1] - got[511]))
    assert not np.array_equal(got, np.asarray(relative_position.t5_relative_bucket(jnp.asarray(rel),
                                                                        buckets, distance)))


def test_bucket_fn_reaches_the_encoder():
    c = tiny_config("maelm")
    c.model.rel_pos_bucket_fn = "maelm"
    pretrain_config.validate(c)
    cfg = setup_lib.model_config(c, TINY_VOCAB)
    assert cfg.encoder.rel_pos_bucket_fn == "maelm" and cfg.decoder.rel_pos_bucket_fn == "maelm"
    c.model.rel_pos_bucket_fn = "alibi"
    with pytest.raises(pretrain_config.ConfigError, match="config.model.rel_pos_bucket_fn"):
        pretrain_config.validate(c)


def test_local_relative_bias_starts_attention_at_the_neighbours():
    heads = 4
    module = relative_position.RelativePositionBias(32, 128, heads, "local")
    positions = jnp.arange(200)[None]
    params = module.init(jax.random.PRNGKey(0), positions, positions)
    bias = np.asarray(module.apply(params, positions, positions))[0]  # [heads, L, L]
    row = bias[:, 100, :]  # query at position 100
    distance = np.abs(np.arange(200) - 100)
    slopes = 2.0 ** (-4.0 * np.arange(1, heads + 1) / heads)
    # Exact buckets (distance < 8): exactly -slope * distance, the same on both sides.
    near = distance < 8
    np.testing.assert_allclose(row[:, near], -slopes[:, None] * distance[near], rtol=1e-6)
    for h in range(heads):
        # Never increasing with distance, and steeper heads first.
        order = np.argsort(distance, kind="stable")
        assert np.all(np.diff(row[h, order]) <= 0)
    assert np.all(row[:-1, 101] < row[1:, 101])
    # The paper's initialisation is small and has no preference for neighbours.
    normal = relative_position.RelativePositionBias(32, 128, heads)
    table = nn.meta.unbox(normal.init(jax.random.PRNGKey(0), positions, positions))
    assert float(jnp.abs(table["params"]["rel_embedding"]).max()) < 0.2


def _scatter_sizes(module, params, q_pos, k_pos, into_table: bool = True) -> list[int]:
    """Sizes of the updates that the bias's gradient scatter-adds (into the table, or
    anywhere)."""
    table = params["params"]["rel_embedding"]
    grad = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(module.apply(p, q_pos, k_pos))))(params)
    sizes = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scatter-add" and (
                    not into_table or eqn.outvars[0].aval.shape == table.shape):
                sizes.append(math.prod(eqn.invars[2].aval.shape))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(grad.jaxpr)
    return sizes


@pytest.mark.parametrize("bucket_fn", ["t5", "maelm"])
def test_a_per_example_bias_is_gathered_from_the_shared_position_grid(bucket_fn):
    """With one bias per example (kept positions differ by row), the module gathers from
    the [heads, P, P] grid of all position pairs: the values of the direct lookup exactly,
    the same gradient, and no scatter-add anywhere (the grid's gradient gathers, the
    table's is a one-hot dot), where the direct lookup's adds B x n x m x heads values into
    the table (a pile-up of atomics on a GPU)."""
    rng = np.random.default_rng(0)
    B, n, m, P, H = 3, 7, 9, 40, 4
    q_pos = jnp.asarray(np.stack([np.sort(rng.permutation(P)[:n]) for _ in range(B)]))
    k_pos = jnp.asarray(np.stack([np.sort(rng.permutation(P)[:m]) for _ in range(B)]))
    grid = relative_position.RelativePositionBias(8, 16, H, bucket_fn=bucket_fn,
                                                  num_positions=P)
    direct = relative_position.RelativePositionBias(8, 16, H, bucket_fn=bucket_fn)
    params = nn.meta.unbox(grid.init(jax.random.PRNGKey(0), q_pos, k_pos))
    bias = grid.apply(params, q_pos, k_pos)
    assert bias.shape == (B, H, n, m)
    np.testing.assert_array_equal(np.asarray(bias), np.asarray(direct.apply(params, q_pos,
                                                                             k_pos)))
    weights = jnp.asarray(rng.normal(size=bias.shape), jnp.float32)

    def table_grad(module, q=q_pos, k=k_pos, w=weights):
        g = jax.grad(lambda p: jnp.sum(module.apply(p, q, k) * w))(params)
        return np.asarray(g["params"]["rel_embedding"])

    np.testing.assert_allclose(table_grad(grid), table_grad(direct), rtol=1e-5, atol=1e-5)
    assert _scatter_sizes(grid, params, q_pos, k_pos, into_table=False) == []
    assert max(_scatter_sizes(direct, params, q_pos, k_pos)) == B * n * m * H
    # A bias shared by the batch: a one-hot dot too; beyond the grid's bound, the lookup.
    shared = q_pos[:1]
    assert _scatter_sizes(grid, params, shared, shared, into_table=False) == []
    huge = relative_position.RelativePositionBias(
        8, 16, H, bucket_fn=bucket_fn, num_positions=relative_position.MAX_GRID)
    assert max(_scatter_sizes(huge, params, q_pos, k_pos)) == B * n * m * H
    # Padding appended after a row's positions may repeat one (the encoder pads with
    # position 0): its cotangent is zero, and the real position's gradient is kept whole.
    padded_q = jnp.concatenate([q_pos.at[:, 0].set(0), jnp.zeros((B, 2), q_pos.dtype)], 1)
    padded_w = jnp.asarray(rng.normal(size=(B, H, n + 2, m)), jnp.float32).at[:, :, n:].set(0)
    np.testing.assert_allclose(table_grad(grid, padded_q, k_pos, padded_w),
                               table_grad(direct, padded_q, k_pos, padded_w),
                               rtol=1e-5, atol=1e-5)


def test_the_bias_is_born_in_the_compute_dtype():
    """A bfloat16 bias is the float32 one rounded, made without a float32 copy of its size;
    the table and its gradient stay float32."""
    rng = np.random.default_rng(1)
    B, n, P, H = 2, 6, 12, 3
    q_pos = jnp.asarray(np.stack([np.sort(rng.permutation(P)[:n]) for _ in range(B)]))
    half = relative_position.RelativePositionBias(8, 16, H, num_positions=P, dtype=jnp.bfloat16)
    full = relative_position.RelativePositionBias(8, 16, H, num_positions=P)
    params = nn.meta.unbox(half.init(jax.random.PRNGKey(0), q_pos, q_pos))
    bias = half.apply(params, q_pos, q_pos)
    assert bias.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bias), np.asarray(
        full.apply(params, q_pos, q_pos).astype(jnp.bfloat16)))
    jaxpr = jax.make_jaxpr(lambda p: half.apply(p, q_pos, q_pos))(params)
    shapes = [tuple(v.aval.shape) for e in jaxpr.jaxpr.eqns for v in e.outvars
              if v.aval.dtype == jnp.float32]
    assert (H, P, P) in shapes  # the grid is float32; the bias, [B, H, n, n], is not
    assert not [s for s in shapes if len(s) == 4 and s[0] == B]
    grad = jax.grad(lambda p: jnp.sum(half.apply(p, q_pos, q_pos).astype(jnp.float32)))(params)
    assert grad["params"]["rel_embedding"].dtype == jnp.float32


@pytest.mark.parametrize("objective", ["mlm", "maelm"])
def test_rel_pos_init_reaches_the_encoder_and_decoder_tables(objective):
    c = tiny_config(objective)
    c.model.rel_pos_init = "local"
    c.model.decoder.rel_pos_buckets = 8
    c.model.decoder.rel_pos_init = "local"
    model = setup_lib.model(c, 64)
    counts = pretrain_config.mask_counts(c)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), pretrain_steps._dummy_batch(counts)))
    tables = {"/".join(k.key for k in path[:-1]): leaf
              for path, leaf in jax.tree_util.tree_flatten_with_path(params["params"])[0]
              if getattr(path[-1], "key", None) == "rel_embedding"}
    assert set(tables) == ({"encoder/relative_bias", "decoder/relative_bias"}
                           if objective == "maelm" else {"encoder/relative_bias"})
    for table in tables.values():
        assert float(table[0, 0]) == 0.0 and float(table[1, 0]) < -0.1  # distance 0, then 1


def test_every_parameter_has_logical_axes():
    program = setup_lib.build(_model("maelm")[2], VOCAB, single_device_mesh())
    state, specs = program.init(), program.state.logical_specs.params
    leaves = jax.tree.leaves(state.params)
    spec_leaves = jax.tree.leaves(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert len(leaves) == len(spec_leaves)
    for array, spec in zip(leaves, spec_leaves, strict=False):
        assert len(spec) == array.ndim and all(name for name in spec), spec


def test_weight_decay_skips_biases_and_layernorm():
    state = setup_lib.build(_model("maelm")[2], VOCAB, single_device_mesh()).init()
    mask = optimizer.weight_decay_mask(state.params)
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert all(v for k, v in flat.items() if k.endswith("kernel']"))
    assert all(v for k, v in flat.items() if k.endswith("['embedding']"))
    assert not any(v for k, v in flat.items() if k.endswith("bias']") or "ln_" in k)


@pytest.mark.parametrize("decay_on", ["weights", "all"])
def test_weight_decay_on_all_parameters_moves_biases(decay_on):
    """With a zero gradient only weight decay moves a parameter: a bias moves under "all"
    (fairseq's rule) and stays under "weights"."""
    c = tiny_config("maelm")
    c.train.update(weight_decay=0.1, weight_decay_on=decay_on, learning_rate=0.1,
                   warmup_steps=0)
    tx = optimizer.make_optimizer(c.train)
    params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones((2,))}}
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params,
                           learning_rate=0.1)
    assert float(jnp.abs(updates["dense"]["kernel"]).max()) > 0
    assert (float(jnp.abs(updates["dense"]["bias"]).max()) > 0) == (decay_on == "all")


@pytest.mark.parametrize("key_mask_kind", ["keys", "causal"])
def test_fused_attention_matches_the_einsum_path(key_mask_kind):
    """jax.nn.dot_product_attention (XLA's implementation here) with the relative bias and
    the key mask passed in gives the einsum path's output."""
    B, n, D, H = 2, 12, 32, 4
    x = jax.random.normal(jax.random.PRNGKey(0), (B, n, D))
    bias = 0.5 * jax.random.normal(jax.random.PRNGKey(1), (B, H, n, n))
    if key_mask_kind == "keys":
        key_mask = jnp.arange(n)[None, :] < jnp.array([[n], [n - 5]])
    else:
        key_mask = jnp.tril(jnp.ones((1, n, n), bool))
    outputs = {}
    for impl in ("einsum", "xla"):
        cfg = layers.StackConfig(num_layers=1, d_model=D, num_heads=H, d_ff=4 * D,
                                 attention_impl=impl)
        attn = layers.MultiHeadAttention(cfg)
        params = attn.init(jax.random.PRNGKey(2), x, x, bias, key_mask, True)
        outputs[impl] = attn.apply(params, x, x, bias, key_mask, True)
    np.testing.assert_allclose(outputs["xla"], outputs["einsum"], atol=2e-5, rtol=1e-5)


def test_attention_impl_auto_resolves_per_backend():
    resolve = layers.resolve_attention_impl
    assert resolve("auto", jnp.bfloat16, "gpu") == "cudnn"
    assert resolve("auto", jnp.float32, "gpu") == "einsum"
    assert resolve("auto", jnp.bfloat16, "tpu") == "einsum"
    assert resolve("auto", jnp.bfloat16, "cpu") == "einsum"
    assert resolve("xla", jnp.float32, "cpu") == "xla"
    # With attention dropout a GPU trains through the Pallas kernel, where it tiles the heads.
    dropout = {"attention_dropout": 0.1}
    assert resolve("auto", jnp.bfloat16, "gpu", head_dims=(64,), **dropout) == "pallas"
    assert resolve("auto", jnp.float16, "gpu", head_dims=(64, 32), **dropout) == "pallas"
    assert resolve("auto", jnp.bfloat16, "gpu", head_dims=(64, 48), **dropout) == "cudnn"
    assert resolve("auto", jnp.bfloat16, "gpu", head_dims=(8,), **dropout) == "cudnn"
    assert resolve("auto", jnp.bfloat16, "gpu", head_dims=(64,)) == "cudnn"
    assert resolve("auto", jnp.float32, "gpu", head_dims=(64,), **dropout) == "einsum"
    # So does a TPU (Mosaic), and without dropout it keeps the einsum path.
    assert resolve("auto", jnp.bfloat16, "tpu", head_dims=(64,), **dropout) == "pallas"
    assert resolve("auto", jnp.bfloat16, "tpu", head_dims=(64, 48), **dropout) == "einsum"
    assert resolve("auto", jnp.float32, "tpu", head_dims=(64,), **dropout) == "einsum"
    assert resolve("einsum", jnp.bfloat16, "gpu", head_dims=(64,), **dropout) == "einsum"


@pytest.mark.parametrize("objective", ["mlm", "maelm"])
def test_attention_impl_auto_reads_both_stacks_on_a_gpu(monkeypatch, objective):
    """The model's "auto" kernel on a GPU (the backend faked: the config is plain data)
    weighs the encoder's and the decoder's attention dropout and heads, since the decoder
    runs the encoder's kernel."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    c = tiny_config(objective)
    c.model.update(num_heads=2, d_model=32, attention_dropout=0.1)  # heads of 16
    c.model.decoder.update(d_model=24, num_heads=2, attention_dropout=0.0)  # heads of 12
    impl = lambda: setup_lib.encoder_config(c, TINY_VOCAB).stack.attention_impl  # noqa: E731
    decoder = objective != "mlm"  # MLM has none: its config's decoder fields are unread
    assert impl() == ("cudnn" if decoder else "pallas")  # the kernel cannot tile 12
    c.model.decoder.update(d_model=32)
    assert impl() == "pallas"
    c.model.attention_dropout = 0.0
    assert impl() == "cudnn"
    c.model.decoder.attention_dropout = 0.1  # the decoder's alone decides it
    assert impl() == ("pallas" if decoder else "cudnn")
    assert setup_lib.model_config(c, TINY_VOCAB).encoder.stack.dtype == jnp.bfloat16
    # A recorded run whose objective this process lacks: its encoder alone decides.
    c.model.update(attention_dropout=0.1)
    c.model.decoder.update(d_model=24)
    assert impl() == ("cudnn" if decoder else "pallas")
    c.objective = "an_objective_registered_elsewhere"
    assert impl() == "pallas"


def test_compute_dtype_auto_is_bfloat16_on_accelerators_and_float32_on_cpu():
    assert layers.resolve_dtype("auto", "gpu") == jnp.bfloat16
    assert layers.resolve_dtype("auto", "tpu") == jnp.bfloat16
    assert layers.resolve_dtype("auto", "cpu") == jnp.float32
    assert layers.resolve_dtype("float16", "gpu") == jnp.float16
    c = tiny_config("maelm")
    assert c.model.dtype == "auto"  # the default
    cfg = setup_lib.model_config(c, TINY_VOCAB)  # this backend: the CPU
    assert cfg.encoder.stack.dtype == jnp.float32 and cfg.decoder.stack.dtype == jnp.float32
    c.model.dtype = "bfloat16"
    assert setup_lib.model_config(c, TINY_VOCAB).encoder.stack.dtype == jnp.bfloat16


def test_fused_attention_model_matches_and_keeps_einsum_for_dropout(monkeypatch):
    """A whole MAE-LM forward with attention_impl="xla" goes through the fused call and
    equals the einsum one; in training with attention dropout the encoder takes the einsum
    path (which has dropout) and the dropout-free decoder stays fused. Which path ran is
    recorded, not inferred from bit-equal outputs: two compiled programs may round
    differently on different CPUs."""
    lengths = []  # the query length of every fused call: n_enc (encoder) or L (decoder)
    fused_attention = jax.nn.dot_product_attention

    def recording(query, *args, **kwargs):
        lengths.append(query.shape[1])
        return fused_attention(query, *args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    c = tiny_config("maelm")
    c.model.attention_dropout = 0.5
    c.model.attention_impl = "einsum"
    plain, batch, params = tiny_model(c)
    n_enc, L = batch.enc_index.shape[1], batch.inputs.shape[1]
    c.model.attention_impl = "xla"
    fused = setup_lib.model(c, TINY_VOCAB)
    want = plain.apply({"params": params}, batch, deterministic=True)
    assert not lengths  # the einsum model never calls the fused attention
    got = fused.apply({"params": params}, batch, deterministic=True)
    assert sorted(lengths) == sorted([n_enc] * c.model.num_layers
                                     + [L] * c.model.decoder.num_layers)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    lengths.clear()
    rngs = {"dropout": jax.random.PRNGKey(3)}
    dropped = fused.apply({"params": params}, batch, deterministic=False, rngs=rngs)
    assert lengths == [L] * c.model.decoder.num_layers  # the encoder's attention dropped
    np.testing.assert_allclose(
        dropped, plain.apply({"params": params}, batch, deterministic=False, rngs=rngs),
        atol=1e-5, rtol=1e-5)
    assert np.abs(dropped - want).max() > 1e-4  # and dropout changed the output
