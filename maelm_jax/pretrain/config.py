"""The pretraining config: defaults shared by every config file, and its validation.

Config files under ``configs/`` start from `pretrain_defaults()` and change what their
experiment needs; `validate` turns every user mistake it can see into a `ConfigError`
naming the field, before any data is prepared or anything compiled. The fields that only
one objective reads are that objective's (its `defaults` and `fields`,
maelm_jax/pretrain/objectives), merged in here.

Plain data: this module (and so every config file) imports no model code, no Flax and no
Pallas kernel. What a config implies to build, its model and its FLOPs, is
maelm_jax/pretrain/setup.py's.
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections
from absl import logging

from maelm_jax.config import options, schema
from maelm_jax.config import sections as config_sections
from maelm_jax.infra import errors
from maelm_jax.pretrain import objectives
from maelm_jax.text import masking
from maelm_jax.text import tokenizer as tokenizer_lib

# JAX's PRNG implementations for masks and dropout. threefry2x32: JAX's default, the same
# bits on every backend and sharding, and the most work per random bit (it is computed
# with integer arithmetic on the vector units). rbg: XLA's RngBitGenerator for the bits,
# threefry for splitting and folding, so keys derive as well as threefry's; much cheaper
# on TPU and GPU, but the bits may differ between backends and XLA versions. unsafe_rbg:
# RngBitGenerator for splitting and folding too: the cheapest, and keys derived from keys
# are of lower statistical quality (fine for dropout, the usual choice for large TPU runs).
PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
MODES = ("pretrain", "prepare")


class ConfigError(errors.UserError):
    """A user-facing config mistake; the message names the field and what is expected."""


def pretrain_defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # "pretrain" trains; "prepare" writes the corpus as block shards into --workdir
    # with Apache Beam (maelm_jax/data/prepare.py), for data.prepared of later runs.
    c.mode = "pretrain"
    # A registered objective (maelm_jax/pretrain/objectives): "maelm" (MAE-LM, 3ML_self, 3ML_cross
    # by model.decoder.kind) or "mlm" (the RoBERTa baseline). Each objective's own fields
    # (the MAE-LM decoder's model.decoder.*, ...) are added below, from the registry.
    c.objective = "maelm"
    c.seed = 0  # parameters, data order, masks and dropout all derive from it

    c.tokenizer = ml_collections.ConfigDict()
    # An existing SentencePiece .model or Hugging Face tokenizer.json (its own special ids and
    # vocabulary); "" trains a SentencePiece model into the workdir.
    c.tokenizer.model_path = ""
    c.tokenizer.vocab_size = 32768
    c.tokenizer.model_type = "bpe"  # "bpe" or "unigram"
    c.tokenizer.lowercase = True  # the paper's base setting is uncased
    c.tokenizer.max_sentences = 2_000_000  # sentences sampled to train the tokenizer

    c.data = ml_collections.ConfigDict()
    # Named corpus sources, mixed by weight; see maelm_jax/data/sources.py for the kinds.
    c.data.sources = ml_collections.ConfigDict(
        {"main": ml_collections.ConfigDict({"kind": "builtin", "weight": 1.0})}
    )
    c.data.seq_len = 512  # L: every block is exactly L tokens
    c.data.validation_fraction = 0.01  # documents held out (by hash) for eval
    c.data.cache_dir = ""  # prepared blocks; "" = <workdir>/data
    # A directory written by mode "prepare" (local or gs://): training reads its shards
    # instead of preparing the sources in the job (the sources still name the corpus: the
    # manifest's fingerprint must be theirs).
    c.data.prepared = ""
    # A prepared set in a bucket (data.prepared, or data.cache_dir's) is read by ranges,
    # never copied whole: the blocks read are kept in a local cache of at most this many
    # GiB per host (0: none; user cache).
    c.data.prepared_cache_gb = 16.0
    c.data.encoding_errors = "replace"  # non-UTF-8 bytes: "replace" (and count) or "strict"
    c.data.prefetch = 2  # batches read ahead by a background thread

    # mode "prepare": the Beam pipeline's runner, its local worker processes (DirectRunner),
    # the blocks per shard, and further Beam flags (another runner's project,
    # region, temp_location, ...).
    c.prepare = ml_collections.ConfigDict()
    c.prepare.runner = "DirectRunner"
    c.prepare.num_workers = 2
    c.prepare.blocks_per_shard = 65536
    c.prepare.beam_options = ()

    c.masking = ml_collections.ConfigDict()
    c.masking.mask_ratio = 0.15  # k = round(mask_ratio * L) positions predicted per sequence
    c.masking.mask_frac = 1.0  # of the k: fraction replaced by [MASK] (3ML: 0.8)
    c.masking.random_frac = 0.0  # of the k: fraction replaced by a random token (3ML: 0.1)
    c.masking.delta = 0.0  # of the [MASK]s: fraction kept in the encoder (MAE-LM ablation)

    # The encoder (config_sections.ENCODER: sizes, dropouts, relative bias, dtype,
    # attention kernel), and pretraining's own model fields.
    c.model = ml_collections.ConfigDict()
    config_sections.ENCODER.add_to(c, "model")
    c.model.activation_dropout = 0.0  # inside the MLP; the official MAE-LM code uses none
    # "normal" N(0, 0.02) as in both papers, or "local": a locality prior that lets small
    # laptop runs leave the unigram plateau early (relative_position.local_bias_init)
    c.model.rel_pos_init = "normal"
    # The masked-LM output layer's three dots (logits and their two gradients): "float32"
    # (TF32 on GPUs, as the papers' fp16 training keeps logits in float32), or "compute"
    # (bfloat16 operands where the model computes in it, float32 accumulation and logits).
    c.model.output_dtype = "float32"
    # nn.scan over the layers of the encoder and of a self decoder: compile time and program
    # size no longer grow with depth; parameters gain a leading "layers" axis (checkpoints
    # of either layout restore into both).
    c.model.scan_layers = False
    # What each layer (encoder and decoder) keeps for the backward pass, the rest being
    # recomputed (options.REMAT_POLICIES): "auto" (the attention kernel's and the matmuls'
    # outputs kept with the Pallas kernel, else everything), "none", "full", "dots",
    # "dots_no_batch", "dots_attention".
    c.model.remat_policy = "auto"

    # The mesh and the sharding rules (config_sections.MESH; docs/scaling.md).
    config_sections.MESH.add_to(c)

    c.train = ml_collections.ConfigDict()
    # The optimiser and the loop's shared fields (config_sections.TRAIN), at the papers'
    # pretraining values (MAE-LM Table 4: batch 2048, peak 5e-4).
    config_sections.TRAIN.add_to(c, "train", batch_size=2048, learning_rate=5e-4,
                                 clip_norm=2.0, log_every=100)
    c.train.grad_accum_steps = 1  # micro-batches per step; batch_size must divide
    c.train.num_steps = 125_000
    c.train.warmup_steps = 10_000  # linear warmup to the peak, then lr_schedule's shape
    # After the warmup (training/optimizer.py, docs/config.md#schedules): "linear" to the
    # floor at the last step (the papers'), "cosine", "wsd" (warmup-stable-decay: the peak,
    # then the last decay_fraction of the steps linearly down), "constant" or "inv_sqrt"
    # (peak x sqrt(warmup_steps / step)). One compiled step serves them all.
    c.train.lr_schedule = "linear"
    c.train.decay_fraction = 0.2  # wsd: the share of the steps in the final decay
    c.train.min_lr_ratio = 0.0  # the floor the decay ends at, a share of learning_rate
    # Minutes the run is given (0: none): a new run measures its step, evaluation and
    # checkpoint here, then plans the most steps (num_steps at most) that end in time, less
    # a margin (a share of the budget), with warmup_steps / num_steps its share of the plan,
    # and plans the end again at each log step from the loop's own rate (training/budget.py;
    # the plan and its re-plans are the workdir's plan.json, kept on resume).
    c.train.time_budget_minutes = 0.0
    c.train.time_budget_margin = 0.05
    # The PRNG implementation of masks and dropout (PRNG_IMPLS; the trade-offs are
    # in maelm_jax/training/steps.py and docs/performance.md).
    c.train.prng_impl = "threefry2x32"
    # Peak dense TFLOP/s of one device, for the MFU in the train logs; 0 looks the device
    # kind up in maelm_jax/pretrain/mfu.py (no MFU for a kind it does not list, such as CPUs).
    c.train.peak_tflops_per_device = 0.0
    c.train.eval_every = 2000
    c.train.eval_batches = 20
    # Each evaluation also scores the eval batches at this fixed mask ratio (the fixed_loss,
    # fixed_accuracy and fixed_perplexity of the eval lines), with the run's own mix of
    # [MASK], random and unchanged tokens, so that runs of different objectives and ratios
    # compare (ModernBERT trains at 30 % and evaluates at 15 %): a second static shape,
    # compiled once; none when it is the run's own mask_ratio (the figures are the same).
    c.train.eval_mask_ratio = 0.15
    c.train.checkpoint_every = 2000
    c.train.keep_checkpoints = 3
    # Milestones, kept for good beside the latest keep_checkpoints (never rotated out):
    # every keep_period steps (0: none) and at each of keep_steps; saved at those steps
    # whatever checkpoint_every says. The rank analysis and the export take one by its
    # path, <workdir>/checkpoints/<step>.
    c.train.keep_period = 0
    # Continued pretraining (pretrain/continued.py, docs/continued.md): the model the run
    # starts from, a pretraining or fine-tuning workdir of ours, one of its
    # checkpoints/<step>, or a local Hugging Face RoBERTa/BERT directory; "" starts from
    # random weights. The parameters both models hold (by name and shape) are loaded, the
    # rest initialised; the optimiser, the step and the schedule start afresh.
    c.train.init_from = ""
    # With init_from a pretraining run of ours: read the data on from where it stopped
    # (the batches of its steps skipped), rather than from the start.
    c.train.continue_data = False
    c.train.keep_steps = ()
    # Where the metrics go besides stdout and metrics.jsonl (always written, the record):
    # a comma-separated list of options.TRACKERS, "" for none. "wandb" needs
    # requirements-trackers.txt and reads W&B's environment (WANDB_MODE=offline, ...).
    c.train.trackers = "tensorboard"
    # "START,COUNT": a jax.profiler trace of steps START to START + COUNT - 1 into
    # <workdir>/profile (TensorBoard's profile plugin, Perfetto), with the top ops by time
    # in the log (training/profiler.py); "" for none. On process 0, or on every process.
    c.train.profile_steps = ""
    c.train.profile_all_processes = False
    # After the last step, fill-mask on this many held-out blocks, logged and written to
    # <workdir>/fill_mask.md (0: none).
    c.train.fill_mask_examples = 0
    _add_fields(c, objectives.defaults())
    return c


def _add_fields(config: ml_collections.ConfigDict, own: dict[str, Any],
                prefix: str = "") -> None:
    """The objectives' `own` fields (nested dicts) added to `config`; a field the shared
    defaults already have is refused (each field has one owner)."""
    for key, value in own.items():
        if isinstance(value, dict) and key in config:
            if not isinstance(config[key], ml_collections.ConfigDict):
                raise ValueError(f"config.{prefix}{key}: an objective's field clashes with a "
                                 "shared one")
            _add_fields(config[key], value, f"{prefix}{key}.")
        elif key in config:
            raise ValueError(f"config.{prefix}{key}: an objective's field clashes with a "
                             "shared one")
        else:
            config[key] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value


# Every shared field's type and allowed values, declared once (maelm_jax/config/schema.py);
# `fields()` adds the objectives' own, validate() the rules that relate several fields.
FIELDS: dict[str, schema.Field] = {
    "mode": schema.choice(*MODES),
    # Looked up when checked, so an objective registered later is accepted.
    "objective": schema.Field((str,), "a registered objective (built in: "
                              f"{', '.join(objectives.names())}; maelm_jax/pretrain/objectives)",
                              lambda v: v in objectives.names()),
    "seed": schema.integer(0),
    "tokenizer.model_path": schema.path("a SentencePiece .model or a Hugging Face "
                                        "tokenizer.json, or empty to train one"),
    # Training one needs >= 262 (train_tokenizer says so); benchmarks use small tables.
    "tokenizer.vocab_size": schema.integer(17),
    "tokenizer.model_type": schema.choice(*tokenizer_lib.MODEL_TYPES),
    "tokenizer.lowercase": schema.boolean(),
    "tokenizer.max_sentences": schema.integer(1),
    "data.sources": schema.free_form("named sources, see maelm_jax/data/sources.py"),
    "data.seq_len": schema.integer(2),
    "data.validation_fraction": schema.number(0.0, 1.0, low_open=True, high_open=True),
    "data.cache_dir": schema.path("a directory, or empty for <workdir>/data"),
    "data.prepared": schema.path("a directory written by --config.mode=prepare, or empty"),
    "prepare.runner": schema.text("a Beam runner name"),
    "prepare.num_workers": schema.integer(1),
    "prepare.blocks_per_shard": schema.integer(1),
    "prepare.beam_options": schema.sequence_of(schema.text(), words="a tuple of Beam flags"),
    "data.encoding_errors": schema.choice("replace", "strict"),
    "data.prefetch": schema.integer(0),
    "data.prepared_cache_gb": schema.number(0.0),
    "masking.mask_ratio": schema.number(0.0, 1.0, low_open=True, high_open=True),
    "masking.mask_frac": schema.number(0.0, 1.0),
    "masking.random_frac": schema.number(0.0, 1.0),
    "masking.delta": schema.number(0.0, 1.0),
    **config_sections.ENCODER.fields("model"),
    "model.activation_dropout": schema.rate(),
    "model.output_dtype": schema.choice(*options.OUTPUT_DTYPES),
    "model.scan_layers": schema.boolean(),
    "model.remat_policy": schema.choice(*options.REMAT_POLICIES),
    "model.rel_pos_init": schema.choice(*options.REL_POS_INITS),
    **config_sections.MESH.fields(),
    "train.grad_accum_steps": schema.integer(1),
    "train.num_steps": schema.integer(1),
    "train.warmup_steps": schema.integer(0),
    "train.lr_schedule": schema.choice(*options.LR_SCHEDULES),
    "train.decay_fraction": schema.number(0.0, 1.0),
    "train.min_lr_ratio": schema.number(0.0, 1.0),
    "train.time_budget_minutes": schema.number(0.0),
    "train.time_budget_margin": schema.number(0.0, 1.0, high_open=True),
    **config_sections.TRAIN.fields("train"),
    "train.prng_impl": schema.choice(*PRNG_IMPLS),
    "train.peak_tflops_per_device": schema.number(0.0),
    "train.eval_every": schema.integer(1),
    "train.eval_batches": schema.integer(1),
    "train.eval_mask_ratio": schema.number(0.0, 1.0, low_open=True, high_open=True),
    "train.checkpoint_every": schema.integer(1),
    "train.keep_checkpoints": schema.integer(1),
    "train.keep_period": schema.integer(0),
    "train.init_from": schema.path("a pretraining or fine-tuning workdir, "
                                   "<workdir>/checkpoints/<step>, a Hugging Face model "
                                   "directory, or empty"),
    "train.continue_data": schema.boolean(),
    "train.profile_steps": schema.Field(
        (str,), 'a window "START,COUNT" of ints >= 1, or empty',
        options.valid_profile_window),
    "train.profile_all_processes": schema.boolean(),
    "train.trackers": schema.Field(
        (str,), f"a comma-separated list of {', '.join(options.TRACKERS)} (or empty)",
        lambda v: all(n.strip() in options.TRACKERS for n in v.split(",") if n.strip())),
    "train.keep_steps": schema.sequence_of(schema.integer(1), words="a tuple of steps (ints >= 1)"),
    "train.fill_mask_examples": schema.integer(0),
}


def fields() -> dict[str, schema.Field]:
    """The whole table: the shared FIELDS and every registered objective's own (looked up
    when called, so an objective registered later is checked too)."""
    return {**FIELDS, **objectives.fields()}


# Path fields of a corpus source (data.sources.<name>.<field>).
_SOURCE_PATH_FIELDS = ("path", "data_dir")


def resolve_paths(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy whose paths (tokenizer, cache, every source's files) are absolute against the
    current directory: a run started from another directory, or resumed, reads the same
    files, and libraries that need absolute paths (orbax) get them."""
    resolved = schema.resolve_paths(config, fields())
    for name, source in resolved.data.sources.items():
        for field in _SOURCE_PATH_FIELDS:
            if isinstance(source, (dict, ml_collections.ConfigDict)) and source.get(field):
                source[field] = schema.absolute_spec(source[field],
                                                     f"config.data.sources.{name}.{field}")
    return resolved


_require = schema.requirer(ConfigError)


def mask_counts(config: ml_collections.ConfigDict) -> masking.MaskCounts:
    m = config.masking
    try:
        return masking.MaskCounts.create(
            config.data.seq_len,
            m.mask_ratio,
            m.mask_frac,
            m.random_frac,
            m.delta,
            remove_masked=objective(config).removes_masks,
        )
    except ValueError as e:
        raise ConfigError(f"config.{e}") from None


def fixed_mask_counts(config: ml_collections.ConfigDict) -> masking.MaskCounts:
    """The evaluation's counts at train.eval_mask_ratio: the run's own mix of [MASK],
    random and unchanged tokens (and of [MASK]s kept in the encoder) at the fixed ratio."""
    m = config.masking
    try:
        return masking.MaskCounts.create(
            config.data.seq_len, config.train.eval_mask_ratio, m.mask_frac, m.random_frac,
            m.delta, remove_masked=objective(config).removes_masks)
    except ValueError as e:
        raise ConfigError(f"config.train.eval_mask_ratio={config.train.eval_mask_ratio}: "
                          f"{e}") from None


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises ConfigError for the first problem found; warns about settings that run but
    are probably not what was meant."""
    schema.check(config, fields(), pretrain_defaults(), ConfigError)
    _require(len(config.data.sources) > 0, "data.sources", "at least one source", {})
    mask_counts(config)
    fixed_mask_counts(config)
    schema.stack_rules(config.model, "model", config.model.attention_impl, _require)
    kernel_options(config)
    objective(config).validate(config, _require)
    t = config.train
    _require(
        t.batch_size % t.grad_accum_steps == 0,
        "train.grad_accum_steps",
        f"a divisor of train.batch_size={t.batch_size}",
        t.grad_accum_steps,
    )
    _require(not t.continue_data or bool(t.init_from), "train.continue_data",
             "False without train.init_from (there is no data stream to continue)",
             t.continue_data)
    if t.warmup_steps > t.num_steps:
        logging.warning(
            "config.train.warmup_steps=%d exceeds config.train.num_steps=%d: the learning "
            "rate only warms up (reaching train.learning_rate at the last step) and never "
            "decays; lower warmup_steps for the usual warmup-then-decay schedule",
            t.warmup_steps, t.num_steps)


def objective(config: ml_collections.ConfigDict) -> objectives.Objective:
    """The objective config.objective names (validate has checked that it is registered)."""
    try:
        return objectives.get(config.objective)
    except KeyError as e:
        raise ConfigError(f"config.objective: {e.args[0]}") from None


def kernel_options(config: ml_collections.ConfigDict) -> options.KernelOptions:
    """config.model.pallas as the kernels' options (ConfigError naming a bad field)."""
    return config_sections.kernel_options(config, ConfigError)


def to_json(config: ml_collections.ConfigDict) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True)
