"""Fine-tuning, top to bottom: `train_and_evaluate(config, workdir)`.

config -> encoder (+ tokenizer) from init_from, or fresh -> task data, encoded once ->
model = encoder + new head -> epochs of shuffled static-shape batches, evaluating on dev
after each (fraction of an) epoch -> the selected evaluation's parameters give the
predictions files and the checkpoint -> results.json. With `config.sweep`, runs the grid.

The workdir gets config.json, metrics.jsonl + tensorboard/, results.json,
predictions/ (GLUE <TASK>.tsv test files; SQuAD predictions.json, null_odds.json), and,
with save_checkpoint, checkpoints/<step>/ + encoder.json + tokenizer.model, so it can be
another run's init_from (MNLI -> RTE, MRPC, STS-B).
"""

from __future__ import annotations

import json
import math
import pathlib
import time
from collections.abc import Callable
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
from maelm_jax import schema, sharding
from maelm_jax import tokenizer as tokenizer_lib
from maelm_jax.finetune import config as config_lib
from maelm_jax.finetune import data, loading, tasks
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.training import metrics as metrics_lib
from maelm_jax.training import optimizer as optimizer_lib
from maelm_jax.training import workdir as workdir_lib

RESULTS_FILE = "results.json"


@flax.struct.dataclass
class FinetuneState:
    step: jax.Array  # int32 scalar
    params: Any  # {"encoder": ..., "head": ...}
    opt_state: Any


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Fine-tunes per `config` in `workdir` (or runs its sweep); returns the results."""
    config_lib.validate(config)
    # Relative paths mean the current directory; made absolute once, here (orbax needs
    # absolute checkpoint paths).
    config = config_lib.resolve_paths(config)
    workdir = schema.absolute(str(workdir))
    if config.sweep:
        from maelm_jax.finetune import sweep  # sweep imports this module

        return sweep.run_sweep(config, workdir)
    return run(config, workdir)


def _check_workdir(workdir: pathlib.Path, init_from: str) -> None:
    """Refuses a workdir that is not ours to overwrite (before anything is written)."""
    workdir_lib.check_directory(workdir)
    mode = loading.workdir_mode(workdir)
    if mode not in (None, "finetune"):
        raise config_lib.FinetuneConfigError(
            f"--workdir {workdir} holds a {mode} run; fine-tune into another directory")
    if init_from and workdir.resolve() in (pathlib.Path(init_from).resolve(),
                                           *pathlib.Path(init_from).resolve().parents):
        # Starting over would delete the checkpoint the run is to start from.
        raise config_lib.FinetuneConfigError(
            f"config.init_from {init_from} is inside --workdir {workdir}; fine-tune into "
            f"another directory")


def _reset_workdir(workdir: pathlib.Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    loading.clear_finetuned(workdir)  # a fine-tuning run starts over; it does not resume


def encoder_and_tokenizer(config: ml_collections.ConfigDict):
    """(EncoderConfig, encoder params (numpy) or None, tokenizer, description)."""
    m = config.model
    if config.init_from:
        p = loading.load_pretrained(config.init_from, m.dropout, m.attention_dropout, m.dtype,
                                    config.tokenizer_path)
        return p.encoder_cfg, p.params, p.tokenizer, p.description
    tok = tokenizer_lib.load_tokenizer(config.tokenizer_path)
    if m.d_model % m.num_heads:
        raise config_lib.FinetuneConfigError(
            f"config.model.d_model: expected a multiple of model.num_heads={m.num_heads}, "
            f"got {m.d_model}")
    arch = encoder_lib.model_architecture(m, vocab_size=tok.vocab_size,
                                          max_positions=m.max_positions)
    cfg = encoder_lib.from_architecture(arch, where="config.model", dtype=m.dtype,
                                        dropout=m.dropout, attention_dropout=m.attention_dropout)
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
    """All devices when a size is -1, else the first prod(shape) devices."""
    shape = tuple(int(s) for s in shape)
    if -1 in shape:
        return sharding.make_mesh(shape)
    return sharding.make_mesh(shape, jax.devices()[: max(math.prod(shape), 1)])


def init_state(model: nn.Module, tx: optax.GradientTransformation, seed: int, length: int,
               encoder_params: Any, mesh, rules,
               compiler_options: dict | None = None) -> tuple[FinetuneState, FinetuneState]:
    """Fresh parameters (the head's from `seed`), the encoder's replaced when given.

    Returns (state, its shardings): every leaf's sharding follows its logical axes and
    the rules (the optimiser moments inherit the parameters' axes), as in pretraining.
    The steps take and return exactly these shardings, so each compiles once per shape.
    """
    tokens = jnp.zeros((1, length), jnp.int32)
    key_mask = jnp.ones((1, length), bool)

    def init_boxed(encoder) -> FinetuneState:
        params = model.init(jax.random.PRNGKey(seed), tokens, key_mask)["params"]
        if encoder is not None:
            params = {**params, "encoder": jax.tree.map(
                lambda box, value: box.replace_boxed(value), params["encoder"], encoder,
                is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))}
        # Adam's moments start at zero whatever the values.
        return FinetuneState(jnp.int32(0), params, tx.init(params))

    with sharding.activate(mesh, rules):
        boxed = jax.eval_shape(init_boxed, None)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
        if encoder_params is not None:
            encoder_params = jax.device_put(encoder_params, shardings.params["encoder"])
        state = jax.jit(lambda e: nn.meta.unbox(init_boxed(e)), out_shardings=shardings,
                        compiler_options=compiler_options)(encoder_params)
    return state, shardings


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
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "learning_rate": schedule(state.step)}
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


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """One fine-tuning run. Returns the results (also written to results.json)."""
    started = time.perf_counter()
    config_lib.validate(config)
    config = config_lib.resolve_paths(config)
    workdir = pathlib.Path(schema.absolute(str(workdir)))
    _check_workdir(workdir, config.init_from)

    # Checkpoint, tokenizer and data are checked before the workdir is touched.
    encoder_cfg, encoder_params, tok, source = encoder_and_tokenizer(config)
    max_len = max_seq_len(config, encoder_cfg.max_positions)
    buckets = data.buckets_for(max_len, config.data.buckets)
    task = tasks.make_task(config, tok, max_len)
    if len(task.train) == 0:
        raise config_lib.FinetuneConfigError(f"config.data: {task.name} has no usable training "
                                             f"example")
    _reset_workdir(workdir)
    (workdir / loading.CONFIG_FILE).write_text(pretrain_config.to_json(config))
    t = config.train
    logging.info("%s: %d train examples, max_seq_len %d (buckets %s); encoder %s",
                 task.name, len(task.train), max_len, buckets, source)

    if jax.process_count() > 1:
        # Batches are built whole on the host; several processes would each need their share.
        raise config_lib.FinetuneConfigError("fine-tuning runs in one process (on all of its "
                                             "devices); start it without multi-process flags")
    mesh = make_mesh(config.mesh.shape)
    rules = sharding.rules_from_config(config.sharding_rules)
    sharding.check_batch(mesh, t.batch_size, 1)
    sharding.check_batch(mesh, t.eval_batch_size, 1)
    batch_sharding = sharding.batch_sharding(mesh)

    model = task.model(encoder_cfg)
    steps_per_epoch = data.steps_per_epoch(len(task.train), t.batch_size)
    num_steps = steps_per_epoch * t.num_epochs
    tx, schedule = optimizer_lib.make_optimizer(optimizer_config(t, num_steps))
    options = {"xla_backend_optimization_level": 0} if config.fast_compile else None
    state, state_shardings = init_state(model, tx, config.seed, buckets[0], encoder_params,
                                        mesh, rules, options)
    replicated = sharding.replicated(mesh)
    train_step = jax.jit(make_train_step(model, task, tx, schedule, config.seed),
                         in_shardings=(state_shardings, batch_sharding),
                         out_shardings=(state_shardings, replicated), donate_argnums=0,
                         compiler_options=options)
    eval_step = jax.jit(make_eval_step(model, task),
                        in_shardings=(state_shardings.params, batch_sharding),
                        out_shardings=replicated, compiler_options=options)

    def put(batch: data.Batch) -> dict:
        return batch.arrays()  # numpy; the steps' in_shardings place it

    def run_eval_with(params) -> tasks.RunEval:
        def run_eval(sequences, targets) -> tasks.BatchOutputs:
            with sharding.activate(mesh, rules):
                return [(b.rows, jax.device_get(eval_step(params, put(b))))
                        for b in data.eval_batches(sequences, targets, t.eval_batch_size,
                                                   buckets)]
        return run_eval

    writer = metrics_lib.MetricWriter(workdir)
    eval_at = _eval_steps(steps_per_epoch, t.num_epochs, t.evals_per_epoch)
    rng = np.random.default_rng(config.seed)
    evals: list[dict] = []
    best, best_params = None, None
    window: list[dict] = []
    window_start, step = time.perf_counter(), 0
    with sharding.activate(mesh, rules):
        for epoch in range(t.num_epochs):
            for batch in data.train_batches(task.train.sequences, task.train.targets,
                                            t.batch_size, buckets, rng):
                state, step_metrics = train_step(state, put(batch))
                step += 1
                window.append(step_metrics)
                if step == 1:  # keep compilation out of the first window's examples/s
                    jax.block_until_ready(state)
                    logging.info("compiled and ran the first step in %.1fs",
                                 time.perf_counter() - window_start)
                    window, window_start = [], time.perf_counter()
                if window and (step % t.log_every == 0 or step == num_steps):
                    fetched = jax.device_get(window)
                    means = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}
                    elapsed = time.perf_counter() - window_start
                    means["examples_per_sec"] = len(window) * t.batch_size / max(elapsed, 1e-9)
                    writer.write("train", step, {**means, "epoch": epoch + 1})
                    window, window_start = [], time.perf_counter()
                if step in eval_at:
                    scores = task.score(run_eval_with(state.params))
                    writer.write("dev", step, scores)
                    evals.append({"step": step, "epoch": step / steps_per_epoch, **scores})
                    if best is None or scores[task.primary_metric] > best[task.primary_metric]:
                        best = evals[-1]
                        if t.select == "best":
                            best_params = jax.device_get(state.params)  # a host copy
    writer.close()
    selected = best if t.select == "best" else evals[-1]
    params = (jax.device_put(best_params, state_shardings.params) if t.select == "best"
              else state.params)
    written = task.write_outputs(workdir, run_eval_with(params))
    if config.save_checkpoint:
        path = loading.save_finetuned(workdir, selected["step"], jax.device_get(params),
                                      encoder_cfg, tok)
        written.append(str(path))
    results = {
        "task": task.name,
        "primary_metric": task.primary_metric,
        "select": t.select,
        "dev": dict(selected),
        "best": best,
        "final": evals[-1],
        "evals": evals,
        "init_from": source,
        "train_examples": len(task.train),
        "num_steps": num_steps,
        "max_seq_len": max_len,
        "seed": config.seed,
        "hyperparameters": {k: t[k] for k in ("learning_rate", "batch_size", "num_epochs",
                                              "warmup_ratio")},
        "files": written,
        "wall_seconds": time.perf_counter() - started,
    }
    (workdir / RESULTS_FILE).write_text(json.dumps(results, indent=2))
    logging.info("%s dev %s = %.2f (%s, step %d); %.0fs", task.name, task.primary_metric,
                 selected[task.primary_metric], t.select, selected["step"],
                 results["wall_seconds"])
    return results
