"""The encoder a fine-tuning run trains: from scratch (config.model's architecture), or
in the architecture, weights and tokenizer of the run it starts from (config.init_from),
built by models/builder.py with this run's dropout, dtype and attention kernel."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from maelm_jax import runs
from maelm_jax.finetune import config as finetune_config
from maelm_jax.models import builder
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.text import tokenizer as tokenizer_lib

# The longest input a run reads when data.max_seq_len is 0 (the positions' limit too).
LONGEST = 512


def run_settings(config: ml_collections.ConfigDict) -> builder.Run:
    """What the fine-tuning `config` sets on any encoder's architecture."""
    m = config.model
    return builder.Run(
        where="config.model", dtype=m.dtype, dropout=m.dropout,
        attention_dropout=m.attention_dropout, attention_impl=m.attention_impl,
        pallas=finetune_config.kernel_options(config),
        length=config.data.max_seq_len or LONGEST)


def scratch_architecture(config: ml_collections.ConfigDict, vocab_size: int) -> dict:
    """The architecture record config.model describes (a run from scratch)."""
    return encoder_lib.model_architecture(config.model, vocab_size=vocab_size,
                                          max_positions=config.model.max_positions)


def build(config: ml_collections.ConfigDict, architecture: dict[str, Any],
          special: tokenizer_lib.SpecialIds) -> encoder_lib.EncoderConfig:
    """The encoder of `architecture` as the fine-tuning `config` runs it, with its
    tokenizer's `special` ids."""
    try:
        return builder.encoder(architecture,
                               dataclasses.replace(run_settings(config), special=special))
    except builder.BuildError as e:
        raise finetune_config.FinetuneConfigError(str(e)) from None


def encoder_and_tokenizer(config: ml_collections.ConfigDict, weights: bool = True):
    """(EncoderConfig, encoder params (numpy) or None, tokenizer, description).
    weights=False reads no parameters (the architecture alone)."""
    if config.init_from:
        pretrained = weights and config.init_weights == "pretrained"
        try:
            p = runs.load_pretrained(config.init_from, run_settings(config),
                                     config.tokenizer_path, weights=pretrained)
        except builder.BuildError as e:
            raise finetune_config.FinetuneConfigError(str(e)) from None
        description = (p.description if pretrained
                       else f"random weights in the architecture of {p.description}")
        return p.encoder_cfg, p.params, p.tokenizer, description
    tok = tokenizer_lib.load_tokenizer(config.tokenizer_path, "config.tokenizer_path")
    return (build(config, scratch_architecture(config, tok.vocab_size), tok.special), None, tok,
            "from scratch (no init_from)")


def max_seq_len(config: ml_collections.ConfigDict, encoder_max_positions: int) -> int:
    """config.data.max_seq_len (0: the encoder's positions, at most LONGEST), checked
    against the encoder's positions."""
    requested = config.data.max_seq_len or min(LONGEST, encoder_max_positions)
    if requested > encoder_max_positions:
        raise finetune_config.FinetuneConfigError(
            f"config.data.max_seq_len: expected at most the encoder's {encoder_max_positions} "
            f"positions, got {requested}")
    return requested
