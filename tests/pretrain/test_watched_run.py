"""One tiny pretraining run with the tools a long run is watched and shaped with all on, beside
the same run with none: a profiled window (training/profiler.py), milestones
(checkpoint.Keep), the stack dump's file (infra/stacks.py) and metrics.jsonl alone as the
record (train.trackers=""), and the evaluations at the fixed mask ratio in both. The
losses are the plain run's: watching changes nothing."""

import logging
import math
import os
import signal
import time

import pytest

from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.training import checkpoint, profiler

from support import tiny_pretraining, train_metrics

pytestmark = pytest.mark.tier("integration")


def test_a_watched_run_trains_as_a_plain_one(tmp_path, tiny_tokenizer, caplog):
    plain = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=6, log_every=1,
                             eval_every=3, checkpoint_every=100)
    plain.masking.mask_ratio = 0.3  # its evaluations also score 15 %, train.eval_mask_ratio
    pretrain_train.train_and_evaluate(plain, str(tmp_path / "plain"))

    watched = plain.copy_and_resolve_references()
    watched.train.update(profile_steps="1,3", keep_checkpoints=1, keep_period=4,
                         keep_steps=(3,), trackers="")
    caplog.set_level(logging.INFO)
    run = tmp_path / "watched"
    pretrain_train.train_and_evaluate(watched, str(run))

    ours, theirs = train_metrics(run), train_metrics(tmp_path / "plain")
    assert sorted(ours) == sorted(theirs) == list(range(1, 7))
    for step in ours:
        assert ours[step]["loss"] == theirs[step]["loss"], step
    evals = train_metrics(run, "eval")
    assert sorted(evals) == [3, 6] and evals == train_metrics(tmp_path / "plain", "eval")
    for row in evals.values():
        assert row["fixed_loss"] != row["loss"] and 0 <= row["fixed_accuracy"] <= 1
        assert row["fixed_perplexity"] == pytest.approx(math.exp(row["fixed_loss"]))

    # The window: step 1 compiles, so the trace holds steps 2-3, in both formats.
    assert list((run / "profile").rglob("*.xplane.pb"))
    assert list((run / "profile").rglob("perfetto_trace.json.gz"))
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile of")]
    assert line.startswith(f"profile of steps 2-3 in {run / 'profile'} (open it with "
                           f"`tensorboard --logdir {run / 'profile'}`")
    assert "ms of ops a step; top: " in line
    assert profiler.op_seconds(run / "profile")

    # Milestones every 4 steps and at step 3 outlive the rotation that keeps one; the
    # first step's save (which shows the workdir can hold one) is rotated out.
    assert checkpoint.finished_steps(run / "checkpoints") == [3, 4, 6]
    assert not (run / "tensorboard").exists()
    # The stacks of this process on SIGUSR1: the file is there to be written.
    stacks_file = run / "stacks" / "process_0.txt"
    assert stacks_file.exists()
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 20
    while "Current thread" not in stacks_file.read_text():
        assert time.monotonic() < deadline, "no stacks written"
        time.sleep(0.05)
