"""Pretraining's evaluation: the objective's masked-LM scores on fixed validation batches
and masks, overall and per category of corruption, and overall at a fixed mask ratio
(train.eval_mask_ratio) that runs of every objective and ratio share."""

from __future__ import annotations

import jax
import numpy as np

from maelm_jax.infra import errors
from maelm_jax.pretrain import objectives
from maelm_jax.text import masking
from maelm_jax.training import metrics as metrics_lib


def evaluate(eval_step, params, batches: list[jax.Array], seed: int) -> dict[str, float]:
    """The objective's loss sums on fixed validation batches and masks, as scores per
    predicted token: loss, accuracy and perplexity, and any other sum the objective adds
    (objectives.per_token); the same per category of corruption (``mask_loss``,
    ``random_accuracy``, ``unchanged_perplexity``, ...; the 3ML paper's Tables 1 and 2c)
    for every category the masking produces (MAE-LM's 100-0-0 has only ``mask_*``)."""
    totals: dict[str, np.ndarray] = {}
    for i, tokens in enumerate(batches):
        # The same keys every time, so evals at different steps score identical masks.
        key = jax.random.fold_in(jax.random.PRNGKey(seed + 1), i)
        sums = jax.device_get(eval_step(params, tokens, key))
        for name, value in sums.items():
            totals[name] = totals.get(name, 0.0) + np.asarray(value, np.float64)
    if not totals or not float(np.sum(totals["count"])):
        # Scores of nothing would read loss 0, accuracy 0, perplexity 1: a result that
        # is none.
        raise errors.UserError("config.data.validation_fraction: the evaluation has no "
                               "validation token to score; raise it, or add text")
    out = scores(totals)
    if "category_count" in totals:
        for c, name in enumerate(masking.CATEGORY_NAMES):
            if totals["category_count"][c] > 0:
                of_category = scores(objectives.category(totals, c))
                out.update({f"{name}_{k}": v for k, v in of_category.items()})
    return out


FIXED = ("loss", "accuracy", "perplexity")  # reported at the fixed ratio as fixed_<name>


def evaluate_program(program, params, batches: list[jax.Array], seed: int) -> dict[str, float]:
    """`evaluate` at the run's own masking, and loss, accuracy and perplexity at
    train.eval_mask_ratio as fixed_loss, fixed_accuracy and fixed_perplexity (the same
    batches and keys; the run's own figures where the ratio is its own): what a
    pretraining run's evaluations report (pretrain/setup.py's Program)."""
    own = evaluate(program.eval_step, params, batches, seed)
    fixed = (own if program.fixed_eval_step is None
             else evaluate(program.fixed_eval_step, params, batches, seed))
    return {**own, **{f"fixed_{name}": fixed[name] for name in FIXED}}


def scores(sums) -> dict[str, float]:
    """Per-token scores of loss sums, with the perplexity."""
    scores = {name: float(value) for name, value in objectives.per_token(sums).items()}
    scores["perplexity"] = metrics_lib.perplexity(scores["loss"])
    return scores
