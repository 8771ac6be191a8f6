"""The study, top to bottom: `run(config, workdir)`.

shared tokenizer -> each model pretrained (<workdir>/pretrain/<model>) -> the rank
analysis of all of them (<workdir>/rank) -> each model fine-tuned on each GLUE task found
with every seed (<workdir>/finetune/<model>/<task>, a sweep of one setting) -> study.json,
study.md and the plots. Every part is an ordinary workdir: a finished one is reused, an
interrupted one resumes, so running the same command again continues where it stopped.

In slices: under a time limit (main.py --time_limit_minutes; preemption.time_limit) a
part starts only while config.reserve_seconds are left, and a pretraining or fine-tuning
run stops at the limit with a checkpoint; the study then writes what it has so far
(study.json with "finished": false and the parts done and left, study.md, the plots) and
raises preemption.TimeLimit. A preempted study (SIGTERM) writes the same and stops.
"""

from __future__ import annotations

import json
import time

import ml_collections
from absl import logging

from maelm_jax import runs
from maelm_jax.analysis import config as rank_config
from maelm_jax.analysis import finetuned
from maelm_jax.analysis import run as rank_run
from maelm_jax.data import digests, run_data
from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import sweep
from maelm_jax.finetune.tasks import glue
from maelm_jax.infra import paths, records
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.study import config as study_config
from maelm_jax.study import encoders, report, sizing
from maelm_jax.training import preemption
from maelm_jax.workdirs import guard as workdir_lib
from maelm_jax.workdirs import layout


def _timed(directory: paths.Path, work) -> float:
    """Runs work(), adds its wall time to directory/layout.STUDY_TIMES_FILE (also when it stops at a
    time limit or a preemption, so the total spans every call); returns the total."""
    start = time.perf_counter()
    try:
        work()
    finally:
        path = directory / layout.STUDY_TIMES_FILE
        total = (json.loads(paths.read_text(path))["seconds"] if path.is_file() else 0.0)
        total += time.perf_counter() - start
        paths.write_text(path, json.dumps({"seconds": total}))
    return total


def _pretrain(name: str, c: ml_collections.ConfigDict, workdir: paths.Path) -> dict:
    if c.train.num_steps in runs.finished_steps(workdir):
        logging.info("study: %s is pretrained, skipping", name)
    else:
        logging.info("study: pretraining %s in %s", name, workdir)
        paths.make_dirs(workdir)
        _timed(workdir, lambda: pretrain_train.train_and_evaluate(c, str(workdir)))
    vocab = run_data.setup_tokenizer(c, workdir).vocab_size
    return {"workdir": str(workdir), "seconds": _seconds(workdir),
            # 3ML Appendix D's count (backward = forward): the study reads only its ratios
            # between models (the papers'), which the model FLOPs' 3 x forward leaves alike;
            # its MFU is the train logs' (3 x forward).
            "train_flops": setup_lib.step_flops(c, vocab) * c.train.num_steps,
            **report.pretraining_record(workdir)}


def _seconds(directory: paths.Path) -> float | None:
    path = directory / layout.STUDY_TIMES_FILE
    return json.loads(paths.read_text(path))["seconds"] if path.is_file() else None


def _rank(config, names: list[str], pretrained: dict, out: paths.Path) -> dict:
    done = out / layout.RANK_JSON_FILE
    workdirs = [pretrained[n]["workdir"] for n in names]
    recorded = json.loads(paths.read_text(done)) if done.is_file() else None
    if (recorded and [r["path"] for r in recorded["runs"]] == workdirs
            and recorded.get("center")):
        logging.info("study: the rank analysis is done, skipping")
        return recorded
    c = rank_config.rank_defaults()
    c.runs = ",".join(workdirs)
    c.num_tokens = config.rank_tokens
    c.mesh.shape = (1, 1, 1)
    return rank_run.analyse(c, str(out))


def _glue_tasks(config) -> list[str]:
    """The study's tasks (in config.tasks' order) that the GLUE directory holds with at
    least config.finetune.min_train_examples training examples; the others with a
    warning."""
    if not config.glue_dir:
        return []
    found = []
    for name in study_config.names(config.tasks):
        task = glue.examples.get_task(study_config.GLUE_TASKS[name])
        if not glue.examples.split_available(task, "train", source="files",
                                             data_dir=config.glue_dir):
            logging.warning("study: %s has no training data in %s, skipped", name,
                            config.glue_dir)
            continue
        rows = len(glue.examples.read_tsv(config.glue_dir, task, "train"))
        if rows < config.finetune.min_train_examples:
            logging.warning("study: %s has %d training examples in %s, fewer than "
                            "config.finetune.min_train_examples=%d, skipped", name, rows,
                            config.glue_dir, config.finetune.min_train_examples)
            continue
        found.append(name)
    return found


def _identity(config, shared: ml_collections.ConfigDict, tok, tasks: list[str]) -> dict:
    """What every part of one study must share, where paths may differ between machines
    (maelm_jax/study/merge.py compares it): the settings, the tokenizer's SHA-256, the
    prepared data's fingerprint (the corpora's content, the tokenizer, the blocks) and
    each GLUE task's files."""
    glue_root = paths.Path(config.glue_dir) if config.glue_dir else None
    return {"settings": study_config.shared_settings(config),
            "tokenizer_sha256": digests.sha256_of(tok.model_path),
            "data_fingerprint": run_data.data_fingerprint(shared, tok),
            "glue": {t: {f.name: digests.content_identity(str(f))
                         for f in sorted((glue_root / t).iterdir(), key=lambda f: f.name)
                         if f.is_file()}
                     for t in tasks}}


SCRATCH = "scratch"  # the control's name in study.json and under finetune/


def scratch_config(config, task: str, pretrain_workdir: str) -> ml_collections.ConfigDict:
    """The control: the study's encoder, from random weights, fine-tuned alike (the
    architecture and tokenizer of the pretraining run in `pretrain_workdir`), at its own
    learning rate when config.finetune.scratch_learning_rate sets one."""
    c = sweep_config(config, task, pretrain_workdir)
    c.init_weights = "random"
    if config.finetune.scratch_learning_rate:
        c.grid.learning_rate = (config.finetune.scratch_learning_rate,)
    return c


def sweep_config(config, task: str, init_from: str) -> ml_collections.ConfigDict:
    """One model's fine-tuning on one task: a sweep of one setting over the study's seeds."""
    f = config.finetune
    c = finetune_config.finetune_defaults()
    c.task = glue.examples.get_task(study_config.GLUE_TASKS[task]).tfds_config
    c.data.source = "files"
    c.init_from = init_from
    c.data.data_dir = config.glue_dir
    c.data.max_seq_len = f.max_seq_len
    c.data.max_train_examples = f.max_train_examples
    c.sweep = True
    c.grid.learning_rate = (f.learning_rate,)
    c.grid.batch_size = (f.batch_size,)
    c.grid.num_epochs = (f.num_epochs,)
    c.grid.warmup_ratio = (f.warmup_ratio,)
    c.grid.seeds = tuple(config.seeds)
    c.grid.seeds_per_program = f.seeds_per_program
    c.predict_test = False
    c.save_checkpoint = False
    # Runs of minutes: a resume checkpoint only when a stop request asks for one, and one
    # padded length for every batch (fewer programs to compile).
    c.train.resume_saves = "stop"
    c.data.one_bucket = True
    c.mesh.shape = (1, 1, 1)
    return c


def _start(part: str, reserve_seconds: float) -> None:
    """Raises TimeLimit when too little time is left to start `part`."""
    left = preemption.time_left()
    if left < reserve_seconds:
        raise preemption.TimeLimit(
            f"time limit: {max(left, 0):.0f} s left, fewer than the reserve of "
            f"{reserve_seconds:.0f} s (config.reserve_seconds, or the sizing's longest stretch "
            f"that cannot stop), so {part} was not started; run the same command to continue")


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs (or resumes) the study; returns what study.json holds. Writes the report, of
    what is done so far, also when a time limit or a preemption stops it (and re-raises)."""
    started = time.perf_counter()
    study_config.validate(config)
    root = paths.resolve(workdir, "--workdir")
    workdir_lib.claim(root, "study", "run the study")
    paths.make_dirs(root)
    layout.write_config(root, config)
    names = study_config.names(config.models)
    configs = {n: study_config.model_config(config, n) for n in names}
    tasks = _glue_tasks(config)
    controls = [SCRATCH] if config.scratch and tasks else []
    parts = ([f"pretrain {n}" for n in names] + (["rank analysis"] if config.rank else [])
             + [f"fine-tune on {t}" for t in tasks])
    result = {"title": config.title, "models": names, "controls": controls, "finished": False,
              "parts_done": [], "parts_left": list(parts),
              "pretraining": {n: {"workdir": str(root / layout.STUDY_PRETRAIN_DIR / n)}
                              for n in names},
              "rank": {"tau": None, "runs": []}, "glue": {},
              "glue_dir": config.glue_dir, "seeds": list(config.seeds),
              "pretrain_seed": config.pretrain.seed,
              "parts": [{"workdir": str(root), "models": names, "controls": controls,
                         **records.machine()}]}

    # Each part's wall seconds in this call, beside the sizing's prediction of it.
    result["part_seconds"] = {}
    clock = [time.perf_counter()]

    def done(part: str) -> None:
        result["parts_done"].append(part)
        result["parts_left"].remove(part)
        now = time.perf_counter()
        result["part_seconds"][part] = now - clock[0]
        clock[0] = now

    finetune_dir = root / layout.STUDY_FINETUNE_DIR
    try:
        # One tokenizer and one set of prepared blocks for every model.
        shared = pretrain_config.resolve_paths(configs[names[0]])
        tok = run_data.setup_tokenizer(shared, root)
        for c in configs.values():
            c.tokenizer.model_path = tok.model_path
            c.data.cache_dir = str(root / layout.DATA_DIR)
        result["identity"] = _identity(config, shared, tok, tasks)
        # The corpus read and packed once, before the plan: its time is spent, not guessed.
        run_data.validate_sources(shared)
        run_data.build_blocks(configs[names[0]], root, tok)
        result["setup_seconds"] = time.perf_counter() - started
        reserve = config.reserve_seconds
        if config.sizing.enabled:  # each model's steps to fit the time there is
            result["sizing"] = sizing.plan(config, configs, tasks, controls, tok, root,
                                           lambda task: sweep_config(config, task, ""))
            reserve = result["sizing"].get("reserve_seconds", reserve)
        clock[0] = time.perf_counter()
        result["pretrain_config"] = {n: json.loads(pretrain_config.to_json(configs[n]))
                                     for n in names}
        for n in names:
            _start(f"pretrain {n}", reserve)
            result["pretraining"][n] = _pretrain(n, configs[n],
                                                 root / layout.STUDY_PRETRAIN_DIR / n)
            if config.return_encoders:
                result["pretraining"][n]["encoder_file"] = str(encoders.pack(
                    root / layout.STUDY_PRETRAIN_DIR / n,
                    root / layout.STUDY_ENCODERS_DIR / f"{n}.npz"))
            done(f"pretrain {n}")
        if config.rank:
            _start("the rank analysis", reserve)
            result["rank"] = _rank(config, names, result["pretraining"],
                                   root / layout.STUDY_RANK_DIR)
            done("rank analysis")
        for task in tasks:
            sweeps = {n: sweep_config(config, task, result["pretraining"][n]["workdir"])
                      for n in names}
            if controls:
                sweeps[SCRATCH] = scratch_config(config, task,
                                                 result["pretraining"][names[0]]["workdir"])
            _start(f"fine-tuning on {task}", reserve)
            # Every model and the control, every seed: one program (per architecture).
            # Each group also measures its fine-tuned encoders' ranks on the task's dev set
            # (Table 3 after fine-tuning).
            summaries = sweep.run_models(
                sweeps, {n: str(finetune_dir / n / task) for n in sweeps},
                str(finetune_dir / layout.STUDY_GROUPS_DIR / task),
                measure=finetuned.run_ranks if config.rank else None)
            for n, summary in summaries.items():
                setting = summary["settings"][0]
                result["glue"].setdefault(n, {})[task] = {
                    "metric": summary["primary_metric"],
                    "median": summary["best_median"][summary["primary_metric"]],
                    "per_seed": setting["per_seed"],
                    "seconds": setting["wall_seconds"],
                    **({"rank_per_seed": setting["rank_per_seed"]}
                       if "rank_per_seed" in setting else {}),
                }
            done(f"fine-tune on {task}")
        result["finished"] = True
        result["seconds"] = time.perf_counter() - started  # this call's, beside the sizing
    except preemption.Preempted:
        result["seconds"] = time.perf_counter() - started
        for p in result["pretraining"].values():  # what a stopped model has logged
            if "step" not in p:
                p.update(report.pretraining_record(paths.Path(p["workdir"])))
        report.write(root, result)
        logging.warning("study: %d of %d parts done, %s left", len(result["parts_done"]),
                        len(parts), ", ".join(result["parts_left"]))
        raise
    report.write(root, result)
    return result
