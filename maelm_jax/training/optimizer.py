"""AdamW with linear warmup then linear decay, and global-norm clipping (MAE-LM Table 4)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

# Parameter leaves that get weight decay under weight_decay_on="weights"; biases and
# LayerNorm scales/offsets do not. "all" decays every parameter, as fairseq (the papers'
# code) does.
_DECAYED_LEAVES = ("kernel", "query_kernel", "key_kernel", "value_kernel", "out_kernel",
                   "embedding", "rel_embedding")


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
    """0 -> peak over warmup_steps, then linearly to 0 at num_steps."""
    warmup = min(train.warmup_steps, train.num_steps)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, train.learning_rate, max(warmup, 1)),
            optax.linear_schedule(train.learning_rate, 0.0, max(train.num_steps - warmup, 1)),
        ],
        [warmup],
    )


def learning_rate_at(step: jax.Array, schedule: jax.Array) -> jax.Array:
    """learning_rate_schedule's value at `step` from the schedule as data, `schedule` =
    [peak, warmup steps, total steps] (float32): the same line in a program that serves
    every learning rate and length (fine-tuning's, where each task and setting would
    otherwise compile its own step)."""
    peak, warmup, total = schedule[0], schedule[1], schedule[2]
    warmup = jnp.minimum(warmup, total)
    step = step.astype(jnp.float32)
    rising = peak * jnp.minimum(step, jnp.maximum(warmup, 1.0)) / jnp.maximum(warmup, 1.0)
    falling = peak * (1.0 - jnp.clip((step - warmup) / jnp.maximum(total - warmup, 1.0),
                                     0.0, 1.0))
    return jnp.where(step < warmup, rising, falling)


def schedule_values(train: ml_collections.ConfigDict) -> tuple[float, float, float]:
    """[peak, warmup steps, total steps] of `train` for learning_rate_at."""
    return (float(train.learning_rate), float(train.warmup_steps), float(train.num_steps))


def _scale_by_learning_rate_argument() -> optax.GradientTransformationExtraArgs:
    """-learning_rate x updates, the rate given to each update (`learning_rate=`)."""

    def update(updates, state, params=None, *, learning_rate, **extra_args):
        del params, extra_args
        return jax.tree.map(lambda u: -learning_rate * u, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def weight_decay_mask(params) -> dict:
    def decayed(path, _):
        # The last dict key names the leaf; boxed (logically annotated) parameters add an
        # attribute step after it, which must not change the answer.
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        return bool(names) and names[-1] in _DECAYED_LEAVES

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(
    train: ml_collections.ConfigDict, runtime_learning_rate: bool = False,
) -> tuple[optax.GradientTransformation, optax.Schedule | None]:
    """(AdamW with `train`'s schedule compiled in, the schedule); runtime_learning_rate:
    (AdamW whose every update is given its rate, `tx.update(..., learning_rate=lr)`, None),
    the same transformations in the same order as optax.adamw's."""
    mask = weight_decay_mask if train.get("weight_decay_on", "weights") == "weights" else None
    if runtime_learning_rate:
        schedule = None
        adamw = optax.chain(
            optax.scale_by_adam(b1=train.adam_b1, b2=train.adam_b2, eps=train.adam_eps),
            optax.add_decayed_weights(train.weight_decay, mask),
            _scale_by_learning_rate_argument())
    else:
        schedule = learning_rate_schedule(train)
        adamw = optax.adamw(schedule, b1=train.adam_b1, b2=train.adam_b2, eps=train.adam_eps,
                            weight_decay=train.weight_decay, mask=mask)
    if train.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(train.clip_norm), adamw), schedule
    return adamw, schedule


def finite_update(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
                  loss: jax.Array, **extra_args) -> tuple[Any, Any, jax.Array, jax.Array]:
    """One optimiser update that a non-finite loss or gradient never reaches: the parameters
    and Adam's moments stay as they were, and the loop stops or counts it
    (config.train.nonfinite, training/engine.py). Returns (params, opt_state, the global
    gradient norm, nonfinite: 1.0 when the update was dropped, else 0.0). `extra_args`
    go to the update (a runtime learning rate)."""
    updates, new_opt_state = tx.update(grads, opt_state, params, **extra_args)
    new_params = optax.apply_updates(params, updates)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def keep_if_finite(new, old):
        return jnp.where(finite, new, old)

    return (jax.tree.map(keep_if_finite, new_params, params),
            jax.tree.map(keep_if_finite, new_opt_state, opt_state), grad_norm,
            1.0 - finite.astype(jnp.float32))
