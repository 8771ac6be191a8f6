"""What a pretraining objective is: the one interface every objective implements.

An objective owns everything that is specific to it, and nothing else in the code
depends on which one runs (the config, the train and eval steps, the loop, checkpoints,
fill-mask, the benchmarks and the study see only this interface):

* its config fields: their defaults (`defaults`, merged into config.pretrain_defaults())
  and their types and ranges (`fields`, merged into the table config.validate checks),
  and the rules that relate them (`validate`);
* what the encoder sees (`removes_masks`: whether removed [MASK]s leave the encoder's
  input, which fixes the masked batch's static sizes through masking.MaskCounts);
* its corruption of a batch of token blocks (`corrupt`: by default the shared masking);
* the model: a frozen model config built from the pretraining config and the shared
  encoder's config (`model_config`), and the Flax module it describes (`model`), whose
  parameters hold the encoder under "encoder" (what fine-tuning keeps) and which maps a
  masking.MaskedBatch to logits [B, k, vocab] at batch.pred_index;
* its loss as sums over predicted tokens (`loss_sums`: by default the masked-LM sums
  below); the train step accumulates whatever sums it returns and reports each one per
  predicted token (`per_token`), so an extra term needs no change outside the objective;
* the training FLOPs of one step (`step_flops`, counted as 3ML Appendix D does, with the
  formulas of maelm_jax/pretrain/flops.py).

Fill-mask also asks an objective to fit a trained model to a text shorter than the
pretraining length (`for_length`). Objectives are registered by name in
maelm_jax/pretrain/objectives/__init__.py; a new one is a module and a registry line.

Importing an objective imports no Flax: config files and their validation read the
objectives' fields, so the model code (maelm_jax/models) is imported where a model is
built (`model_config`, `model`) or a loss computed.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_collections

from maelm_jax.config import schema
from maelm_jax.text import masking

if TYPE_CHECKING:
    import flax.linen as nn

    from maelm_jax.models import encoder as encoder_lib

# require(cond, field, expected, got): raises the config's one-line error naming
# config.<field> when cond is false (config.py passes its own).
Require = Callable[[bool, str, str, Any], None]


class Objective(abc.ABC):
    """One pretraining objective; subclasses set `name` and `removes_masks`."""

    name: str  # the value of config.objective
    removes_masks: bool  # removed [MASK]s are left out of the encoder's input

    def defaults(self) -> ml_collections.ConfigDict:
        """The config fields only this objective reads, with their defaults, nested as in
        the pretraining config (e.g. {"model": {"decoder": {...}}}). Every registered
        objective's are in config.pretrain_defaults(), whichever config.objective names,
        so a config (and a recorded run's config.json) switches objective by one field."""
        return ml_collections.ConfigDict()

    def fields(self) -> dict[str, schema.Field]:
        """Each field of `defaults` by dotted name: its type and range
        (maelm_jax/config/schema.py)."""
        return {}

    def validate(  # noqa: B027 (optional: an objective may have no rules of its own)
            self, config: ml_collections.ConfigDict, require: Require) -> None:
        """Rules between fields that only this objective has (the fields' own types and
        ranges are `fields`'); warnings for settings that run but do nothing."""

    def corrupt(self, model_cfg: Any, key: jax.Array, tokens: jax.Array,
                counts: masking.MaskCounts, vocab_size: int) -> masking.MaskedBatch:
        """The corrupted batch of `tokens` [B, L] int32, with exactly the static sizes of
        `counts` (n_enc encoder positions, k predicted), drawn from `key`; runs inside the
        jitted train and eval steps. `model_cfg`: this objective's `model_config`, which
        carries whatever of its own fields the corruption reads, and its encoder's
        config the tokenizer's special ids."""
        return masking.apply_mask(key, tokens, counts, vocab_size, model_cfg.encoder.special)

    def attention_stacks(self, config: ml_collections.ConfigDict
                         ) -> list[ml_collections.ConfigDict]:
        """The config sections of this objective's stacks besides the encoder that run the
        encoder's attention kernel (each with d_model, num_heads, attention_dropout): what
        `model.attention_impl="auto"` weighs beside the encoder (pretrain/setup.py)."""
        del config
        return []

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

    def loss_sums(self, model_cfg: Any, logits: jax.Array, batch: masking.MaskedBatch,
                  per_category: bool = False) -> dict[str, jax.Array]:
        """Float32 scalar sums over the predicted tokens of `batch` (logits [B, k, V]):
        "loss_sum", which the train step minimises divided by "count" over the global
        batch, "count", and any other "<x>_sum", reported as <x> per count (`per_token`).
        With `per_category` (evaluation), also "category_<x>_sum" and "category_count" as
        [3] arrays indexed by masking.MASKED / RANDOM / UNCHANGED. `model_cfg`: as for
        `corrupt` (a loss weight of the objective's own, say)."""
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
    from maelm_jax.models import layers  # the model code, once a loss is computed

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


# Metric names of sums whose name is not "<metric>_sum" (logs and study reports read
# "accuracy").
_METRIC_NAMES = {"correct_sum": "accuracy"}
CATEGORY_PREFIX = "category_"


def per_token(sums: Mapping[str, Any]) -> dict[str, Any]:
    """Each "<x>_sum" of `sums` divided by its "count" (at least 1), named <x> ("correct_sum"
    as "accuracy"): the train step's metrics (jax scalars) and an evaluation's scores
    (numpy totals) alike. The per-category sums are `category`'s."""
    count = sums["count"]
    count = jnp.maximum(count, 1.0) if isinstance(count, jax.Array) else max(float(count), 1.0)
    return {_METRIC_NAMES.get(name, name.removesuffix("_sum")): value / count
            for name, value in sums.items()
            if name.endswith("_sum") and not name.startswith(CATEGORY_PREFIX)}


def category(sums: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The sums of one corruption category (masking.MASKED, RANDOM or UNCHANGED) out of
    the "category_*" [3] arrays, under the overall sums' names (for `per_token`)."""
    return {name.removeprefix(CATEGORY_PREFIX): value[index] for name, value in sums.items()
            if name.startswith(CATEGORY_PREFIX)}
