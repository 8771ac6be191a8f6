"""Fine-tuning, top to bottom: `run(config, workdir)`, one run. (A sweep, `config.sweep`,
is sweep.run_sweep, which calls `run` per setting and seed; main.py picks between them.)

config -> encoder (+ tokenizer) from init_from, or fresh -> task data, encoded once ->
model = encoder + new head -> epochs of shuffled static-shape batches, evaluating on dev
after each (fraction of an) epoch -> the selected evaluation's parameters give the
predictions files and the checkpoint -> results.json.

The workdir gets config.json, metrics.jsonl + tensorboard/, results.json,
predictions/ (GLUE <TASK>.tsv test files; SQuAD predictions.json, null_odds.json), and,
with save_checkpoint, checkpoints/<step>/ + encoder.json + tokenizer.model, so it can be
another run's init_from (MNLI -> RTE, MRPC, STS-B).

Until the run finishes, the workdir also holds resume/<step>/: orbax checkpoints of the
whole train state, written at every evaluation but the last, every
train.checkpoint_every steps and on SIGTERM. Running the same command again continues
from the latest one exactly as if the run had not stopped: epoch e's data order is drawn
from (seed, e) and dropout from (seed, step), and the checkpoint carries the evaluations
so far, the best one's parameters (select="best") and the train metrics since the last
log line. resume/ is deleted once results.json is written. A workdir holding a finished
run, or an unfinished run of another config (a warning names the fields), starts over.

Several processes (jax.distributed, as in pretraining) run it as one job on one mesh:
each builds the same whole batches (from the seed) and gives the mesh only its own rows;
eval outputs come back replicated, so every process scores them alike. Process 0 alone
prepares the workdir and writes config.json, the metrics, results.json, the predictions
and the files beside the final checkpoint; orbax's saves are made by every process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from maelm_jax import config as pretrain_config
from maelm_jax import distributed, paths, runs, sharding
from maelm_jax import tokenizer as tokenizer_lib
from maelm_jax.finetune import config as config_lib
from maelm_jax.finetune import data, loading, tasks
from maelm_jax.finetune import resume as resume_lib
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.training import engine, steps
from maelm_jax.training import metrics as metrics_lib
from maelm_jax.training import optimizer as optimizer_lib
from maelm_jax.training import state as state_lib
from maelm_jax.training import workdir as workdir_lib


@flax.struct.dataclass
class FinetuneState:
    step: jax.Array  # int32 scalar
    params: Any  # {"encoder": ..., "head": ...}
    opt_state: Any


def _check_workdir(workdir: paths.Path, init_from: str) -> None:
    """Refuses a workdir that is not ours to overwrite (before anything is written)."""
    workdir_lib.check_directory(workdir)
    mode = runs.mode(workdir)
    if mode not in (None, "finetune"):
        raise config_lib.FinetuneConfigError(
            f"--workdir {workdir} holds a {mode} run; fine-tune into another directory")
    if init_from and paths.contains(workdir, init_from):
        # Starting over would delete the checkpoint the run is to start from.
        raise config_lib.FinetuneConfigError(
            f"config.init_from {init_from} is inside --workdir {workdir}; fine-tune into "
            f"another directory")


def encoder_and_tokenizer(config: ml_collections.ConfigDict):
    """(EncoderConfig, encoder params (numpy) or None, tokenizer, description)."""
    m = config.model
    if config.init_from:
        pretrained = config.init_weights == "pretrained"
        p = runs.load_pretrained(config.init_from, m.dropout, m.attention_dropout, m.dtype,
                                 config.tokenizer_path, weights=pretrained)
        # The kernel changes no parameter: chosen once the architecture is known.
        impl = config_lib.attention_impl(config, p.encoder_cfg.stack.num_heads,
                                         p.encoder_cfg.stack.d_model)
        cfg = dataclasses.replace(p.encoder_cfg, stack=dataclasses.replace(
            p.encoder_cfg.stack, attention_impl=impl, pallas=config_lib.kernel_options(config)))
        description = (p.description if pretrained
                       else f"random weights in the architecture of {p.description}")
        return cfg, p.params, p.tokenizer, description
    tok = tokenizer_lib.load_tokenizer(config.tokenizer_path)
    if m.d_model % m.num_heads:
        raise config_lib.FinetuneConfigError(
            f"config.model.d_model: expected a multiple of model.num_heads={m.num_heads}, "
            f"got {m.d_model}")
    arch = encoder_lib.model_architecture(m, vocab_size=tok.vocab_size,
                                          max_positions=m.max_positions)
    cfg = encoder_lib.from_architecture(
        arch, where="config.model", dtype=m.dtype, dropout=m.dropout,
        attention_dropout=m.attention_dropout,
        attention_impl=config_lib.attention_impl(config, m.num_heads, m.d_model),
        pallas=config_lib.kernel_options(config))
    return cfg, None, tok, "from scratch (no init_from)"


def max_seq_len(config: ml_collections.ConfigDict, encoder_max_positions: int) -> int:
    requested = config.data.max_seq_len or min(512, encoder_max_positions)
    if requested > encoder_max_positions:
        raise config_lib.FinetuneConfigError(
            f"config.data.max_seq_len: expected at most the encoder's {encoder_max_positions} "
            f"positions, got {requested}")
    return requested


def optimizer_config(train: ml_collections.ConfigDict, num_steps: int) -> ml_collections.ConfigDict:
    """The pretraining optimiser's fields (AdamW, warmup then linear decay, clipping)."""
    return ml_collections.ConfigDict({
        "learning_rate": train.learning_rate,
        "warmup_steps": round(train.warmup_ratio * num_steps),
        "num_steps": num_steps,
        "weight_decay": train.weight_decay,
        "weight_decay_on": train.weight_decay_on,
        "adam_b1": train.adam_b1,
        "adam_b2": train.adam_b2,
        "adam_eps": train.adam_eps,
        "clip_norm": train.clip_norm,
    })


def make_mesh(shape) -> jax.sharding.Mesh:
    """All devices when a size is -1 or the job has several processes (each must hold part
    of the mesh), else the first prod(shape) devices."""
    shape = tuple(int(s) for s in shape)
    if -1 in shape or jax.process_count() > 1:
        return sharding.make_mesh(shape)
    return sharding.make_mesh(shape, jax.devices()[: max(math.prod(shape), 1)])


def state_setup(model: nn.Module, tx: optax.GradientTransformation, seed: int, length: int,
                mesh, rules, compiler_options: dict | None = None) -> state_lib.StateSetup:
    """The fine-tuning state laid out on the mesh as pretraining's is (training/state.py):
    parameters by their logical axes, Adam's moments like their parameters, the step
    replicated. The steps take and return exactly these shardings, so each compiles once
    per shape; a resume checkpoint restores straight into them.

    `init(encoder_params)`: fresh parameters from `seed` (the head's; the encoder's too
    when `encoder_params` is None), the encoder's replaced by `encoder_params` (numpy, as
    runs.load_pretrained gives them) when given. `length` is any sequence length the
    model accepts (the parameters do not depend on it).
    """
    tokens = jnp.zeros((1, length), jnp.int32)
    key_mask = jnp.ones((1, length), bool)
    fresh = state_lib.build(
        lambda: model.init(jax.random.PRNGKey(seed), tokens, key_mask)["params"], mesh, rules,
        make_state=lambda params: FinetuneState(jnp.int32(0), params, tx.init(params)), tx=tx,
        compiler_options=compiler_options)

    def init(encoder_params: Any) -> FinetuneState:
        state = fresh.init()
        if encoder_params is None:
            return state
        # Adam's moments start at zero whatever the parameters' values, so swapping the
        # encoder's in after the fresh initialisation is starting from them.
        encoder = jax.device_put(encoder_params, fresh.shardings.params["encoder"])
        return state.replace(params={**state.params, "encoder": encoder})

    return fresh._replace(init=init)


def make_train_step(model: nn.Module, task, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, seed: int) -> Callable:
    """train_step(state, batch) -> (state, metrics); batch as `data.Batch.arrays()`."""

    def loss_fn(params, batch, dropout_key):
        outputs = model.apply({"params": params}, batch["tokens"], batch["key_mask"],
                              deterministic=False, rngs={"dropout": dropout_key})
        loss_sum, count = task.loss_sums(outputs, batch)
        return loss_sum / jnp.maximum(count, 1.0)

    def train_step(state: FinetuneState, batch: dict):
        # Dropout depends on (seed, step) only.
        dropout_key = jax.random.fold_in(jax.random.PRNGKey(seed), state.step)
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, dropout_key)
        params, opt_state, grad_norm, nonfinite = optimizer_lib.finite_update(
            tx, grads, state.opt_state, state.params, loss)
        metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": schedule(state.step),
                   "nonfinite": nonfinite}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(model: nn.Module, task) -> Callable:
    def eval_step(params, batch: dict) -> dict:
        outputs = model.apply({"params": params}, batch["tokens"], batch["key_mask"],
                              deterministic=True)
        return task.eval_outputs(outputs)

    return eval_step


def _eval_steps(steps_per_epoch: int, num_epochs: int, evals_per_epoch: int) -> set[int]:
    """Steps after which to evaluate: evals_per_epoch times per epoch, always at the end."""
    k = min(evals_per_epoch, steps_per_epoch)
    return {max(1, round(steps_per_epoch * (epoch + i / k)))
            for epoch in range(num_epochs) for i in range(1, k + 1)}


def train_batches(train: tasks.Split, batch_size: int, buckets, seed: int, num_epochs: int,
                  start: int) -> Iterator[tuple[int, data.Batch]]:
    """(epoch, batch) for each step after the first `start` steps, to the last epoch's end.

    Epoch e's order is a permutation drawn from (seed, e) alone, so a resumed run draws
    the orders again and skips the batches it has already trained on.
    """
    first, done = divmod(start, data.steps_per_epoch(len(train), batch_size))
    for epoch in range(first, num_epochs):
        batches = data.train_batches(train.sequences, train.targets, batch_size, buckets,
                                     np.random.default_rng((seed, epoch)))
        for batch in itertools.islice(batches, done if epoch == first else 0, None):
            yield epoch, batch


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """One fine-tuning run; returns the results (also written to results.json).

    An unfinished run of the same config in `workdir` continues from its latest resume
    checkpoint; anything else there is replaced (see the module docstring). On a stop
    request (SIGTERM, the time limit), saves a resume checkpoint and raises
    preemption.Preempted (TimeLimit).
    """
    started = time.perf_counter()
    config, workdir = config_lib.prepare(config, workdir)
    if config.sweep:
        raise config_lib.FinetuneConfigError(
            "config.sweep: expected False for a single run (sweep.run_sweep runs the grid)")
    _check_workdir(workdir, config.init_from)

    # Checkpoint, tokenizer and data are checked before the workdir is touched.
    encoder_cfg, encoder_params, tok, source = encoder_and_tokenizer(config)
    max_len = max_seq_len(config, encoder_cfg.max_positions)
    buckets = data.buckets_for(max_len, config.data.buckets)
    task = tasks.make_task(config, tok, max_len)
    if len(task.train) == 0:
        raise config_lib.FinetuneConfigError(f"config.data: {task.name} has no usable training "
                                             f"example")
    # Process 0 decides and prepares the workdir; the others wait, so none reads it half
    # cleared.
    resume = distributed.leader_says_ok(
        distributed.is_leader() and resume_lib.resumable(workdir, config))
    if distributed.is_leader():
        if not resume:
            resume_lib.start_over(workdir)
        loading.clear_finetuned(workdir)  # the final checkpoint is written when the run ends
        paths.write_text(workdir / runs.CONFIG_FILE, pretrain_config.to_json(config))
    distributed.barrier("fine-tuning workdir")
    t = config.train
    logging.info("%s: %d train examples, max_seq_len %d (buckets %s); encoder %s",
                 task.name, len(task.train), max_len, buckets, source)

    mesh = make_mesh(config.mesh.shape)
    rules = sharding.rules_from_config(config.sharding_rules)
    sharding.check_batch(mesh, t.batch_size, 1)
    sharding.check_batch(mesh, t.eval_batch_size, 1)
    batch_sharding = sharding.batch_sharding(mesh)

    def on_mesh(batch: data.Batch) -> dict:
        """The global batch: every process holds it whole and gives its devices their rows."""
        return {k: sharding.global_batch_from_full(v, mesh) for k, v in batch.arrays().items()}

    model = task.model(encoder_cfg)
    steps_per_epoch = data.steps_per_epoch(len(task.train), t.batch_size)
    num_steps = steps_per_epoch * t.num_epochs
    tx, schedule = optimizer_lib.make_optimizer(optimizer_config(t, num_steps))
    options = {"xla_backend_optimization_level": 0} if config.fast_compile else None
    setup = state_setup(model, tx, config.seed, buckets[0], mesh, rules, options)
    replicated = sharding.replicated(mesh)
    train_step = steps.jit_train_step(make_train_step(model, task, tx, schedule, config.seed),
                                      setup, mesh, options)
    eval_step = jax.jit(make_eval_step(model, task),
                        in_shardings=(setup.shardings.params, batch_sharding),
                        out_shardings=replicated, compiler_options=options)

    def run_eval_with(params) -> tasks.RunEval:
        def run_eval(sequences, targets) -> tasks.BatchOutputs:
            with sharding.activate(mesh, rules):
                return [(b.rows, jax.device_get(eval_step(params, on_mesh(b))))
                        for b in data.eval_batches(sequences, targets, t.eval_batch_size,
                                                   buckets)]
        return run_eval

    # Saves are forced: the loop decides when (the interval argument is unused).
    with contextlib.closing(checkpoint_lib.Checkpointer(workdir / resume_lib.RESUME_DIR, 1,
                                                        resume_lib.KEEP)) as ckpt:
        start, state, best_params, progress = resume_lib.restore_or_init(
            ckpt, setup, encoder_params, t.select, resume)
        eval_at = _eval_steps(steps_per_epoch, t.num_epochs, t.evals_per_epoch)
        writer = metrics_lib.MetricWriter(workdir, resume_step=start,
                                          enabled=distributed.is_leader())
        with (contextlib.closing(writer),
              sharding.activate(mesh, rules), engine.Loop(start, ckpt) as loop):
            for step, (epoch, batch) in enumerate(
                    train_batches(task.train, t.batch_size, buckets, config.seed,
                                  t.num_epochs, start), start=start + 1):
                state, step_metrics = train_step(state, on_mesh(batch))
                progress.window.append(step_metrics)
                log = step % t.log_every == 0 or step == num_steps
                loop.after_step(step, state, closes_window=log)
                if log:
                    window = resume_lib.on_host(progress.window)
                    progress.skipped += engine.check_finite(
                        list(range(step - len(window) + 1, step + 1)), window, t.nonfinite,
                        ckpt)
                    means = engine.window_means(window)
                    means["skipped_updates"] = progress.skipped
                    lapped, seconds = loop.lap(step)
                    means["examples_per_sec"] = lapped * t.batch_size / seconds
                    writer.write("train", step, {**means, "epoch": epoch + 1})
                    progress.window = []
                if step in eval_at:
                    scores = task.score(run_eval_with(state.params))
                    writer.write("dev", step, scores)
                    progress.evals.append({"step": step, "epoch": step / steps_per_epoch,
                                           **scores})
                    best = None if progress.best is None else progress.evals[progress.best]
                    if best is None or scores[task.primary_metric] > best[task.primary_metric]:
                        progress.best = len(progress.evals) - 1
                        if t.select == "best":
                            best_params = distributed.host_copy(state.params)
                if step == num_steps:
                    break  # the results follow at once: nothing to resume from
                stopping = loop.stop_requested(step)
                if stopping or step in eval_at or (
                        t.checkpoint_every and step % t.checkpoint_every == 0):
                    resume_lib.save(ckpt, step, state, best_params, t.select, progress,
                          time.perf_counter() - started)
                    writer.flush()  # a resumed run finds every metrics line up to here
                if stopping:
                    ckpt.wait()
                    raise loop.stopped(step, str(ckpt.directory))

    best = progress.evals[progress.best]
    selected = best if t.select == "best" else progress.evals[-1]
    params = (jax.device_put(best_params, setup.shardings.params) if t.select == "best"
              else state.params)
    with tempfile.TemporaryDirectory() as scratch:
        # Every process runs the evaluations (each is a step on the whole mesh); only
        # process 0's files are kept.
        written = task.write_outputs(workdir if distributed.is_leader()
                                     else paths.Path(scratch), run_eval_with(params))
    if config.save_checkpoint:
        path = loading.save_finetuned(workdir, selected["step"], distributed.host_copy(params),
                                      encoder_cfg, tok)
        written.append(str(path))
    results = {
        "task": task.name,
        "primary_metric": task.primary_metric,
        "select": t.select,
        "dev": dict(selected),
        "best": best,
        "final": progress.evals[-1],
        "evals": progress.evals,
        "init_from": source,
        "train_examples": len(task.train),
        "num_steps": num_steps,
        "max_seq_len": max_len,
        "seed": config.seed,
        "hyperparameters": {k: t[k] for k in ("learning_rate", "batch_size", "num_epochs",
                                              "warmup_ratio")},
        "files": written,
        "wall_seconds": progress.seconds + time.perf_counter() - started,
    }
    if distributed.is_leader():
        paths.write_text(workdir / resume_lib.RESULTS_FILE, json.dumps(results, indent=2))
        paths.remove(workdir / resume_lib.RESUME_DIR)  # finished: nothing to resume
    logging.info("%s dev %s = %.2f (%s, step %d); %.0fs", task.name, task.primary_metric,
                 selected[task.primary_metric], t.select, selected["step"],
                 results["wall_seconds"])
    return results
