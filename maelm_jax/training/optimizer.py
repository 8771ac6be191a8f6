"""AdamW with linear warmup then linear decay, and global-norm clipping (MAE-LM Table 4);
the schedule is data given to each step (learning_rate_at), not compiled in."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

# Parameter leaves that get weight decay under weight_decay_on="weights"; biases and
# LayerNorm scales/offsets do not. "all" decays every parameter, as fairseq (the papers'
# code) does.
_DECAYED_LEAVES = ("kernel", "query_kernel", "key_kernel", "value_kernel", "out_kernel",
                   "embedding", "rel_embedding")


def learning_rate_at(step: jax.Array, schedule: jax.Array, xp: Any = jnp) -> jax.Array:
    """The learning rate at `step` (optimiser updates done): 0 -> peak over the warmup
    steps, then linearly to 0 at the total steps. `schedule` (float32) is data, not part
    of the program: one compiled step serves every learning rate and length (fine-tuning's
    tasks and settings; a pretraining run whose time budget plans its steps after its step
    is compiled and timed, and plans them again as it runs):

    * [peak, warmup steps, total steps]: the decay from the peak at the warmup's end;
    * [peak, warmup steps, total steps, decay from, rate there]: the decay from the rate at
      a later step (`with_decay_end`), the steps before it as an earlier schedule had them.

    `xp`: numpy computes the same rates on the host (in the schedule's dtype)."""
    peak, warmup, total = schedule[0], schedule[1], schedule[2]
    warmup = xp.minimum(warmup, total)
    origin, origin_rate = (schedule[3], schedule[4]) if len(schedule) == 5 else (warmup, peak)
    step = step.astype(schedule.dtype)
    rising = peak * xp.minimum(step, xp.maximum(warmup, 1.0)) / xp.maximum(warmup, 1.0)
    falling = origin_rate * (1.0 - xp.clip((step - origin) / xp.maximum(total - origin, 1.0),
                                           0.0, 1.0))
    return xp.where(step < warmup, rising, falling)


def schedule_values(train: ml_collections.ConfigDict) -> tuple[float, float, float]:
    """[peak, warmup steps, total steps] of `train` for learning_rate_at."""
    return (float(train.learning_rate), float(train.warmup_steps), float(train.num_steps))


def with_decay_end(schedule: tuple[float, ...], step: int, total: int) -> tuple[float, ...]:
    """`schedule` (either form of learning_rate_at) with its decay ending at `total` steps
    instead, from `step` on: the rates of the first `step` updates are unchanged, and the
    decay goes on from the rate it had reached (the warmup's peak, if `step` is within the
    warmup) without a jump. Computed on the host in float64: the same numbers on every
    process and in every resumption."""
    values = np.asarray(schedule, np.float64)
    origin = max(float(step), float(min(values[1], values[2])))
    rate = float(learning_rate_at(np.float64(origin), values, xp=np))
    return (float(values[0]), float(values[1]), float(total), origin, rate)


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
