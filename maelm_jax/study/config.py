"""The study config: which models, on what, and how each is fine-tuned.

``config.pretrain`` is a whole pretraining config (any field can be overridden from the
command line, e.g. ``--config.pretrain.data.sources.main.kind=wikiextractor``); each
model of ``config.models`` starts from it and changes only what defines that model (its
recipe, maelm_jax/pretrain/objectives/recipes.py), so every model sees the same corpus, tokenizer,
token budget, optimiser settings and seed.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from maelm_jax.config import schema
from maelm_jax.infra import errors
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain.objectives import recipes

# GLUE directory names the study knows, with the names fine-tuning configs take.
GLUE_TASKS = {"RTE": "rte", "MRPC": "mrpc", "STS-B": "stsb", "CoLA": "cola", "SST-2": "sst2",
              "QNLI": "qnli", "MNLI": "mnli", "QQP": "qqp"}


class StudyConfigError(errors.UserError):
    """A study config mistake; the message names the field and what is expected."""


def study_defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "study"  # main.py dispatches on it
    c.title = "Study"  # study.md's heading
    c.models = ("mlm", "maelm", "3ml_self", "3ml_cross")
    c.pretrain = pretrain_config.pretrain_defaults()
    c.glue_dir = ""  # the GLUE directory (<dir>/RTE/train.tsv, ...); empty: no fine-tuning
    c.tasks = ("RTE", "MRPC", "STS-B", "CoLA", "SST-2")
    c.seeds = (1, 2, 3, 4, 5)  # fine-tuning seeds; each task reports the median
    c.finetune = ml_collections.ConfigDict()
    c.finetune.max_seq_len = 128
    c.finetune.max_train_examples = 2000  # per task (0 = all): SST-2 alone has 67K
    # A task with fewer training examples is left out (with a warning): a sample that
    # small says nothing and costs a program of its own.
    c.finetune.min_train_examples = 100
    c.finetune.num_epochs = 3
    c.finetune.batch_size = 32
    c.finetune.learning_rate = 1e-3
    # The from-scratch control's own peak learning rate (0: the models'): random weights
    # usually want a larger one than pretrained ones.
    c.finetune.scratch_learning_rate = 0.0
    c.finetune.warmup_ratio = 0.06
    # Seeds of a task trained together as one program (finetune/seed_group.py): 1 runs
    # each alone; on an accelerator a group keeps it busy where one small run does not
    # (benchmarks/finetune_seeds.py measures it).
    c.finetune.seeds_per_program = 1
    c.rank = True  # the rank analysis of the pretrained models (MAE-LM Fig. 1, Table 3)
    c.rank_tokens = 0  # tokens of held-out text per run (0: 1000 x d_model)
    # Each pretrained encoder packed into <workdir>/encoders/<model>.npz (bfloat16, with its
    # config and tokenizer; study/encoders.py): what a GPU call brings back to redo
    # fine-tuning and the analyses on a CPU.
    c.return_encoders = False
    # Pretraining steps per model as a fraction of config.pretrain.train.num_steps, e.g.
    # {"3ml_self": 0.86}: 3ML_self at 0.75x MLM's training FLOPs at 6 x 256 (its step
    # costs 0.87x MLM's); part of the study's design.
    c.step_scale = ml_collections.ConfigDict()
    # The control: the same encoder fine-tuned from random weights with the same settings,
    # which says whether pretraining helped at all at this scale.
    c.scratch = True
    # Under a time limit (main.py --time_limit_minutes), a part (a model's pretraining, the
    # rank analysis, a model's fine-tuning on a task) starts only while this much time is
    # left; the study then stops, writes what it has, and the same command continues.
    c.reserve_seconds = 60.0
    # Sizing the pretraining to the time there is (maelm_jax/study/sizing.py): at the start,
    # each model's train step and the fine-tuning step are compiled and timed on this
    # machine, and every model's steps are set (config.pretrain.train.num_steps at most,
    # step_scale applied) so that the whole study is predicted to end within the time
    # limit (main.py --time_limit_minutes) or budget_seconds, whichever is less.
    c.sizing = ml_collections.ConfigDict()
    c.sizing.enabled = False
    c.sizing.budget_seconds = 0.0  # 0: the time limit alone
    c.sizing.measure_steps = 3  # timed steps per program, after one that compiles
    c.sizing.step_multiple = 50  # the pretraining steps are rounded down to a multiple
    c.sizing.min_steps = 100  # fewer than this: the study does not fit, one line says so
    # Seconds the timing model adds for what it does not time: start-up, reading and
    # packing the corpus, saving, the reports.
    c.sizing.overhead_seconds = 60.0
    return c


def names(value: Any) -> list[str]:
    """A tuple of names, or comma-separated names (`--config.tasks=RTE,MRPC` arrives as
    ('RTE,MRPC',))."""
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    return [n.strip() for item in items for n in item.split(",") if n.strip()]


def _names_of(*allowed: str) -> schema.Field:
    return schema.Field((str, list, tuple), f"names among {', '.join(allowed)}",
                        lambda v: bool(names(v)) and set(names(v)) <= set(allowed))


# Looked up when checked, so an objective registered later can be studied too.
_MODELS = schema.Field((str, list, tuple), "names among the papers' models "
                       f"({', '.join(recipes.MODELS)}), MAE-LM Table 2's rows (e.g. "
                       "enc_mask) and the registered objectives",
                       lambda v: bool(names(v)) and set(names(v)) <= set(recipes.study_names()))


FIELDS: dict[str, schema.Field] = {
    "mode": schema.choice("study"),
    "title": schema.Field((str,), "a heading", bool),
    "models": _MODELS,
    "pretrain": schema.free_form("a pretraining config (maelm_jax/pretrain/config.py)"),
    "glue_dir": schema.path("the GLUE directory, or empty to skip fine-tuning"),
    "tasks": _names_of(*GLUE_TASKS),
    "seeds": schema.sequence_of(schema.integer(0), min_len=1),
    "finetune.max_seq_len": schema.integer(8),
    "finetune.max_train_examples": schema.integer(0),
    "finetune.min_train_examples": schema.integer(0),
    "finetune.num_epochs": schema.integer(1),
    "finetune.batch_size": schema.integer(1),
    "finetune.learning_rate": schema.number(0.0, low_open=True),
    "finetune.scratch_learning_rate": schema.number(0.0),
    "finetune.warmup_ratio": schema.number(0.0, 1.0),
    "finetune.seeds_per_program": schema.integer(1),
    "rank": schema.boolean(),
    "rank_tokens": schema.integer(0),
    "return_encoders": schema.boolean(),
    "step_scale": schema.free_form("model name -> a fraction of the pretraining steps, "
                                   "in (0, 1]"),
    "sizing.enabled": schema.boolean(),
    "sizing.budget_seconds": schema.number(0.0),
    "sizing.measure_steps": schema.integer(1),
    "sizing.step_multiple": schema.integer(1),
    "sizing.min_steps": schema.integer(1),
    "sizing.overhead_seconds": schema.number(0.0),
    "scratch": schema.boolean(),
    "reserve_seconds": schema.number(0.0),
}


# Which of the study's models a run takes, and how it is sliced: fields that may differ
# between parts of one study run on different machines (maelm_jax/study/merge.py).
PART_FIELDS = ("models", "scratch", "reserve_seconds")


def shared_settings(config: ml_collections.ConfigDict) -> dict:
    """The settings every part of one study shares: the config without PART_FIELDS and
    without paths (the schemas' path fields and the corpora's), which may differ between
    machines; the digests of study.json's "identity" stand for what they hold."""
    settings = config.to_dict()
    places = ([f for f, field in FIELDS.items() if field.path]
              + [f"pretrain.{f}" for f, field in pretrain_config.FIELDS.items() if field.path])
    for field in (*PART_FIELDS, *places):
        *parents, leaf = field.split(".")
        node = settings
        for name in parents:
            node = node.get(name, {})
        node.pop(leaf, None)
    for source in settings["pretrain"]["data"]["sources"].values():
        source.pop("path", None)
    return settings


def merge_defaults() -> ml_collections.ConfigDict:
    """The config of a merge of parts of one study (maelm_jax/study/merge.py)."""
    c = ml_collections.ConfigDict()
    c.mode = "study_merge"  # main.py dispatches on it
    c.inputs = ""  # the parts: study workdirs or study.json files, comma-separated or a list
    return c


MERGE_FIELDS: dict[str, schema.Field] = {
    "mode": schema.choice("study_merge"),
    "inputs": schema.Field((str, list, tuple), "study workdirs or study.json files, "
                           "comma-separated", lambda v: bool(names(v))),
}


def validate(config: ml_collections.ConfigDict) -> None:
    schema.check(config, FIELDS, study_defaults(), StudyConfigError)
    for name, scale in config.step_scale.items():
        if name not in recipes.study_names():
            raise StudyConfigError(f"config.step_scale.{name}: not a model; expected names "
                                   f"among {', '.join(recipes.study_names())}")
        if not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                and 0 < scale <= 1):
            raise StudyConfigError(f"config.step_scale.{name}: expected a number in (0, 1], "
                                   f"got {scale!r}")
    for name in names(config.models):
        try:
            pretrain_config.validate(model_config(config, name))
        except errors.UserError as e:  # its fields live under config.pretrain here
            raise StudyConfigError(f"{str(e).replace('config.', 'config.pretrain.', 1)} "
                                   f"(model {name})") from None


def model_config(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """The pretraining config of one model of the study (its steps scaled by
    config.step_scale)."""
    c = recipes.get(name).apply(config.pretrain)
    c.train.fill_mask_examples = 0
    c.train.num_steps = scaled_steps(config, name, c.train.num_steps)
    return c


def scaled_steps(config: ml_collections.ConfigDict, name: str, steps: int) -> int:
    """`steps` of the study's pretraining for model `name`: times its config.step_scale."""
    return max(1, round(steps * config.step_scale.get(name, 1.0)))
