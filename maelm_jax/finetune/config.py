"""The fine-tuning config: defaults, the papers' search spaces, and validation.

`configs/finetune/glue.py` and `squad.py` start from `finetune_defaults()`: the fields
every task has, plus each registered task kind's own (finetune/tasks: SQuAD's
config.squad.*). The search spaces (`paper_grid`) are the kinds': Tables 5 (GLUE) and 6
(SQuAD 2.0) of the MAE-LM paper, Appendix D, and Table 5 of the 3ML paper, Appendix B; a
single run uses one point of its grid, a sweep (`config.sweep = True`) runs all of it and
aggregates the seeds by its paper's rule.
"""

from __future__ import annotations

import ml_collections

from maelm_jax.config import options, schema
from maelm_jax.config import sections as config_sections
from maelm_jax.finetune import tasks
from maelm_jax.finetune.tasks.base import FinetuneConfigError, require
from maelm_jax.infra import paths

DATA_SOURCES = ("files", "tfds")
SELECT = ("best", "final")
# Encoder widths the paper's learning-rate sets are given for (Table 5 / Table 6).
MODEL_SIZES = ("base", "large")

# 3ML's fine-tuning weight decay (its Table 5's grids are the GLUE kind's).
THREEML_WEIGHT_DECAY = 0.1
# Whose fine-tuning recipe (grid and aggregation) a config follows.
PAPERS = ("maelm", "3ml")
# How a sweep turns grid x seeds into one figure:
# * "median_then_best" (MAE-LM, Appendix D): each setting's median over the seeds, then
#   the best setting's median;
# * "best_then_median" (3ML, Appendix B): each seed's best over the settings, then the
#   median of those bests.
AGGREGATES = ("median_then_best", "best_then_median")
PAPER_AGGREGATE = {"maelm": "median_then_best", "3ml": "best_then_median"}
# `metric`: whose reported number per task picks a run's best evaluation and a sweep's
# best setting (tasks/glue/metrics.py, REPORTED_METRIC): MAE-LM's one number per task, or
# 3ML's Table 3 pairs (F1/accuracy, Pearson/Spearman, MNLI-m/mm) averaged.
# Both papers report five seeds.
PAPER_SEEDS = (1, 2, 3, 4, 5)


INIT_WEIGHTS = ("pretrained", "random")
# When a run writes resume checkpoints (train.resume_saves).
RESUME_SAVES = ("evaluations", "stop")


def finetune_defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "finetune"  # main.py dispatches on it
    # A GLUE task (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli), squad, or a task of
    # another registered kind (finetune/tasks): the kind serving it reads, trains and scores.
    c.task = "sst2"
    c.seed = 1  # head initialisation, data order and dropout derive from it
    # Whose reported metric a run's best evaluation and a sweep's best setting are chosen
    # by (PAPERS): "maelm" (accuracy for MRPC/QQP, Spearman for STS-B, MNLI matched) or
    # "3ml" (the mean of F1 and accuracy, of Pearson and Spearman, of MNLI-m and -mm).
    # SQuAD is compared by F1 either way.
    c.metric = "maelm"
    # A pretraining workdir, one of its checkpoints/<step> directories, a fine-tuning
    # workdir (e.g. MNLI's, to start RTE/MRPC/STS-B from it), or a local Hugging Face
    # RoBERTa/BERT directory (a published baseline, docs/finetuning.md): the encoder and the
    # tokenizer come from there, the head is new. "" trains from scratch (a control).
    c.init_from = ""
    # "pretrained" loads init_from's encoder weights; "random" keeps its architecture and
    # tokenizer but starts from fresh weights: the from-scratch control of a pretraining
    # run, with nothing else changed.
    c.init_weights = "pretrained"
    c.tokenizer_path = ""  # a sentencepiece model; required from scratch, else a check

    # The encoder architecture for from-scratch runs (names as in the pretraining config);
    # with init_from the checkpoint decides it. dropout, attention_dropout and dtype apply
    # to both: they change no parameter shape.
    c.model = ml_collections.ConfigDict()
    config_sections.ENCODER.add_to(c, "model")
    c.model.max_positions = 512
    # The GLUE head's two dropouts. The papers give one dropout (0.1); the official code's
    # head (fairseq's --pooler-dropout) defaults to 0.
    c.model.classifier_dropout = 0.1
    # What the classification head reads: "first", the first token's state (RoBERTa's and
    # the papers' <s>), or "mean", the mean over the real tokens (sentence-embedding
    # style; helps small encoders whose <s> state carries little).
    c.model.pooling = "first"

    c.data = ml_collections.ConfigDict()
    c.data.source = "files"  # "files" (GLUE TSVs / SQuAD JSON) or "tfds" (ArrayRecord)
    # GLUE: the directory of the standard download (<data_dir>/SST-2/train.tsv, ...) or the
    # task's own directory. Unused for SQuAD files (see config.squad) and for tfds.
    c.data.data_dir = ""
    c.data.tfds_name = ""  # "" = the standard name (glue/sst2, squad/v2.0, ...)
    c.data.tfds_data_dir = ""  # "" = the TFDS default
    c.data.max_seq_len = 0  # 0 = the encoder's max positions, at most 512 (Table 5)
    # Padded lengths: a batch is padded to the smallest bucket that holds its longest
    # sequence, so XLA compiles at most one train and one eval step per bucket.
    c.data.buckets = (64, 128, 256, 512)
    # True: train and dev batches all padded to one length, the smallest bucket that holds
    # the task's longest train or dev text (one program per step kind; for short runs on
    # an accelerator, where compiling costs more than the padding). Longer test texts
    # still take the larger buckets.
    c.data.one_bucket = False
    c.data.max_train_examples = 0  # 0 = all; else the first N (quick experiments)
    c.data.max_eval_examples = 0

    c.train = ml_collections.ConfigDict()
    # The optimiser and the loop's shared fields (config_sections.TRAIN) at Table 5 / 6's
    # values (a single run's point of the grid; no clipping).
    config_sections.TRAIN.add_to(c, "train", batch_size=32, learning_rate=2e-5,
                                 clip_norm=0.0, log_every=50)
    c.train.num_epochs = 3
    c.train.warmup_ratio = 0.06  # Table 5: "warm-up proportion" of all steps
    c.train.eval_batch_size = 64
    c.train.evals_per_epoch = 1
    # Which dev score a run reports: "best" over its evaluations (fairseq keeps the best
    # checkpoint by the dev metric, which is how RoBERTa and MAE-LM fine-tune) or "final".
    c.train.select = "best"
    # Resume states (<workdir>/checkpoints/<step>) are written at every evaluation but the
    # last and every checkpoint_every steps (0: at evaluations only), so a run killed
    # part-way continues from the latest; they are deleted when the run finishes.
    c.train.checkpoint_every = 1000
    # When resume checkpoints are written: "evaluations" (as above, and on a stop
    # request) or "stop" (only on a stop request: SIGTERM, the time limit), for runs so
    # short that saving costs more than running again would (the study's).
    c.train.resume_saves = "evaluations"

    config_sections.MESH.add_to(c)  # as in pretraining (docs/scaling.md)
    # XLA's backend optimisation level 0: compiles are much shorter, steps run slower. For
    # tiny models and tests on a CPU, never for real runs.
    c.fast_compile = False

    c.save_checkpoint = True  # the fine-tuned encoder + head (the selected evaluation's)
    c.predict_test = True  # GLUE submission files when the test split is available

    # Each task kind's own fields (SQuAD's config.squad.*).
    for kind in tasks.kinds():
        kind.add_defaults(c)

    # Sweep: grid x seeds, each run in <workdir>/runs/<setting>/seed_<s>; medians per
    # setting in <workdir>/sweep.json and sweep.md.
    c.sweep = False
    c.grid = ml_collections.ConfigDict()
    c.grid.num_epochs = (3,)
    c.grid.learning_rate = (2e-5,)
    c.grid.batch_size = (32,)
    c.grid.warmup_ratio = (0.06,)
    c.grid.seeds = PAPER_SEEDS
    c.grid.aggregate = "median_then_best"  # AGGREGATES
    # How many of a setting's seeds train together as one program (finetune/seed_group.py):
    # 1 runs each alone; more pays on an accelerator, where a small run leaves it idle.
    c.grid.seeds_per_program = 1
    return c


def paper_grid(task: str, size: str = "base", paper: str = "maelm") -> dict:
    """A paper's search space for a task: {"num_epochs": ..., "learning_rate": ..., ...},
    from the task's kind (finetune/tasks).

    MAE-LM's depends on the model size; 3ML gives one grid for GLUE (none for SQuAD).
    """
    if size not in MODEL_SIZES:
        raise FinetuneConfigError(f"model size: expected one of {MODEL_SIZES}, got {size!r}")
    return tasks.kind_for(task).paper_grid(task, size, paper)


def set_grid(c: ml_collections.ConfigDict, grid: dict) -> None:
    for name, values in grid.items():
        c.grid[name] = tuple(values)


# Every field's type and allowed values, declared once (maelm_jax/config/schema.py; the encoder
# and optimiser fields are shared with pretraining); validate() adds cross-field rules.
# The task kinds declare their own fields (fields() adds them).
COMMON_FIELDS: dict[str, schema.Field] = {
    "mode": schema.choice("finetune"),
    "task": schema.text("a task name (a GLUE task, squad, or a registered kind's)"),
    "seed": schema.integer(0),
    "metric": schema.choice(*PAPERS),
    "init_from": schema.path("a pretraining or fine-tuning workdir, one of its "
                             "checkpoints/<step>, a Hugging Face RoBERTa/BERT directory, "
                             "or empty"),
    "init_weights": schema.choice(*INIT_WEIGHTS),
    "tokenizer_path": schema.path("a sentencepiece .model file, or empty"),
    **config_sections.ENCODER.fields("model"),
    "model.max_positions": schema.integer(1),
    "model.classifier_dropout": schema.rate(),
    "model.pooling": schema.choice(*options.POOLINGS),
    "data.source": schema.choice(*DATA_SOURCES),
    "data.data_dir": schema.path("the GLUE data directory"),
    "data.tfds_name": schema.text(),
    "data.tfds_data_dir": schema.path("a TFDS data directory, or empty for the default"),
    "data.max_seq_len": schema.integer(0),
    "data.buckets": schema.sequence_of(schema.integer(8), min_len=1,
                                       words="increasing lengths >= 8"),
    "data.max_train_examples": schema.integer(0),
    "data.max_eval_examples": schema.integer(0),
    "train.num_epochs": schema.integer(1),
    "train.warmup_ratio": schema.number(0.0, 1.0, high_open=True),
    **config_sections.TRAIN.fields("train"),
    "train.eval_batch_size": schema.integer(1),
    "train.evals_per_epoch": schema.integer(1),
    "train.select": schema.choice(*SELECT),
    "train.checkpoint_every": schema.integer(0),
    "train.resume_saves": schema.choice(*RESUME_SAVES),
    "data.one_bucket": schema.boolean(),
    **config_sections.MESH.fields(),
    "fast_compile": schema.boolean(),
    "save_checkpoint": schema.boolean(),
    "predict_test": schema.boolean(),
    "sweep": schema.boolean(),
    "grid.num_epochs": schema.sequence_of(schema.integer(1), min_len=1),
    "grid.learning_rate": schema.sequence_of(schema.number(0.0, low_open=True), min_len=1,
                                             words="a tuple of numbers > 0"),
    "grid.batch_size": schema.sequence_of(schema.integer(1), min_len=1),
    "grid.warmup_ratio": schema.sequence_of(schema.number(0.0, 1.0, high_open=True),
                                            min_len=1, words="a tuple of numbers in [0, 1)"),
    "grid.seeds": schema.sequence_of(schema.integer(0), min_len=1),
    "grid.aggregate": schema.choice(*AGGREGATES),
    "grid.seeds_per_program": schema.integer(1),
}


def fields() -> dict[str, schema.Field]:
    """COMMON_FIELDS plus every registered task kind's own fields."""
    table = dict(COMMON_FIELDS)
    for kind in tasks.kinds():
        table.update(kind.fields())
    return table


# The table with the built-in kinds' fields (validation uses fields(), which also has the
# fields of kinds registered later).
FIELDS = fields()


def resolve_paths(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy whose paths (init_from, tokenizer, data, the kinds' files such as SQuAD's)
    are absolute against the current directory."""
    return schema.resolve_paths(c, fields())


def validated(c: ml_collections.ConfigDict,
            workdir: str) -> tuple[ml_collections.ConfigDict, paths.Path]:
    """What every fine-tuning entry (a single run, a sweep) does first: validates `c` and
    returns it with absolute paths, and the workdir as an absolute path. Relative paths
    mean the current directory; they are made absolute once, here (orbax needs absolute
    checkpoint paths, and config.json records them)."""
    validate(c)
    return resolve_paths(c), paths.resolve(workdir, "--workdir")


def validate(c: ml_collections.ConfigDict) -> None:
    """Raises FinetuneConfigError for the first problem found."""
    schema.check(c, fields(), finetune_defaults(), FinetuneConfigError)
    kind = tasks.kind_for(c.task)
    kernel_options(c)
    require(
        bool(c.init_from) or bool(c.tokenizer_path),
        "tokenizer_path",
        "a sentencepiece model when config.init_from is empty (training from scratch)",
        c.tokenizer_path,
    )
    require(
        bool(c.init_from) or c.init_weights == "pretrained",
        "init_from",
        "a workdir to take the architecture and tokenizer from (init_weights='random')",
        c.init_from,
    )
    kind.validate(c)
    if not c.init_from:  # the encoder is config.model's (else the run's it starts from)
        schema.stack_rules(c.model, "model", c.model.attention_impl, require)
    buckets = tuple(c.data.buckets)
    require(
        list(buckets) == sorted(buckets),
        "data.buckets",
        "increasing lengths >= 8",
        buckets,
    )
    if c.sweep:
        seeds = tuple(c.grid.seeds)
        require(len(set(seeds)) == len(seeds), "grid.seeds", "distinct seeds", seeds)


def kernel_options(config: ml_collections.ConfigDict) -> options.KernelOptions:
    """config.model.pallas as the kernels' options (FinetuneConfigError naming a bad field)."""
    return config_sections.kernel_options(config, FinetuneConfigError)
