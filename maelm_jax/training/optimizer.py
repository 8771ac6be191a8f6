"""AdamW with a linear warmup then a decay (linear as in MAE-LM Table 4, cosine, WSD, constant
or inverse square root), and global-norm clipping; the schedule is data given to each step
(learning_rate_at), not compiled in."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from maelm_jax.config import options

# Parameter leaves that get weight decay under weight_decay_on="weights"; biases and
# LayerNorm scales/offsets do not. "all" decays every parameter, as fairseq (the papers'
# code) does.
_DECAYED_LEAVES = ("kernel", "query_kernel", "key_kernel", "value_kernel", "out_kernel",
                   "embedding", "rel_embedding")


# The shapes a pretraining run's schedule takes after its warmup (config.train.lr_schedule),
# coded as a number in the schedule array: one compiled step serves them all.
#   linear    from the peak straight down to the floor at the last step (the papers')
#   cosine    half a cosine from the peak down to the floor at the last step
#   wsd       warmup-stable-decay: the peak until the last decay_fraction of the steps,
#             then straight down to the floor (a budget's re-plans move only the decay)
#   constant  the peak to the end
#   inv_sqrt  the peak x sqrt(warmup / step) (1 / sqrt(step) without a warmup), never below
#             the floor; the last step changes nothing
SCHEDULES = options.LR_SCHEDULES
LINEAR, COSINE, WSD, CONSTANT, INV_SQRT = range(len(SCHEDULES))
FULL = 8  # values in the full form of learning_rate_at's schedule


def learning_rate_at(step: jax.Array, schedule: jax.Array, xp: Any = jnp) -> jax.Array:
    """The learning rate at `step` (optimiser updates done): 0 -> peak over the warmup
    steps, then the schedule's shape. `schedule` (float32) is data, not part of the
    program: one compiled step serves every learning rate, length and shape (fine-tuning's
    tasks and settings; a pretraining run whose time budget plans its steps after its step
    is compiled and timed, and plans them again as it runs):

    * [peak, warmup steps, total steps]: linear decay from the peak at the warmup's end
      to 0 at the total (fine-tuning's);
    * [peak, warmup steps, total steps, decay from, rate there]: the linear decay from the
      rate at a later step (`with_decay_end`), the steps before it as an earlier schedule
      had them;
    * the full form, [peak, warmup steps, total steps, decay from, rate there, shape
      (SCHEDULES' index), WSD's decay fraction, the floor as a share of the peak]
      (`shaped`, `with_decay_end`): the decay (linear, cosine, WSD's linear) goes from the
      rate at "decay from" to the floor at the total, holding the rate until "decay from";
      constant and inv_sqrt read neither.

    `xp`: numpy computes the same rates on the host (in the schedule's dtype)."""
    peak, warmup, total = schedule[0], schedule[1], schedule[2]
    warmup = xp.minimum(warmup, total)
    origin, origin_rate = (schedule[3], schedule[4]) if len(schedule) >= 5 else (warmup, peak)
    step = step.astype(schedule.dtype)
    rising = peak * xp.minimum(step, xp.maximum(warmup, 1.0)) / xp.maximum(warmup, 1.0)
    progress = xp.clip((step - origin) / xp.maximum(total - origin, 1.0), 0.0, 1.0)
    if len(schedule) < FULL:
        return xp.where(step < warmup, rising, origin_rate * (1.0 - progress))
    shape, floor = schedule[5], schedule[7] * peak
    span = origin_rate - floor
    linear = floor + span * (1.0 - progress)
    cosine = floor + span * (0.5 + 0.5 * xp.cos(xp.pi * progress))
    inv_sqrt = xp.maximum(floor, peak * xp.sqrt(xp.maximum(warmup, 1.0)
                                                / xp.maximum(step, xp.maximum(warmup, 1.0))))
    after = xp.where(shape == COSINE, cosine, xp.where(
        shape == CONSTANT, peak, xp.where(shape == INV_SQRT, inv_sqrt, linear)))
    return xp.where(step < warmup, rising, after)


def schedule_values(train: ml_collections.ConfigDict) -> tuple[float, float, float]:
    """[peak, warmup steps, total steps] of `train` for learning_rate_at."""
    return (float(train.learning_rate), float(train.warmup_steps), float(train.num_steps))


def shaped(train: ml_collections.ConfigDict) -> tuple[float, ...]:
    """The full form of `train`'s schedule (its lr_schedule, decay_fraction and
    min_lr_ratio; a config without them: linear to 0), its decay ending at
    train.num_steps."""
    shape = SCHEDULES.index(train.get("lr_schedule", "linear"))
    values = (*schedule_values(train), float(train.warmup_steps), float(train.learning_rate),
              float(shape), float(train.get("decay_fraction", 0.0)),
              float(train.get("min_lr_ratio", 0.0)))
    return with_decay_end(values, 0, train.num_steps)


def with_decay_end(schedule: tuple[float, ...], step: int, total: int) -> tuple[float, ...]:
    """`schedule` (any form of learning_rate_at) in the full form with its decay ending at
    `total` steps instead, from `step` on: the rates of the first `step` updates are
    unchanged, and the rate goes on from the one it had reached (the warmup's peak, if
    `step` is within the warmup) without a jump: a linear decay from there to the floor at
    `total`; a cosine stretched from there to the new end (its phase kept); WSD's rate held
    until its decay, the last decay_fraction of the `total` steps, moves there (started
    already: from the rate reached, to the floor at `total`); constant and inv_sqrt do not
    depend on the end. Computed on the host in float64: the same numbers on every process
    and in every resumption."""
    values = np.asarray(schedule, np.float64)
    if len(values) < FULL:  # the linear forms: a linear decay to 0
        origin, rate = (values[3], values[4]) if len(values) == 5 else (values[1], values[0])
        values = np.array([*values[:3], origin, rate, LINEAR, 0.0, 0.0])
    peak, warmup, end, origin, origin_rate, shape = values[:6]
    at = max(float(step), float(min(warmup, end)))
    rate = float(learning_rate_at(np.float64(at), values, xp=np))
    new_origin, new_rate = at, rate
    if shape == WSD:
        new_origin = max(at, float(total) - round(values[6] * total))
    elif shape == COSINE:
        progress = (at - origin) / max(end - origin, 1.0)
        if 0.0 < progress < 1.0:  # the same phase at `at`, the rest of the cosine stretched
            new_origin = (at - progress * total) / (1.0 - progress)
            new_rate = float(origin_rate)
    return (float(peak), float(warmup), float(total), float(new_origin), float(new_rate),
            float(shape), float(values[6]), float(values[7]))


def _scale_by_learning_rate_argument(
        counts_updates: bool) -> optax.GradientTransformationExtraArgs:
    """-learning_rate x updates, the rate given to each update (`learning_rate=`).
    counts_updates: the state counts the updates as optax's scheduled rate does
    (ScaleByScheduleState), so that the optimiser state has the tree of optax.adamw's with
    a schedule (pretraining's checkpoints from before the schedule was data hold one)."""

    def init(params):
        del params
        return (optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32)) if counts_updates
                else optax.EmptyState())

    def update(updates, state, params=None, *, learning_rate, **extra_args):
        del params, extra_args
        if counts_updates:
            state = optax.ScaleByScheduleState(count=optax.safe_increment(state.count))
        return jax.tree.map(lambda u: -learning_rate * u, updates), state

    return optax.GradientTransformationExtraArgs(init, update)


def weight_decay_mask(params) -> dict:
    def decayed(path, _):
        # The last dict key names the leaf; boxed (logically annotated) parameters add an
        # attribute step after it, which must not change the answer.
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        return bool(names) and names[-1] in _DECAYED_LEAVES

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(train: ml_collections.ConfigDict,
                   counts_updates: bool = False) -> optax.GradientTransformation:
    """AdamW whose every update is given its rate (`tx.update(..., learning_rate=lr)`, lr
    from learning_rate_at), with `train`'s betas, epsilon, weight decay and clipping: the
    transformations of optax.adamw in its order. counts_updates: see
    _scale_by_learning_rate_argument."""
    mask = weight_decay_mask if train.get("weight_decay_on", "weights") == "weights" else None
    adamw = optax.chain(
        optax.scale_by_adam(b1=train.adam_b1, b2=train.adam_b2, eps=train.adam_eps),
        optax.add_decayed_weights(train.weight_decay, mask),
        _scale_by_learning_rate_argument(counts_updates))
    if train.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(train.clip_norm), adamw)
    return adamw


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
