"""Pretraining's train state and its train / eval steps (jitted by training/steps.py).

The corruption (the objective's `corrupt`; by default the shared masking), the loss and
the metrics are the objective's: the step accumulates whatever loss sums it returns and
reports each per predicted token. Masks and dropout come from keys folded from (seed, step,
micro-batch), so a step's randomness does not depend on what ran before it: a resumed run
draws the same masks.
Those keys use the PRNG implementation `prng_impl` (config.train.prng_impl, one of
config.PRNG_IMPLS); parameter initialisation and evaluation masks always use threefry, so they
are the same whichever is chosen. Gradients are accumulated as sums over micro-batches
and divided once by the number of predicted tokens in the global batch, which is the
paper's loss exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from maelm_jax.infra import sharding
from maelm_jax.pretrain import objectives
from maelm_jax.text import masking
from maelm_jax.training import optimizer as optimizer_lib
from maelm_jax.training import state as state_lib


def train_key_data(seed: int, prng_impl: str = "threefry2x32") -> jax.Array:
    """The raw key data a run's masks and dropout derive from (TrainState.rng): uint32 [2]
    for threefry2x32, [4] for the rbg kinds."""
    if prng_impl == "threefry2x32":
        # The second half of split(PRNGKey(seed)), as before the field existed: resumed
        # runs and old checkpoints draw the same masks.
        return jax.random.split(jax.random.PRNGKey(seed))[1]
    return jax.random.key_data(jax.random.key(seed, impl=prng_impl))


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # completed optimiser updates, int32 scalar
    params: Any
    opt_state: Any
    rng: jax.Array  # raw uint32 key data; every step folds its own keys from it


def _dummy_batch(counts: masking.MaskCounts) -> masking.MaskedBatch:
    return masking.MaskedBatch(
        inputs=jnp.zeros((1, counts.seq_len), jnp.int32),
        enc_index=jnp.zeros((1, counts.n_enc), jnp.int32),
        pred_index=jnp.zeros((1, counts.k), jnp.int32),
        targets=jnp.zeros((1, counts.k), jnp.int32),
        weights=jnp.zeros((1, counts.k), jnp.float32),
    )


def state_setup(
    model: nn.Module,
    tx: optax.GradientTransformation,
    seed: int,
    counts: masking.MaskCounts,
    mesh: Mesh,
    rules: tuple = sharding.DEFAULT_RULES,
    prng_impl: str = "threefry2x32",
) -> state_lib.StateSetup:
    """The pretraining state laid out on the mesh (training/state.py): parameters from
    the first half of split(PRNGKey(seed)), Adam's moments sharded like them, the step and
    the key data replicated. `init()` builds it."""
    init_key = jax.random.split(jax.random.PRNGKey(seed))[0]
    train_key = train_key_data(seed, prng_impl)
    return state_lib.build(
        lambda: model.init(init_key, _dummy_batch(counts))["params"], mesh, rules,
        make_state=lambda params: TrainState(jnp.int32(0), params, tx.init(params), train_key),
        tx=tx)


def make_micro_loss(model: nn.Module, model_cfg: Any, objective: objectives.Objective,
                    counts: masking.MaskCounts, vocab_size: int) -> Callable:
    """Returns micro_loss(params, tokens [b, L] int32, key) -> (loss sum, the objective's
    sums): one micro-batch corrupted with the mask key and run with the dropout key that
    `key` splits into. What the train step differentiates (and what
    benchmarks/program_cost.py reads the backward's residuals of)."""

    def micro_loss(params, tokens, key):
        mask_key, dropout_key = jax.random.split(key)
        batch = objective.corrupt(model_cfg, mask_key, tokens, counts, vocab_size)
        logits = model.apply(
            {"params": params}, batch, deterministic=False, rngs={"dropout": dropout_key}
        )
        sums = objective.loss_sums(model_cfg, logits, batch)
        return sums["loss_sum"], sums

    return micro_loss


def make_train_step(
    model: nn.Module,
    model_cfg: Any,
    objective: objectives.Objective,
    tx: optax.GradientTransformation,
    counts: masking.MaskCounts,
    vocab_size: int,
    grad_accum_steps: int,
    prng_impl: str = "threefry2x32",
) -> Callable:
    """Returns train_step(state, tokens [batch, L] int32, schedule [3] float32) -> (state,
    metrics). `model_cfg`: the objective's model config `model` was built from (its
    corruption and loss read it); `tx`: optimizer.make_optimizer's, given the rate
    learning_rate_at(state.step, schedule) at each step (the schedule is data: a run's
    length is not part of its program).

    `prng_impl` must be the one the state's `rng` was made with (state_setup's)."""

    grad_fn = jax.grad(make_micro_loss(model, model_cfg, objective, counts, vocab_size),
                       has_aux=True)

    def sums_shape(tokens, key):
        """The loss sums of one micro-batch, for their shapes (the accumulation's carry):
        only the corruption and the loss are traced, on logits [b, k, vocab] of the
        interface's shape."""
        batch = objective.corrupt(model_cfg, key, tokens, counts, vocab_size)
        return objective.loss_sums(
            model_cfg, jnp.zeros((*batch.targets.shape, vocab_size), jnp.float32), batch)

    def train_step(state: TrainState, tokens: jax.Array, schedule: jax.Array):
        B, L = tokens.shape
        # Row r goes to micro-batch r % A: each device's contiguous rows split evenly over
        # the micro-batches, so accumulation needs no communication.
        micro = tokens.reshape(B // grad_accum_steps, grad_accum_steps, L).swapaxes(0, 1)
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng, impl=prng_impl),
                                      state.step)

        def accumulate(carry, xs):
            grads, sums = carry
            tokens_i, i = xs
            g, s = grad_fn(state.params, tokens_i, jax.random.fold_in(step_key, i))
            return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, s)), None

        zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                 jax.eval_shape(sums_shape, micro[0], step_key))
        zero_grads = jax.tree.map(jnp.zeros_like, state.params)
        (grads, sums), _ = jax.lax.scan(
            accumulate, (zero_grads, zero_sums), (micro, jnp.arange(grad_accum_steps))
        )
        count = jnp.maximum(sums["count"], 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        loss = sums["loss_sum"] / count
        learning_rate = optimizer_lib.learning_rate_at(state.step, schedule)
        # Named, so that a profile can sum the update's ops (benchmarks/gpu_probe.py).
        with jax.named_scope("optimizer"):
            params, opt_state, grad_norm, nonfinite = optimizer_lib.finite_update(
                tx, grads, state.opt_state, state.params, loss, learning_rate=learning_rate)
        metrics = {
            **objectives.per_token(sums),  # loss, accuracy and any other sum, per token
            "grad_norm": grad_norm,
            "learning_rate": learning_rate,
            "nonfinite": nonfinite,
        }
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return train_step


def make_eval_step(model: nn.Module, model_cfg: Any, objective: objectives.Objective,
                   counts: masking.MaskCounts, vocab_size: int) -> Callable:
    """Returns eval_step(params, tokens [b, L], key) -> the objective's loss sums, overall
    and per category of corruption ([MASK], random, unchanged; see objectives.masked_lm_sums).

    The caller passes fixed keys so every evaluation scores the same masks.
    """

    def eval_step(params, tokens, key):
        batch = objective.corrupt(model_cfg, key, tokens, counts, vocab_size)
        logits = model.apply({"params": params}, batch, deterministic=True)
        return objective.loss_sums(model_cfg, logits, batch, per_category=True)

    return eval_step
