"""Fine-tuning models: the pretrained encoder (submodule ``encoder``, so a pretraining
checkpoint's ``params["encoder"]`` loads as is) plus a task head (submodule ``head``).

* `SequenceClassifier`: RoBERTa's classification head on the first token (``<s>``):
  dropout -> dense -> tanh -> dropout -> output projection; one output for regression.
* `SpanExtractor`: SQuAD start / end logits at every position; position 0 (``<s>``)
  means "no answer" (SQuAD 2.0), padding can never be chosen.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maelm_jax.config import options
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import layers
from maelm_jax.models.dropout import Dropout

# Padded positions' span logits; finite so start + end logits cannot overflow.
_MASKED_LOGIT = -1e9


def positions_like(tokens: jax.Array) -> jax.Array:
    """Fine-tuning feeds whole sequences: positions 0..n-1, one row for the batch ([1, n]
    int32; the encoder computes the relative bias once)."""
    return jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]


class ClassificationHead(nn.Module):
    """[B, D] pooled states -> [B, num_outputs] float32 (as RoBERTa's)."""

    num_outputs: int
    dropout: float
    dtype: layers.Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        d_model = x.shape[-1]
        x = Dropout(self.dropout)(x, deterministic=deterministic)
        x = nn.Dense(
            d_model,
            dtype=self.dtype,
            name="dense",
            kernel_init=layers.normal_init(("embed", "mlp")),
            bias_init=layers.zeros_init(("mlp",)),
        )(x)
        x = jnp.tanh(x)
        x = Dropout(self.dropout)(x, deterministic=deterministic)
        x = nn.Dense(
            self.num_outputs,
            dtype=self.dtype,
            name="out",
            kernel_init=layers.normal_init(("mlp", "labels")),
            bias_init=layers.zeros_init(("labels",)),
        )(x)
        return x.astype(jnp.float32)


POOLINGS = options.POOLINGS  # config.model.pooling


def pool(hidden: jax.Array, key_mask: jax.Array, pooling: str) -> jax.Array:
    """hidden [B, n, D], key_mask [B, n] bool -> [B, D]: the first token's state, or the
    mean over the real tokens."""
    if pooling == "first":
        return hidden[:, 0]
    if pooling == "mean":
        weights = key_mask.astype(hidden.dtype)[..., None]
        return jnp.sum(hidden * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1)
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")


class SequenceClassifier(nn.Module):
    """Encoder + classification (or regression, num_outputs=1) head."""

    encoder_cfg: encoder_lib.EncoderConfig
    num_outputs: int
    head_dropout: float = 0.1  # config.model.classifier_dropout
    pooling: str = "first"  # config.model.pooling

    def setup(self):
        self.encoder = encoder_lib.Encoder(self.encoder_cfg)
        stack = self.encoder_cfg.stack
        self.head = ClassificationHead(self.num_outputs, self.head_dropout, stack.dtype)

    def __call__(self, tokens: jax.Array, key_mask: jax.Array,
                 deterministic: bool = True) -> jax.Array:
        """tokens [B, n] int32, key_mask [B, n] bool -> logits [B, num_outputs] float32."""
        hidden = self.encoder(tokens, positions_like(tokens), key_mask, deterministic)
        return self.head(pool(hidden, key_mask, self.pooling), deterministic)


class SpanHead(nn.Module):
    """[B, n, D] -> start and end logits, each [B, n] float32 (BERT's ``qa_outputs``)."""

    dtype: layers.Dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = nn.Dense(
            2,
            dtype=self.dtype,
            name="out",
            kernel_init=layers.normal_init(("embed", "span")),
            bias_init=layers.zeros_init(("span",)),
        )(hidden).astype(jnp.float32)
        return logits[..., 0], logits[..., 1]


def answer_positions(tokens: jax.Array, key_mask: jax.Array, eos: int) -> jax.Array:
    """[B, n] bool: where a span may start or end in ``<s> question </s></s> context </s>``
    windows (`eos`: the tokenizer's </s>): the context tokens, and position 0 (``<s>``,
    the no-answer span). The question and the special tokens are excluded, as the
    official SQuAD head does."""
    is_eos = tokens == eos
    # Context tokens come after the second </s> and are not </s> themselves.
    context = (jnp.cumsum(is_eos, axis=1) >= 2) & ~is_eos & key_mask
    return context.at[:, 0].set(True)


class SpanExtractor(nn.Module):
    """Encoder + span head for extractive question answering."""

    encoder_cfg: encoder_lib.EncoderConfig
    # config.squad.exclude_question: start/end softmax over answer_positions only
    context_only: bool = True

    def setup(self):
        self.encoder = encoder_lib.Encoder(self.encoder_cfg)
        self.head = SpanHead(self.encoder_cfg.stack.dtype)

    def __call__(self, tokens: jax.Array, key_mask: jax.Array,
                 deterministic: bool = True) -> tuple[jax.Array, jax.Array]:
        """tokens [B, n], key_mask [B, n] -> (start, end) logits [B, n]; padding (and with
        context_only the question and special tokens) masked."""
        hidden = self.encoder(tokens, positions_like(tokens), key_mask, deterministic)
        start, end = self.head(hidden)
        allowed = (answer_positions(tokens, key_mask, self.encoder_cfg.special.eos)
                   if self.context_only else key_mask)
        return (jnp.where(allowed, start, _MASKED_LOGIT), jnp.where(allowed, end, _MASKED_LOGIT))


# Losses as sums over the batch's real rows (weight 1) and the count of those rows, so the
# step divides once; filler rows (weight 0) contribute nothing, whatever their labels.


def classification_loss_sums(logits: jax.Array, labels: jax.Array,
                             weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cross-entropy. logits [B, C], labels [B] int (-1 in filler rows), weights [B]."""
    per_example = layers.cross_entropy(logits, jnp.maximum(labels, 0))
    return jnp.sum(per_example * weights), jnp.sum(weights)


def regression_loss_sums(outputs: jax.Array, labels: jax.Array,
                         weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Squared error, as RoBERTa fine-tunes STS-B. outputs [B, 1], labels [B] float."""
    labels = jnp.where(weights > 0, labels, 0.0)  # unlabeled rows hold nan
    per_example = jnp.square(outputs[:, 0] - labels)
    return jnp.sum(per_example * weights), jnp.sum(weights)


def span_loss_sums(start_logits: jax.Array, end_logits: jax.Array, start_positions: jax.Array,
                   end_positions: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean of the start and end cross-entropies over positions. logits [B, n], positions [B]."""
    per_example = 0.5 * (layers.cross_entropy(start_logits, start_positions)
                         + layers.cross_entropy(end_logits, end_positions))
    return jnp.sum(per_example * weights), jnp.sum(weights)
