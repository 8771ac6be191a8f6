"""Fill-mask: the command, the end-of-run examples, and the routing of masked positions."""

import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from maelm_jax.fill_mask import config as fill_mask_config
from maelm_jax.fill_mask import run as fill_mask_run
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.pretrain import steps as pretrain_steps
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.text import masking, tokenizer
from maelm_jax.workdirs import layout

from conftest import REPO_ROOT, subprocess_env
from tiny_config import tiny_config

SP = tokenizer.SENTENCEPIECE_IDS

pytestmark = pytest.mark.tier("integration")

TEXT = "Return a <mask> of the items in the <mask>."


@pytest.fixture(scope="module")
def maelm_run(tmp_path_factory, tiny_tokenizer):
    """A tiny MAE-LM pretraining of 6 steps that ends with two fill-mask examples."""
    c = tiny_config("maelm", tiny_tokenizer.model_path)
    c.train.num_steps = c.train.checkpoint_every = c.train.eval_every = 6
    c.train.fill_mask_examples = 2
    workdir = tmp_path_factory.mktemp("fill_mask") / "maelm"
    pretrain_train.train_and_evaluate(c, str(workdir))
    fill_mask_run.after_pretraining(str(workdir))  # what main.py does when a run has finished
    return workdir


def test_a_run_ends_with_examples_from_held_out_blocks(maelm_run):
    text = (maelm_run / layout.FILL_MASK_FILE).read_text()
    assert text.startswith("# Fill-mask on held-out blocks, step 6")
    assert text.count("input: ") == 2 and "<mask>" in text
    lines = [line for line in text.splitlines() if line.startswith("  <mask> ")]
    assert lines and all("(true: ▁" in line and line.count(" | ") == 4 for line in lines)


def test_the_command_prints_the_top_predictions_of_each_mask(maelm_run, capsys):
    c = fill_mask_config.fill_mask_defaults()
    c.text = TEXT + "|The <mask> module."
    first, second = fill_mask_run.run(c, str(maelm_run))
    assert first.top_ids.shape == (2, 5) and second.top_ids.shape == (1, 5)
    for filled in (first, second):
        assert np.all(filled.top_probs > 0) and np.all(filled.top_probs <= 1)
        assert np.all(np.diff(filled.top_probs, axis=1) <= 0)
        assert filled.ids[0] == SP.bos and filled.ids[-1] == SP.eos
        assert np.all(filled.ids[filled.masked] == SP.mask)
    out = capsys.readouterr().out
    assert out.count("input: ") == 2 and "return a <mask> of the items in the <mask>." in out
    # The space before a mask is not a piece of its own: the mask is a word-initial piece.
    pieces = [first.ids[m - 1] for m in first.masked]
    assert all(fill_mask_run.FillMasker.from_workdir(str(maelm_run)).tok.id_to_piece(int(p)) != "▁"
               for p in pieces)


@pytest.mark.parametrize("objective", ["maelm", "mlm"])
def test_maelm_never_reads_the_masked_inputs_and_mlm_does(objective, tiny_tokenizer):
    c = tiny_config(objective, tiny_tokenizer.model_path)
    model = setup_lib.model(c, tiny_tokenizer.vocab_size)
    batch = pretrain_steps._dummy_batch(pretrain_config.mask_counts(c))
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch))["params"]
    masker = fill_mask_run.FillMasker(c, tiny_tokenizer, jax.device_get(params))
    ids, masked = masker.encode_text(TEXT)
    other = ids.copy()
    other[masked] = 100  # what sits at the masked positions
    a, b = masker.predict(ids, masked), masker.predict(other, masked)
    if objective == "maelm":
        np.testing.assert_array_equal(a.top_ids, b.top_ids)
        np.testing.assert_allclose(a.top_probs, b.top_probs, rtol=1e-6)
    else:
        assert not np.allclose(a.top_probs, b.top_probs)


def test_full_length_predictions_match_the_pretraining_model(maelm_run):
    masker = fill_mask_run.FillMasker.from_workdir(str(maelm_run))
    L = masker.seq_len
    ids = np.arange(10, 10 + L, dtype=np.int32)
    masked = np.array([3, 7, L - 1])
    ids[masked] = SP.mask
    filled = masker.predict(ids, masked, top_k=3)
    model = setup_lib.model(masker.config, masker.tok.vocab_size)
    kept = np.setdiff1d(np.arange(L), masked)
    batch = masking.MaskedBatch(ids[None], kept[None].astype(np.int32),
                                masked[None].astype(np.int32), np.zeros((1, 3), np.int32),
                                np.ones((1, 3), np.float32))
    logits = np.asarray(model.apply({"params": masker.params}, batch))[0]
    # The jitted fill-mask program and this one may round differently: the logits of its
    # picks are the three largest, in order, to within that rounding.
    np.testing.assert_allclose(np.take_along_axis(logits, filled.top_ids, axis=-1),
                               -np.sort(-logits, axis=-1)[:, :3], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_mistakes_are_one_line_errors(maelm_run, tmp_path):
    masker = fill_mask_run.FillMasker.from_workdir(str(maelm_run))
    with pytest.raises(fill_mask_config.FillMaskError, match="^config.text: .* has no <mask>"):
        masker.encode_text("No mark here.")
    with pytest.raises(fill_mask_config.FillMaskError, match="^config.text: .* pieces with <s>"):
        masker.encode_text("<mask> " + "word " * 200)
    c = fill_mask_config.fill_mask_defaults()
    with pytest.raises(fill_mask_config.FillMaskError, match="^config.text: "):
        fill_mask_run.run(c, str(maelm_run))  # no text
    bad = subprocess.run([sys.executable, "main.py", "--config=configs/fill_mask.py",
                          f"--workdir={tmp_path / 'missing'}", f"--config.text={TEXT}"],
                         cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True)
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 1 and len(lines) == 1, bad.stderr[-2000:]
    assert lines[0].startswith("error: --workdir: ") and "does not exist" in lines[0], lines[0]
