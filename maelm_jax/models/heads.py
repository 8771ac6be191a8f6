"""The masked-LM prediction head, run only at the predicted positions."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from maelm_jax.models import layers


class LmHead(nn.Module):
    """dense -> GELU -> LayerNorm -> projection tied to the word embeddings, + bias.

    The first dense maps the input width (the decoder's, in 3ML) to the encoder width so
    that the output projection can share the word-embedding table.
    """

    d_model: int  # encoder width = word-embedding width
    vocab_size: int
    dtype: layers.Dtype = jnp.float32
    layer_norm_eps: float = 1e-5  # the encoder's (StackConfig.layer_norm_eps)

    @nn.compact
    def __call__(self, x: jax.Array, attend: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """x [B, k, D_in] at the predicted positions -> logits [B, k, vocab] (float32)."""
        x = nn.Dense(
            self.d_model,
            dtype=self.dtype,
            name="dense",
            kernel_init=layers.normal_init(("dec_embed", "embed")),
            bias_init=layers.zeros_init(("embed",)),
        )(x)
        x = layers.gelu(x)
        x = layers.layer_norm("ln", self.dtype, self.layer_norm_eps)(x)
        bias = self.param("bias", layers.zeros_init(("vocab",)), (self.vocab_size,), jnp.float32)
        return attend(x) + bias
