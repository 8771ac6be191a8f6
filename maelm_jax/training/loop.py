"""Pretraining, top to bottom: `train_and_evaluate(config, workdir)`.

config -> tokenizer -> prepared blocks -> model and optimiser -> restore the latest
checkpoint if any -> steps with periodic logs, evals and checkpoints.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from maelm_jax import config as config_lib
from maelm_jax import distributed, masking, mfu, objectives, paths, sharding
from maelm_jax.data import loader, pipeline, shards
from maelm_jax.models import layers
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.training import engine
from maelm_jax.training import metrics as metrics_lib
from maelm_jax.training import setup as setup_lib
from maelm_jax.training import workdir as workdir_lib


def evaluate(eval_step, params, batches: list[jax.Array], seed: int) -> dict[str, float]:
    """The objective's loss sums on fixed validation batches and masks, as scores per
    predicted token: loss, accuracy and perplexity, and any other sum the objective adds
    (objectives.per_token); the same per category of corruption (``mask_loss``,
    ``random_accuracy``, ``unchanged_perplexity``, ...; the 3ML paper's Tables 1 and 2c)
    for every category the masking produces (MAE-LM's 100-0-0 has only ``mask_*``)."""
    totals: dict[str, np.ndarray] = {}
    for i, tokens in enumerate(batches):
        # The same keys every time, so evals at different steps score identical masks.
        key = jax.random.fold_in(jax.random.PRNGKey(seed + 1), i)
        sums = jax.device_get(eval_step(params, tokens, key))
        for name, value in sums.items():
            totals[name] = totals.get(name, 0.0) + np.asarray(value, np.float64)
    if not totals:
        return _scores({"loss_sum": 0.0, "correct_sum": 0.0, "count": 0.0})
    out = _scores(totals)
    if "category_count" in totals:
        for c, name in enumerate(masking.CATEGORY_NAMES):
            if totals["category_count"][c] > 0:
                scores = _scores(objectives.category(totals, c))
                out.update({f"{name}_{k}": v for k, v in scores.items()})
    return out


def _scores(sums) -> dict[str, float]:
    scores = {name: float(value) for name, value in objectives.per_token(sums).items()}
    scores["perplexity"] = metrics_lib.perplexity(scores["loss"])
    return scores


def _throughput(steps: int, seconds: float, step: int, tokens_per_step: int,
                num_steps: int) -> dict[str, float]:
    """Steps/s, tokens/s and ETA of a logging window of `steps` steps up to `step`."""
    rate = steps / seconds
    return {
        "steps_per_sec": rate,
        "tokens_per_sec": rate * tokens_per_step,
        "eta_minutes": (num_steps - step) / max(rate, 1e-9) / 60,
    }


def _prepare(config: ml_collections.ConfigDict, workdir: paths.Path,
             allow_config_change: bool):
    """Tokenizer and packed data. Process 0 builds them in the shared workdir while the
    others wait, then everyone loads the same files. A failure leaves the workdir as it
    was. (config.json is written once the checkpoint, if any, has restored.)"""
    if config.data.prepared:  # shards of mode "prepare": every process reads its own blocks
        shards.check_run(config)  # they fit this run and are whole, before anything is written
        if jax.process_index() == 0:
            workdir_lib.check_compatible(config, workdir, allow_config_change)
            with workdir_lib.all_or_nothing(workdir):
                paths.make_dirs(workdir)
                pipeline.prepared_tokenizer(config, workdir)
        distributed.barrier("tokenizer")
        tok = pipeline.prepared_tokenizer(config, workdir)
        return tok, shards.load(config.data.prepared, pipeline.source_weights(config))
    if jax.process_index() == 0:
        workdir_lib.check_compatible(config, workdir, allow_config_change)
        with workdir_lib.all_or_nothing(workdir):
            paths.make_dirs(workdir)
            tok = pipeline.setup_tokenizer(config, workdir)
            data = pipeline.prepare_data(config, workdir, tok)
    distributed.barrier("prepared data")
    if jax.process_index() != 0:
        tok = pipeline.setup_tokenizer(config, workdir)
        data = pipeline.prepare_data(config, workdir, tok)
    return tok, data


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       allow_config_change: bool = False) -> dict[str, float]:
    """Pretrains per `config` in `workdir`, resuming from its latest checkpoint.

    Returns the last evaluation's metrics. A stop request (SIGTERM, the preemption sync
    point, the time limit) saves a checkpoint and raises preemption.Preempted (TimeLimit).
    """
    config_lib.validate(config)
    # Every path absolute, once: relative ones mean the current directory (orbax and
    # resumed runs started elsewhere would otherwise read other files).
    config = config_lib.resolve_paths(config)
    workdir = paths.resolve(workdir, "--workdir")
    workdir_lib.check_directory(workdir)
    t = config.train
    mesh = sharding.make_mesh(config.mesh.shape)
    sharding.check_batch(mesh, t.batch_size, t.grad_accum_steps)
    rules = sharding.rules_from_config(config.sharding_rules)
    if not config.data.prepared:  # else the corpus need not be on this machine at all
        pipeline.validate_sources(config)
    tok, data = _prepare(config, workdir, allow_config_change)
    logging.info("mesh %s over %d devices in %d processes", dict(mesh.shape), mesh.size,
                 jax.process_count())

    trainer = setup_lib.build(config, tok.vocab_size, mesh, rules)
    logging.info("%s model: %.2fM parameters", config.objective, trainer.num_params / 1e6)
    counts = trainer.counts
    logging.info(
        "masking: k=%d predicted (%d [MASK], %d random, %d unchanged), encoder length %d of %d",
        counts.k,
        counts.k_mask,
        counts.k_random,
        counts.k_keep,
        counts.n_enc,
        counts.seq_len,
    )

    ckpt = checkpoint_lib.Checkpointer(
        workdir / "checkpoints", t.checkpoint_every, t.keep_checkpoints
    )
    # Restored straight into this run's shardings, whatever mesh saved it; a damaged
    # newest checkpoint gives way to the one before it.
    restored = ckpt.restore_latest(trainer.state.abstract)
    if restored is not None:
        step, state, meta = restored
        logging.info(
            "resumed from checkpoint at step %d (data position %d)", step, meta["data_position"]
        )
        start = meta["data_position"]
        # What the logs report goes on from the checkpoint: the skipped updates and the
        # steps since the last log line (absent in older checkpoints: none).
        skipped = int(meta.get("skipped_updates", 0))
        window = list(meta.get("log_window", []))
    else:
        state, start, skipped, window = trainer.init(), 0, 0, []
    if distributed.is_leader():
        # Recorded once the run can go on (a run refused above leaves the old record).
        workdir_lib.write_config(config, workdir)
    writer = metrics_lib.MetricWriter(workdir, resume_step=start, enabled=distributed.is_leader())
    device_kind = jax.devices()[0].device_kind
    utilisation = mfu.Utilisation(config, tok.vocab_size, mesh.size, device_kind)
    if utilisation.peak:
        logging.info("MFU against %.1f peak TFLOP/s per device (%s, %s compute)",
                     utilisation.peak, device_kind, layers.resolve_dtype(config.model.dtype))
    else:
        logging.info("no peak FLOP/s known for device kind %r: logging TFLOP/s per device "
                     "without MFU (config.train.peak_tflops_per_device sets one)", device_kind)

    dp = sharding.data_parallel_size(mesh)
    # The accuracy of always predicting the most frequent piece, logged with every eval.
    top_piece, unigram_accuracy = loader.unigram_baseline(data, tok.vocab_size)
    logging.info("unigram baseline: the most frequent piece %r is %.1f %% of training tokens",
                 tok.id_to_piece(top_piece), 100 * unigram_accuracy)
    eval_data = [
        sharding.global_batch_from_full(b[: len(b) - len(b) % dp], mesh)
        for b in loader.eval_batches(data, t.batch_size, t.eval_batches)
        if len(b) >= dp
    ]
    row_start, row_count = sharding.process_rows(mesh, t.batch_size)
    logging.info("process %d reads rows [%d, %d) of every global batch of %d (%s)",
                 jax.process_index(), row_start, row_start + row_count, t.batch_size,
                 f"the shards of {config.data.prepared}" if config.data.prepared
                 else "prepared in the job")
    batches = loader.train_batches(
        data,
        t.batch_size,
        config.seed,
        start_step=start,
        row_start=row_start,
        row_count=row_count,
        prefetch=config.data.prefetch,
    )

    try:
        metrics, _ = _train_loop(config, state, trainer, eval_data, batches, ckpt, writer,
                                 utilisation, start, unigram_accuracy, skipped, window)
        return metrics
    finally:
        # Pending asynchronous saves finish (or fail loudly) before the process ends.
        ckpt.close()
        writer.close()


def _train_loop(config, state, trainer: setup_lib.Trainer, eval_data, batches, ckpt, writer,
                utilisation, start, unigram_accuracy: float, skipped: int = 0,
                window: list[dict] | None = None) -> tuple[dict[str, float], Any]:
    """Steps from `start` to train.num_steps with logs, evals, checkpoints and the
    non-finite and preemption policies. Returns (the last eval's metrics, the state).
    `skipped` and `window`: the non-finite updates dropped before `start` and the step
    metrics since the last log line before it (both saved with each checkpoint).

    Between logging, eval and checkpoint steps nothing is read back from the device: the
    host dispatches step after step while the accelerator runs them. Step metrics pile up
    on the device and are fetched together at the next of those steps, which is also when
    the non-finite flags are checked (the step itself already dropped any non-finite
    update, so checking late loses nothing, and a checkpoint is never saved past an
    unchecked step).
    """
    t = config.train
    unchecked: list[tuple[int, dict]] = []  # (step, metrics on device) not yet fetched
    window = list(window or [])  # fetched metrics since the last log
    eval_metrics: dict[str, float] = {}
    with sharding.activate(trainer.mesh, trainer.rules), engine.Loop(start, ckpt) as loop:
        for step in range(start + 1, t.num_steps + 1):
            state, step_metrics = trainer.train_step(
                state, sharding.global_batch(next(batches), trainer.mesh))
            unchecked.append((step, step_metrics))
            last = step == t.num_steps
            log = step % t.log_every == 0 or last
            loop.after_step(step, state, closes_window=log)
            run_eval = step % t.eval_every == 0 or last
            preempted = loop.stop_requested(step)
            save = last or preempted or ckpt.due(step)
            if log or run_eval or save:
                fetched = jax.device_get([m for _, m in unchecked])
                skipped += engine.check_finite([s for s, _ in unchecked], fetched,
                                               t.nonfinite, ckpt)
                window += [{k: float(v) for k, v in m.items()} for m in fetched]
                unchecked = []
            if log:
                means = engine.window_means(window)
                means["perplexity"] = metrics_lib.perplexity(means["loss"])
                means["skipped_updates"] = skipped
                rates = _throughput(*loop.lap(step), step, t.batch_size * config.data.seq_len,
                                    t.num_steps)
                rates.update(utilisation.measure(rates["steps_per_sec"]))
                writer.write("train", step, {**means, **rates})
                window = []
            if run_eval:
                eval_metrics = evaluate(trainer.eval_step, state.params, eval_data, config.seed)
                eval_metrics["unigram_accuracy"] = unigram_accuracy
                writer.write("eval", step, eval_metrics)
            if save:
                ckpt.save(step, state, {"step": step, "data_position": step,
                                        "skipped_updates": skipped, "log_window": window},
                          force=True)
                writer.flush()  # a resumed run finds every metrics line up to its checkpoint
            if preempted:
                ckpt.wait()
                raise loop.stopped(step, str(ckpt.directory))
    ckpt.wait()
    return eval_metrics, state
