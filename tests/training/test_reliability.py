"""Reliability: preemption, non-finite policies, half-written and failed checkpoints, and a
clear one-line error (with the workdir left untouched) for each kind of bad input."""

import builtins
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import sentencepiece as spm

from maelm_jax.infra import errors
from maelm_jax.pretrain import steps as pretrain_steps
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.training import checkpoint, engine, preemption, steps

from conftest import HANG_SECONDS, REPO_ROOT, poison_steps, preempt_main, subprocess_env
from support import (
    expect_user_error,
    plain_corpus,
    plain_documents,
    preempt_at,
    snapshot,
    tiny_pretraining,
    train_metrics,
)

pytestmark = pytest.mark.tier("integration")


@pytest.mark.parametrize("edit, match", [
    (lambda c: setattr(c.masking, "mask_ratio", 1.5),
     r"config.masking.mask_ratio: expected a number in \(0, 1\)"),
    (lambda c: setattr(c.masking, "mask_ratio", 0.01), "predicts k < 1"),
    (lambda c: setattr(c.masking, "mask_ratio", 0.99), "encoder length of 0"),
    (lambda c: setattr(c.model, "num_heads", 3), "config.model.d_model: expected a multiple of"),
    (lambda c: setattr(c.model.decoder, "d_model", 31), "config.model.decoder.d_model"),
    (lambda c: setattr(c.mesh, "shape", (3, 1, 1)),
     r"config.mesh.shape=\(3, 1, 1\) needs 3 devices"),
    (lambda c: (setattr(c.mesh, "shape", (8, 1, 1)), setattr(c.train, "batch_size", 12)),
     "batch_size=12 .* not divisible by the data-parallel size 8"),
    (lambda c: setattr(c.data.sources.main, "path", "/nonexistent/*.txt"),
     "config.data.sources.main.path|data.sources.main.path"),
    (lambda c: setattr(c.train, "nonfinite", "ignore"), "config.train.nonfinite"),
])
def test_bad_config_is_named_and_touches_nothing(tmp_path, tiny_tokenizer, edit, match):
    c = tiny_pretraining(tmp_path, tiny_tokenizer)
    edit(c)
    expect_user_error(c, tmp_path / "run", match)


def test_empty_and_unreadable_corpus_files(tmp_path, tiny_tokenizer, monkeypatch):
    c = tiny_pretraining(tmp_path, tiny_tokenizer)
    (tmp_path / "empty.txt").write_text("")
    c.data.sources.main.path = str(tmp_path / "empty.txt")
    expect_user_error(c, tmp_path / "run", "data.sources.main.path: .*empty")

    locked = tmp_path / "locked.txt"
    locked.write_text("text")
    real_open = builtins.open

    def deny(path, *args, **kwargs):  # as root, file permissions cannot make this case
        if str(path) == str(locked):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", deny)
    c.data.sources.main.path = str(locked)
    expect_user_error(c, tmp_path / "run", "cannot read .*locked.txt.*Permission denied")


def test_non_utf8_bytes_fail_or_are_replaced(tmp_path, tiny_tokenizer):
    c = tiny_pretraining(tmp_path, tiny_tokenizer)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(plain_documents(word="caf\xe9").encode("latin-1"))
    c.data.sources.main.path = str(bad)
    c.data.encoding_errors = "strict"
    expect_user_error(c, tmp_path / "run", "latin1.txt")
    c.data.encoding_errors = "replace"
    c.train.num_steps = 1
    pretrain_train.train_and_evaluate(c, str(tmp_path / "run"))
    assert (tmp_path / "run" / "checkpoints" / "1").exists()


def test_tokenizer_without_special_tokens_is_refused(tmp_path, tiny_tokenizer):
    corpus = plain_corpus(tmp_path)
    prefix = tmp_path / "plain"
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(prefix), vocab_size=40)
    c = tiny_pretraining(tmp_path, tiny_tokenizer)
    c.tokenizer.model_path = str(prefix) + ".model"
    expect_user_error(c, tmp_path / "run", "plain.model.*special token")


def test_workdir_of_another_run_is_refused_unless_allowed(tmp_path, tiny_tokenizer):
    run = tmp_path / "run"
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=2)
    pretrain_train.train_and_evaluate(c, str(run))
    changed = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=3)
    changed.model.d_ff = 128
    expect_user_error(changed, run, r"different config.model.d_ff; .*--allow_config_change")
    # Continuing with more steps is not a different run.
    pretrain_train.train_and_evaluate(tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=3),
                                      str(run))
    assert 3 in train_metrics(run)


@pytest.mark.slow
def test_cli_errors_are_one_line_without_traceback(tmp_path):
    base = [sys.executable, "main.py", "--config=tests/tiny_config.py",
            f"--workdir={tmp_path / 'w'}"]
    for extra, message in (
        (["--config.masking.mask_ration=0.2"], "mask_ration"),
        (["--config.masking.mask_ratio=2"], "config.masking.mask_ratio"),
    ):
        result = subprocess.run(base + extra, cwd=REPO_ROOT, env=subprocess_env(),
                                capture_output=True, text=True)
        assert result.returncode == 1
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    debug = subprocess.run(base + ["--config.masking.mask_ratio=2", "--debug"], cwd=REPO_ROOT,
                           env=subprocess_env(), capture_output=True, text=True)
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------- non-finite losses

def _poison_from(step_index, monkeypatch):
    """The real train step sees NaN parameters at the given 0-based steps."""
    poison_steps(monkeypatch, pretrain_steps, "make_train_step", step_index)


def test_nonfinite_stop_names_the_step_and_keeps_the_good_checkpoint(
        tmp_path, tiny_tokenizer, monkeypatch):
    _poison_from([4], monkeypatch)
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=8, checkpoint_every=2)
    with pytest.raises(engine.NonFiniteError, match="step 5: non-finite .* checkpoint is step 4"):
        pretrain_train.train_and_evaluate(c, str(tmp_path / "run"))
    assert checkpoint.Checkpointer(tmp_path / "run" / "checkpoints", 3).latest_step() == 4


def test_nonfinite_skip_drops_the_update_and_counts_it(tmp_path, tiny_tokenizer, monkeypatch):
    _poison_from([2, 3], monkeypatch)
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=6, nonfinite="skip")
    pretrain_train.train_and_evaluate(c, str(tmp_path / "run"))
    m = train_metrics(tmp_path / "run")
    assert m[6]["skipped_updates"] == 2
    assert [m[s]["nonfinite"] for s in range(1, 7)] == [0, 0, 1, 1, 0, 0]
    assert np.isfinite(m[6]["loss"])


def test_a_resumed_run_counts_on_from_its_checkpoint(tmp_path, tiny_tokenizer, monkeypatch,
                                                     caplog):
    """The skipped updates and the steps since the last log line before a stop are carried
    by its checkpoint: the resumed run logs what the uninterrupted run logs (here the line
    of step 6 averages steps 4-6, the stop being at step 4). The schedule is WSD with its
    decay over steps 4-6 (the rate after 3, 4 and 5 updates): the stop is mid-decay.

    The resumed run is also watched with every tool that changes nothing it computes: a
    profiled window (training/profiler.py), milestones (checkpoint.Keep), the stack dump's
    file (infra/stacks.py) and metrics.jsonl alone as the record (train.trackers=""); both
    evaluate at the fixed mask ratio too (train.eval_mask_ratio, 15 %, the run's being 30 %)."""
    from maelm_jax.training import profiler

    _poison_from([1, 2], monkeypatch)
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=6, nonfinite="skip", log_every=3,
                         lr_schedule="wsd", decay_fraction=0.5)
    c.masking.mask_ratio = 0.3
    pretrain_train.train_and_evaluate(c, str(tmp_path / "whole"))
    watched = c.copy_and_resolve_references()
    watched.train.update(profile_steps="2,2", keep_checkpoints=1, keep_period=3,
                         keep_steps=(2,), trackers="")
    caplog.set_level(logging.INFO)
    run = tmp_path / "resumed"
    preempt_at(monkeypatch, watched, run, 4)
    pretrain_train.train_and_evaluate(watched, str(run))
    whole, resumed = train_metrics(tmp_path / "whole"), train_metrics(run)
    assert sorted(whole) == sorted(resumed) == [3, 6]
    assert [resumed[s]["skipped_updates"] for s in (3, 6)] == [2, 2]
    for key in ("skipped_updates", "loss", "accuracy", "grad_norm", "learning_rate"):
        assert resumed[6][key] == pytest.approx(whole[6][key], rel=1e-6), key
    peak = c.train.learning_rate
    assert resumed[6]["learning_rate"] == pytest.approx(peak * (1 + 2 / 3 + 1 / 3) / 3)

    [evaluated] = train_metrics(run, "eval").values()
    assert evaluated == pytest.approx(train_metrics(tmp_path / "whole", "eval")[6], rel=1e-6)
    assert evaluated["fixed_loss"] != evaluated["loss"]
    assert evaluated["fixed_perplexity"] == pytest.approx(np.exp(evaluated["fixed_loss"]))
    # The window: steps 2-3, in both formats, summed in one line.
    assert list((run / "profile").rglob("*.xplane.pb"))
    assert profiler.op_seconds(run / "profile")
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile of")]
    assert line.startswith(f"profile of steps 2-3 in {run / 'profile'} (open it with "
                           f"`tensorboard --logdir {run / 'profile'}`")
    assert "ms of ops a step; top: " in line
    # Milestones at step 2 and every 3 steps outlive the rotation that keeps one (step 1's
    # save and step 4's, which the run resumed from, are rotated out).
    assert checkpoint.finished_steps(run / "checkpoints") == [2, 3, 6]
    assert not (run / "tensorboard").exists() and (tmp_path / "whole" / "tensorboard").exists()
    # This process's stacks on SIGUSR1.
    stacks_file = run / "stacks" / "process_0.txt"
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 20
    while "Current thread" not in stacks_file.read_text():
        assert time.monotonic() < deadline, "no stacks written"
        time.sleep(0.05)


class _Watched:
    """A step metric that records, at every read-back to the host, how many steps had been
    dispatched by then."""

    def __init__(self, value, reads, dispatched):
        self.value, self.reads, self.dispatched = value, reads, dispatched

    def _read(self):
        self.reads.append(len(self.dispatched))
        return np.asarray(jax.device_get(self.value))

    def copy_to_host_async(self):
        self.value.copy_to_host_async()

    def __array__(self, dtype=None, copy=None):
        return self._read() if dtype is None else self._read().astype(dtype)

    def __float__(self):
        return float(self._read())

    def __int__(self):
        return int(self._read())

    def __bool__(self):
        return bool(self._read())

    def item(self):
        return self._read().item()


def test_steps_between_logs_never_read_back_from_the_device(
        tmp_path, tiny_tokenizer, monkeypatch):
    """Between logging (and eval and checkpoint) steps the loop only dispatches: every read
    of a step's metrics, and every fetch of any device array, happens at such a step."""
    from jax._src import array as array_impl

    dispatched, reads = [], []
    real_step = steps.jit_train_step

    def watched(*args, **kwargs):
        train_step = real_step(*args, **kwargs)

        def step(state, tokens, *args):  # args: pretraining's schedule
            state, metrics = train_step(state, tokens, *args)
            dispatched.append(None)
            return state, {k: _Watched(v, reads, dispatched) for k, v in metrics.items()}

        return step

    monkeypatch.setattr(steps, "jit_train_step", watched)
    value = array_impl.ArrayImpl._value
    monkeypatch.setattr(array_impl.ArrayImpl, "_value", property(
        lambda self: (reads.append(len(dispatched)), value.fget(self))[1]))
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=8, log_every=4, eval_every=8,
                checkpoint_every=100, peak_tflops_per_device=0.5)
    pretrain_train.train_and_evaluate(c, str(tmp_path / "run"))
    assert len(dispatched) == 8
    # Orbax saves a fresh run's first step too (which also shows early that saving works).
    saved = {int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir()}
    assert saved == {1, 8}
    during = set(reads) - {0}  # 0: setup before the first step
    assert during <= {4, 8} | saved, f"read back from the device after steps {sorted(during)}"
    logged = train_metrics(tmp_path / "run")
    assert sorted(logged) == [4, 8]
    # Utilisation from the model's FLOPs and the window's steps/s, against the given peak.
    assert logged[8]["tflops_per_device"] > 0
    assert logged[8]["mfu"] == pytest.approx(logged[8]["tflops_per_device"] / 0.5)


def test_half_written_checkpoint_is_never_the_latest(tmp_path, tiny_tokenizer):
    run = tmp_path / "run"
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=4, checkpoint_every=2)
    pretrain_train.train_and_evaluate(c, str(run))
    # What a crash in the middle of saving step 6 leaves behind.
    partial = run / "checkpoints" / "6.orbax-checkpoint-tmp-1234567890"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\0" * 10)
    assert checkpoint.Checkpointer(run / "checkpoints", 3).latest_step() == 4
    c.train.num_steps = 6
    pretrain_train.train_and_evaluate(c, str(run))
    assert checkpoint.Checkpointer(run / "checkpoints", 3).latest_step() == 6


def test_failed_save_is_reported_and_the_previous_checkpoint_survives(
        tmp_path, tiny_tokenizer, monkeypatch):
    real_save = checkpoint.ocp.CheckpointManager.save

    def full_disk(self, step, *args, **kwargs):
        if step == 4:
            raise OSError(28, "No space left on device")
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", full_disk)
    run = tmp_path / "run"
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=6, checkpoint_every=2)
    with pytest.raises(checkpoint.CheckpointError,
                       match="step 4 .*No space left on device.*checkpoint of step 2 is intact"):
        pretrain_train.train_and_evaluate(c, str(run))
    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", real_save)
    pretrain_train.train_and_evaluate(c, str(run))  # resumes from step 2 and finishes
    assert min(s for s in train_metrics(run)) == 1 and 6 in train_metrics(run)


# ---------------------------------------------------------------- preemption

@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_the_same_command_finishes(tmp_path, tiny_tokenizer):
    """main.py as a scheduler runs it: SIGTERM saves the step the run is on and exits 143
    with no post-training work (no fill-mask examples); the same command continues and
    ends as the run that was never stopped. The workdir is named like a sweep's cell
    (brackets are refused: tests/test_workdirs.py), and the same
    command started while the run runs is refused: one run per workdir."""
    run = tmp_path / "sweep lr=3e-3,#1%"
    cmd = [sys.executable, "main.py", "--config=tests/tiny_config.py", f"--workdir={run}",
           f"--config.tokenizer.model_path={tiny_tokenizer.model_path}",
           "--config.train.num_steps=100", "--config.train.checkpoint_every=1000",
           "--config.train.eval_every=1000", "--config.train.fill_mask_examples=1"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=subprocess_env(1), stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + HANG_SECONDS
    while not ((run / "metrics.jsonl").exists() and len(train_metrics(run)) >= 5):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)  # paused, whatever the machine's speed: still running
    written = snapshot(run)
    second = subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(1), capture_output=True,
                            text=True, timeout=HANG_SECONDS)
    assert second.returncode == 1, second.stderr[-2000:]
    assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
    assert f"is in use by process {proc.pid} on {socket.gethostname()} since" in second.stderr
    assert snapshot(run) == written  # the second start wrote nothing
    proc.send_signal(signal.SIGCONT)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=HANG_SECONDS)
    assert proc.returncode == 143, stderr[-2000:]  # preempted: schedulers run it again
    assert "preempted: saved a checkpoint at step" in stderr
    assert "run the same command to continue" in stderr
    saved = checkpoint.Checkpointer(run / "checkpoints", 3).latest_step()
    assert 5 <= saved < 100
    assert not (run / "fill_mask.md").exists()  # no post-training work
    resumed = subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(1), capture_output=True,
                             text=True, check=True)
    assert f"resumed from checkpoint at step {saved}" in resumed.stderr
    assert (run / "fill_mask.md").exists()
    whole = tmp_path / "whole"
    subprocess.run([*cmd[:3], f"--workdir={whole}", *cmd[4:]], cwd=REPO_ROOT,
                   env=subprocess_env(1), capture_output=True, text=True, check=True)
    got, want = train_metrics(run, "eval")[100], train_metrics(whole, "eval")[100]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert train_metrics(run)[100]["loss"] == pytest.approx(train_metrics(whole)[100]["loss"],
                                                            rel=1e-6)
    assert (run / "fill_mask.md").read_text() == (whole / "fill_mask.md").read_text()
    # The finished run started again says so and trains nothing.
    metrics = (run / "metrics.jsonl").read_text()
    again = subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(1), capture_output=True,
                           text=True, check=True)
    assert "holds this run, finished at step 100: nothing trained" in again.stderr
    assert "resumed from checkpoint" not in again.stderr
    assert (run / "metrics.jsonl").read_text() == metrics


def test_a_first_ctrl_c_asks_for_a_stop_and_a_second_interrupts():
    """StopRequest on one process: the first SIGINT sets the request and gives Ctrl-C back
    to Python, so a second raises KeyboardInterrupt; both handlers are restored after the
    block, and an ignored SIGINT stays ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with preemption.StopRequest() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.received and stop.interrupted
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with preemption.StopRequest() as stop:
            signal.raise_signal(signal.SIGTERM)
            assert stop.received and not stop.interrupted
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with preemption.StopRequest() as stop:
            signal.raise_signal(signal.SIGINT)
            assert not stop.received
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_sigterm_outside_a_loop_raises_and_a_wrapped_interrupt_is_recognised():
    """Outside a training loop SIGTERM raises errors.Terminated in the main thread (the
    clean-ups of what is being written run, main.py says it in one line, status 143); a
    loop's StopRequest takes it over and gives it back. An interrupt a library wrapped
    (numpy's tofile turns one into a TypeError) is still found for main.py."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        preemption.raise_on_sigterm()
        with pytest.raises(errors.Terminated):
            signal.raise_signal(signal.SIGTERM)
        with preemption.StopRequest() as stop:
            signal.raise_signal(signal.SIGTERM)
            assert stop.received
        with pytest.raises(errors.Terminated):
            signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise TypeError("a library's own error") from None
    except TypeError as wrapped:
        assert isinstance(errors.interrupted(wrapped), KeyboardInterrupt)
    assert errors.interrupted(ValueError("x")) is None


def test_a_ctrl_c_during_garbage_collection_is_not_lost():
    """A SIGINT whose handler Python runs inside a gc callback (as while the built-in
    corpus is parsed: JAX registers one) would be printed and dropped; raise_on_ctrl_c
    raises it again in the main thread's own code."""
    sent = []

    def callback(phase, info):
        if phase == "start" and not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)  # handled at the callback's next bytecode

    before = signal.getsignal(signal.SIGINT)
    gc.callbacks.append(callback)
    try:
        preemption.raise_on_ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            gc.collect()
            time.sleep(5)  # interrupted within a moment, or lost
        assert sent
    finally:
        gc.callbacks.remove(callback)
        signal.signal(signal.SIGINT, before)


@pytest.mark.slow
def test_ctrl_c_saves_the_current_step_and_outside_the_loop_is_one_line(tmp_path,
                                                                      tiny_tokenizer):
    """main.py at a terminal: Ctrl-C during training saves the step the run is on and exits
    130 with the message a preemption gives; Ctrl-C anywhere else (before the loop, or a
    second one) is one line and status 130, SIGTERM there one line and 143, no
    traceback."""
    run = tmp_path / "run"
    cmd = [sys.executable, "main.py", "--config=tests/tiny_config.py", f"--workdir={run}",
           f"--config.tokenizer.model_path={tiny_tokenizer.model_path}",
           "--config.train.num_steps=1000", "--config.train.checkpoint_every=1000",
           "--config.train.eval_every=1000"]
    saved = preempt_main(cmd, run / "metrics.jsonl", signum=signal.SIGINT, cwd=REPO_ROOT)
    assert checkpoint.Checkpointer(run / "checkpoints", 3).latest_step() == saved
    assert 3 <= saved < 1000
    # Resumed with a save at every step (harmless), then Ctrl-C twice in quick succession:
    # the second lands in a step or, mostly, in a save being finalised by orbax's thread
    # (or, on a fast machine, after the stop's own save), and it is one line, status 130.
    lines = len((run / "metrics.jsonl").read_text().splitlines())
    twice = subprocess.Popen([*cmd, "--config.train.checkpoint_every=1"], cwd=REPO_ROOT,
                             env=subprocess_env(1), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG_SECONDS
    while len((run / "metrics.jsonl").read_text().splitlines()) < lines + 3:
        assert twice.poll() is None and time.monotonic() < deadline, "finished or hung"
        time.sleep(0.02)
    twice.send_signal(signal.SIGINT)
    time.sleep(0.02)
    twice.send_signal(signal.SIGINT)
    _, stderr = twice.communicate(timeout=HANG_SECONDS)
    assert twice.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted (Ctrl-C)") or "interrupted: saved a checkpoint" in last
    # Outside the loop: the mode itself interrupted, as a Ctrl-C during setup would be.
    script = ("import sys, main; from absl import app; from maelm_jax.infra import cli\n"
              "def ctrl_c(mode): raise KeyboardInterrupt\n"
              "main._run_mode = ctrl_c; sys.argv = sys.argv[1:]\n"
              "app.run(main.main, flags_parser=cli.parse_flags)")
    outside = subprocess.run([sys.executable, "-c", script, *cmd[1:]], cwd=REPO_ROOT,
                             env=subprocess_env(1), capture_output=True, text=True,
                             timeout=HANG_SECONDS)
    assert outside.returncode == 130, outside.stderr[-2000:]
    assert outside.stderr.strip().splitlines()[-1].startswith(
        "interrupted (Ctrl-C): the work since the last checkpoint is lost")
    assert "Traceback" not in outside.stderr
    # SIGTERM outside the loop (a scheduler's notice while a mode prepares or exports):
    # one line, status 143, and what was being written cleaned up on the way out.
    sigterm = script.replace("raise KeyboardInterrupt", "import os, signal, time; "
                             "os.kill(os.getpid(), signal.SIGTERM); time.sleep(60)")
    outside = subprocess.run([sys.executable, "-c", sigterm, *cmd[1:]], cwd=REPO_ROOT,
                             env=subprocess_env(1), capture_output=True, text=True,
                             timeout=HANG_SECONDS)
    assert outside.returncode == 143, outside.stderr[-2000:]
    assert outside.stderr.strip().splitlines()[-1].startswith("terminated (SIGTERM)")
    assert "Traceback" not in outside.stderr


def test_finetuning_from_the_wrong_kind_of_checkpoint_touches_nothing(tmp_path):
    from configs.finetune import glue as glue_config
    from maelm_jax.finetune import train as finetune_train

    not_a_run = tmp_path / "not_a_run"
    not_a_run.mkdir()
    (not_a_run / "notes.txt").write_text("no checkpoint here")
    c = glue_config.get_config("sst2")
    c.init_from = str(not_a_run)
    c.data.data_dir = str(tmp_path)
    workdir = tmp_path / "ft"
    with pytest.raises(errors.UserError, match="config.init_from: .* neither a workdir"):
        finetune_train.run(c, str(workdir))
    assert not workdir.exists()
    # Nor a pretraining workdir: fine-tuning refuses to write into one.
    run = tmp_path / "pre"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"mode": "pretrain"}))
    before = snapshot(run)
    with pytest.raises(errors.UserError, match="holds a pretrain"):
        finetune_train.run(c, str(run))
    assert snapshot(run) == before
