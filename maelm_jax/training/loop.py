"""Pretraining, top to bottom: `train_and_evaluate(config, workdir)`.

config -> tokenizer -> prepared blocks -> model and optimiser -> restore the latest
checkpoint if any -> steps with periodic logs, evals and checkpoints.
"""

from __future__ import annotations

import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from maelm_jax import config as config_lib
from maelm_jax.data import loader, pipeline
from maelm_jax.models import pretrain as pretrain_lib
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.training import metrics as metrics_lib
from maelm_jax.training import optimizer as optimizer_lib
from maelm_jax.training import steps

CONFIG_FILE = "config.json"


def evaluate(eval_step, params, batches: list[np.ndarray], seed: int) -> dict[str, float]:
    """Masked-token loss, accuracy and perplexity on fixed validation batches and masks."""
    totals = {"loss_sum": 0.0, "correct_sum": 0.0, "count": 0.0}
    for i, tokens in enumerate(batches):
        # The same keys every time, so evals at different steps score identical masks.
        key = jax.random.fold_in(jax.random.PRNGKey(seed + 1), i)
        sums = jax.device_get(eval_step(params, tokens, key))
        for name in totals:
            totals[name] += float(sums[name])
    count = max(totals["count"], 1.0)
    loss = totals["loss_sum"] / count
    return {
        "loss": loss,
        "accuracy": totals["correct_sum"] / count,
        "perplexity": metrics_lib.perplexity(loss),
    }


class _Throughput:
    """Steps/s, tokens/s and ETA over the last logging window."""

    def __init__(self, step: int, tokens_per_step: int, num_steps: int):
        self.step, self.time = step, time.perf_counter()
        self.tokens_per_step, self.num_steps = tokens_per_step, num_steps

    def measure(self, step: int) -> dict[str, float]:
        now = time.perf_counter()
        rate = (step - self.step) / max(now - self.time, 1e-9)
        self.step, self.time = step, now
        return {
            "steps_per_sec": rate,
            "tokens_per_sec": rate * self.tokens_per_step,
            "eta_minutes": (self.num_steps - step) / max(rate, 1e-9) / 60,
        }


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Pretrains per `config` in `workdir`, resuming from its latest checkpoint.

    Returns the last evaluation's metrics.
    """
    config_lib.validate(config)
    pipeline.validate_sources(config)
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / CONFIG_FILE).write_text(config_lib.to_json(config))

    tok = pipeline.setup_tokenizer(config, workdir)
    data = pipeline.prepare_data(config, workdir, tok)
    counts = config_lib.mask_counts(config)
    logging.info(
        "masking: k=%d predicted (%d [MASK], %d random, %d unchanged), encoder length %d of %d",
        counts.k,
        counts.k_mask,
        counts.k_random,
        counts.k_keep,
        counts.n_enc,
        counts.seq_len,
    )

    model = pretrain_lib.PretrainModel(config_lib.model_config(config, tok.vocab_size))
    tx, schedule = optimizer_lib.make_optimizer(config.train)
    state, _ = steps.create_state(model, tx, config.seed, counts)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    logging.info("%s model: %.2fM parameters", config.objective, n_params / 1e6)

    t = config.train
    ckpt = checkpoint_lib.Checkpointer(
        workdir / "checkpoints", t.checkpoint_every, t.keep_checkpoints
    )
    start = ckpt.latest_step()
    if start is not None:
        state, meta = ckpt.restore(start, state)
        logging.info(
            "resumed from checkpoint at step %d (data position %d)", start, meta["data_position"]
        )
        start = meta["data_position"]
    else:
        start = 0
    writer = metrics_lib.MetricWriter(workdir, resume_step=start)

    train_step = jax.jit(
        steps.make_train_step(model, tx, schedule, counts, tok.vocab_size, t.grad_accum_steps),
        donate_argnums=0,
    )
    eval_step = jax.jit(steps.make_eval_step(model, counts, tok.vocab_size))
    eval_data = loader.eval_batches(data, t.batch_size, t.eval_batches)
    batches = loader.train_batches(
        data,
        t.batch_size,
        config.seed,
        start_step=start,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        prefetch=config.data.prefetch,
    )

    throughput = _Throughput(start, t.batch_size * config.data.seq_len, t.num_steps)
    window: list[dict] = []
    eval_metrics: dict[str, float] = {}
    for step in range(start + 1, t.num_steps + 1):
        state, step_metrics = train_step(state, jnp.asarray(next(batches)))
        window.append(step_metrics)
        if step == start + 1:
            # Keep compilation out of the first window's steps/s and ETA.
            jax.block_until_ready(state)
            logging.info(
                "compiled and ran the first step in %.1fs", time.perf_counter() - throughput.time
            )
            throughput = _Throughput(step, t.batch_size * config.data.seq_len, t.num_steps)
        if step % t.log_every == 0 or step == t.num_steps:
            fetched = jax.device_get(window)
            means = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}
            means["perplexity"] = metrics_lib.perplexity(means["loss"])
            writer.write("train", step, {**means, **throughput.measure(step)})
            window = []
        if step % t.eval_every == 0 or step == t.num_steps:
            eval_metrics = evaluate(eval_step, state.params, eval_data, config.seed)
            writer.write("eval", step, eval_metrics)
        ckpt.save(step, state, {"step": step, "data_position": step}, force=step == t.num_steps)
    ckpt.wait()
    ckpt.close()
    writer.close()
    return eval_metrics
