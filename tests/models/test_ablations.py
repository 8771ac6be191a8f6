"""MAE-LM Table 2 ablations as config fields, and the presets of both papers."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax.config import variants
from maelm_jax.models import decoder as decoder_lib
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import maelm
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.text import masking, tokenizer

from conftest import HANG_SECONDS, subprocess_env
from tiny_config import TINY_VOCAB, tiny_config, tiny_model

SP = tokenizer.SENTENCEPIECE_IDS
pytestmark = pytest.mark.tier("integration")

REPO = pathlib.Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "configs" / "pretrain"


def _setup(c, batch_size=2, seed=0):
    pretrain_config.validate(c)
    return tiny_model(c, batch_size, seed)


def _no_dropout(c):
    c.model.dropout = c.model.attention_dropout = 0.0
    return c


# --- decoder attention kinds --------------------------------------------------------------

def _cross_kind(kind):
    c = _no_dropout(tiny_config("maelm"))
    c.model.decoder.kind = kind
    return c


def _intermediates(model, params, batch):
    """Every module's output (jitted: op-by-op dispatch of a whole model is slow)."""
    run = jax.jit(lambda p, b: model.apply({"params": p}, b, capture_intermediates=True,
                                           mutable=["intermediates"])[1]["intermediates"])
    return run(params, batch)


def _decoder_outputs(model, params, batch):
    """The decoder's states at the removed [MASK]s, [B, n_de, D_dec] (ascending position)."""
    return np.asarray(_intermediates(model, params, batch)["decoder"]["__call__"][0])


def test_causal_cross_decoder_is_causal_and_bidirectional_is_not():
    """Changing the last [MASK]'s decoder query (through its position) moves no earlier
    [MASK]'s state in the causal decoder, and does in the bidirectional one."""
    for kind, earlier_moves in (("causal_cross", False), ("cross", True)):
        model, batch, params = _setup(_cross_kind(kind), batch_size=1)
        before = _decoder_outputs(model, params, batch)
        table = params["decoder"]["position_embeddings"]["embedding"]
        split = maelm.split_predictions(batch)
        last_pos = int(split.dec_index[0, -1])
        moved = jax.tree.map(lambda x: x, params)
        moved["decoder"]["position_embeddings"]["embedding"] = table.at[last_pos].add(1.0)
        after = _decoder_outputs(model, moved, batch)
        assert not np.allclose(before[0, -1], after[0, -1])
        # Exactly: a masked key's weight is exp(-inf) = 0. (At init the attention is nearly
        # uniform and small, so the bidirectional change is tiny but not zero.)
        assert np.array_equal(before[0, :-1], after[0, :-1]) != earlier_moves, kind


def test_cross_only_decoder_has_no_self_attention_and_masks_do_not_interact():
    model, batch, params = _setup(_cross_kind("cross_only"), batch_size=1)
    layer = params["decoder"]["layer_0"]
    assert "cross_attention" in layer and "self_attention" not in layer
    before = _decoder_outputs(model, params, batch)
    split = maelm.split_predictions(batch)
    first_pos = int(split.dec_index[0, 0])
    moved = jax.tree.map(lambda x: x, params)
    table = params["decoder"]["position_embeddings"]["embedding"]
    moved["decoder"]["position_embeddings"]["embedding"] = table.at[first_pos].add(1.0)
    after = _decoder_outputs(model, moved, batch)
    assert not np.allclose(before[0, 0], after[0, 0])
    np.testing.assert_array_equal(before[0, 1:], after[0, 1:])


def test_cross_kinds_never_read_a_kept_tokens_input_embedding_directly():
    """The decoder is a function of the encoder's outputs and the [MASK] positions only:
    run on its own with the encoder outputs held fixed, a changed kept token (and so a
    changed input embedding) cannot reach it, and it holds no word-embedding table."""
    for kind in ("causal_cross",):  # every cross kind runs this same CrossDecoder code
        c = _cross_kind(kind)
        model, batch, params = _setup(c, batch_size=1)
        assert set(params["decoder"]) & {"word_embeddings", "token_embeddings"} == set()
        enc_out = _intermediates(model, params, batch)["encoder"]["__call__"][0]
        split = maelm.split_predictions(batch)
        cfg = setup_lib.model_config(c, TINY_VOCAB).decoder
        alone = decoder_lib.CrossDecoder(cfg).apply(
            {"params": params["decoder"]}, enc_out, batch.enc_index, split.dec_index)
        np.testing.assert_allclose(np.asarray(alone), _decoder_outputs(model, params, batch),
                                   atol=1e-6)


# --- reset and misaligned positions ---------------------------------------------------------

def _enc_mask_config(reset):
    c = _no_dropout(tiny_config("maelm"))
    c.masking.delta = 1.0  # every [MASK] stays in the encoder
    c.model.decoder.reset_masks = reset
    return c


def _decoder_input(model, params, batch):
    return np.asarray(_intermediates(model, params, batch)["decoder"]["input"][0])


def test_reset_puts_the_mask_embedding_back_in_the_decoder():
    for reset in (False, True):
        model, batch, params = _setup(_enc_mask_config(reset))
        x = _decoder_input(model, params, batch)  # [B, L, D]: input + decoder positions
        positions = np.asarray(params["decoder"]["position_embeddings"]["embedding"])
        mask_row = np.asarray(params["encoder"]["word_embeddings"]["embedding"][SP.mask])
        is_mask = np.asarray(batch.inputs) == SP.mask
        assert is_mask.any()
        at_masks = (x - positions[None, : x.shape[1]])[is_mask]
        # reset: every [MASK] reads the [MASK] embedding; else each its encoder output.
        assert np.allclose(at_masks, mask_row[None], atol=1e-5) == reset


def test_reset_is_validated():
    c = tiny_config("maelm")
    c.model.decoder.reset_masks = True
    c.model.decoder.kind = "cross"
    with pytest.raises(pretrain_config.ConfigError, match="model.decoder.reset_masks"):
        pretrain_config.validate(c)


def test_misaligned_positions_are_consecutive():
    """The encoder output equals the encoder run directly on positions 0..n_enc-1, not on
    the original positions."""
    c = _no_dropout(tiny_config("maelm"))
    c.model.misaligned_positions = True
    model, batch, params = _setup(c)
    enc_out = np.asarray(_intermediates(model, params, batch)["encoder"]["__call__"][0])
    enc_tokens = masking.gather_tokens(batch.inputs, batch.enc_index)
    consecutive = jnp.broadcast_to(jnp.arange(enc_tokens.shape[1]), enc_tokens.shape)
    encoder = encoder_lib.Encoder(setup_lib.model_config(c, TINY_VOCAB).encoder)
    direct = jax.jit(lambda pos: encoder.apply({"params": params["encoder"]}, enc_tokens, pos))
    np.testing.assert_allclose(enc_out, np.asarray(direct(consecutive)), atol=1e-5)
    assert not np.allclose(enc_out, np.asarray(direct(batch.enc_index)), atol=1e-5)


def test_misaligned_positions_need_maelm():
    c = tiny_config("mlm")
    c.model.misaligned_positions = True
    with pytest.raises(pretrain_config.ConfigError, match="model.misaligned_positions"):
        pretrain_config.validate(c)


# --- presets and the variant syntax -----------------------------------------------------------

BASE_VARIANTS = ("maelm", "mlm", "enc_mask", "enc_mask_reset", "random_replace", "misaligned",
                 "no_rel_pos", "dec_bi_cross", "dec_uni_cross", "dec_cross_only", "dec_2x768",
                 "dec_6x768", "dec_4x512", "dec_4x1024")
THREEML_VARIANTS = ("self_base", "self_large", "cross_base", "cross_large", "mlm_base",
                    "mlm_large", "cross_large,mask=0.5", "mlm_large,mask=0.4,steps=1000")


# One variant per model family is built (abstractly); every variant is validated.
BUILT = {"base.py:maelm", "base.py:mlm", "base.py:enc_mask_reset", "base.py:dec_uni_cross",
         "base.py:dec_4x512", "3ml.py:self_base", "3ml.py:cross_large", "large_plus.py"}


@pytest.mark.parametrize("spec", [f"base.py:{v}" for v in BASE_VARIANTS]
                         + [f"3ml.py:{v}" for v in THREEML_VARIANTS]
                         + ["base_plus.py:misaligned", "large_plus.py", "quickstart.py:mlm"])
def test_every_preset_validates_and_builds(spec):
    c = variants.load(str(PRETRAIN / spec))
    pretrain_config.validate(c)
    model_cfg = setup_lib.model_config(c, c.tokenizer.vocab_size)
    counts = pretrain_config.mask_counts(c)
    assert setup_lib.step_flops(c, c.tokenizer.vocab_size) > 0
    if spec not in BUILT:
        return
    # Built abstractly (shapes only, no memory) at batch 1.
    model = pretrain_config.objective(c).model(model_cfg)
    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)
    batch = masking.MaskedBatch(i32(1, counts.seq_len), i32(1, counts.n_enc), i32(1, counts.k),
                                i32(1, counts.k), jax.ShapeDtypeStruct((1, counts.k), jnp.float32))
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), batch)
    assert "encoder" in shapes["params"]


def test_3ml_presets_follow_table_4():
    large = variants.load(f"{PRETRAIN}/3ml.py:cross_large")
    assert (large.model.num_layers, large.model.d_model, large.data.seq_len) == (24, 1024, 128)
    assert (large.model.decoder.num_layers, large.model.decoder.d_model) == (2, 512)
    assert large.model.decoder.kind == "cross" and large.model.pre_ln
    assert large.masking.mask_ratio == 0.4
    assert (large.masking.mask_frac, large.masking.random_frac) == (0.8, 0.1)
    assert large.model.decoder.dropout == 0.1 and large.train.clip_norm == 0.0
    assert large.train.warmup_steps == round(0.06 * 23_000)
    base = variants.load(f"{PRETRAIN}/3ml.py:self_base,mask=0.5")
    assert not base.model.pre_ln and base.masking.mask_ratio == 0.5
    assert (base.train.batch_size, base.train.learning_rate) == (2048, 7e-4)
    hbert = variants.load(f"{PRETRAIN}/3ml.py:mlm_large")
    assert hbert.objective == "mlm" and hbert.model.pre_ln and hbert.masking.mask_ratio == 0.15


@pytest.mark.parametrize("arg, message", [
    ("nope", "unknown config variant 'nope'; expected one of"),
    ("self_base,mask", "expected key=value"),
    ("self_base,lr=1", "unknown variant option 'lr'"),
    ("self_base,mask=lots", "variant option mask: expected float"),
])
def test_variant_errors_are_one_line(arg, message):
    with pytest.raises(variants.VariantError, match=message) as info:
        variants.load(f"{PRETRAIN}/3ml.py:{arg}")
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_speedup_table_reproduces_3ml_table_3():
    """benchmarks/speedup_table.py: our FLOPs ratios against the paper's Table 3 column
    (1.22x / 1.28x base, 1.34x / 1.47x / 1.37x large), to within 0.015."""
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "speedup_table.py")],
                            cwd=REPO.parent, env=subprocess_env(), capture_output=True,
                            text=True, timeout=HANG_SECONDS, check=True)
    rows = [line for line in result.stdout.splitlines() if line.startswith("3ML")]
    assert len(rows) == 5, result.stdout
    for line in rows:
        ours, paper = (float(x.rstrip("x")) for x in line[40:].split()[:2])
        assert abs(ours - paper) <= 0.015, line
