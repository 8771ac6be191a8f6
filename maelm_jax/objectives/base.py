"""What a pretraining objective is: the one interface every objective implements.

An objective decides five things, and nothing else in the trainer depends on which one
runs (the train step, the loop, the checkpoints, the benchmarks and the study see only
this interface):

* what the encoder sees (`removes_masks`: whether removed [MASK]s leave the encoder's
  input, which fixes the masked batch's static sizes through masking.MaskCounts);
* the model: a frozen model config built from the pretraining config and the shared
  encoder's config (`model_config`), and the Flax module it describes (`model`), whose
  parameters hold the encoder under "encoder" (what fine-tuning keeps) and which maps a
  masking.MaskedBatch to logits [B, k, vocab] at batch.pred_index;
* the loss and per-category metrics (`loss_sums`: by default the masked-LM sums below);
* the training FLOPs of one step (`step_flops`, counted as 3ML Appendix D does, with the
  formulas of maelm_jax/flops.py);
* its validation rules: the fields that relate to each other only under this objective
  (`validate`).

Fill-mask also asks an objective to fit a trained model to a text shorter than the
pretraining length (`for_length`). Objectives are registered by name in
maelm_jax/objectives/__init__.py; a new one is a module and a registry line.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from maelm_jax import masking
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import layers

# require(cond, field, expected, got): raises the config's one-line error naming
# config.<field> when cond is false (config.py passes its own).
Require = Callable[[bool, str, str, Any], None]


class Objective(abc.ABC):
    """One pretraining objective; subclasses set `name` and `removes_masks`."""

    name: str  # the value of config.objective
    removes_masks: bool  # removed [MASK]s are left out of the encoder's input

    @abc.abstractmethod
    def model_config(self, config: ml_collections.ConfigDict,
                     encoder: encoder_lib.EncoderConfig) -> Any:
        """The frozen description `model` takes, from a validated pretraining config and the
        encoder's config (dtype and attention kernel already resolved in it)."""

    @abc.abstractmethod
    def model(self, model_cfg: Any) -> nn.Module:
        """The Flax module: __call__(batch: masking.MaskedBatch, deterministic: bool) ->
        float32 logits [B, k, vocab] at batch.pred_index; parameters {"encoder": ..., ...}."""

    @abc.abstractmethod
    def step_flops(self, config: ml_collections.ConfigDict, counts: masking.MaskCounts,
                   vocab_size: int) -> int:
        """Training FLOPs of one optimiser step (3ML Appendix D's count; see flops.py)."""

    def validate(  # noqa: B027 (optional: an objective may have no rules of its own)
            self, config: ml_collections.ConfigDict, require: Require) -> None:
        """Rules between fields that only this objective has (the fields' own types and
        ranges are config.FIELDS'); warnings for settings that run but do nothing."""

    def loss_sums(self, logits: jax.Array, batch: masking.MaskedBatch,
                  per_category: bool = False) -> dict[str, jax.Array]:
        """Sums over the predicted tokens (see masked_lm_sums); the train step minimises
        "loss_sum" / "count" over the global batch."""
        return masked_lm_sums(logits, batch.targets, batch.weights,
                              batch.category if per_category else None)

    def for_length(self, model_cfg: Any, params: Any, length: int) -> tuple[Any, Any]:
        """(model config, parameters) to run the trained model on `length` <= L tokens;
        unchanged unless a part of the model is built for exactly L positions."""
        return model_cfg, params


def masked_lm_sums(
    logits: jax.Array, targets: jax.Array, weights: jax.Array,
    category: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Sums over predicted tokens: cross-entropy, correct predictions, and the token count.

    Sums (not means) so that gradient accumulation and data parallelism divide once, by the
    number of predicted tokens in the global batch, as the paper's loss does.
    logits [B, k, V] float32; targets [B, k] int32; weights [B, k] float32.
    With `category` [B, k] (masking.MaskedBatch.category; evaluation passes it, the train
    step does not), also the same three sums per category as [3] arrays indexed by
    masking.MASKED / RANDOM / UNCHANGED: "category_loss_sum", "category_correct_sum",
    "category_count".
    """
    nll = layers.cross_entropy(logits, targets)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    sums = {
        "loss_sum": jnp.sum(nll * weights),
        "correct_sum": jnp.sum(correct * weights),
        "count": jnp.sum(weights),
    }
    if category is not None:
        one_hot = jax.nn.one_hot(category, len(masking.CATEGORY_NAMES)) * weights[..., None]
        sums["category_loss_sum"] = jnp.einsum("bk,bkc->c", nll, one_hot)
        sums["category_correct_sum"] = jnp.einsum("bk,bkc->c", correct, one_hot)
        sums["category_count"] = jnp.sum(one_hot, axis=(0, 1))
    return sums
