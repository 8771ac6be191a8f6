"""Pretraining's evaluation: the objective's masked-LM scores on fixed validation batches
and masks, overall and per category of corruption."""

from __future__ import annotations

import jax
import numpy as np

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
    if not totals:
        return scores({"loss_sum": 0.0, "correct_sum": 0.0, "count": 0.0})
    out = scores(totals)
    if "category_count" in totals:
        for c, name in enumerate(masking.CATEGORY_NAMES):
            if totals["category_count"][c] > 0:
                of_category = scores(objectives.category(totals, c))
                out.update({f"{name}_{k}": v for k, v in of_category.items()})
    return out


def scores(sums) -> dict[str, float]:
    """Per-token scores of loss sums, with the perplexity."""
    scores = {name: float(value) for name, value in objectives.per_token(sums).items()}
    scores["perplexity"] = metrics_lib.perplexity(scores["loss"])
    return scores
