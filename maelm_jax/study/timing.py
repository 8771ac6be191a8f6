"""What the study's parts cost on this machine, measured at its start: `measure(...)`.

Each measurement runs the program a part will run (built the same way, so JAX's
compilation cache finds it again), compiles it, times its steps after that, and then
times a part's fixed cost by doing what the part does once more: building its program
again, loading its compiled steps (from the cache where there is one), its first step, its
evaluation and, for pretraining, its checkpoint. Nothing here is a guessed share: what a
part costs besides its steps is what starting one again took. maelm_jax/study/sizing.py
turns these figures into the study's plan.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from absl import logging

from maelm_jax import runs
from maelm_jax.analysis import config as rank_config
from maelm_jax.analysis import inputs as rank_inputs
from maelm_jax.analysis import measures
from maelm_jax.analysis import run as rank_run
from maelm_jax.finetune import data as finetune_data
from maelm_jax.finetune import encoder as finetune_encoder_lib
from maelm_jax.finetune import seed_group, tasks
from maelm_jax.finetune import setup as finetune_setup
from maelm_jax.finetune import train as finetune_train
from maelm_jax.infra import paths, sharding, timer
from maelm_jax.models import builder
from maelm_jax.pretrain import evaluation as pretrain_evaluation
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.training import checkpoint as checkpoint_lib


@dataclasses.dataclass
class Timing:
    """What was measured on this machine, in seconds."""

    pretrain_step: dict[str, float]  # per model, one train step
    # Per model, compiling its programs: initialisation, train step and evaluation.
    pretrain_compile: dict[str, float]
    # Per model, what its pretraining part adds besides its steps: its program built
    # again, its compiled steps loaded, its first step, the evaluation at its end and its
    # checkpoint written.
    pretrain_part: dict[str, float]
    # Per model, reading its encoder back from its checkpoint, as the rank analysis and
    # every fine-tuning part do.
    pretrain_restore: dict[str, float]
    finetune_step: float  # one train step of a task's program (finetune_runs runs)
    finetune_eval: float  # one eval batch of it (every run's parameters at once)
    finetune_compile: float  # its initialisation, train and eval programs
    # What a fine-tuning part adds besides its steps and evaluations: its task data, its
    # program, loading its compiled steps, its first step and evaluation. A part's fixed cost: a
    # model without it under-predicts a call's time.
    finetune_part: float
    finetune_runs: int  # the runs the measured program trains (models x seeds)
    rank_model: float  # the rank analysis of one model (its programs from the cache)
    rank_compile: float  # compiling the rank analysis's program
    measuring: float  # the whole measurement, compiles included


def _random_rows(c: ml_collections.ConfigDict, vocab_size: int, rows: int) -> np.ndarray:
    return np.random.default_rng(0).integers(tokenizer_lib.NUM_SPECIAL, vocab_size,
                                             (rows, c.data.seq_len)).astype(np.int32)


def time_pretraining(c: ml_collections.ConfigDict, vocab_size: int,
                     repeats: int) -> tuple[float, float, float, float]:
    """(compile seconds, step seconds, a part's fixed seconds, seconds to read its encoder
    back from its checkpoint) of the pretraining `c` describes, on random tokens."""

    def part():
        start = time.perf_counter()
        program = setup_lib.build(c, vocab_size)
        state = [program.init()]
        batch = sharding.global_batch_from_full(
            _random_rows(c, vocab_size, c.train.batch_size), program.mesh)
        evals = [batch] * c.train.eval_batches
        return program, state, batch, evals, time.perf_counter() - start

    program, state, batch, evals, built = part()

    def step():
        state[0], metrics = program.train_step(state[0], batch)
        return metrics

    with sharding.activate(program.mesh, program.rules):
        compile_train, step_seconds = timer.timed(step, repeats)
        start = time.perf_counter()
        pretrain_evaluation.evaluate_program(program, state[0].params, evals[:1], c.seed)
        compile_eval = time.perf_counter() - start
    # A part again: build, its programs (found in the cache), a step, its evaluation and
    # its checkpoint.
    program, state, batch, evals, again = part()
    with sharding.activate(program.mesh, program.rules), tempfile.TemporaryDirectory() as d:
        start = time.perf_counter()
        jax.block_until_ready(step())
        pretrain_evaluation.evaluate_program(program, state[0].params, evals, c.seed)
        ckpt = checkpoint_lib.Checkpointer(d, 1)
        ckpt.save(1, state[0], {"step": 1})
        ckpt.wait()
        ckpt.close()
        again += time.perf_counter() - start - step_seconds
        start = time.perf_counter()
        runs.restore_encoder_params(paths.Path(d) / "1")
        restore = time.perf_counter() - start
    return built + compile_train + compile_eval, step_seconds, max(again, 0.0), restore


def finetune_encoder(pretrain: ml_collections.ConfigDict, c: ml_collections.ConfigDict,
                     vocab_size: int,
                     special: tokenizer_lib.SpecialIds = tokenizer_lib.SENTENCEPIECE_IDS):
    """The encoder of `pretrain` as a fine-tuning part with config `c` rebuilds it from the
    pretraining checkpoint (finetune/train.py): timed alike, the measured program is the one
    the parts find again in the compilation cache. `special`: the tokenizer's ids (the
    sizing's estimate needs none: they change no shape)."""
    return finetune_encoder_lib.build(c, runs.pretrained_architecture(pretrain.to_dict(),
                                                                     vocab_size), special)


def time_finetuning(pretrain: ml_collections.ConfigDict, c: ml_collections.ConfigDict,
                    tok: tokenizer_lib.Tokenizer, keys: tuple[str, ...],
                    seeds: tuple[int, ...], repeats: int
                    ) -> tuple[float, float, float, float]:
    """(compile seconds, seconds per train step, seconds per eval batch, seconds a part
    adds besides its steps and evaluations) of a task's fine-tuning program: `pretrain`'s
    encoder fine-tuned with the study's config `c` of the task (its first setting), the
    runs named `keys` with `seeds` (as sweep.run_models names them: the program's outputs
    are named by them), one bucket of data.max_seq_len."""
    c = c.copy_and_resolve_references()
    c.train.update(learning_rate=c.grid.learning_rate[0], batch_size=c.grid.batch_size[0],
                   num_epochs=1, warmup_ratio=c.grid.warmup_ratio[0])
    c.tokenizer_path = tok.model_path
    max_len = c.data.max_seq_len
    encoder = finetune_encoder(pretrain, c, tok.vocab_size, tok.special)
    buckets = (max_len,)
    group = (finetune_setup.Runs(seeds, keys, (finetune_setup.schedule_of(c.train, 1000),)
                                 * len(keys)) if len(keys) > 1 else None)

    def part():
        """A part's start: (program, [state], a train batch, an eval batch)."""
        task_data = tasks.make_task(c, tok, max_len)
        program = finetune_setup.build(c, encoder, task_data, 1000, max_len, runs=group)
        if group:
            arrays = next(seed_group.stacked_batches(task_data.train, c.train.batch_size,
                                                     buckets, seeds, 1, 0))
            batch = program.stacked_on_mesh(arrays)
        else:
            batch = program.on_mesh(next(finetune_train.train_batches(
                task_data.train, c.train.batch_size, buckets, seeds[0], 1, 0))[1])
        split = task_data.eval_splits()[0]
        eval_batch = program.on_mesh(next(iter(finetune_data.eval_batches(
            split.sequences, split.targets, c.train.eval_batch_size, buckets))))
        return program, batch, eval_batch

    program, batch, eval_batch = part()
    start = time.perf_counter()
    state = [jax.block_until_ready(program.state.init(None))]
    compile_init = time.perf_counter() - start

    def step():
        state[0], metrics = program.train_step(state[0], batch)
        return metrics

    with sharding.activate(program.mesh, program.rules):
        compile_train, step_seconds = timer.timed(step, repeats)
        compile_eval, eval_seconds = timer.timed(
            lambda: program.eval_step(state[0].params, eval_batch), repeats)
    start = time.perf_counter()
    program, batch, eval_batch = part()
    state = [program.state.init(None)]
    with sharding.activate(program.mesh, program.rules):
        jax.block_until_ready(step())  # the state is donated: step() keeps the new one
        jax.block_until_ready(program.eval_step(state[0].params, eval_batch))
    again = time.perf_counter() - start - step_seconds - eval_seconds
    return (compile_init + compile_train + compile_eval, step_seconds, eval_seconds,
            max(again, 0.0))


def time_rank(study: ml_collections.ConfigDict, c: ml_collections.ConfigDict,
              vocab_size: int) -> tuple[float, float]:
    """(compile seconds, seconds per model) of the rank analysis the study runs on the
    pretraining `c` (study/run.py's settings: config.rank_tokens, one device), on random
    tokens: its Gram program over its batches, then the statistics and their bootstrap. The
    analysis builds its program afresh for every model, so the second time is a model's."""
    r = rank_config.rank_defaults()
    encoder = builder.encoder(runs.pretrained_architecture(c.to_dict(), vocab_size),
                              builder.Run(dtype=r.dtype))
    params = jax.device_get(nn.meta.unbox(runs.encoder_init(encoder)()))
    num_tokens = study.rank_tokens or rank_config.DEFAULT_TOKENS_PER_DIM * c.model.d_model
    rows = _random_rows(c, vocab_size, -(-num_tokens // c.data.seq_len))
    batches, _, _ = rank_inputs.make_batches(rows, c.data.seq_len, r.batch_size, num_tokens,
                                             r.mask_ratio, r.seed,
                                             special=encoder.special)
    r.mesh.shape = (1, 1, 1)  # as study/run.py runs it
    mesh = sharding.fixed_mesh(r.mesh.shape, r.mesh.dcn_shape)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        grams = rank_run.gram_sums(encoder, params, batches, mesh,
                                   groups=r.bootstrap_groups)
        seconds.append(time.perf_counter() - start)
    # The statistics and their bootstrap on the host: the same time whatever the weights.
    start = time.perf_counter()
    measures.run_measures(grams, r.tau, r.center, r.bootstrap_replicates, r.seed)
    host = time.perf_counter() - start
    return max(seconds[0] - seconds[1], 0.0), seconds[1] + host


def measure(study: ml_collections.ConfigDict, configs: dict[str, ml_collections.ConfigDict],
            tok: tokenizer_lib.Tokenizer, program: dict | None,
            sweep_config: Callable[[str], ml_collections.ConfigDict]) -> Timing:
    """Times every model's pretraining, the rank analysis (when the study runs it) and,
    given the first of the study's fine-tuning `program`s (sizing.finetune_programs), that
    program, on the encoder of program["encoder_of"]'s pretraining (`sweep_config(task)`:
    the study's fine-tuning config of a task)."""
    start = time.perf_counter()
    repeats = study.sizing.measure_steps
    compiles, steps, parts, restores = {}, {}, {}, {}
    for name, c in configs.items():
        compiles[name], steps[name], parts[name], restores[name] = time_pretraining(
            c, tok.vocab_size, repeats)
        logging.info("study sizing: %s compiles in %.1f s, steps in %.4f s, a part adds "
                     "%.1f s, its encoder reads back in %.2f s", name, compiles[name],
                     steps[name], parts[name], restores[name])
    rank_compile = rank_model = 0.0
    if study.rank:
        first = configs[next(iter(configs))]
        rank_compile, rank_model = time_rank(study, first, tok.vocab_size)
        logging.info("study sizing: the rank analysis compiles in %.1f s, takes %.1f s a "
                     "model", rank_compile, rank_model)
    ft_compile = ft_step = ft_eval = ft_part = 0.0
    ft_runs = 0
    if program:
        pretrain = configs[program["encoder_of"]]
        keys = tuple(f"{m}/seed_{s}" for m in program["models"] for s in program["seeds"])
        seeds = tuple(s for _ in program["models"] for s in program["seeds"])
        ft_runs = len(keys)
        ft_compile, ft_step, ft_eval, ft_part = time_finetuning(
            pretrain, sweep_config(program["tasks"][0]), tok, keys, seeds, repeats)
        logging.info("study sizing: fine-tuning %d runs as one program compiles in %.1f s, "
                     "steps in %.4f s, evaluates a batch in %.4f s, a part adds %.1f s",
                     ft_runs, ft_compile, ft_step, ft_eval, ft_part)
    return Timing(steps, compiles, parts, restores, ft_step, ft_eval, ft_compile, ft_part, ft_runs,
                  rank_model, rank_compile, time.perf_counter() - start)
