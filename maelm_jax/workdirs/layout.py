"""A workdir, by kind of run: the one definition of its file names, of what each kind
(config.mode) writes there, and of its config record. Every writer and reader names a
file through this module.

Pretraining, fine-tuning, sweeps and the study record their config in ``config.json``
(``mode`` says the kind; absent means pretraining), written once the run can go on.
`KINDS` lists the top-level entries each kind may leave (directories with a trailing
"/"; a sweep is mode "finetune" with sweep=True); the study's test checks its workdir and
every part of it against them, the prepare test the shards' directory. An export's
directory is a Hugging Face model: export/run.py names its files.
"""

from __future__ import annotations

import dataclasses
import json

import ml_collections

from maelm_jax.infra import errors, paths

# Shared by several kinds.
CONFIG_FILE = "config.json"  # the run's config (export: the Hugging Face config)
TOKENIZER_FILE = "tokenizer.model"  # a trained or copied sentencepiece model
HF_TOKENIZER_FILE = "tokenizer.json"  # or a copied Hugging Face tokenizer (text/hf_tokenizer.py)
# A run's tokenizer file by kind (text/tokenizer.py's Tokenizer.kind).
TOKENIZER_FILES = {"sentencepiece": TOKENIZER_FILE, "huggingface": HF_TOKENIZER_FILE}
METRICS_FILE = "metrics.jsonl"  # a JSON line per log, eval or dev evaluation
TENSORBOARD_DIR = "tensorboard"  # the same metrics as TensorBoard event files
# <step>/: orbax checkpoints, the one place every kind keeps them: pretraining's; a
# fine-tuning run's resume states until it finishes, then its final checkpoint.
CHECKPOINTS = "checkpoints"
STATE_ITEM = "state"  # checkpoints/<step>/state: the arrays
META_ITEM = "meta"  # checkpoints/<step>/meta: the loop's JSON record (a final has none)
# Pretraining.
DATA_DIR = "data"  # <fingerprint>/: blocks prepared in the job (unless data.cache_dir)
DATA_RECORD_FILE = "data.json"  # the data the run trains on: fingerprint, sources (run_data)
PLAN_FILE = "plan.json"  # a run to a time budget: its planned steps (training/budget.py)
FILL_MASK_FILE = "fill_mask.md"  # fill-mask examples after the run (train.fill_mask_examples)
# Where a continued run started from (train.init_from): the source, what was loaded.
INIT_FROM_FILE = "init_from.json"
# Every process's stacks on SIGUSR1 (infra/stacks.py): process_<i>.txt; pretraining and
# fine-tuning.
STACKS_DIR = "stacks"
PROFILE_DIR = "profile"  # a jax.profiler trace of train.profile_steps (training/profiler.py)
# The experiment trackers' own files (training/trackers.py): W&B's run and its id, kept so
# that a resumed run continues the same W&B run.
TRACKERS_DIR = "trackers"
# Fine-tuning.
# Where fine-tuning kept its resume checkpoints before they moved into checkpoints/: an
# unfinished run of that layout is refused with the one command that converts it.
OLD_RESUME_DIR = "resume"
RESULTS_FILE = "results.json"  # the finished run's scores
GROUP_FILE = "group.json"  # a group of runs trained as one program: who they are
PREDICTIONS_DIR = "predictions"  # GLUE test-set TSVs; SQuAD predictions.json and friends
ENCODER_FILE = "encoder.json"  # the encoder's architecture, beside checkpoints/
# A sweep: sweep.json and sweep.md over runs/<setting>/seed_<n>/, each a fine-tuning run
# (with grid.seeds_per_program > 1 also runs/<setting>/seeds_<a>_<b>.../, a seed group's
# workdir, while each seed_<n>/ holds only its config.json and results.json).
SWEEP_SUMMARY_FILE = "sweep.json"
SWEEP_TABLE_FILE = "sweep.md"
SWEEP_RUNS_DIR = "runs"
# The rank analysis.
RANK_JSON_FILE = "rank.json"
RANK_MARKDOWN_FILE = "rank.md"
RANK_LAYERS_PLOT = "rank_layers.png"
RANK_MASK_PLOT = "rank_mask.png"
# The study: each part an ordinary workdir of its kind.
STUDY_JSON_FILE = "study.json"
STUDY_MARKDOWN_FILE = "study.md"
STUDY_LOSS_PLOT = "loss_curves.png"
STUDY_GLUE_PLOT = "glue_medians.png"
STUDY_TIMES_FILE = "study_time.json"  # in each part: its wall seconds, over resumes
STUDY_SIZING_FILE = "sizing.json"  # the study's plan of pretraining steps (study/sizing.py)
POOL_JSON_FILE = "pool.json"  # calls of one study design pooled (study/pool.py)
POOL_MARKDOWN_FILE = "pool.md"
STUDY_PRETRAIN_DIR = "pretrain"  # <model>/: a pretraining run
STUDY_RANK_DIR = "rank"  # the rank analysis of every model
STUDY_FINETUNE_DIR = "finetune"  # <model>/<task>/: a sweep
STUDY_GROUPS_DIR = "groups"  # under finetune/: <task>/<models>/seeds_<a>_...: a task's programs
STUDY_ENCODERS_DIR = "encoders"  # <model>.npz: each pretrained encoder packed (study/encoders.py)
# Mode "prepare": the shards' manifest (written last) and tokenizer, beside the shards.
MANIFEST_FILE = "manifest.json"
# Held by the run that writes the workdir, and removed when it ends (workdirs/lock.py).
LOCK_FILE = ".lock"


@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind of run: its config.mode and the top-level entries its workdir may hold."""

    mode: str
    writes: tuple[str, ...]  # names; a trailing "/" marks a directory
    patterns: tuple[str, ...] = ()  # glob patterns for entries named by the data


# A study's parts (pretraining runs, the rank analysis, sweeps) also hold its time record.
KINDS: dict[str, Kind] = {k.mode: k for k in (
    Kind("pretrain", (CONFIG_FILE, TOKENIZER_FILE, HF_TOKENIZER_FILE, METRICS_FILE,
                      TENSORBOARD_DIR + "/", CHECKPOINTS + "/", DATA_DIR + "/", FILL_MASK_FILE,
                      STUDY_TIMES_FILE, PLAN_FILE, STACKS_DIR + "/", PROFILE_DIR + "/",
                      TRACKERS_DIR + "/", DATA_RECORD_FILE, INIT_FROM_FILE)),
    Kind("prepare", (MANIFEST_FILE, TOKENIZER_FILE, HF_TOKENIZER_FILE),
         patterns=("*-*-of-*", "notes")),
    Kind("finetune", (CONFIG_FILE, METRICS_FILE, TENSORBOARD_DIR + "/", RESULTS_FILE,
                      PREDICTIONS_DIR + "/", CHECKPOINTS + "/", ENCODER_FILE,
                      TOKENIZER_FILE, HF_TOKENIZER_FILE, GROUP_FILE, STACKS_DIR + "/")),
    Kind("sweep", (CONFIG_FILE, SWEEP_SUMMARY_FILE, SWEEP_TABLE_FILE, SWEEP_RUNS_DIR + "/",
                   STUDY_TIMES_FILE)),
    Kind("rank", (RANK_JSON_FILE, RANK_MARKDOWN_FILE, RANK_LAYERS_PLOT, RANK_MASK_PLOT,
                  STUDY_TIMES_FILE)),
    # Reads the pretraining run in --workdir and prints; writes nothing there.
    Kind("fill_mask", ()),
    Kind("study", (CONFIG_FILE, TOKENIZER_FILE, HF_TOKENIZER_FILE, DATA_DIR + "/", STUDY_JSON_FILE,
                   STUDY_SIZING_FILE, STUDY_MARKDOWN_FILE, STUDY_LOSS_PLOT, STUDY_GLUE_PLOT,
                   RANK_LAYERS_PLOT, STUDY_PRETRAIN_DIR + "/", STUDY_RANK_DIR + "/",
                   STUDY_FINETUNE_DIR + "/", STUDY_ENCODERS_DIR + "/")),
    # Parts of one study run apart, merged (study/merge.py): the report and rank/ only.
    Kind("study_merge", (CONFIG_FILE, STUDY_JSON_FILE, STUDY_MARKDOWN_FILE, STUDY_LOSS_PLOT,
                         STUDY_GLUE_PLOT, RANK_LAYERS_PLOT, STUDY_RANK_DIR + "/")),
    # Study calls pooled (study/pool.py): the claims' report only.
    Kind("study_pool", (CONFIG_FILE, POOL_JSON_FILE, POOL_MARKDOWN_FILE)),
)}


class WorkdirError(errors.UserError):
    """A workdir whose record cannot be read, or that holds a run this one cannot use."""


def tokenizer_file(directory: paths.Path) -> paths.Path | None:
    """The tokenizer file a workdir or prepared directory holds (either kind), or None."""
    for name in TOKENIZER_FILES.values():
        if (directory / name).is_file():
            return directory / name
    return None


def unexpected_entries(workdir: paths.Path, kind: str) -> list[str]:
    """The top-level entries of `workdir` that a run of `kind` does not write."""
    k = KINDS[kind]
    out = []
    for entry in sorted(workdir.iterdir(), key=lambda p: p.name):
        if entry.name == LOCK_FILE:  # the hold of the run writing it now
            continue
        name = entry.name + ("/" if entry.is_dir() else "")
        if name not in k.writes and not any(entry.match(p) for p in k.patterns):
            out.append(name)
    return out


def config_json(config: ml_collections.ConfigDict) -> str:
    """The config as config.json records it (sorted keys, tuples as lists)."""
    return json.dumps(config.to_dict(), indent=2, sort_keys=True)


def write_config(workdir: paths.Path, config: ml_collections.ConfigDict) -> None:
    paths.write_text(workdir / CONFIG_FILE, config_json(config))


def recorded_config(workdir: paths.Path) -> dict | None:
    """The workdir's config.json as a dict (None if absent); one line if it is unreadable."""
    path = workdir / CONFIG_FILE
    if not path.exists():
        return None
    try:
        recorded = json.loads(paths.read_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        reason = (f"line {e.lineno} column {e.colno}: {e.msg}"
                  if isinstance(e, json.JSONDecodeError) else str(e))
        raise WorkdirError(
            f"{path} is not valid JSON ({reason}); it records the run this workdir holds: "
            "repair it, or use another --workdir") from None
    if not isinstance(recorded, dict):
        raise WorkdirError(
            f"{path} holds a JSON {type(recorded).__name__}, not a run's config; repair it, "
            "or use another --workdir")
    return recorded


def mode(workdir: paths.Path) -> str | None:
    """The kind of run recorded in workdir/config.json ("pretrain" when the record has no
    mode), or None when there is no record."""
    recorded = recorded_config(workdir)
    return None if recorded is None else recorded.get("mode", "pretrain")
