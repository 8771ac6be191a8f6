"""The train step and the loop: one compilation, learning, and kill-and-resume."""

import json
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax.config import variants
from maelm_jax.infra import sharding
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import evaluation as pretrain_evaluation
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.text import tokenizer

from conftest import HANG_SECONDS, REPO_ROOT, require_shared_data, subprocess_env
from tiny_config import TINY_VOCAB, tiny_config

pytestmark = pytest.mark.tier("integration")


def _step_fn(c):
    """The train step exactly as the loop compiles it, on one device."""
    program = setup_lib.build(c, TINY_VOCAB, sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    return program.init(), program.train_step


def _bf16_losses(output_dtype: str, seed: int, steps: int = 40) -> np.ndarray:
    """Train losses of a bfloat16 MAE-LM on a fixed stream of a small repetitive corpus."""
    c = tiny_config("maelm")
    c.model.dtype, c.model.output_dtype, c.seed = "bfloat16", output_dtype, seed
    c.train.learning_rate, c.train.warmup_steps = 3e-3, 5
    state, step = _step_fn(c)
    rng = np.random.default_rng(0)
    words = rng.integers(tokenizer.NUM_SPECIAL, TINY_VOCAB, (16, 32))
    losses = []
    for _ in range(steps):
        rows = words[rng.integers(0, 16, c.train.batch_size)]
        state, metrics = step(state, jnp.asarray(rows, jnp.int32))
        losses.append(float(metrics["loss"]))
    return np.asarray(losses)


def test_the_output_layer_in_bfloat16_trains_within_the_noise_of_float32():
    """model.output_dtype="compute" (bfloat16 operands, float32 accumulation): the loss
    curve of a bfloat16 model stays as close to the float32 output layer's as another seed
    of that one does."""
    full, half, other_seed = (_bf16_losses("float32", 0), _bf16_losses("compute", 0),
                              _bf16_losses("float32", 1))
    assert full[-10:].mean() < full[:5].mean() - 0.15  # it learns
    gap = abs(half[-10:].mean() - full[-10:].mean())
    noise = abs(other_seed[-10:].mean() - full[-10:].mean())
    assert gap <= max(2 * noise, 0.02 * full[-10:].mean()), (gap, noise)


# The preset families' model switches (3ML, MAE-LM Table 2, the fidelity switches), two at
# a time so that each family compiles in one of the cases below.
ABLATIONS = {
    "cross": {"model.decoder.kind": "causal_cross", "model.misaligned_positions": True,
              "model.rel_pos_bucket_fn": "maelm", "masking.mask_ratio": 0.4,
              "masking.mask_frac": 0.8, "masking.random_frac": 0.1},
    "reset": {"model.decoder.kind": "self", "masking.delta": 0.5,
              "model.decoder.reset_masks": True, "train.weight_decay_on": "all"},
}


@pytest.mark.parametrize("objective, accum, ablation", [
    ("maelm", 1, None), ("mlm", 2, None), ("maelm", 1, "cross"), ("maelm", 1, "reset")])
def test_train_step_compiles_once(objective, accum, ablation):
    c = tiny_config(objective)
    c.train.grad_accum_steps = accum
    if ablation:
        variants.apply(c, ABLATIONS[ablation])
        pretrain_config.validate(c)
    state, train_step = _step_fn(c)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(24):
        tokens = rng.integers(tokenizer.NUM_SPECIAL, TINY_VOCAB, (8, 32)).astype(np.int32)
        state, metrics = train_step(state, jnp.asarray(tokens))
        losses.append(float(metrics["loss"]))
    assert train_step.__self__.step._cache_size() == 1  # the program's jitted step
    assert int(state.step) == 24
    assert np.all(np.isfinite(losses))


@pytest.mark.parametrize("impl", pretrain_config.PRNG_IMPLS)
def test_same_step_same_masks_and_dropout(impl):
    """A step's randomness is a function of (seed, step) only: what resumption needs."""
    c = tiny_config("maelm")
    c.model.dropout = 0.1
    c.train.prng_impl = impl
    state, train_step = _step_fn(c)
    tokens = jnp.asarray(
        np.random.default_rng(0).integers(tokenizer.NUM_SPECIAL, TINY_VOCAB, (8, 32)), jnp.int32
    )
    host_state = jax.device_get(state)  # the step donates its input: pass fresh copies
    def fresh():
        return jax.tree.map(np.array, host_state)
    _, a = train_step(fresh(), tokens)
    _, b = train_step(fresh(), tokens)
    assert float(a["loss"]) == float(b["loss"])
    _, other = train_step(fresh().replace(step=np.int32(1)), tokens)
    assert float(other["loss"]) != float(a["loss"])


@pytest.mark.parametrize("objective", ["maelm", "mlm"])
def test_eval_reports_each_category_of_80_10_10(objective):
    """Loss, accuracy and perplexity for [MASK], random and unchanged positions (3ML
    Tables 1 and 2c), next to the overall figures they add up to."""
    c = tiny_config(objective)
    c.masking.mask_ratio, c.masking.mask_frac, c.masking.random_frac = 0.4, 0.8, 0.1
    program = setup_lib.build(c, TINY_VOCAB, sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    counts, state, eval_step = program.counts, program.init(), program.eval_step
    rng = np.random.default_rng(0)
    batches = [jnp.asarray(rng.integers(tokenizer.NUM_SPECIAL, TINY_VOCAB, (8, 32)), jnp.int32)
               for _ in range(2)]
    result = pretrain_evaluation.evaluate(eval_step, state.params, batches, c.seed)
    names = ("mask", "random", "unchanged")
    assert set(result) == {f"{p}{m}" for p in ("", *(n + "_" for n in names))
                           for m in ("loss", "accuracy", "perplexity")}
    # k = 13 of 32: 10 [MASK], 1 random, 2 unchanged per sequence, 16 sequences.
    share = np.array([counts.k_mask, counts.k_random, counts.k_keep]) / counts.k
    assert (counts.k_mask, counts.k_random, counts.k_keep) == (10, 1, 2)
    for metric in ("loss", "accuracy"):
        parts = np.array([result[f"{n}_{metric}"] for n in names])
        assert result[metric] == pytest.approx(float(share @ parts), rel=1e-5)
    assert result["mask_perplexity"] == pytest.approx(np.exp(result["mask_loss"]))
    # The untrained model's losses are near uniform for every category.
    for n in names:
        assert abs(result[f"{n}_loss"] - np.log(TINY_VOCAB)) < 1.0

    # The run's evaluations add loss, accuracy and perplexity at train.eval_mask_ratio
    # (0.15: k = 5, 4 [MASK] and 1 random), a second program compiled once.
    fixed = pretrain_config.fixed_mask_counts(c)
    assert (fixed.k, fixed.k_mask, fixed.k_random, fixed.k_keep) == (5, 4, 1, 0)
    for _ in range(2):
        both = pretrain_evaluation.evaluate_program(program, state.params, batches, c.seed)
    assert both == {**result, **{f"fixed_{m}": both[f"fixed_{m}"]
                                 for m in ("loss", "accuracy", "perplexity")}}
    assert both["fixed_loss"] != result["loss"] and program.fixed_eval_step._cache_size() == 1
    assert both["fixed_perplexity"] == pytest.approx(np.exp(both["fixed_loss"]))
    # At its own ratio a run's fixed figures are its own, with no second program.
    c.masking.mask_ratio = c.train.eval_mask_ratio
    own = setup_lib.build(c, TINY_VOCAB, sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    assert own.fixed_eval_step is None


def _read_metrics(workdir, split="train"):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == split}


@pytest.mark.slow
def test_short_wikipedia_run_lowers_the_loss(tmp_path, tiny_tokenizer):
    wiki = require_shared_data("wiki")
    c = tiny_config("maelm", tiny_tokenizer.model_path)
    c.data.sources.main.kind = "wikiextractor"
    c.data.sources.main.path = str(wiki / "wiki_00")
    c.data.seq_len = 64
    c.train.batch_size = 16
    c.train.num_steps = 60
    c.train.learning_rate = 2e-3
    c.train.warmup_steps = 5
    c.train.eval_every = 30
    c.train.checkpoint_every = 30
    result = pretrain_train.train_and_evaluate(c, str(tmp_path))
    train = _read_metrics(tmp_path)
    evals = _read_metrics(tmp_path, "eval")
    assert train[1]["loss"] > np.log(TINY_VOCAB) - 0.5  # starts near uniform
    assert result["loss"] < train[1]["loss"] - 1.0, (train[1], result)
    assert evals[60]["loss"] < evals[30]["loss"]
    # MAE-LM's masking has only [MASK]s: their figures are the overall ones.
    assert set(result) == {"loss", "accuracy", "perplexity", "mask_loss", "mask_accuracy",
                           "mask_perplexity", "unigram_accuracy", "fixed_loss",
                           "fixed_accuracy", "fixed_perplexity"}
    # Trained at train.eval_mask_ratio: its figures at the fixed ratio are its own.
    assert result["fixed_loss"] == result["loss"]
    assert result["mask_loss"] == pytest.approx(result["loss"])
    # The constant predictor of the most frequent piece: logged with every eval.
    assert 0.01 < evals[30]["unigram_accuracy"] == result["unigram_accuracy"] < 0.5
    assert (tmp_path / "config.json").exists() and list((tmp_path / "tensorboard").iterdir())


def _main_command(workdir, tokenizer_path, num_steps):
    c = [
        sys.executable, "main.py", "--config=tests/tiny_config.py", f"--workdir={workdir}",
        f"--config.tokenizer.model_path={tokenizer_path}",
        f"--config.train.num_steps={num_steps}", "--config.train.checkpoint_every=5",
    ]
    return c


def _kill_when(proc, condition, what):
    deadline = time.monotonic() + HANG_SECONDS
    while not condition():
        assert proc.poll() is None, f"the run finished before {what}"
        assert time.monotonic() < deadline
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


@pytest.mark.slow
def test_kill_and_resume_continues_exactly(tmp_path, tiny_tokenizer):
    """SIGKILL a run while it writes a checkpoint, and again between checkpoints; each
    time start it again: the losses are the ones an uninterrupted run produces (same data
    order, masks and dropout)."""
    steps_total = 60
    env = subprocess_env()
    command = _main_command(tmp_path / "killed", tiny_tokenizer.model_path, steps_total)
    full = tmp_path / "full"
    subprocess.run(_main_command(full, tiny_tokenizer.model_path, steps_total), cwd=REPO_ROOT,
                   env=env, check=True, capture_output=True)
    reference = _read_metrics(full)

    ckpt_dir = tmp_path / "killed" / "checkpoints"
    def in_progress():
        return ckpt_dir.exists() and any(
            "tmp" in p.name for p in ckpt_dir.iterdir() if p.name.split(".")[0] not in ("", "1"))
    def after_20():
        return (ckpt_dir / "20").exists()
    resumed_from = []
    for condition, what in ((in_progress, "a checkpoint save was caught in progress"),
                            (after_20, "checkpoint 20 was written")):
        log_path = tmp_path / f"log{len(resumed_from)}.txt"
        with open(log_path, "w") as log_file:  # a pipe could fill up and stall the run
            proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                    stderr=log_file)
            _kill_when(proc, condition, what)
        log = log_path.read_text()
        resumed_from += [int(x) for x in re.findall(r"resumed from checkpoint at step (\d+)", log)]
    finish = subprocess.run(command, cwd=REPO_ROOT, env=env, check=True, capture_output=True,
                            text=True)
    resumed_from += [int(x) for x in re.findall(r"resumed from checkpoint at step (\d+)",
                                                finish.stderr)]
    assert len(resumed_from) == 2 and resumed_from[1] >= 20, resumed_from
    after = _read_metrics(tmp_path / "killed")
    assert sorted(after) == list(range(1, steps_total + 1))  # one record per step
    for step in range(1, steps_total + 1):
        assert after[step]["loss"] == reference[step]["loss"], step
    assert _read_metrics(tmp_path / "killed", "eval")[steps_total]["loss"] == \
        _read_metrics(full, "eval")[steps_total]["loss"]


def test_step_never_applies_a_nonfinite_update():
    state, train_step = _step_fn(tiny_config("maelm"))
    host = jax.device_get(state)
    host = host.replace(params=jax.tree.map(np.array, host.params))
    host.params["lm_head"]["bias"][0] = np.inf
    tokens = jnp.full((8, 32), 7, jnp.int32)
    new, metrics = train_step(host, tokens)
    assert float(metrics["nonfinite"]) == 1.0 and int(new.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(new.params), host.params)


# ---------------------------------------------------------------- checkpoints
