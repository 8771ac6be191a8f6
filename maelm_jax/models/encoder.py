"""The encoder: the only network kept for fine-tuning.

Input: token ids plus each token's *original* position ("aligned" positions). MAE-LM
feeds only the kept tokens, so positions skip the removed [MASK] slots; MLM and
fine-tuning feed the whole sequence with positions 0..L-1. Learned absolute position
embeddings plus an embedding LayerNorm, and a T5 relative position bias computed from the
same original positions and shared by all layers (as in the official MAE-LM code).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maelm_jax.infra import errors
from maelm_jax.models import layers, relative_position
from maelm_jax.models import stack as stack_lib
from maelm_jax.models.dropout import Dropout
from maelm_jax.text import tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderConfig:
    """The encoder's description. Its architecture (below) is what a checkpoint records;
    build one from a record or a run config's model fields with from_architecture."""

    stack: layers.StackConfig
    vocab_size: int
    max_positions: int
    rel_pos_buckets: int = 32  # 0 disables the relative position bias
    rel_pos_max_distance: int = 128
    rel_pos_init: str = "normal"  # relative_position.REL_POS_INITS; only matters before training
    rel_pos_bucket_fn: str = "t5"  # relative_position.BUCKET_FNS
    # The masked-LM output layer's dot against the tied table (options.OUTPUT_DTYPES):
    # "float32" (TF32 on GPUs), or "compute" (the stack's dtype, float32 accumulation).
    output_dtype: str = "float32"
    # The tokenizer's special ids (not part of the architecture: the tokenizer file records
    # them): what the maskers insert and the models, heads and exports look for.
    special: tokenizer.SpecialIds = tokenizer.SENTENCEPIECE_IDS


class ArchitectureError(errors.UserError):
    """An architecture record that does not describe an encoder; the message names the
    record and the field."""


# The encoder's architecture: every field its parameter shapes and the function it computes
# depend on, with the JSON type a record holds it as, in the order encoder.json lists them.
# What a run may change without changing the model (dropout, compute dtype, attention
# kernel, scan, remat, the relative bias's initialisation) is not part of it: each run gives
# its own to from_architecture. Pretraining and fine-tuning configs name these fields alike
# in their `model` section (MODEL_FIELDS), bar the two they take from elsewhere.
ARCHITECTURE: dict[str, type] = {
    "num_layers": int,
    "d_model": int,
    "num_heads": int,
    "d_ff": int,
    "pre_ln": bool,
    "vocab_size": int,
    "max_positions": int,
    "rel_pos_buckets": int,
    "rel_pos_max_distance": int,
    "rel_pos_bucket_fn": str,
    "layer_norm_eps": float,
}
# Fields added after the first release, with the value every record written before meant.
ADDED = {"rel_pos_bucket_fn": "t5", "layer_norm_eps": 1e-5}
# Fields whose values are one of a few names.
_CHOICES = {"rel_pos_bucket_fn": tuple(relative_position.BUCKET_FNS)}
# The architecture fields a run config's model section holds under the same names: the
# vocabulary is the tokenizer's, and the positions are pretraining's data.seq_len or
# fine-tuning's model.max_positions.
MODEL_FIELDS = tuple(k for k in ARCHITECTURE if k not in ("vocab_size", "max_positions"))
_STACK_FIELDS = frozenset(f.name for f in dataclasses.fields(layers.StackConfig))
_TYPE_NAMES = {int: "an integer", bool: "true or false", str: "a string",
               float: "a positive number"}


def architecture(cfg: EncoderConfig) -> dict[str, Any]:
    """The encoder's architecture record (a fine-tuning workdir's encoder.json), JSON-ready."""
    return {k: getattr(cfg.stack if k in _STACK_FIELDS else cfg, k) for k in ARCHITECTURE}


def model_architecture(model: Mapping[str, Any], *, vocab_size: int,
                       max_positions: int) -> dict[str, Any]:
    """The architecture record a run config's model section describes (see MODEL_FIELDS)."""
    # A field added since a run was recorded takes what the run meant (ADDED).
    record = {**{k: model[k] if k in model else ADDED[k] for k in MODEL_FIELDS},
              "vocab_size": vocab_size, "max_positions": max_positions}
    record["layer_norm_eps"] = float(record["layer_norm_eps"])  # a config may say 1
    return record


def from_architecture(arch: Any, *, where: str = "architecture", dtype: Any = "float32",
                      rel_pos_init: str = "normal", output_dtype: str = "float32",
                      special: tokenizer.SpecialIds = tokenizer.SENTENCEPIECE_IDS,
                      **run: Any) -> EncoderConfig:
    """The EncoderConfig an architecture record describes, with a run's own settings.

    arch: a record as `architecture` writes it; fields added since the first release may be
    absent (ADDED gives what such a record meant). where: names the record in the
    ArchitectureError raised for a missing, mistyped or unknown field, e.g. the file.
    dtype: the compute dtype (a layers.DTYPES name, "auto" included, or a dtype).
    rel_pos_init: how a fresh relative bias is initialised. output_dtype: the masked-LM
    output layer's (EncoderConfig.output_dtype). special: the run's tokenizer's special
    ids (EncoderConfig.special). run: the StackConfig fields
    outside the architecture (dropout, attention_dropout, activation_dropout,
    attention_impl, scan_layers, remat_policy); StackConfig's defaults for those not given.
    """
    arch = checked(arch, where)
    stack = layers.StackConfig(**{k: v for k, v in arch.items() if k in _STACK_FIELDS},
                               dtype=layers.resolve_dtype(dtype), **run)
    return EncoderConfig(stack=stack, rel_pos_init=rel_pos_init, output_dtype=output_dtype,
                         special=special,
                         **{k: v for k, v in arch.items() if k not in _STACK_FIELDS})


def checked(arch: Any, where: str) -> dict[str, Any]:
    """arch with ADDED's values for the fields it lacks, or an ArchitectureError."""
    if not isinstance(arch, Mapping):
        raise ArchitectureError(f"{where}: expected an object of the encoder's fields, got "
                                f"{type(arch).__name__}")
    # A field this code does not know may change what the model computes (a record from a
    # newer version): refused rather than ignored.
    unknown = sorted(set(arch) - set(ARCHITECTURE))
    if unknown:
        raise ArchitectureError(f"{where}: unknown field {unknown[0]!r}; expected only "
                                f"{', '.join(ARCHITECTURE)}")
    arch = {**ADDED, **arch}
    for name, kind in ARCHITECTURE.items():
        if name not in arch:
            raise ArchitectureError(f"{where}: field {name!r} is missing")
        value = arch[name]
        # `type is`, not isinstance: true is an int to Python, never a layer count.
        if type(value) is not kind:
            raise ArchitectureError(f"{where}: field {name!r} must be {_TYPE_NAMES[kind]}, "
                                    f"got {value!r}")
        if kind is float and not value > 0:
            raise ArchitectureError(f"{where}: field {name!r} must be {_TYPE_NAMES[kind]}, "
                                    f"got {value!r}")
        if name in _CHOICES and value not in _CHOICES[name]:
            raise ArchitectureError(f"{where}: field {name!r} must be one of "
                                    f"{', '.join(_CHOICES[name])}, got {value!r}")
    return arch


class Encoder(nn.Module):
    """Token + aligned position embeddings -> LayerNorm -> Transformer stack."""

    cfg: EncoderConfig

    def setup(self):
        cfg, stack = self.cfg, self.cfg.stack
        self.word_embeddings = nn.Embed(
            cfg.vocab_size,
            stack.d_model,
            dtype=stack.dtype,
            embedding_init=layers.normal_init(("vocab", "embed")),
        )
        self.position_embeddings = nn.Embed(
            cfg.max_positions,
            stack.d_model,
            dtype=stack.dtype,
            embedding_init=layers.normal_init(("positions", "embed")),
        )
        self.ln_embed = layers.layer_norm("ln_embed", stack.dtype, stack.layer_norm_eps)
        self.dropout = Dropout(stack.dropout)
        self.relative_bias = (
            relative_position.RelativePositionBias(
                cfg.rel_pos_buckets, cfg.rel_pos_max_distance, stack.num_heads,
                cfg.rel_pos_init, cfg.rel_pos_bucket_fn, num_positions=cfg.max_positions,
                dtype=stack.dtype, as_grid=stack.attention_impl == "pallas",
            )
            if cfg.rel_pos_buckets
            else None
        )
        self.stack = stack_lib.TransformerStack(stack)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        key_mask: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """tokens [B, n] int32; positions [B, n] int32, or [1, n] when every row has the same
        (then the relative bias is computed once for the batch); key_mask [B, n] bool
        (True = real token) or None.

        Returns hidden states [B, n, d_model].

        The sequence is padded once, here, to the attention kernel's length multiple
        (layers.length_multiple; padded keys masked, their outputs dropped), unless the
        hidden states are being collected (the diagnostics read every real position).
        """
        n = tokens.shape[1]
        pad = 0 if self.is_mutable_collection(layers.HIDDEN_STATES) else (
            -n % layers.length_multiple(self.cfg.stack))
        if pad:
            if key_mask is None:
                key_mask = jnp.ones(tokens.shape, bool)
            # Position 0 for the padding: any row of the table does, nothing reads it.
            tokens, positions, key_mask = (jnp.pad(a, ((0, 0), (0, pad)))
                                           for a in (tokens, positions, key_mask))
        return self._encode(tokens, positions, key_mask, deterministic)[:, :n]

    def _encode(self, tokens, positions, key_mask, deterministic):
        x = layers.add_per_batch(
            self.embed(tokens),
            layers.lookup(self.position_embeddings, positions, ("positions", None),
                          distinct=True))
        x = self.ln_embed(x)
        self.sow(layers.HIDDEN_STATES, "embedding", x)  # "layer 0" of the rank analysis
        x = self.dropout(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        bias = self.relative_bias(positions, positions) if self.relative_bias else None
        return self.stack(x, bias, key_mask, deterministic)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Word embeddings only."""
        return layers.lookup(self.word_embeddings, tokens, ("vocab", None))

    def embed_token(self, token: int) -> jax.Array:
        """One token's word embedding [d_model] (the decoder's [MASK] row): a static slice of
        the table, whose gradient XLA adds into the table's in place, not a scatter into a
        zeroed [vocab, d_model] buffer."""
        table = nn.with_logical_constraint(self.word_embeddings.embedding, ("vocab", None))
        return table[token].astype(self.word_embeddings.dtype)

    def position_table(self) -> jax.Array:
        """The absolute position embeddings [max_positions, d_model] (shared with the decoder
        when model.decoder.share_positions is set)."""
        return self.position_embeddings.embedding

    def attend(self, x: jax.Array) -> jax.Array:
        """[..., d_model] -> [..., vocab] logits against the tied word embeddings (float32):
        a float32 dot, or with output_dtype "compute" one in the stack's dtype that
        accumulates in float32 (half the bytes of x, the table and their gradients; a
        numerics choice, see docs/performance.md)."""
        table = self.word_embeddings.embedding
        if self.cfg.output_dtype == "compute":
            return layers.logits_in(x, table, jnp.dtype(self.cfg.stack.dtype).name)
        return jnp.einsum("...d,vd->...v", x.astype(jnp.float32), table.astype(jnp.float32))
