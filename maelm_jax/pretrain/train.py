"""Pretraining, top to bottom: `train_and_evaluate(config, workdir)`.

config -> the workdir's decision (training/lifecycle.py) -> tokenizer -> prepared blocks ->
model and optimiser -> a time budget's plan (time_budget.py) -> the session: config.json,
the latest checkpoint restored if any -> steps with periodic logs, evals and checkpoints.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import jax
import ml_collections
import numpy as np
from absl import logging

from maelm_jax.data import loader, run_data, shards
from maelm_jax.infra import distributed, errors, paths, sharding
from maelm_jax.models import layers
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import continued, evaluation, mfu, time_budget
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.training import budget as budget_lib
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.training import engine, lifecycle, profiler
from maelm_jax.training import metrics as metrics_lib
from maelm_jax.workdirs import guard as workdir_lib
from maelm_jax.workdirs import layout


def _throughput(steps: int, seconds: float, step: int, tokens_per_step: int,
                num_steps: int) -> dict[str, float]:
    """Steps/s, tokens/s and ETA of a logging window of `steps` steps up to `step`."""
    rate = steps / seconds
    return {
        "steps_per_sec": rate,
        "tokens_per_sec": rate * tokens_per_step,
        "eta_minutes": (num_steps - step) / max(rate, 1e-9) / 60,
    }


# Pretraining's lifecycle (training/lifecycle.py). A finished run is found by its
# checkpoints: one at train.num_steps or later (a run given more steps continues).
PRETRAINING = lifecycle.Policy(
    mode="pretrain", noun="pretraining", defaults=pretrain_config.pretrain_defaults,
    resolve_paths=pretrain_config.resolve_paths,
    # What changes how the run proceeds, not what its checkpoints mean: steps, logging and
    # checkpoint cadence, the mesh (checkpoints restore onto any), the kernel, the layout.
    # A budgeted run keeps its plan (plan.json) whatever budget it is resumed with.
    harmless=(
        "train.num_steps", "train.time_budget_minutes", "train.time_budget_margin",
        "train.log_every", "train.eval_every", "train.eval_batches", "train.eval_mask_ratio",
        "train.checkpoint_every", "train.resume_saves", "train.keep_checkpoints",
        "train.keep_period", "train.keep_steps", "train.trackers", "train.profile_steps",
        "train.profile_all_processes",
        "train.nonfinite", "train.peak_tflops_per_device", "data.prefetch",
        "data.prepared_cache_gb", "data.cache_dir", "data.encoding_errors", "mesh",
        "sharding_rules", "model.dtype", "model.attention_impl", "model.pallas",
        "model.scan_layers",  # the checkpoint converts between the layouts on restore
        "model.remat_policy"),
    finished=lambda workdir, config: any(
        step >= _last_step(workdir, config)
        for step in checkpoint_lib.finished_steps(workdir / layout.CHECKPOINTS)),
    override=lifecycle.Decision.CONTINUE, override_words="continue it with the new config")


def _last_step(workdir: paths.Path, config: ml_collections.ConfigDict) -> int:
    """The step the run in `workdir` ends at: its time budget's plan's, else num_steps."""
    plan = budget_lib.read(workdir)
    return plan.end if plan else config.train.num_steps


def _plan_cap(workdir: paths.Path, plan: budget_lib.Plan,
              train: ml_collections.ConfigDict) -> int:
    """The train.num_steps `plan` was made under: its own record, or for a plan of an
    earlier version the one config.json recorded (read before this session rewrites it)."""
    if plan.cap is not None:
        return plan.cap
    recorded = (layout.recorded_config(workdir) or {}).get("train") or {}
    cap = recorded.get("num_steps")
    return cap if isinstance(cap, int) and cap > 0 else train.num_steps


def _tokenizer_and_blocks(config: ml_collections.ConfigDict, workdir: paths.Path):
    """Tokenizer and packed data. Process 0 builds them in the shared workdir while the
    others wait, then everyone loads the same files. A failure leaves the workdir as it
    was. (config.json is written when the session opens, lifecycle.session.)"""
    if config.data.prepared:  # shards of mode "prepare": every process reads its own blocks
        shards.check_run(config)  # they fit this run and are whole, before anything is written
        with distributed.as_one("tokenizer"):
            if jax.process_index() == 0:
                with workdir_lib.all_or_nothing(workdir):
                    paths.make_dirs(workdir)
                    run_data.shards_tokenizer(config, workdir)
        tok = run_data.shards_tokenizer(config, workdir)
        return tok, shards.load(config.data.prepared, run_data.source_weights(config),
                                cache_bytes=int(config.data.prepared_cache_gb * 2**30))
    with distributed.as_one("prepared data"):
        if jax.process_index() == 0:
            with workdir_lib.all_or_nothing(workdir):
                paths.make_dirs(workdir)
                tok = run_data.setup_tokenizer(config, workdir)
                data = run_data.build_blocks(config, workdir, tok)
    if jax.process_index() != 0:
        tok = run_data.setup_tokenizer(config, workdir)
        data = run_data.build_blocks(config, workdir, tok)
    return tok, data


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       allow_config_change: bool = False,
                       started: float | None = None) -> dict[str, float]:
    """Pretrains per `config` in `workdir`, resuming from its latest checkpoint.
    `started`: the budget_lib.clock() a time budget counts from (main.py: the process's
    start; default: now).

    Returns the last evaluation's metrics. A run found finished (a checkpoint at
    train.num_steps, or at its time budget's planned end) is not started again: its last
    evaluation is returned, nothing read but its record. A stop request (SIGTERM, the
    preemption sync point, the time limit) saves a checkpoint and raises
    preemption.Preempted (TimeLimit).
    """
    started = budget_lib.clock() if started is None else started
    pretrain_config.validate(config)
    trackers = metrics_lib.check_trackers(config.train.trackers)  # installed, before anything
    # Every path absolute, once: relative ones mean the current directory (orbax and
    # resumed runs started elsewhere would otherwise read other files).
    config = pretrain_config.resolve_paths(config)
    workdir = paths.resolve(workdir, "--workdir")
    workdir_lib.check_directory(workdir)
    decision = lifecycle.decided(PRETRAINING, config, workdir, allow_config_change)
    if decision is lifecycle.Decision.FINISHED:
        evals = metrics_lib.read(workdir, "eval")
        logging.info("%s holds this run, finished at step %d: nothing trained (%s)", workdir,
                     max(checkpoint_lib.finished_steps(workdir / layout.CHECKPOINTS)),
                     "the steps its time budget planned" if budget_lib.read(workdir) else
                     "give more train.num_steps to continue it")
        return {k: v for k, v in (evals[-1] if evals else {}).items()
                if k not in ("step", "split")}
    t = config.train
    budgeted = bool(t.time_budget_minutes) or (workdir / layout.PLAN_FILE).exists()
    # A budget too small for the run is found after the data is prepared: the workdir is
    # then left as it was found.
    before = workdir_lib.snapshot(workdir)
    data_before = workdir_lib.snapshot(workdir / layout.DATA_DIR)
    mesh = sharding.make_mesh(config.mesh.shape, dcn_shape=config.mesh.dcn_shape)
    sharding.check_batch(mesh, t.batch_size, t.grad_accum_steps)
    rules = sharding.rules_from_config(config.sharding_rules)
    # The model a continued run starts from, read before any data is prepared.
    source = continued.read_source(config, workdir)
    if not config.data.prepared:  # else the corpus need not be on this machine at all
        run_data.validate_sources(config)
    tok, data = _tokenizer_and_blocks(config, workdir)
    data_record = run_data.data_record(data)
    with distributed.as_one("data of the run"):
        if distributed.is_leader():
            try:  # a resumed run must train on the data its checkpoints were trained on
                run_data.check_resumed_data(
                    workdir, data_record,
                    bool(checkpoint_lib.finished_steps(workdir / layout.CHECKPOINTS)),
                    allow_config_change)
            except errors.UserError:
                workdir_lib.restore(workdir / layout.DATA_DIR, data_before)
                workdir_lib.restore(workdir, before)
                raise
    logging.info("mesh %s over %d devices in %d processes", dict(mesh.shape), mesh.size,
                 jax.process_count())

    dp = sharding.data_parallel_size(mesh)
    eval_data = [
        sharding.global_batch_from_full(b[: len(b) - len(b) % dp], mesh)
        for b in loader.eval_batches(data, t.batch_size, t.eval_batches)
        if len(b) >= dp
    ]
    if not eval_data:  # refused now, not at the first evaluation; the workdir as it was
        if distributed.is_leader():
            workdir_lib.restore(workdir, before)
        raise errors.UserError(
            f"config.data.validation_fraction: the validation split holds fewer blocks than "
            f"the {dp} data-parallel devices each need one of; raise it, or add text")
    program = setup_lib.build(config, tok.vocab_size, mesh, rules, tok.special)
    fresh = not checkpoint_lib.finished_steps(workdir / layout.CHECKPOINTS)
    init, offset, loaded = program.init, continued.data_offset(config, source, workdir), None
    if source is not None and fresh:  # a resumed run's checkpoints hold what was loaded
        try:
            loaded = continued.load(source, program.state.abstract.params,
                                    config.model.scan_layers)
        except errors.UserError:
            if distributed.is_leader():
                workdir_lib.restore(workdir, before)
            raise
        logging.info("%s: %s", continued.FIELD, loaded.summary(source))
        init = lambda: continued.initial_state(program.init(), loaded)  # noqa: E731
    # The config the run trains with: the given one, or with a time budget, scaled to its
    # plan (config.json records the given one; plan.json the plan).
    run_config, plan, planned_now = config, None, False
    spans = sharding.process_spans(mesh, t.batch_size)

    def batches(start_step: int = 0) -> Iterator[np.ndarray]:
        # A continued run reading on where its source stopped skips the source's batches.
        return loader.train_batches(data, t.batch_size, config.seed,
                                    start_step=start_step + offset,
                                    spans=spans, prefetch=config.data.prefetch)

    if budgeted:
        try:
            plan, planned_now = time_budget.plan_run(
                config, workdir, program, mesh, batches, eval_data, tok.vocab_size, started,
                resumed=bool(checkpoint_lib.finished_steps(workdir / layout.CHECKPOINTS)))
        except budget_lib.BudgetError:
            if distributed.is_leader():
                workdir_lib.restore(workdir, before)
            raise
        run_config = config.copy_and_resolve_references()
        # The warmup's share is of the cap the plan was made under, whatever this command's.
        budget_lib.scale_schedule(run_config.train, plan.steps, _plan_cap(workdir, plan, t))
        program = program.with_steps(run_config)
    utilisation = mfu.Utilisation(program, mesh.size, jax.devices()[0].device_kind)
    # The accuracy of always predicting the most frequent piece, logged with every eval.
    top_piece, unigram_accuracy = loader.unigram_baseline(data, tok.vocab_size)
    _log_run(config, program, utilisation, spans)
    logging.info("unigram baseline: the most frequent piece %r is %.1f %% of training tokens",
                 tok.id_to_piece(top_piece), 100 * unigram_accuracy)

    # A plan made now is recorded with the config; a plan read back is there already.
    records = [lambda: time_budget.record(workdir, plan)] if planned_now else []
    records.append(lambda: paths.write_text(workdir / layout.DATA_RECORD_FILE,
                                            json.dumps(data_record, indent=2)))
    if loaded is not None:  # where the run started from, written once, with its config
        records.append(lambda: paths.write_text(workdir / layout.INIT_FROM_FILE, json.dumps(
            loaded.record(source, offset), indent=2)))
    # Its checkpoints are the run's: it continues from the latest, whatever the decision
    # (a changed config allowed continues too: PRETRAINING.override).
    keep = checkpoint_lib.Keep(t.keep_checkpoints, t.keep_period, tuple(t.keep_steps))
    tracked = ({"config": config.to_dict(),
                "data_fingerprint": run_data.data_fingerprint(config, tok)}
               if set(trackers) - {"tensorboard"} else None)  # what W&B is told
    with lifecycle.session(workdir, config, program.state.abstract, init, keep,
                           resume=True, records=records, trackers=trackers,
                           tracked=tracked) as session:
        replanner = None
        if plan is not None:
            replanner = budget_lib.Replanner(
                plan, program.schedule_values, session.start, started, run_config.train,
                cap=t.num_steps, replans=planned_now,
                record=lambda plan: time_budget.record(workdir, plan))
        run = Pretraining(run_config, program, eval_data, utilisation, unigram_accuracy,
                          resumed=session.start > 0, replanner=replanner)
        window = profiler.Window(workdir, t.profile_steps, session.start + 1,
                                 t.profile_all_processes or jax.process_index() == 0)
        with sharding.activate(program.mesh, program.rules):
            _, progress, _ = engine.train(run, session.state, session.start,
                                          batches(session.start), session.ckpt,
                                          session.writer, session.progress, profile=window)
    _report(run_config, utilisation, session.start, run.num_steps,
            budget_lib.clock() - started, plan if replanner is None else replanner.plan)
    last = progress.evals[-1] if progress.evals else {}
    return {k: v for k, v in last.items() if k != "step"}


def _log_run(config: ml_collections.ConfigDict, program: setup_lib.Program,
             utilisation: mfu.Utilisation, spans) -> None:
    """What the run is, in the log before it starts: the model, its masking, MFU's peak
    and the rows this process reads."""
    logging.info("%s model: %.2fM parameters", config.objective, program.num_params / 1e6)
    counts = program.counts
    logging.info("masking: k=%d predicted (%d [MASK], %d random, %d unchanged), encoder "
                 "length %d of %d", counts.k, counts.k_mask, counts.k_random, counts.k_keep,
                 counts.n_enc, counts.seq_len)
    device_kind = jax.devices()[0].device_kind
    if utilisation.peak:
        logging.info("MFU against %.1f peak TFLOP/s per device (%s, %s compute)",
                     utilisation.peak, device_kind, layers.resolve_dtype(config.model.dtype))
    else:
        logging.info("no peak FLOP/s known for device kind %r: logging TFLOP/s per device "
                     "without MFU (config.train.peak_tflops_per_device sets one)", device_kind)
    # The batch size and seed are the given config's (a plan changes neither).
    logging.info("process %d reads rows %s of every global batch of %d (%s)",
                 jax.process_index(), sharding.describe_spans(spans),
                 config.train.batch_size, f"the shards of {config.data.prepared}"
                 if config.data.prepared else "prepared in the job")


def _report(config: ml_collections.ConfigDict, utilisation: mfu.Utilisation, start: int,
            end: int, seconds: float, plan: budget_lib.Plan | None) -> None:
    """The run's account at its end: steps, tokens and FLOPs of this process's session
    (steps `start` + 1 to `end`), its wall time (against the plan's, with a budget) and
    MFU where the peak is known."""
    t = config.train
    steps = end - start
    flops = steps * utilisation.flops_per_step
    line = (f"trained steps {start + 1}-{end} in {seconds:.0f} s: "
            f"{steps * t.batch_size * config.data.seq_len / 1e6:.1f}M tokens, {flops:.3g} "
            f"FLOPs")
    if utilisation.peak:
        line += f", MFU {flops / seconds / utilisation.num_devices / 1e12 / utilisation.peak:.1%}"
    if plan is not None and start == 0:
        predicted = (plan.revisions[-1] if plan.revisions else plan).predicted_seconds
        line += (f"; the plan predicted {predicted:.0f} s of a {plan.budget_seconds:.0f} s "
                 "budget")
    logging.info("%s", line)


class Pretraining:
    """What pretraining supplies to the shared loop (engine.Run): its train step on token
    blocks, the cadence of config.train, the masked-LM evaluation, throughput and MFU in
    the log lines, and checkpoints of the whole train state at the data position."""

    eval_split = "eval"
    keeps_best = False  # the checkpoints are what a pretraining run keeps

    def __init__(self, config: ml_collections.ConfigDict, program: setup_lib.Program,
                 eval_data: list[jax.Array], utilisation: mfu.Utilisation,
                 unigram_accuracy: float, resumed: bool,
                 replanner: budget_lib.Replanner | None = None):
        """`replanner`: a time budget's plan as it goes (its end and schedule in force at
        the step the run resumes after)."""
        self.saved = resumed  # whether the workdir holds a checkpoint of this run
        self.t, self.seq_len, self.seed = config.train, config.data.seq_len, config.seed
        self.num_steps, self.nonfinite = self.t.num_steps, self.t.nonfinite
        self.program, self.eval_data = program, eval_data
        self.utilisation, self.unigram_accuracy = utilisation, unigram_accuracy
        self.replanner = replanner
        self.keep = checkpoint_lib.Keep(self.t.keep_checkpoints, self.t.keep_period,
                                        tuple(self.t.keep_steps))
        if replanner is not None:
            self.num_steps = replanner.end
            self.program = program.with_schedule(replanner.schedule)

    def train_step(self, state, tokens: np.ndarray):
        return self.program.train_step(state, sharding.global_batch(tokens, self.program.mesh))

    def log_due(self, step: int) -> bool:
        return step % self.t.log_every == 0

    def eval_due(self, step: int) -> bool:
        return step % self.t.eval_every == 0

    def after_log(self, step: int) -> None:
        """A time budget's re-plan from the loop's own rate, or one recorded at `step`:
        the run ends at its step, with the learning rate's decay aimed at it."""
        if self.replanner is None:
            return
        was = self.num_steps
        revision = self.replanner.at_log(step)
        if revision is None:
            return
        self.num_steps = self.replanner.end
        self.program = self.program.with_schedule(self.replanner.schedule)
        logging.info("time budget: at step %d the loop ran %.1f ms a step (%.1f measured "
                     "before it): the run ends at step %d (was %d), predicted %.0f s after the "
                     "start", step, revision.step_seconds * 1e3,
                     self.replanner.plan.costs.step * 1e3, revision.steps, was,
                     revision.predicted_seconds)

    def checkpoint_due(self, step: int) -> bool:
        # Also a fresh run's first step: a workdir where checkpoints cannot be written
        # shows at once, not checkpoint_every steps into the run.
        return (not self.saved or step == self.num_steps
                or step % self.t.checkpoint_every == 0 or self.keep.milestone(step))

    def log_line(self, step, means, steps, seconds):
        rates = _throughput(steps, seconds, step, self.t.batch_size * self.seq_len,
                            self.num_steps)
        rates.update(self.utilisation.measure(rates["steps_per_sec"]))
        return {**means, "perplexity": metrics_lib.perplexity(means["loss"]), **rates}

    def evaluate(self, state, step: int) -> dict[str, float]:
        with self._paused(evaluation=True):
            scores = evaluation.evaluate_program(self.program, state.params, self.eval_data,
                                                 self.seed)
        return {**scores, "unigram_accuracy": self.unigram_accuracy}

    @contextlib.contextmanager
    def _paused(self, evaluation: bool) -> Iterator[None]:
        """Time outside the steps, told to the time budget's re-planner."""
        begun = budget_lib.clock()
        yield
        if self.replanner is not None:
            self.replanner.paused(budget_lib.clock() - begun, evaluation)

    def better(self, scores, best) -> bool:
        return scores["loss"] < best["loss"]

    def save(self, ckpt, step, state, progress, best_params) -> None:
        with self._paused(evaluation=False):
            ckpt.save(step, state, {**progress.meta(step, 0.0), "data_position": step})
        self.saved = True
