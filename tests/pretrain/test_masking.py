"""Masking invariants: fixed counts, no duplicates, padding, order, 80-10-10, delta."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax.text import masking, tokenizer

SP = tokenizer.SENTENCEPIECE_IDS

pytestmark = pytest.mark.tier("unit")

VOCAB = 1000


def random_tokens(seed: int, batch: int, length: int, pad_tail: int = 0) -> jnp.ndarray:
    rng = np.random.default_rng(seed)
    # Real tokens never use a special id, so [MASK] in the output can only come from masking.
    tokens = rng.integers(tokenizer.NUM_SPECIAL, VOCAB, size=(batch, length))
    if pad_tail:
        tokens[:, length - pad_tail :] = SP.pad
    return jnp.asarray(tokens, jnp.int32)


@pytest.mark.parametrize(
    "L, ratio, mask_frac, random_frac, delta, expected",
    [
        # k = round(0.15 * 512) = 77 (76.8); MAE-LM: all [MASK], all removed.
        (
            512,
            0.15,
            1.0,
            0.0,
            0.0,
            dict(k=77, k_mask=77, k_random=0, k_keep=0, k_in_enc=0, n_enc=435),
        ),
        # 3ML 40 % of 128: k = 51 (51.2); [MASK] = round(40.8) = 41, random = round(5.1) = 5,
        # keep 5.
        (
            128,
            0.4,
            0.8,
            0.1,
            0.0,
            dict(k=51, k_mask=41, k_random=5, k_keep=5, k_in_enc=0, n_enc=87),
        ),
        # delta = 0.5 of 19 [MASK] -> round(9.5) = 10 stay in the encoder (half up, not banker's).
        (
            128,
            0.15,
            1.0,
            0.0,
            0.5,
            dict(k=19, k_mask=19, k_random=0, k_keep=0, k_in_enc=10, n_enc=119),
        ),
    ],
)
def test_counts(L, ratio, mask_frac, random_frac, delta, expected):
    c = masking.MaskCounts.create(L, ratio, mask_frac, random_frac, delta)
    assert {name: getattr(c, name) for name in expected} == expected


def test_mlm_keeps_every_position_in_the_encoder():
    c = masking.MaskCounts.create(128, 0.15, remove_masked=False)
    assert (c.k, c.k_removed, c.n_enc) == (19, 0, 128)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mask_ratio=0.0), "mask_ratio must be in"),
        (dict(mask_ratio=1.0), "mask_ratio must be in"),
        (dict(mask_ratio=0.001), "k < 1"),
        (dict(mask_ratio=0.995), "encoder length of 0"),
        (
            dict(mask_ratio=0.15, mask_frac=0.8, random_frac=0.3),
            r"mask_frac \+ masking.random_frac",
        ),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        masking.MaskCounts.create(64, **kwargs)


def _check_batch(tokens, b: masking.MaskedBatch, c: masking.MaskCounts):
    tokens, inputs = np.asarray(tokens), np.asarray(b.inputs)
    enc, pred = np.asarray(b.enc_index), np.asarray(b.pred_index)
    B, L = tokens.shape
    assert enc.shape == (B, c.n_enc) and pred.shape == (B, c.k)
    for row in range(B):
        # Sorted and unique: the encoder reads tokens in their original order.
        assert np.all(np.diff(enc[row]) > 0) and np.all(np.diff(pred[row]) > 0)
        predicted = set(pred[row])
        assert len(predicted) == c.k
        is_mask = inputs[row] == SP.mask
        assert is_mask.sum() == c.k_mask
        assert set(np.flatnonzero(is_mask)) <= predicted
        # Outside the predicted positions nothing changes.
        untouched = np.setdiff1d(np.arange(L), pred[row])
        np.testing.assert_array_equal(inputs[row, untouched], tokens[row, untouched])
        # Random replacements are never special tokens and are at most k_random.
        changed = (inputs[row] != tokens[row]) & ~is_mask
        assert changed.sum() <= c.k_random
        assert np.all(inputs[row, changed] >= tokenizer.NUM_SPECIAL)
        # The encoder holds all unmasked positions and exactly k_in_enc [MASK]s (delta).
        assert (inputs[row, enc[row]] == SP.mask).sum() == (
            c.k_in_enc if c.remove_masked else c.k_mask
        )
        removed = np.setdiff1d(np.arange(L), enc[row])
        assert len(removed) == c.k_removed
        assert np.all(inputs[row, removed] == SP.mask)
    np.testing.assert_array_equal(b.targets, np.take_along_axis(tokens, pred, axis=1))


@pytest.mark.parametrize(
    "mask_frac, random_frac, delta, remove",
    [
        (1.0, 0.0, 0.0, True),  # MAE-LM
        (0.8, 0.1, 0.0, True),  # 3ML 80-10-10
        (1.0, 0.0, 0.25, True),  # MAE-LM delta ablation
        (0.8, 0.1, 0.0, False),  # MLM
    ],
)
def test_invariants(mask_frac, random_frac, delta, remove):
    c = masking.MaskCounts.create(64, 0.4, mask_frac, random_frac, delta, remove_masked=remove)
    for seed in range(3):
        tokens = random_tokens(seed, 4, 64)
        batch = jax.jit(masking.apply_mask, static_argnums=(2, 3, 4))(
            jax.random.PRNGKey(seed), tokens, c, VOCAB, SP
        )
        _check_batch(tokens, batch, c)
        assert np.all(np.asarray(batch.weights) == 1.0)


@pytest.mark.parametrize(
    "mask_frac, random_frac, remove",
    [(1.0, 0.0, True), (0.8, 0.1, True), (0.8, 0.0, True), (0.8, 0.2, True), (0.8, 0.1, False)],
)
def test_categories_align_with_pred_index(mask_frac, random_frac, remove):
    """category[b, j] says how position pred_index[b, j] was corrupted: [MASK] in the input,
    a random (non-special) token, or the original token."""
    c = masking.MaskCounts.create(64, 0.4, mask_frac, random_frac, remove_masked=remove)
    tokens = random_tokens(5, 16, 64)
    b = jax.jit(masking.apply_mask, static_argnums=(2, 3, 4))(jax.random.PRNGKey(4), tokens,
                                                               c, VOCAB, SP)
    category, pred = np.asarray(b.category), np.asarray(b.pred_index)
    assert category.shape == pred.shape and category.dtype == np.int32
    seen = np.take_along_axis(np.asarray(b.inputs), pred, axis=1)
    targets = np.asarray(b.targets)
    for row in range(len(category)):
        assert np.bincount(category[row], minlength=3).tolist() == [c.k_mask, c.k_random, c.k_keep]
    is_mask, is_random, is_kept = (category == v for v in (masking.MASKED, masking.RANDOM,
                                                            masking.UNCHANGED))
    assert np.all(seen[is_mask] == SP.mask)
    assert np.all(seen[~is_mask] != SP.mask)
    assert np.all(seen[is_random] >= tokenizer.NUM_SPECIAL)
    if c.k_random:  # a random draw hits the original token with probability ~1/995
        assert np.mean(seen[is_random] != targets[is_random]) > 0.95
    np.testing.assert_array_equal(seen[is_kept], targets[is_kept])


def test_random_fraction_really_replaces_tokens():
    c = masking.MaskCounts.create(64, 0.5, 0.0, 1.0)  # every corrupted token is random
    tokens = random_tokens(0, 8, 64)
    b = masking.apply_mask(jax.random.PRNGKey(0), tokens, c, VOCAB, SP)
    changed = (np.asarray(b.inputs) != np.asarray(tokens)).sum()
    # Each of the 8 * 32 draws hits the original token with probability ~1/995.
    assert changed >= 8 * 32 - 3


def test_padding_is_never_chosen_when_avoidable():
    c = masking.MaskCounts.create(64, 0.25)
    tokens = random_tokens(1, 16, 64, pad_tail=40)  # 24 real tokens >= k = 16
    b = masking.apply_mask(jax.random.PRNGKey(3), tokens, c, VOCAB, SP)
    assert np.all(np.asarray(b.pred_index) < 24)
    assert np.all(np.asarray(b.targets) != SP.pad)


def test_padding_chosen_only_when_forced_and_weighs_zero():
    c = masking.MaskCounts.create(64, 0.25)  # k = 16
    tokens = random_tokens(1, 2, 64, pad_tail=54)  # only 10 real tokens
    b = masking.apply_mask(jax.random.PRNGKey(3), tokens, c, VOCAB, SP)
    weights = np.asarray(b.weights)
    assert np.all(weights.sum(axis=1) == 10)
    np.testing.assert_array_equal(weights == 0, np.asarray(b.targets) == SP.pad)


def test_masks_depend_only_on_the_key():
    c = masking.MaskCounts.create(64, 0.15)
    tokens = random_tokens(0, 4, 64)
    a = masking.apply_mask(jax.random.PRNGKey(7), tokens, c, VOCAB, SP)
    b = masking.apply_mask(jax.random.PRNGKey(7), tokens, c, VOCAB, SP)
    d = masking.apply_mask(jax.random.PRNGKey(8), tokens, c, VOCAB, SP)
    np.testing.assert_array_equal(a.pred_index, b.pred_index)
    assert not np.array_equal(a.pred_index, d.pred_index)


def test_masked_positions_are_uniform():
    c = masking.MaskCounts.create(32, 0.25)
    tokens = random_tokens(0, 4000, 32)
    b = masking.apply_mask(jax.random.PRNGKey(0), tokens, c, VOCAB, SP)
    freq = np.bincount(np.asarray(b.pred_index).ravel(), minlength=32) / 4000
    np.testing.assert_allclose(freq, 0.25, atol=0.03)


def test_gather_scatter_round_trip():
    c = masking.MaskCounts.create(48, 0.3)
    tokens = random_tokens(2, 3, 48)
    b = masking.apply_mask(jax.random.PRNGKey(1), tokens, c, VOCAB, SP)
    hidden = jax.random.normal(jax.random.PRNGKey(2), (3, 48, 8))
    kept = masking.gather_tokens(hidden, b.enc_index)  # [B, n_enc, D]
    fill = jnp.full((3, 48, 8), -7.0)
    restored = masking.scatter_tokens(fill, b.enc_index, kept)  # [B, L, D]
    enc = np.asarray(b.enc_index)
    for row in range(3):
        np.testing.assert_array_equal(restored[row, enc[row]], hidden[row, enc[row]])
        removed = np.setdiff1d(np.arange(48), enc[row])
        assert np.all(np.asarray(restored[row, removed]) == -7.0)
    np.testing.assert_array_equal(masking.gather_tokens(restored, b.enc_index), kept)
    # Gathering the token ids gives the encoder's input in original order.
    np.testing.assert_array_equal(
        masking.gather_tokens(b.inputs, b.enc_index),
        np.take_along_axis(np.asarray(b.inputs), enc, axis=1),
    )


def test_random_replacements_skip_special_ids_wherever_they_are():
    key = jax.random.PRNGKey(4)
    # SentencePiece's 0-4 first: the draw is randint(5, vocab)'s, as before the ids moved.
    np.testing.assert_array_equal(masking.random_ordinary_tokens(key, (64, 64), 40, SP),
                                  jax.random.randint(key, (64, 64), 5, 40, jnp.int32))
    # BERT's layout, the ids spread over the vocabulary: every other id, never a special.
    bert = tokenizer.SpecialIds(pad=0, unk=3, bos=4, eos=5, mask=6)
    drawn = np.asarray(masking.random_ordinary_tokens(key, (64, 64), 12, bert))
    assert set(np.unique(drawn)) == {1, 2, 7, 8, 9, 10, 11}
