"""The study config: which models, on what, and how each is fine-tuned.

``config.pretrain`` is a whole pretraining config (any field can be overridden from the
command line, e.g. ``--config.pretrain.data.sources.main.kind=wikiextractor``); each
model of ``config.models`` starts from it and changes only what defines that model (its
recipe, maelm_jax/objectives/recipes.py), so every model sees the same corpus, tokenizer,
token budget, optimiser settings and seed.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from maelm_jax import config as pretrain_config
from maelm_jax import errors, schema
from maelm_jax.objectives import recipes

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
    c.finetune.warmup_ratio = 0.06
    # Seeds of a task trained together as one program (finetune/seed_group.py): 1 runs
    # each alone; on an accelerator a group keeps it busy where one small run does not
    # (benchmarks/finetune_seeds.py measures it).
    c.finetune.seeds_per_program = 1
    c.rank_tokens = 0  # tokens of held-out text per run (0: 100 x d_model)
    # The control: the same encoder fine-tuned from random weights with the same settings,
    # which says whether pretraining helped at all at this scale.
    c.scratch = True
    # Under a time limit (main.py --time_limit_minutes), a part (a model's pretraining, the
    # rank analysis, a model's fine-tuning on a task) starts only while this much time is
    # left; the study then stops, writes what it has, and the same command continues.
    c.reserve_seconds = 60.0
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
                       f"({', '.join(recipes.MODELS)}) and the registered objectives",
                       lambda v: bool(names(v)) and set(names(v)) <= set(recipes.names()))


FIELDS: dict[str, schema.Field] = {
    "mode": schema.choice("study"),
    "title": schema.Field((str,), "a heading", bool),
    "models": _MODELS,
    "pretrain": schema.free_form("a pretraining config (maelm_jax/config.py)"),
    "glue_dir": schema.path("the GLUE directory, or empty to skip fine-tuning"),
    "tasks": _names_of(*GLUE_TASKS),
    "seeds": schema.sequence_of(schema.integer(0), min_len=1),
    "finetune.max_seq_len": schema.integer(8),
    "finetune.max_train_examples": schema.integer(0),
    "finetune.min_train_examples": schema.integer(0),
    "finetune.num_epochs": schema.integer(1),
    "finetune.batch_size": schema.integer(1),
    "finetune.learning_rate": schema.number(0.0, low_open=True),
    "finetune.warmup_ratio": schema.number(0.0, 1.0),
    "finetune.seeds_per_program": schema.integer(1),
    "rank_tokens": schema.integer(0),
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
    for name in names(config.models):
        try:
            pretrain_config.validate(model_config(config, name))
        except errors.UserError as e:  # its fields live under config.pretrain here
            raise StudyConfigError(f"{str(e).replace('config.', 'config.pretrain.', 1)} "
                                   f"(model {name})") from None


def model_config(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """The pretraining config of one model of the study."""
    c = recipes.get(name).apply(config.pretrain)
    c.train.fill_mask_examples = 0
    return c
