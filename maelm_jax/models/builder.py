"""The encoder a run builds, decided in one place: `encoder(architecture, run)`.

Pretraining (the encoder inside its objective's model), fine-tuning (from scratch, or in
the architecture of the run it starts from), reading a finished run back, the study's
sizing and the benchmarks all build their encoder here, so the compute dtype, the
attention kernel and its tiles a run gets do not depend on which of them asked. Plain
values in: models/ reads no config; each mode's config module turns its fields into a
`Run` and a BuildError into its own one-line error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from maelm_jax.config import options, schema
from maelm_jax.infra import errors
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import layers
from maelm_jax.text import tokenizer


class BuildError(errors.UserError):
    """A run's settings that cannot build its encoder; the message names the field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """What a run sets on top of an architecture: none of it changes a parameter.

    `where` names the run's model fields in errors ("config.model"). The attention kernel
    ("auto" resolved here) serves every self-attention stack of the model: `other_stacks`
    gives the others' (head size, attention dropout), a decoder's. `length` is the longest
    self-attention the encoder runs (pretraining's kept tokens, fine-tuning's longest
    input): the TPU kernels' tiles are checked against it, and with `fit_tiles` (one fixed
    length, pretraining's) shrunk to pad it least."""

    where: str = "config.model"
    dtype: Any = "float32"
    dropout: float = 0.0
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    attention_impl: str = "einsum"
    pallas: options.KernelOptions = options.KernelOptions()
    other_stacks: tuple[tuple[int, float], ...] = ()
    length: int = 512
    fit_tiles: bool = False
    scan_layers: bool = False
    remat_policy: str = "none"  # options.REMAT_POLICIES, "auto" resolved by `encoder`
    rel_pos_init: str = "normal"
    output_dtype: str = "float32"
    # The run's tokenizer's (EncoderConfig.special); a run with a Hugging Face tokenizer
    # sets its own.
    special: tokenizer.SpecialIds = tokenizer.SENTENCEPIECE_IDS


def attention_impl(run: Run, head_dim: int, backend: str | None = None) -> str:
    """run.attention_impl resolved for `backend` (default: this process's) and the run's
    dtype, for an encoder with heads of `head_dim` and the run's other stacks; "pallas"
    where a stack's heads cannot be tiled is a BuildError."""
    head_dims = (head_dim, *(d for d, _ in run.other_stacks))
    impl = layers.resolve_attention_impl(
        run.attention_impl, layers.resolve_dtype(run.dtype, backend), backend,
        attention_dropout=max([run.attention_dropout, *(p for _, p in run.other_stacks)]),
        head_dims=head_dims)
    bad = [d for d in head_dims if not schema.pallas_heads(d)]
    if impl == "pallas" and bad:
        raise BuildError(f"{run.where}.attention_impl: expected 'einsum' or 'auto' for heads "
                         f"of {bad[0]} (the Pallas kernel needs a power-of-two head size "
                         f">= 16), got 'pallas'")
    return impl


def remat_policy(run: Run, attention_impl: str) -> str:
    """run.remat_policy with "auto" resolved for the run's resolved `attention_impl`: the
    matmuls and the Pallas kernel's named outputs kept ("dots_attention": the backward
    recomputes only element-wise work, never the attention forward) where the kernel is
    Pallas, else everything kept ("none": the other paths' attention outputs are not named,
    and recomputing them would run the attention twice)."""
    if run.remat_policy != "auto":
        return run.remat_policy
    return "dots_attention" if attention_impl == "pallas" else "none"


def encoder(architecture: Mapping[str, Any], run: Run,
            record: str | None = None) -> encoder_lib.EncoderConfig:
    """The EncoderConfig of `architecture` (an architecture record, encoder.ARCHITECTURE)
    as `run` builds it on this backend. An ArchitectureError names a bad record (`record`
    says where it was read; default run.where); a BuildError the run's field that cannot
    build it."""
    architecture = encoder_lib.checked(architecture, record or run.where)
    head_dim = architecture["d_model"] // max(architecture["num_heads"], 1)
    impl = attention_impl(run, head_dim)
    pallas = run.pallas
    if impl == "pallas" and run.fit_tiles:
        pallas = pallas.fitted(run.length)
    if impl == "pallas" and jax.default_backend() == "tpu":
        try:
            for d in (head_dim, *(d for d, _ in run.other_stacks)):
                pallas.check_tpu_vmem(run.length, run.length, d, f"{run.where}.pallas")
        except options.OptionsError as e:
            raise BuildError(str(e)) from None
    return encoder_lib.from_architecture(
        architecture, where=record or run.where, dtype=run.dtype, rel_pos_init=run.rel_pos_init,
        output_dtype=run.output_dtype, special=run.special, dropout=run.dropout,
        attention_dropout=run.attention_dropout, activation_dropout=run.activation_dropout,
        attention_impl=impl, pallas=pallas, scan_layers=run.scan_layers,
        remat_policy=remat_policy(run, impl))
