"""The pretraining program, built once from a config: `build(config, vocab_size, mesh)`.

The training loop, the memory planner (scripts/plan_memory.py), the benchmarks and the
tests all build what they run through `build`, so the step a benchmark times or a test
checks is the step the loop runs: the same model, optimiser and schedule, mask counts,
state shardings and jitted steps. The model (`model_config`, `model`) and the FLOPs
(`step_flops`) a config implies are built here too, for everything that needs one
without a program (fill-mask, the analyses, reading a run back, MFU); the config itself
(maelm_jax/pretrain/config.py) stays plain data.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from maelm_jax.infra import sharding
from maelm_jax.models import builder, layers
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import flops
from maelm_jax.pretrain import steps as pretrain_steps
from maelm_jax.text import masking, tokenizer
from maelm_jax.training import optimizer as optimizer_lib
from maelm_jax.training import state as state_lib
from maelm_jax.training import steps


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a pretraining config's step is sized by, derived from the config once: its
    objective, the mask counts (the encoder's length n_enc among them) and the vocabulary.
    The program, its encoder's kernel tiles and its FLOPs (and through them the train
    logs' utilisation, the time budget's plan and the benchmarks) read this, not the raw
    config again."""

    objective: Any  # objectives.Objective
    counts: masking.MaskCounts
    vocab_size: int
    special: tokenizer.SpecialIds  # the tokenizer's special ids (EncoderConfig.special)

    def paper_flops(self, config: ml_collections.ConfigDict) -> int:
        """Training FLOPs of one step as 3ML Appendix D counts them (backward = forward;
        maelm_jax/pretrain/flops.py), at the exact mask counts and the global batch."""
        return self.objective.step_flops(config, self.counts, self.vocab_size)

    def model_flops(self, config: ml_collections.ConfigDict) -> int:
        """Model FLOPs of one step, forward + backward = 3 x forward: every utilisation
        and FLOPs rate reports these (pretrain/mfu.py)."""
        return flops.model_flops(self.paper_flops(config))


def shape(config: ml_collections.ConfigDict, vocab_size: int,
          special: tokenizer.SpecialIds = tokenizer.SENTENCEPIECE_IDS) -> Shape:
    """`config`'s Shape (ConfigError for a config that does not validate its objective),
    for a tokenizer of `vocab_size` ids with the `special` ids (a run passes its
    tokenizer's; the default is a SentencePiece model of ours, as the benchmarks' ids)."""
    return Shape(pretrain_config.objective(config), pretrain_config.mask_counts(config),
                 vocab_size, special)


@dataclasses.dataclass(frozen=True)
class Program:
    """A pretraining run's program: its model, optimiser, state layout and compiled steps on
    a mesh. What the loop (training/engine.py), the benchmarks and the tests run; the loop
    is not here."""

    config: ml_collections.ConfigDict
    vocab_size: int
    mesh: Mesh
    rules: tuple  # logical axis -> mesh axis rules (sharding.DEFAULT_RULES by default)
    shape: Shape  # the objective, mask counts and vocabulary, resolved once
    model: nn.Module  # the objective's model (`model`)
    tx: optax.GradientTransformation
    # The learning-rate schedule as data, [peak, warmup steps, total steps, decay from,
    # rate there, shape, decay fraction, floor] (optimizer.learning_rate_at): config.train's,
    # or a time budget's plan.
    schedule_values: tuple[float, ...]
    state: state_lib.StateSetup  # init(), the abstract state and its shardings
    # step(state, tokens [batch, L] int32, schedule) -> (state, metrics): the state
    # donated, the batch split over data x fsdp, metrics replicated; compiles exactly once,
    # whatever the schedule.
    step: Callable
    # eval_step(params, tokens [b, L] int32, key) -> masked-LM sums, replicated.
    eval_step: Callable
    # The same at train.eval_mask_ratio (pretrain_config.fixed_mask_counts): a second static
    # shape, compiled at its first call; None where that is the run's own mask_ratio.
    fixed_eval_step: Callable | None = None

    def init(self) -> pretrain_steps.TrainState:
        """The initial train state, sharded on the mesh."""
        return self.state.init()

    def train_step(self, state: pretrain_steps.TrainState,
                   tokens: jax.Array) -> tuple[pretrain_steps.TrainState, dict]:
        """One optimiser step on the global batch `tokens` with this program's schedule."""
        return self.step(state, tokens, self.schedule)

    @functools.cached_property
    def schedule(self) -> jax.Array:
        """schedule_values as the program takes them, float32 [8], replicated on the mesh
        (put there when first used: a mesh of compile-only devices holds no array)."""
        return jax.device_put(np.asarray(self.schedule_values, np.float32),
                              sharding.replicated(self.mesh))

    def schedule_spec(self) -> jax.ShapeDtypeStruct:
        """The abstract schedule argument of `program`, for lowering without devices."""
        return jax.ShapeDtypeStruct((len(self.schedule_values),), np.float32,
                                    sharding=sharding.replicated(self.mesh))

    def with_steps(self, config: ml_collections.ConfigDict) -> Program:
        """This program running `config` (this one's, with other train.num_steps and the
        schedule and cadence scaled to them): the same compiled programs."""
        return dataclasses.replace(self, config=config,
                                   schedule_values=schedule_values(config.train))

    def with_schedule(self, values: tuple[float, ...]) -> Program:
        """This program with the learning-rate schedule `values` (a time budget's re-plan):
        the same compiled programs."""
        return dataclasses.replace(self, schedule_values=tuple(values))

    @property
    def counts(self) -> masking.MaskCounts:
        """The static sizes of every masked batch."""
        return self.shape.counts

    @property
    def model_flops(self) -> int:
        """Model FLOPs of one optimiser step (forward + backward = 3 x forward)."""
        return self.shape.model_flops(self.config)

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.state.abstract.params))

    def batch_spec(self) -> jax.ShapeDtypeStruct:
        """The abstract global batch of token ids [batch_size, seq_len] int32, sharded."""
        return jax.ShapeDtypeStruct(
            (self.config.train.batch_size, self.config.data.seq_len), np.int32,
            sharding=sharding.batch_sharding(self.mesh))

    def lower_train_step(self) -> Any:
        """The train step lowered for the abstract state and batch (jax's Lowered)."""
        with sharding.activate(self.mesh, self.rules):
            return self.step.lower(self.state.abstract, self.batch_spec(),
                                      self.schedule_spec())

    def compile_train_step(self) -> Any:
        """The train step compiled ahead of time for the abstract state and batch (its
        `memory_analysis()` and `cost_analysis()` describe the real step)."""
        return self.lower_train_step().compile()


def schedule_values(train: ml_collections.ConfigDict) -> tuple[float, ...]:
    """`train`'s learning-rate schedule (train.lr_schedule's shape) in the full form
    (optimizer.learning_rate_at) that a time budget's re-plans keep: one program takes
    every schedule of the run, whatever its shape."""
    return optimizer_lib.shaped(train)


def encoder_run(config: ml_collections.ConfigDict, run_shape: Shape | None = None
                ) -> builder.Run:
    """What a pretraining `config` (of `run_shape`, when resolved already) sets on its
    encoder's architecture (models/builder.py): the kernel serves the objective's decoder
    too, and its tiles are fitted to the encoder's fixed length."""
    m = config.model
    try:
        objective = run_shape.objective if run_shape else pretrain_config.objective(config)
        stacks = objective.attention_stacks(config)
        # The encoder's length, in pretraining.
        length = (run_shape.counts if run_shape else pretrain_config.mask_counts(config)).n_enc
    except pretrain_config.ConfigError:  # a recorded run's objective this process lacks: the
        stacks, length = [], config.data.seq_len  # encoder alone is what is rebuilt from it
    return builder.Run(
        where="config.model", dtype=m.dtype, dropout=m.dropout,
        attention_dropout=m.attention_dropout, activation_dropout=m.activation_dropout,
        attention_impl=m.attention_impl, pallas=pretrain_config.kernel_options(config),
        other_stacks=tuple((s.d_model // s.num_heads, s.attention_dropout) for s in stacks),
        length=length, fit_tiles=True, scan_layers=m.scan_layers,
        remat_policy=m.remat_policy, rel_pos_init=m.rel_pos_init, output_dtype=m.output_dtype,
        special=run_shape.special if run_shape else tokenizer.SENTENCEPIECE_IDS)


def encoder_config(config: ml_collections.ConfigDict, vocab_size: int,
                   run_shape: Shape | None = None) -> encoder_lib.EncoderConfig:
    """The shared encoder's frozen description (dtype and attention kernel resolved for this
    backend), whatever the objective: what fine-tuning and the analyses rebuild."""
    try:
        return builder.encoder(encoder_lib.model_architecture(
            config.model, vocab_size=vocab_size, max_positions=config.data.seq_len),
            encoder_run(config, run_shape))
    except builder.BuildError as e:
        raise pretrain_config.ConfigError(str(e)) from None


def resolve_auto(config: ml_collections.ConfigDict, backend: str) -> None:
    """Sets config.model's "auto" choices (compute dtype, attention kernel) to what they
    choose on `backend`: a program compiled for a TPU slice from a CPU host
    (maelm_jax/infra/topology.py) must not take the host's float32."""
    m = config.model
    if m.dtype == "auto":
        m.dtype = layers.resolve_dtype("auto", backend).name
    if m.attention_impl == "auto":
        m.attention_impl = builder.attention_impl(encoder_run(config),
                                                m.d_model // m.num_heads, backend)


def model_config(config: ml_collections.ConfigDict, vocab_size: int,
                 run_shape: Shape | None = None) -> Any:
    """The frozen model description the objective's Flax module takes: the objective's
    parts around the shared encoder's (`encoder_config`)."""
    run_shape = run_shape or shape(config, vocab_size)
    return run_shape.objective.model_config(config,
                                            encoder_config(config, vocab_size, run_shape))


def model(config: ml_collections.ConfigDict, vocab_size: int) -> nn.Module:
    """The pretraining model (encoder, and the objective's decoder and head) of `config`."""
    return pretrain_config.objective(config).model(model_config(config, vocab_size))


def step_flops(config: ml_collections.ConfigDict, vocab_size: int) -> int:
    """Training FLOPs of one optimiser step (3ML Appendix D's count, maelm_jax/pretrain/flops.py)
    for a config without a program: the papers' ratios (benchmarks/speedup_table.py, the
    study's records). Shape.model_flops is the count every rate reports."""
    return shape(config, vocab_size).paper_flops(config)


def build(config: ml_collections.ConfigDict, vocab_size: int, mesh: Mesh | None = None,
          rules: tuple | None = None,
          special: tokenizer.SpecialIds = tokenizer.SENTENCEPIECE_IDS) -> Program:
    """The program a validated pretraining `config` describes, on `mesh` (default: the
    config's mesh.shape and dcn_shape over all devices) with `rules` (default:
    config.sharding_rules), for a tokenizer of `vocab_size` ids with the `special` ids."""
    t = config.train
    mesh = mesh if mesh is not None else sharding.make_mesh(config.mesh.shape,
                                                            dcn_shape=config.mesh.dcn_shape)
    rules = rules if rules is not None else sharding.rules_from_config(config.sharding_rules)
    run_shape = shape(config, vocab_size, special)
    counts, objective = run_shape.counts, run_shape.objective
    model_cfg = model_config(config, vocab_size, run_shape)
    model = objective.model(model_cfg)
    # The update count kept as optax.adamw's schedule keeps it: checkpoints of runs from
    # before the schedule was data restore.
    tx = optimizer_lib.make_optimizer(t, counts_updates=True)
    state = pretrain_steps.state_setup(model, tx, config.seed, counts, mesh, rules, t.prng_impl)
    step = steps.jit_train_step(
        pretrain_steps.make_train_step(model, model_cfg, objective, tx, counts, vocab_size,
                                       t.grad_accum_steps, t.prng_impl),
        state, mesh, replicated_args=1)
    eval_step = steps.jit_eval_step(
        pretrain_steps.make_eval_step(model, model_cfg, objective, counts, vocab_size), state, mesh,
        replicated_args=1)
    fixed_eval_step = None
    if t.eval_mask_ratio != config.masking.mask_ratio:
        fixed_eval_step = steps.jit_eval_step(
            pretrain_steps.make_eval_step(model, model_cfg, objective,
                                          pretrain_config.fixed_mask_counts(config),
                                          vocab_size), state, mesh, replicated_args=1)
    return Program(config, vocab_size, mesh, rules, run_shape, model, tx,
                   schedule_values(t), state, step, eval_step, fixed_eval_step)
