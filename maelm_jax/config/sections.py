"""The config sections both trainers have, each declared once: the encoder (config.model),
the optimiser and its loop policy (config.train), and the device mesh.

A `Section` holds each field's default beside its type and allowed values
(maelm_jax/config/schema.py). A config kind adds a section to its defaults (`add_to`, with its
own values where its recipe differs: fine-tuning's learning rate is not pretraining's) and
to its field table (`fields`), then declares only the fields that are its own. So a field
the two trainers share has one name, one meaning, one check and one comment: pretraining's
``model.dropout`` is fine-tuning's.

Plain data, like every config module: no Flax, no model code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from maelm_jax.config import options, schema
from maelm_jax.infra import sharding

# The default of a field each config kind must give (`add_to` refuses to leave it out).
OWN_DEFAULT = object()


@dataclasses.dataclass(frozen=True)
class Section:
    """Fields by dotted name relative to the section's prefix: name -> (default, Field)."""

    entries: Mapping[str, tuple[Any, schema.Field]]

    def add_to(self, config: ml_collections.ConfigDict, prefix: str = "",
               **defaults: Any) -> None:
        """Sets each field's default under `prefix` in `config` (nested ConfigDicts made as
        needed); `defaults` replace the section's by name (``"pallas.forward"`` is written
        ``pallas__forward``). A field whose default is OWN_DEFAULT must be given."""
        names = {name.replace(".", "__"): name for name in self.entries}
        unknown = sorted(set(defaults) - set(names))
        if unknown:
            raise ValueError(f"{unknown[0]}: not a field of this section; expected one of "
                             f"{', '.join(sorted(names))}")
        for key, name in names.items():
            value = defaults.get(key, self.entries[name][0])
            if value is OWN_DEFAULT:
                raise ValueError(f"{prefix or 'the section'}.{name}: the config kind must "
                                 "give this field's default")
            *parents, leaf = [part for part in f"{prefix}.{name}".split(".") if part]
            node = config
            for part in parents:
                if part not in node:
                    node[part] = ml_collections.ConfigDict()
                node = node[part]
            node[leaf] = value

    def fields(self, prefix: str = "") -> dict[str, schema.Field]:
        """The section's rows of a config kind's field table, under `prefix`."""
        return {f"{prefix}.{name}" if prefix else name: field
                for name, (_, field) in self.entries.items()}


_TILE = schema.text("a tile 'block_qxblock_k:warps:stages' such as '64x64:4:2'")
_TPU_TILE = schema.text("a TPU tile 'block_qxblock_k' in multiples of 128 such as '128x128'")
# The Pallas kernels' options (models/flash_attention.py, flash_attention_tpu.py); their
# own rules between fields (tile sizes, VMEM) are KernelOptions.from_fields'.
_PALLAS_FIELDS = {
    "forward": _TILE, "dkv": _TILE, "dq": _TILE,
    "bias_grad": schema.choice(*options.BIAS_GRADS),
    "bias_grad_groups": schema.integer(1),
    "hash_elements": schema.choice(*options.HASH_ELEMENTS),
    "tpu_forward": _TPU_TILE, "tpu_dkv": _TPU_TILE, "tpu_dq": _TPU_TILE,
    "tpu_vmem_limit_mb": schema.integer(1),
}

# config.model: the encoder. Both trainers build the same encoder from these; fine-tuning
# from a pretraining run takes the sizes from its checkpoint instead (dropout, dtype and
# the kernel, which change no parameter shape, stay the fine-tuning config's).
ENCODER = Section({
    "num_layers": (12, schema.integer(1)),
    "d_model": (768, schema.integer(1)),
    "num_heads": (12, schema.integer(1)),
    "d_ff": (3072, schema.integer(1)),
    "dropout": (0.1, schema.rate()),
    "attention_dropout": (0.1, schema.rate()),
    "pre_ln": (False, schema.boolean()),
    # T5's relative position bias: buckets (0 disables it; evenness is stack_rules') and
    # the distance beyond which all share the last bucket.
    "rel_pos_buckets": (32, schema.integer(0)),
    "rel_pos_max_distance": (128, schema.integer(1)),
    # Bucketing of relative distances: "t5" (Raffel et al., as both papers cite) or
    # "maelm", the official MAE-LM code's (options.BUCKET_FNS).
    "rel_pos_bucket_fn": ("t5", schema.choice(*options.BUCKET_FNS)),
    # Added to the variance in every LayerNorm (RoBERTa's and MAE-LM's 1e-5; BERT's 1e-12).
    "layer_norm_eps": (1e-5, schema.number(0.0, low_open=True)),
    # Compute dtype (options.DTYPES): "auto" is bfloat16 on GPUs and TPUs, float32 on CPUs.
    # Parameters, optimiser state, softmax, LayerNorm statistics and the loss stay float32.
    "dtype": ("auto", schema.choice(*options.DTYPES)),
    # Attention kernel (options.ATTENTION_IMPLS): "auto" takes, on GPUs at half precision,
    # our Pallas kernel when there is attention dropout (it drops inside the kernel) and
    # cuDNN's fused attention when there is none; on TPUs at half precision with attention
    # dropout our Mosaic kernel; our einsums elsewhere.
    "attention_impl": ("auto", schema.choice(*options.ATTENTION_IMPLS)),
    # The Pallas kernels' tiles ("block_qxblock_k:warps:stages" for the GPU's forward, dK/dV
    # and dQ kernels; "block_qxblock_k" for the TPU's), how a bias shared by the batch gets
    # its gradient ("batch": summed inside the kernel by bias_grad_groups groups of rows;
    # "rows": per row, summed by XLA; "kernel": by a kernel of its own, bias_grad_groups
    # groups of rows summed in registers) and the dropout elements per 32-bit hash.
    **{f"pallas.{name}": (value, _PALLAS_FIELDS[name])
       for name, value in options.KernelOptions().fields().items()},
})


def kernel_options(config: ml_collections.ConfigDict,
                   error: type[Exception]) -> options.KernelOptions:
    """ENCODER's model.pallas fields of `config` as the kernels' options; a bad field is
    `error` (the config kind's) with one line naming it."""
    try:
        return options.KernelOptions.from_fields(config.model.pallas.to_dict(),
                                                 "config.model.pallas")
    except options.OptionsError as e:
        raise error(str(e)) from None


# config.train: AdamW with a linear warmup and decay, clipping, and what a non-finite step
# does (training/optimizer.py, training/engine.py).
TRAIN = Section({
    "batch_size": (OWN_DEFAULT, schema.integer(1)),  # examples per optimiser step (global)
    "learning_rate": (OWN_DEFAULT, schema.number(0.0, low_open=True)),  # the peak
    "weight_decay": (0.01, schema.number(0.0)),
    # "weights": kernels and embeddings only (biases and LayerNorm exempt, BERT's rule);
    # "all": every parameter, as the papers' fairseq code does (their presets set it).
    "weight_decay_on": ("weights", schema.choice("weights", "all")),
    "adam_b1": (0.9, schema.number(0.0, 1.0, high_open=True)),
    "adam_b2": (0.98, schema.number(0.0, 1.0, high_open=True)),
    "adam_eps": (1e-6, schema.number(0.0, low_open=True)),
    "clip_norm": (OWN_DEFAULT, schema.number(0.0)),  # global-norm clipping; 0 disables
    # A non-finite loss or gradient: its update is dropped, then "stop" (the run ends with
    # one line naming the step; its last checkpoints stay) or "skip" (counted, logged).
    "nonfinite": ("stop", schema.choice("stop", "skip")),
    "log_every": (OWN_DEFAULT, schema.integer(1)),  # steps per train log line
})

_AXIS_SIZE = schema.Field((int,), "an int", lambda v: v == -1 or v >= 1)

# The device mesh (maelm_jax/infra/sharding.py, docs/scaling.md), at the config's top level.
MESH = Section({
    # Sizes of the ('data', 'fsdp', 'tensor') mesh axes; -1 takes the devices left over.
    # Fixed sizes use the first devices (e.g. (1, 1, 1): one device).
    "mesh.shape": ((-1, 1, 1), schema.sequence_of(
        _AXIS_SIZE, min_len=1,
        words="a tuple of mesh axis sizes (ints >= 1, or -1 for the devices left over)")),
    # A multislice TPU job: how the slices lay out along the same axes (each axis is the
    # product of the two); -1 takes the slices left over, so data parallel across slices
    # by default. One slice: ones.
    "mesh.dcn_shape": ((-1, 1, 1), schema.sequence_of(
        _AXIS_SIZE, min_len=1,
        words="a tuple of sizes across slices (ints >= 1, or -1 for the slices left over)")),
    # Logical axis -> mesh axes.
    "sharding_rules": (sharding.DEFAULT_RULES, schema.sequence_of(
        schema.Field((tuple, list), "pair", lambda v: len(v) == 2 and isinstance(v[0], str)),
        words="a tuple of (logical axis, mesh axes) pairs")),
})
