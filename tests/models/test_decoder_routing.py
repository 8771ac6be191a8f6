"""The decoder's position options: what they build, and that they let it route context.

The MAE-LM decoder must learn to read a removed position's neighbours from absolute
positions alone; at laptop scale it often does not within a useful budget (README,
"MAE-LM and the unigram plateau"). On a synthetic task where every token is repeated
(`a a b b c c ...`), a masked token is predictable only from its partner: MLM learns it in
a few hundred steps, the paper's decoder does not, and the decoder's own relative position
bias (`model.decoder.rel_pos_buckets`, an option of the official code) closes the gap.
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax.infra import sharding
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import objectives
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.text import masking, tokenizer

from tiny_config import tiny_config

pytestmark = pytest.mark.tier("integration")

PAIRS_VOCAB = 64
PAIRS_LEN = 16


def _pairs_config(objective: str, **decoder_options):
    c = tiny_config(objective)
    c.data.seq_len = PAIRS_LEN
    c.model.dropout = c.model.attention_dropout = 0.0
    c.model.rel_pos_buckets = 16
    c.model.rel_pos_max_distance = 32
    for name, value in decoder_options.items():
        c.model.decoder[name] = value
    c.train.batch_size = 32
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 20
    return c


def _pairs(rng: np.random.Generator, batch: int) -> np.ndarray:
    """[batch, PAIRS_LEN] int32: each token twice in a row, no special ids."""
    half = rng.integers(tokenizer.NUM_SPECIAL, PAIRS_VOCAB, (batch, PAIRS_LEN // 2))
    return np.repeat(half, 2, axis=1).astype(np.int32)


def _pairs_accuracy(objective: str, num_steps: int, **decoder_options) -> float:
    """Trains on the pairs task and returns the masked-token accuracy on fresh pairs."""
    c = _pairs_config(objective, **decoder_options)
    c.train.num_steps = num_steps
    program = setup_lib.build(c, PAIRS_VOCAB, sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    state, rng = program.init(), np.random.default_rng(0)
    for _ in range(num_steps):
        state, _ = program.train_step(state, jnp.asarray(_pairs(rng, c.train.batch_size)))
    sums = program.eval_step(state.params, jnp.asarray(_pairs(rng, 256)), jax.random.PRNGKey(1))
    return float(sums["correct_sum"] / sums["count"])


def _params(objective: str, **decoder_options):
    c = _pairs_config(objective, **decoder_options)
    model = setup_lib.model(c, PAIRS_VOCAB)
    batch = masking.apply_mask(
        jax.random.PRNGKey(0), jnp.asarray(_pairs(np.random.default_rng(0), 2)),
        pretrain_config.mask_counts(c), PAIRS_VOCAB, tokenizer.SENTENCEPIECE_IDS,
    )
    return model, batch, nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch)["params"])


def test_paper_decoder_has_no_relative_bias_and_its_own_positions():
    _, _, params = _params("maelm")
    assert "relative_bias" not in params["decoder"]
    assert "position_embeddings" in params["decoder"]


def test_decoder_relative_bias_is_its_own_table():
    _, _, params = _params("maelm", rel_pos_buckets=8, rel_pos_max_distance=16)
    assert params["decoder"]["relative_bias"]["rel_embedding"].shape == (8, 2)
    # The encoder keeps its own (shared by its layers), as in the official code.
    assert params["encoder"]["relative_bias"]["rel_embedding"].shape == (16, 2)


def test_shared_positions_use_the_encoders_table():
    model, batch, params = _params("maelm", share_positions=True)
    assert "position_embeddings" not in params["decoder"]

    def loss(p):
        logits = model.apply({"params": p}, batch)
        return objectives.masked_lm_sums(logits, batch.targets, batch.weights)["loss_sum"]

    grads = jax.grad(loss)(params)
    # Removed positions are never read by the encoder: any gradient on their rows of the
    # encoder's position table comes through the decoder.
    read_by_encoder = np.zeros(PAIRS_LEN, bool)
    read_by_encoder[np.asarray(batch.enc_index[0])] = True
    read_by_encoder[np.asarray(batch.enc_index[1])] = True
    row_grads = np.abs(np.asarray(grads["encoder"]["position_embeddings"]["embedding"])).sum(1)
    assert np.all(row_grads[~read_by_encoder] > 0)


def test_share_positions_needs_equal_widths():
    c = _pairs_config("maelm", share_positions=True, d_model=16, num_heads=2, d_ff=32)
    with pytest.raises(pretrain_config.ConfigError, match="model.decoder.share_positions"):
        pretrain_config.validate(c)


def test_decoder_relative_bias_lets_maelm_learn_pairs_like_mlm():
    """MLM and MAE-LM with the decoder's relative bias both reach a high accuracy; the
    paper's decoder is far below in the same budget (it gets there later: 0.73 at 800
    steps where the biased decoder has 0.93)."""
    mlm = _pairs_accuracy("mlm", 400)
    with_bias = _pairs_accuracy("maelm", 600, rel_pos_buckets=16, rel_pos_max_distance=32)
    paper = _pairs_accuracy("maelm", 600)
    # Measured: MLM 0.83 at 400 steps; MAE-LM 0.77 with the decoder's bias, 0.28 without.
    # An unmasked partner makes a token predictable: about 1 - 0.15 of them at best.
    assert mlm > 0.6, mlm
    assert with_bias > 0.6, with_bias
    assert paper < with_bias - 0.3, (paper, with_bias)


def test_workdir_from_before_the_options_still_resumes():
    """A config.json without the new decoder fields counts them at their defaults."""
    from maelm_jax.pretrain import train as pretrain_train
    from maelm_jax.training import lifecycle

    new = json.loads(pretrain_config.to_json(tiny_config("maelm")))
    old = json.loads(json.dumps(new))
    for field in ("rel_pos_buckets", "rel_pos_max_distance", "share_positions"):
        del old["model"]["decoder"][field]
    defaults = json.loads(pretrain_config.to_json(pretrain_config.pretrain_defaults()))
    assert lifecycle.config_changes(old, new, defaults, pretrain_train.PRETRAINING.harmless) == []
    changed = json.loads(json.dumps(new))
    changed["model"]["decoder"]["rel_pos_buckets"] = 16
    assert lifecycle.config_changes(old, changed, defaults,
                                     pretrain_train.PRETRAINING.harmless) == [
        "model.decoder.rel_pos_buckets"]
