"""3ML_cross (3ML Section 3, Fig. 2 right) and the decoder's dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax.infra import sharding
from maelm_jax.models import maelm
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.text import tokenizer

from tiny_config import TINY_VOCAB, tiny_config, tiny_model

SP = tokenizer.SENTENCEPIECE_IDS
pytestmark = pytest.mark.tier("integration")


def _cross_config(**decoder_options):
    """3ML_cross in miniature: 40 % masking, 80-10-10, a half-width pre-LN decoder."""
    c = tiny_config("maelm")
    c.masking.mask_ratio, c.masking.mask_frac, c.masking.random_frac = 0.4, 0.8, 0.1
    c.model.pre_ln = True
    c.model.dropout = c.model.attention_dropout = 0.0
    c.model.decoder.update(kind="cross", num_layers=2, d_model=16, num_heads=2, d_ff=32,
                           pre_ln=True)
    c.model.decoder.update(decoder_options)
    pretrain_config.validate(c)
    return c


def _setup(c, batch_size=4, seed=0):
    return (*tiny_model(c, batch_size, seed), pretrain_config.mask_counts(c))


def test_split_puts_removed_masks_in_the_decoder_and_the_rest_in_the_encoder():
    c = _cross_config()
    _, batch, _, counts = _setup(c)
    split = maelm.split_predictions(batch)
    assert split.dec_index.shape == (4, counts.k_removed)
    assert split.enc_slot.shape == (4, counts.k - counts.k_removed)
    for b in range(4):
        inputs, enc_index = np.asarray(batch.inputs[b]), np.asarray(batch.enc_index[b])
        dec = np.asarray(split.dec_index[b])
        assert np.all(np.diff(dec) > 0)
        assert np.all(inputs[dec] == SP.mask)
        assert not set(dec) & set(enc_index)
        # The encoder-side predictions are the predicted positions the encoder reads.
        enc_pred = enc_index[np.asarray(split.enc_slot[b])]
        assert sorted(set(dec) | set(enc_pred)) == sorted(np.asarray(batch.pred_index[b]))
        # inverse puts [decoder part; encoder part] back in pred_index order.
        both = np.concatenate([dec, enc_pred])
        assert np.all(both[np.asarray(split.inverse[b])] == np.asarray(batch.pred_index[b]))


def test_decoder_reads_only_the_masks_and_the_encoder_outputs():
    c = _cross_config()
    model, batch, params, counts = _setup(c)
    dec = params["decoder"]
    assert dec["mask_embedding"].shape == (16,)  # a [MASK] vector in the decoder's space
    assert dec["projection"]["kernel"].shape == (32, 16)  # encoder width -> decoder width
    assert "cross_attention" in dec["layer_0"] and "self_attention" in dec["layer_0"]
    assert params["decoder_to_encoder"]["kernel"].shape == (16, 32)


def _logits_by_part(model, params, batch):
    logits = np.asarray(model.apply({"params": params}, batch))
    split = maelm.split_predictions(batch)
    removed = np.stack([np.isin(np.asarray(batch.pred_index[b]), np.asarray(split.dec_index[b]))
                        for b in range(batch.inputs.shape[0])])
    return logits, removed


def test_random_and_unchanged_tokens_are_predicted_from_the_encoder():
    c = _cross_config()
    model, batch, params, _ = _setup(c)
    before, removed = _logits_by_part(model, params, batch)
    changed = jax.tree.map(lambda x: x, params)
    changed["decoder"] = jax.tree.map(lambda x: x + 0.5, params["decoder"])
    after, _ = _logits_by_part(model, changed, batch)
    assert np.allclose(before[~removed], after[~removed])  # encoder side: untouched
    assert not np.allclose(before[removed], after[removed])  # decoder side: changed


def test_a_kept_token_reaches_the_mask_predictions():
    c = _cross_config()
    model, batch, params, _ = _setup(c, batch_size=1)
    before, removed = _logits_by_part(model, params, batch)
    kept = np.setdiff1d(np.asarray(batch.enc_index[0]), np.asarray(batch.pred_index[0]))[0]
    other = batch._replace(inputs=batch.inputs.at[0, kept].set(
        (batch.inputs[0, kept] + 1 - tokenizer.NUM_SPECIAL) % (TINY_VOCAB - tokenizer.NUM_SPECIAL)
        + tokenizer.NUM_SPECIAL))
    after, _ = _logits_by_part(model, params, other)
    assert not np.allclose(before[removed], after[removed])


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_decoder_dropout_only_when_configured(kind):
    def outputs(rate):
        c = _cross_config(kind=kind, dropout=rate, attention_dropout=rate)
        model, batch, params, _ = _setup(c)
        return [np.asarray(model.apply({"params": params}, batch, deterministic=False,
                                       rngs={"dropout": jax.random.PRNGKey(i)}))
                for i in (1, 2)]

    a, b = outputs(0.0)  # encoder dropout is 0 too: no randomness anywhere
    np.testing.assert_allclose(a, b)
    a, b = outputs(0.1)
    assert not np.allclose(a, b)


def test_cross_train_step_compiles_once_and_learns():
    c = _cross_config()
    c.train.learning_rate = 3e-3
    program = setup_lib.build(c, TINY_VOCAB, sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    train_step, state = program.train_step, program.init()
    # A fixed batch: the loss must fall as the model memorises it.
    tokens = jnp.asarray(np.random.default_rng(0).integers(
        tokenizer.NUM_SPECIAL, TINY_VOCAB, (8, c.data.seq_len)), jnp.int32)
    losses = []
    for _ in range(20):
        state, metrics = train_step(state, tokens)
        losses.append(float(metrics["loss"]))
    assert program.step._cache_size() == 1
    assert losses[-1] < losses[0] - 0.5, losses


def test_kind_is_validated():
    c = tiny_config("maelm")
    c.model.decoder.kind = "bart"
    with pytest.raises(pretrain_config.ConfigError, match="model.decoder.kind"):
        pretrain_config.validate(c)


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_both_decoders_drop_out_after_their_input_layernorm(kind):
    """With no layer at all, a decoder's output is its input LayerNorm's, dropped out at
    the decoder's rate in training (0: untouched), as after the encoder's embeddings."""
    from maelm_jax.models import decoder as decoder_lib
    from maelm_jax.models import layers

    rate = 0.5
    stack = layers.StackConfig(num_layers=0, d_model=16, num_heads=2, d_ff=32, dropout=rate)
    cfg = decoder_lib.DecoderConfig(stack=stack, seq_len=8, kind=kind)
    module = (decoder_lib.Decoder if kind == "self" else decoder_lib.CrossDecoder)(cfg)
    enc_out = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 16))
    enc_index = jnp.tile(jnp.array([0, 1, 3, 4, 6]), (2, 1))
    args = (enc_out, enc_index) + ((jnp.ones(16),) if kind == "self"
                                   else (jnp.tile(jnp.array([2, 5, 7]), (2, 1)),))
    params = module.init(jax.random.PRNGKey(1), *args)
    clean = np.asarray(module.apply(params, *args, deterministic=True))
    dropped = np.asarray(module.apply(params, *args, deterministic=False,
                                      rngs={"dropout": jax.random.PRNGKey(2)}))
    zero = dropped == 0
    assert 0.3 < zero.mean() < 0.7
    np.testing.assert_allclose(dropped[~zero], clean[~zero] / (1 - rate), rtol=1e-5, atol=1e-6)
    off = type(module)(decoder_lib.DecoderConfig(
        stack=layers.StackConfig(num_layers=0, d_model=16, num_heads=2, d_ff=32), seq_len=8,
        kind=kind))
    np.testing.assert_allclose(off.apply(params, *args, deterministic=False,
                                         rngs={"dropout": jax.random.PRNGKey(2)}), clean)
