"""The fine-tuning trainer, built once from a config: `build(config, encoder_cfg, task, ...)`,
as training/setup.py builds pretraining's.

The run (finetune/train.py), the lowering tests and the analyses build what they run
here, so the step they check is the step the run takes: the encoder plus the task's head,
AdamW with warmup and linear decay over the run's steps, the state laid out on the mesh
as pretraining's is, and the train and eval steps compiled once per bucket length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from maelm_jax import sharding
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.training import optimizer as optimizer_lib
from maelm_jax.training import state as state_lib
from maelm_jax.training import steps


@flax.struct.dataclass
class FinetuneState:
    step: jax.Array  # int32 scalar
    params: Any  # {"encoder": ..., "head": ...}
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class Trainer:
    """A fine-tuning run's model, optimiser, state layout and compiled steps on a mesh."""

    mesh: Mesh
    rules: tuple  # logical axis -> mesh axis rules
    model: nn.Module  # encoder + the task's head
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    # init(encoder_params or None), the abstract state and its shardings (state_setup).
    state: state_lib.StateSetup
    # train_step(state, batch) -> (state, metrics): the state donated, every array of the
    # batch (data.Batch.arrays()) split over data x fsdp, metrics replicated.
    train_step: Callable
    # eval_step(params, batch) -> the task's eval outputs, replicated.
    eval_step: Callable

    def on_mesh(self, batch: Any) -> dict:
        """A data.Batch as the global batch: every process holds it whole and gives its
        devices their rows."""
        return {k: sharding.global_batch_from_full(v, self.mesh)
                for k, v in batch.arrays().items()}


def optimizer_config(train: ml_collections.ConfigDict, num_steps: int
                     ) -> ml_collections.ConfigDict:
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


def state_setup(model: nn.Module, tx: optax.GradientTransformation, seed: int, length: int,
                mesh: Mesh, rules: tuple, compiler_options: dict | None = None
                ) -> state_lib.StateSetup:
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
    """eval_step(params, batch) -> the task's eval outputs ({name: [B, ...]})."""

    def eval_step(params, batch: dict) -> dict:
        outputs = model.apply({"params": params}, batch["tokens"], batch["key_mask"],
                              deterministic=True)
        return task.eval_outputs(outputs)

    return eval_step


def build(config: ml_collections.ConfigDict, encoder_cfg: encoder_lib.EncoderConfig, task,
          num_steps: int, length: int, mesh: Mesh | None = None) -> Trainer:
    """The trainer of a prepared fine-tuning `config` (finetune/config.py) for `task`
    (tasks.make_task) on `encoder_cfg`, over `num_steps` steps; `length`: any sequence
    length the model accepts. `mesh`: default sharding.fixed_mesh(config.mesh.shape)."""
    mesh = mesh if mesh is not None else sharding.fixed_mesh(config.mesh.shape)
    rules = sharding.rules_from_config(config.sharding_rules)
    model = task.model(encoder_cfg)
    tx, schedule = optimizer_lib.make_optimizer(optimizer_config(config.train, num_steps))
    options = {"xla_backend_optimization_level": 0} if config.fast_compile else None
    setup = state_setup(model, tx, config.seed, length, mesh, rules, options)
    train_step = steps.jit_train_step(make_train_step(model, task, tx, schedule, config.seed),
                                      setup, mesh, options)
    eval_step = steps.jit_eval_step(make_eval_step(model, task), setup, mesh, options)
    return Trainer(mesh, rules, model, tx, schedule, setup, train_step, eval_step)
