"""Fine-tuning models and losses: padding changes nothing, losses by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax.finetune import heads
from maelm_jax.models import encoder as encoder_lib

pytestmark = pytest.mark.tier("integration")

ARCH = {"num_layers": 1, "d_model": 16, "num_heads": 2, "d_ff": 32, "pre_ln": False,
        "vocab_size": 64, "max_positions": 32, "rel_pos_buckets": 8, "rel_pos_max_distance": 16}


def _padded(tokens, length):
    """[B, n] -> [B, length] with PAD (0) after, and the key mask."""
    out = np.zeros((tokens.shape[0], length), np.int32)
    out[:, : tokens.shape[1]] = tokens
    return jnp.asarray(out), jnp.asarray(out != 0)


@pytest.fixture(scope="module")
def encoder_cfg():
    return encoder_lib.from_architecture(ARCH, dropout=0.1, attention_dropout=0.1)


@pytest.mark.parametrize("pooling", heads.POOLINGS)
def test_padding_to_a_larger_bucket_changes_no_output(encoder_cfg, pooling):
    tokens = np.random.default_rng(0).integers(5, 64, (3, 9)).astype(np.int32)
    classifier = heads.SequenceClassifier(encoder_cfg, 3, pooling=pooling)
    short, short_mask = _padded(tokens, 12)
    long, long_mask = _padded(tokens, 32)
    params = jax.jit(classifier.init)(jax.random.PRNGKey(0), short, short_mask)["params"]
    assert set(params) == {"encoder", "head"}  # the pretrained subtree's name
    apply = jax.jit(classifier.apply)
    a = apply({"params": params}, short, short_mask)
    b = apply({"params": params}, long, long_mask)
    assert a.shape == (3, 3) and a.dtype == jnp.float32
    np.testing.assert_allclose(a, b, atol=1e-5)
    if pooling != "first":
        return  # the span extractor has no pooling

    spans = heads.SpanExtractor(encoder_cfg)
    span_params = jax.jit(spans.init)(jax.random.PRNGKey(0), short, short_mask)["params"]
    span_apply = jax.jit(spans.apply)
    (s1, e1), (s2, e2) = (span_apply({"params": span_params}, t, m)
                          for t, m in ((short, short_mask), (long, long_mask)))
    np.testing.assert_allclose(s1[:, :9], s2[:, :9], atol=1e-5)
    np.testing.assert_allclose(e1[:, :9], e2[:, :9], atol=1e-5)
    assert (s2[:, 9:] <= -1e8).all() and (e2[:, 9:] <= -1e8).all()  # padding: never a span


def test_pooling_reads_the_first_token_or_the_mean_of_the_real_ones():
    hidden = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    key_mask = jnp.array([[True, True, True, False], [True, False, False, False]])
    np.testing.assert_array_equal(heads.pool(hidden, key_mask, "first"), hidden[:, 0])
    np.testing.assert_allclose(heads.pool(hidden, key_mask, "mean"),
                               [hidden[0, :3].mean(0), hidden[1, 0]])
    with pytest.raises(ValueError, match="pooling must be one of"):
        heads.pool(hidden, key_mask, "max")


def test_span_softmax_excludes_the_question_and_special_tokens():
    # <s> q q </s></s> c c c </s> pad pad
    tokens = jnp.asarray([[1, 9, 9, 2, 2, 7, 7, 7, 2, 0, 0]], jnp.int32)
    mask = tokens != 0
    allowed = np.asarray(heads.answer_positions(tokens, mask, 2))[0]
    np.testing.assert_array_equal(allowed, [1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0])
    cfg = encoder_lib.from_architecture(ARCH)
    for context_only, expected in ((True, allowed), (False, np.asarray(mask)[0])):
        model = heads.SpanExtractor(cfg, context_only)
        params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens, mask)["params"]
        start, end = jax.jit(model.apply)({"params": params}, tokens, mask)
        np.testing.assert_array_equal(np.asarray(start[0]) > -1e8, expected)
        np.testing.assert_array_equal(np.asarray(end[0]) > -1e8, expected)


def test_classifier_dropout_is_the_heads_own():
    """Encoder dropout 0: the outputs are random under training exactly when the head's
    dropout (config.model.classifier_dropout) is above 0."""
    quiet = encoder_lib.from_architecture(ARCH)
    tokens, mask = _padded(np.random.default_rng(0).integers(5, 64, (2, 6)).astype(np.int32), 8)
    for head_dropout in (0.0, 0.5):
        model = heads.SequenceClassifier(quiet, 2, head_dropout)
        params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens, mask)["params"]
        run = jax.jit(lambda key, model=model, params=params: model.apply(
            {"params": params}, tokens, mask, False, rngs={"dropout": key}))
        a, b = run(jax.random.PRNGKey(1)), run(jax.random.PRNGKey(2))
        assert np.allclose(a, b) == (head_dropout == 0.0)


def test_encoder_params_have_the_pretraining_structure(encoder_cfg):
    tokens, mask = _padded(np.ones((1, 4), np.int32) * 7, 8)
    params = jax.eval_shape(heads.SequenceClassifier(encoder_cfg, 2).init,
                            jax.random.PRNGKey(0), tokens, mask)["params"]
    standalone = jax.eval_shape(encoder_lib.Encoder(encoder_cfg).init,
                                jax.random.PRNGKey(0), tokens, tokens)["params"]
    assert jax.tree.map(lambda x: x.shape, params["encoder"]) == jax.tree.map(
        lambda x: x.shape, standalone)


def test_losses_by_hand():
    weights = jnp.array([1.0, 1.0, 0.0])  # the last row fills the batch
    logits = jnp.zeros((3, 4))  # uniform over 4 classes: cross-entropy log 4
    loss, count = heads.classification_loss_sums(logits, jnp.array([0, 3, -1]), weights)
    assert count == 2 and loss == pytest.approx(2 * math.log(4), rel=1e-6)
    outputs = jnp.array([[1.0], [3.0], [0.0]])
    loss, count = heads.regression_loss_sums(outputs, jnp.array([2.0, 0.5, jnp.nan]), weights)
    assert count == 2 and loss == pytest.approx(1.0 + 6.25)  # (1 - 2)^2 + (3 - 0.5)^2
    start = jnp.log(jnp.array([[0.5, 0.25, 0.25], [1.0, 1e-30, 1e-30], [1.0, 1.0, 1.0]]))
    loss, count = heads.span_loss_sums(start, start, jnp.array([0, 0, 2]),
                                       jnp.array([1, 0, 2]), weights)
    # Row 0: (-log 0.5 - log 0.25) / 2; row 1: 0.
    assert loss == pytest.approx((math.log(2) + math.log(4)) / 2, rel=1e-5)
