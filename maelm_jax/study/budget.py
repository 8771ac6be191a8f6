"""What each model of a study call was planned to pretrain on, read from its record
(study.json): steps, tokens and training FLOPs per step.

The configured step count is only a cap once the call sizes itself on its machine
(study/sizing.py sets each model's steps to what fits the time limit), so two calls of one
config on two machines train on different budgets. The pool (study/pool.py) keys a design
on the planned tokens per model, and the README puts claim (a)'s gains beside them.
Papers compare objectives at equal tokens, but not at equal compute: MAE-LM's decoder and
3ML's encoder on the kept tokens change the FLOPs per step, so a comparison says by how
much (3ML Appendix D; `flops_per_step_ratio`).
"""

from __future__ import annotations


def base_steps(record: dict) -> int:
    """The call's planned steps at step scale 1 (each model's are these times its
    config.step_scale): the sizing's base steps, else the configured steps."""
    sizing = record.get("sizing") or {}
    if "base_steps" in sizing:
        return int(sizing["base_steps"])
    return int(record["identity"]["settings"]["pretrain"]["train"]["num_steps"])


def base_tokens(record: dict) -> int:
    """The tokens a model at step scale 1 was planned to pretrain on: with the step scales,
    every model's planned tokens, whichever models the call took."""
    return base_steps(record) * tokens_per_step(record, None)


def planned_steps(record: dict, model: str) -> int | None:
    """The model's planned pretraining steps: the sizing's plan, else its pretraining
    config's (step_scale applied), else the study's configured steps times its step_scale
    (study/config.py's rule); None for a model the record does not hold."""
    steps = (record.get("sizing") or {}).get("steps", {})
    if model in steps:
        return int(steps[model])
    config = (record.get("pretrain_config") or {}).get(model)
    if config:
        return int(config["train"]["num_steps"])
    if model not in record.get("pretraining", {}) and model not in record.get("models", []):
        return None
    settings = record["identity"]["settings"]
    scale = settings.get("step_scale", {}).get(model, 1.0)
    return max(1, round(settings["pretrain"]["train"]["num_steps"] * scale))


def tokens_per_step(record: dict, model: str | None) -> int:
    """Tokens in one pretraining batch: batch_size (all micro-batches) x seq_len, of the
    model's config (None: the study's shared one)."""
    config = (record.get("pretrain_config") or {}).get(model) or \
        record["identity"]["settings"]["pretrain"]
    return int(config["train"]["batch_size"]) * int(config["data"]["seq_len"])


def planned_tokens(record: dict, model: str) -> int | None:
    """Tokens the model was planned to pretrain on (steps x batch x length)."""
    steps = planned_steps(record, model)
    return None if steps is None else steps * tokens_per_step(record, model)


def flops_per_step(record: dict, model: str) -> float | None:
    """Training FLOPs of one step: the record's train_flops (the step's FLOPs times the
    planned steps, study/run.py) over the planned steps."""
    flops = record.get("pretraining", {}).get(model, {}).get("train_flops")
    steps = planned_steps(record, model)
    return flops / steps if flops and steps else None


def flops_per_step_ratio(record: dict, model: str, reference: str) -> float | None:
    """model's training FLOPs per step over reference's at the call's shape."""
    a, b = flops_per_step(record, model), flops_per_step(record, reference)
    return a / b if a and b else None
