"""The fine-tuning program, built once from a config: `build(config, encoder_cfg, task, ...)`,
as pretrain/setup.py builds pretraining's.

The run (finetune/train.py), the lowering tests and the analyses build what they run
here, so the step they check is the step the run takes: the encoder plus the task's head,
AdamW with warmup and linear decay over the run's steps, the state laid out on the mesh
as pretraining's is, and the train and eval steps compiled once per bucket length. The
learning-rate schedule is data in the state (its peak, warmup and length), not part of
the program, so every task, learning rate and length on one encoder, head and bucket
shares one compiled step (JAX's compilation cache finds it again across runs).
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
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from maelm_jax.infra import distributed, sharding
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.training import optimizer as optimizer_lib
from maelm_jax.training import state as state_lib
from maelm_jax.training import steps


@flax.struct.dataclass
class FinetuneState:
    step: jax.Array  # int32 scalar
    params: Any  # {"encoder": ..., "head": ...}
    opt_state: Any
    # The learning-rate schedule as data, [peak, warmup steps, total steps] float32
    # (optimizer.learning_rate_at): one compiled step serves every task's and setting's.
    schedule: jax.Array


@dataclasses.dataclass(frozen=True)
class Program:
    """A fine-tuning run's program: its model, optimiser, state layout and compiled steps on
    a mesh. What the loop (training/engine.py), the benchmarks and the tests run; the loop
    is not here."""

    mesh: Mesh
    rules: tuple  # logical axis -> mesh axis rules
    model: nn.Module  # encoder + the task's head
    tx: optax.GradientTransformation  # its update takes the step's learning_rate
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

    def stacked_on_mesh(self, arrays: dict) -> dict:
        """A seed group's train batches ({name: [runs, B, ...]}, every process holding
        them whole) on the mesh, each run's batch split as on_mesh splits one."""
        layout = sharding.stacked_batch_sharding(self.mesh)
        return {k: sharding.global_batch_from_full(v, self.mesh, layout)
                for k, v in arrays.items()}


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


def schedule_of(train: ml_collections.ConfigDict, num_steps: int
                ) -> tuple[float, float, float]:
    """The learning-rate schedule, as data, of a run of `num_steps` with `train`'s settings."""
    return optimizer_lib.schedule_values(optimizer_config(train, num_steps))


def state_setup(model: nn.Module, tx: optax.GradientTransformation, seed: int, length: int,
                mesh: Mesh, rules: tuple, compiler_options: dict | None = None,
                schedule: tuple[float, float, float] = (0.0, 0.0, 1.0)
                ) -> state_lib.StateSetup:
    """The fine-tuning state laid out on the mesh as pretraining's is (training/state.py):
    parameters by their logical axes, Adam's moments like their parameters, the step
    replicated. The steps take and return exactly these shardings, so each compiles once
    per shape; a resume checkpoint restores straight into them.

    `init(encoder_params)`: fresh parameters from `seed` (the head's; the encoder's too
    when `encoder_params` is None), the encoder's replaced by `encoder_params` (numpy, as
    runs.load_pretrained gives them) when given, and the learning-rate `schedule`
    (optimizer.schedule_values). `length` is any sequence length the model accepts (the
    parameters do not depend on it).
    """
    tokens = jnp.zeros((1, length), jnp.int32)
    key_mask = jnp.ones((1, length), bool)
    fresh = state_lib.build(
        lambda: model.init(jax.random.PRNGKey(seed), tokens, key_mask)["params"], mesh, rules,
        make_state=lambda params: FinetuneState(jnp.int32(0), params, tx.init(params),
                                                jnp.zeros(3, jnp.float32)),
        tx=tx, compiler_options=compiler_options)
    # Put in after the initialisation, which then compiles once for every schedule.
    values = np.asarray(schedule, np.float32)

    def init(encoder_params: Any) -> FinetuneState:
        state = fresh.init()
        state = state.replace(schedule=jax.device_put(values, fresh.shardings.schedule))
        if encoder_params is None:
            return state
        # Adam's moments start at zero whatever the parameters' values, so swapping the
        # encoder's in after the fresh initialisation is starting from them.
        encoder = jax.device_put(encoder_params, fresh.shardings.params["encoder"])
        return state.replace(params={**state.params, "encoder": encoder})

    return fresh._replace(init=init)


@dataclasses.dataclass(frozen=True)
class Runs:
    """The runs a group trains as one program (seed_group.py): run i draws its head's
    initialisation, its data order and its dropout from seeds[i] (seeds may repeat: the
    same seed for several models gives them the same draws, so their differences are
    paired), follows its own learning-rate schedule, schedules[i] ([peak, warmup steps,
    total steps], data in the state), and names its metrics "<keys[i]>/<name>"."""

    seeds: tuple[int, ...]
    keys: tuple[str, ...]
    schedules: tuple[tuple[float, float, float], ...]

    def __post_init__(self):
        if not (len(self.seeds) == len(self.keys) == len(self.schedules)) or not self.seeds:
            raise ValueError(f"a group needs a seed, a key and a schedule per run, got "
                             f"{len(self.seeds)}, {len(self.keys)} and {len(self.schedules)}")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"a group's runs need distinct keys, got {self.keys}")

    def __len__(self) -> int:
        return len(self.seeds)

    @classmethod
    def of_seeds(cls, seeds, schedule: tuple[float, float, float]) -> Runs:
        """A seed group's runs: one setting, one run per seed, named "seed_<s>"."""
        seeds = tuple(int(s) for s in seeds)
        return cls(seeds, tuple(f"seed_{s}" for s in seeds), (tuple(schedule),) * len(seeds))


def stacked_state_setup(model: nn.Module, tx: optax.GradientTransformation, runs: Runs,
                        length: int, mesh: Mesh, rules: tuple,
                        compiler_options: dict | None = None) -> state_lib.StateSetup:
    """The state of a group of runs (seed_group.py): state_setup's with a leading axis of
    len(runs) on every leaf, whole on every device (each device holds its shards of every
    run, as it would of one).

    `init(encoder_params)`: run i's leaves as state_setup with seed=runs.seeds[i] makes
    them (the same draws: the seed is a traced int32 under vmap, which draws the same
    bits) and its schedule runs.schedules[i]; the encoder's replaced by `encoder_params`:
    one tree for every run, or a list with each run's tree (None: the run keeps its fresh
    encoder, as the from-scratch control does).
    """
    solo = state_setup(model, tx, runs.seeds[0], length, mesh, rules, compiler_options)
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731 (a tuple: not a leaf)
    logical_specs = jax.tree.map(lambda spec: PartitionSpec(None, *spec), solo.logical_specs,
                                 is_leaf=is_spec)
    shardings = nn.logical_to_mesh_sharding(logical_specs, mesh, rules)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct((len(runs), *x.shape), x.dtype, sharding=s),
        solo.abstract, shardings)
    tokens = jnp.zeros((1, length), jnp.int32)
    key_mask = jnp.ones((1, length), bool)

    def fresh(seed: jax.Array) -> FinetuneState:
        params = nn.meta.unbox(model.init(jax.random.PRNGKey(seed), tokens, key_mask)["params"])
        return FinetuneState(jnp.int32(0), params, tx.init(params), jnp.zeros(3, jnp.float32))

    # The seeds are constants of the program: a process-local array argument would not do
    # on a mesh spanning several processes.
    jitted = jax.jit(lambda: jax.vmap(fresh)(jnp.asarray(runs.seeds, jnp.int32)),
                     out_shardings=shardings, compiler_options=compiler_options)

    values = np.asarray(runs.schedules, np.float32)

    def init(encoder_params: Any) -> FinetuneState:
        with sharding.activate(mesh, rules):
            state = jitted()
        state = state.replace(schedule=jax.device_put(values, shardings.schedule))
        if encoder_params is None:
            return state
        if isinstance(encoder_params, list):
            if len(encoder_params) != len(runs):
                raise ValueError(f"{len(encoder_params)} encoders for {len(runs)} runs")
            if all(p is None for p in encoder_params):
                return state
            own = (distributed.host_copy(state.params["encoder"])
                   if any(p is None for p in encoder_params) else None)
            each = [p if p is not None else jax.tree.map(lambda x, i=i: x[i], own)
                    for i, p in enumerate(encoder_params)]
            stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *each)
        else:
            stacked = jax.tree.map(lambda x: np.broadcast_to(x, (len(runs), *np.shape(x))),
                                   encoder_params)
        encoder = jax.device_put(stacked, shardings.params["encoder"])
        return state.replace(params={**state.params, "encoder": encoder})

    return state_lib.StateSetup(init, abstract, shardings, logical_specs)


def make_seeded_train_step(model: nn.Module, task, tx: optax.GradientTransformation
                           ) -> Callable:
    """train_step(state, batch, seed) -> (state, metrics): the step of the run with `seed`
    (a Python int, or an int32 scalar when a seed group vmaps it over its seeds: the
    dropout bits are the same either way)."""

    def loss_fn(params, batch, dropout_key):
        outputs = model.apply({"params": params}, batch["tokens"], batch["key_mask"],
                              deterministic=False, rngs={"dropout": dropout_key})
        loss_sum, count = task.loss_sums(outputs, batch)
        return loss_sum / jnp.maximum(count, 1.0)

    def train_step(state: FinetuneState, batch: dict, seed):
        # Dropout depends on (seed, step) only.
        dropout_key = jax.random.fold_in(jax.random.PRNGKey(seed), state.step)
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, dropout_key)
        learning_rate = optimizer_lib.learning_rate_at(state.step, state.schedule)
        params, opt_state, grad_norm, nonfinite = optimizer_lib.finite_update(
            tx, grads, state.opt_state, state.params, loss, learning_rate=learning_rate)
        metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": learning_rate,
                   "nonfinite": nonfinite}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_train_step(model: nn.Module, task, tx: optax.GradientTransformation,
                    seed: int) -> Callable:
    """train_step(state, batch) -> (state, metrics); batch as `data.Batch.arrays()`."""
    seeded = make_seeded_train_step(model, task, tx)
    return lambda state, batch: seeded(state, batch, seed)


def stacked_train_step(seeded_step: Callable, runs: Runs) -> Callable:
    """A group's train_step(state, batch) -> (state, metrics): `seeded_step`
    (make_seeded_train_step's) vmapped over the runs' axis of the state and of every batch
    array ([runs, B, ...]), run i with runs.seeds[i]. Metrics: each run's own as
    "<runs.keys[i]>/<name>" (its learning rate too: the runs' schedules may differ),
    "learning_rate" the first run's, and "nonfinite" the number of runs whose update was
    dropped."""

    def train_step(state: FinetuneState, batch: dict):
        state, per_run = jax.vmap(seeded_step)(state, batch,
                                               jnp.asarray(runs.seeds, jnp.int32))
        metrics = {f"{key}/{name}": values[i]
                   for name, values in per_run.items() if name != "nonfinite"
                   for i, key in enumerate(runs.keys)}
        return state, {**metrics, "learning_rate": per_run["learning_rate"][0],
                       "nonfinite": jnp.sum(per_run["nonfinite"].astype(jnp.float32))}

    return train_step


def make_eval_step(model: nn.Module, task) -> Callable:
    """eval_step(params, batch) -> the task's eval outputs ({name: [B, ...]})."""

    def eval_step(params, batch: dict) -> dict:
        outputs = model.apply({"params": params}, batch["tokens"], batch["key_mask"],
                              deterministic=True)
        return task.eval_outputs(outputs)

    return eval_step


def build(config: ml_collections.ConfigDict, encoder_cfg: encoder_lib.EncoderConfig, task,
          num_steps: int, length: int, mesh: Mesh | None = None,
          runs: Runs | None = None) -> Program:
    """The program of a prepared fine-tuning `config` (finetune/config.py) for `task`
    (tasks.make_task) on `encoder_cfg`, over `num_steps` steps; `length`: any sequence
    length the model accepts. `mesh`: default sharding.fixed_mesh(config.mesh.shape).

    `runs`: a group's program (seed_group.py), which trains its runs as one program: its
    state has a leading runs axis (stacked_state_setup), its train step takes batches
    stacked the same way (Program.stacked_on_mesh) and its eval step returns every run's
    outputs ([runs, B, ...]) for one batch. None: the single run of config.seed.
    """
    mesh = mesh if mesh is not None else sharding.fixed_mesh(config.mesh.shape,
                                                             config.mesh.dcn_shape)
    rules = sharding.rules_from_config(config.sharding_rules)
    model = task.model(encoder_cfg)
    optimizer = optimizer_config(config.train, num_steps)
    # The schedule is data in the state: programs differ only by shapes and the model.
    tx = optimizer_lib.make_optimizer(optimizer)
    schedule = optimizer_lib.schedule_values(optimizer)
    options = {"xla_backend_optimization_level": 0} if config.fast_compile else None
    eval_one = make_eval_step(model, task)
    if runs is None:
        setup = state_setup(model, tx, config.seed, length, mesh, rules, options, schedule)
        train_step = steps.jit_train_step(
            make_train_step(model, task, tx, config.seed), setup, mesh, options)
        eval_step = steps.jit_eval_step(eval_one, setup, mesh, options)
    else:
        setup = stacked_state_setup(model, tx, runs, length, mesh, rules, options)
        train_step = steps.jit_train_step(
            stacked_train_step(make_seeded_train_step(model, task, tx), runs),
            setup, mesh, options, sharding.stacked_batch_sharding(mesh))
        # One eval batch for every run: only the parameters carry the runs axis.
        eval_step = steps.jit_eval_step(jax.vmap(eval_one, in_axes=(0, None)), setup, mesh,
                                        options)
    return Program(mesh, rules, model, tx, setup, train_step, eval_step)
