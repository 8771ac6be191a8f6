"""Sharding over a mesh of 8 CPU devices: same losses, the rules' placements, restoring
across mesh shapes, mixed precision, and a two-process run through jax.distributed."""

import json
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maelm_jax.infra import sharding
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.text import tokenizer
from maelm_jax.training import checkpoint

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env
from support import free_port, log_tail
from tiny_config import TINY_VOCAB, tiny_config

pytestmark = [pytest.mark.tier("integration"),
              pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")]


def shardable_config(**model):
    """Every sharded dimension divisible by 8, so any 8-device mesh shape works."""
    c = tiny_config("maelm")
    c.model.d_model, c.model.num_heads, c.model.d_ff = 64, 8, 128
    c.model.decoder.d_model, c.model.decoder.num_heads, c.model.decoder.d_ff = 64, 8, 128
    for key, value in model.items():
        c.model[key] = value
    return c


def run_steps(c, mesh, n=3, state=None, skip=0):
    """n train steps on `mesh` (after skipping `skip` batches of the fixed stream)."""
    program = setup_lib.build(c, TINY_VOCAB, mesh, sharding.DEFAULT_RULES)
    state = program.init() if state is None else state
    rng = np.random.default_rng(0)
    losses = []
    with sharding.activate(mesh, sharding.DEFAULT_RULES):
        for i in range(skip + n):
            rows = rng.integers(tokenizer.NUM_SPECIAL, TINY_VOCAB, (c.train.batch_size, 32))
            if i < skip:
                continue
            state, metrics = program.train_step(
                state, sharding.global_batch(rows.astype(np.int32), mesh))
            losses.append(float(metrics["loss"]))
    return losses, state, program.state


def single_device_mesh():
    return sharding.make_mesh((1, 1, 1), jax.devices()[:1])


def test_mesh_shape_is_validated():
    assert sharding.resolve_shape((-1, 2, 1), 8) == (4, 2, 1)
    with pytest.raises(sharding.MeshError, match=r"config.mesh.shape=\(3, 1, 1\) needs 3 devices"):
        sharding.resolve_shape((3, 1, 1), 8)
    with pytest.raises(sharding.MeshError, match="not divisible by 3"):
        sharding.resolve_shape((-1, 3, 1), 8)
    with pytest.raises(sharding.MeshError, match="at most one -1"):
        sharding.resolve_shape((-1, -1, 1), 8)
    # A DCN layout without TPU slices spans processes; this job has one.
    with pytest.raises(sharding.MeshError, match=r"config.mesh.dcn_shape=\(2, 1, 1\) needs 2 "
                                                 "processes, but 1 are available"):
        sharding.make_mesh((-1, 1, 1), dcn_shape=(2, 1, 1))
    mesh = sharding.make_mesh((2, 2, 2))
    with pytest.raises(sharding.MeshError, match="batch_size=6 .* data-parallel size 4"):
        sharding.check_batch(mesh, 6, 1)
    with pytest.raises(sharding.MeshError, match="grad_accum_steps=4"):
        sharding.check_batch(mesh, 8, 4)


@pytest.fixture(scope="module")
def single_device_losses():
    losses, _, _ = run_steps(shardable_config(), single_device_mesh())
    assert losses[2] != losses[0]
    return losses


@pytest.mark.parametrize("shape", [(2, 2, 2), (8, 1, 1), (1, 1, 8)])
def test_losses_match_single_device(shape, single_device_losses):
    losses, _, _ = run_steps(shardable_config(), sharding.make_mesh(shape))
    np.testing.assert_allclose(losses, single_device_losses, rtol=2e-5)


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_cheaper_prng_is_mesh_independent_and_resumes_exactly(impl, tmp_path):
    """Masks and dropout drawn with the rbg kinds: the same losses on one device and on a
    mesh, and a run restored from a checkpoint goes on as if never stopped."""
    c = shardable_config(dropout=0.1, attention_dropout=0.1)
    c.train.prng_impl = impl
    one, _, _ = run_steps(c, single_device_mesh())
    mesh = sharding.make_mesh((2, 2, 2))
    first, state, setup = run_steps(c, mesh, n=2)
    np.testing.assert_allclose(first, one[:2], rtol=2e-5)
    assert state.rng.shape == (4,)  # rbg key data, saved with the state
    ckpt = checkpoint.Checkpointer(tmp_path, keep=1)
    ckpt.save(2, state, {"step": 2, "data_position": 2})
    ckpt.wait()
    restored, _ = ckpt.restore(2, setup.abstract)
    ckpt.close()
    last, _, _ = run_steps(c, mesh, n=1, state=restored, skip=2)
    np.testing.assert_allclose(last, one[2:], rtol=2e-5)


def test_parameter_and_optimizer_shardings_follow_the_rules():
    c = shardable_config()
    _, state, setup = run_steps(c, sharding.make_mesh((2, 2, 2)), n=1)
    attn = state.params["encoder"]["stack"]["layer_0"]["attention"]
    assert attn["query_kernel"].sharding.spec == P("fsdp", "tensor", None)
    assert attn["query_kernel"].addressable_shards[0].data.shape == (32, 4, 8)
    assert attn["out_kernel"].sharding.spec == P("tensor", None, "fsdp")
    mlp = state.params["encoder"]["stack"]["layer_0"]["mlp"]
    assert mlp["wi"]["kernel"].sharding.spec == P("fsdp", "tensor")
    words = state.params["encoder"]["word_embeddings"]["embedding"]
    assert words.sharding.spec == P("tensor", "fsdp")
    assert words.addressable_shards[0].data.shape == (TINY_VOCAB // 2, 32)
    # Adam's moments are sharded like their parameters; the step is replicated.
    mu = state.opt_state[1][0].mu["encoder"]["word_embeddings"]["embedding"]
    assert mu.sharding.spec == P("tensor", "fsdp")
    assert state.step.sharding.spec == P()


def test_finetuning_state_shards_like_pretraining():
    """Fine-tuning's optimiser moments take their parameters' shardings through the same
    rule as pretraining's (sharding.optimizer_specs)."""
    from maelm_jax.finetune import heads
    from maelm_jax.finetune import setup as finetune_setup
    from maelm_jax.models import encoder as encoder_lib
    from maelm_jax.training import optimizer

    c = shardable_config()
    arch = {"num_layers": 1, "d_model": 64, "num_heads": 8, "d_ff": 128, "pre_ln": False,
            "vocab_size": TINY_VOCAB, "max_positions": 32, "rel_pos_buckets": 8,
            "rel_pos_max_distance": 16}
    model = heads.SequenceClassifier(encoder_lib.from_architecture(arch), num_outputs=2)
    tx = optimizer.make_optimizer(c.train)
    mesh = sharding.make_mesh((2, 2, 2))
    setup = finetune_setup.state_setup(model, tx, 0, 16, mesh, sharding.DEFAULT_RULES)
    words = ("encoder", "word_embeddings", "embedding")
    param = setup.shardings.params
    for key in words:
        param = param[key]
    assert param.spec == P("tensor", "fsdp")
    moments = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
        setup.shardings.opt_state) if tuple(getattr(k, "key", None) for k in path[-3:]) == words]
    assert len(moments) == 2 and all(m == param for m in moments)  # Adam's mu and nu
    state = setup.init(None)
    assert jax.tree.map(lambda x: x.sharding, state) == setup.shardings


def test_checkpoint_restores_across_meshes(tmp_path):
    c = shardable_config()
    saved_losses, state, _ = run_steps(c, sharding.make_mesh((8, 1, 1)), n=2)
    ckpt = checkpoint.Checkpointer(tmp_path, keep=2)
    ckpt.save(2, state, {"step": 2, "data_position": 2})
    ckpt.wait()
    expected = jax.device_get(state.params)
    for shape, devices in (((2, 2, 2), None), ((1, 1, 1), jax.devices()[:1])):
        mesh = sharding.make_mesh(shape, devices)
        _, _, setup = run_steps(c, mesh, n=0)
        restored, meta = ckpt.restore(2, setup.abstract)
        assert meta["data_position"] == 2 and int(restored.step) == 2
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), expected)
        word = restored.params["encoder"]["word_embeddings"]["embedding"]
        assert word.sharding == setup.shardings.params["encoder"]["word_embeddings"]["embedding"]
        if shape == (2, 2, 2):  # training goes on from the restored state on the new mesh
            more, _, _ = run_steps(c, mesh, n=1, state=restored)
            assert np.isfinite(more[0])
    ckpt.close()


def test_bfloat16_compute_keeps_float32_parameters(single_device_losses):
    c = shardable_config(dtype="bfloat16")
    losses, state, _ = run_steps(c, sharding.make_mesh((2, 2, 2)))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert moments and all(x.dtype == np.float32 for x in moments)
    np.testing.assert_allclose(losses, single_device_losses, rtol=2e-2)
    assert not np.allclose(losses, single_device_losses, rtol=1e-6)  # bf16 really ran



def _train_losses(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["split"] == "train"}


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, tiny_tokenizer):
    """Two processes on localhost (4 CPU devices each) form one 8-device mesh through
    jax.distributed, each a (2, 2, 1) block laid along the data axis as slices are
    (mesh.dcn_shape, hosts as the granules); the losses equal a single 8-device process's
    on (4, 2, 1)."""
    common = [
        sys.executable, "main.py", "--config=tests/tiny_config.py",
        f"--config.tokenizer.model_path={tiny_tokenizer.model_path}",
        "--config.train.num_steps=2",
    ]
    single = tmp_path / "single"
    subprocess.run(common + [f"--workdir={single}", "--config.mesh.shape=(4,2,1)"],
                   cwd=REPO_ROOT, check=True,
                   capture_output=True, env=subprocess_env(8))

    multi = tmp_path / "multi"
    port = free_port()
    procs = [
        subprocess.Popen(
            common + [f"--workdir={multi}", f"--coordinator_address=127.0.0.1:{port}",
                      "--num_processes=2", f"--process_id={i}", "--config.mesh.shape=(2,2,1)",
                      "--config.mesh.dcn_shape=(2,1,1)"],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=subprocess_env(4),
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=HANG_SECONDS)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=False):
        assert p.returncode == 0, log_tail(out)
    assert "process 1 of 2" in outputs[1]
    expected = _train_losses(single)
    got = _train_losses(multi)
    assert sorted(got) == [1, 2]
    np.testing.assert_allclose([got[s] for s in (1, 2)], [expected[s] for s in (1, 2)],
                               rtol=2e-5)
    assert (multi / "checkpoints" / "2").exists()


# Each process's 4 CPU devices interleaved with the other's in the mesh, as a TPU mesh
# orders devices for its links rather than by process: every process then holds
# non-contiguous rows of the batch. One process of 8 devices lays them out the same way
# (devices 0-3 standing for process 0's). Prints the spans and the losses of 3 steps.
_INTERLEAVED = """
import json, sys
import jax, numpy as np
sys.path.insert(0, "tests")
from maelm_jax.infra import distributed, sharding
from maelm_jax.data import loader, shards
from maelm_jax.pretrain import setup as setup_lib
from tiny_config import TINY_VOCAB, tiny_config
processes, pid, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if processes > 1:
    distributed.initialize(f"127.0.0.1:{port}", processes, pid)
devices = sorted(jax.devices(), key=lambda d: d.id)
owner = [d.process_index for d in devices] if processes > 1 else [i // 4 for i in range(8)]
groups = [[d for d, o in zip(devices, owner) if o == p] for p in range(2)]
order = [d for pair in zip(*groups) for d in pair]
mesh = sharding.make_mesh((4, 2, 1), order)
c = tiny_config("maelm")
c.model.d_model, c.model.num_heads, c.model.d_ff = 64, 8, 128
c.model.decoder.d_model, c.model.decoder.num_heads, c.model.decoder.d_ff = 64, 8, 128
c.train.batch_size = 16
rng = np.random.default_rng(0)
data = shards.PreparedData(None, 32, {"a": rng.integers(5, TINY_VOCAB, (64, 32))}, {},
                            {"a": 1.0})
spans = sharding.process_spans(mesh, 16)
batches = loader.train_batches(data, 16, seed=0, spans=spans)
program = setup_lib.build(c, TINY_VOCAB, mesh, sharding.DEFAULT_RULES)
state, losses = program.init(), []
with sharding.activate(mesh, sharding.DEFAULT_RULES):
    for _ in range(3):
        state, metrics = program.train_step(state, sharding.global_batch(next(batches), mesh))
        losses.append(float(metrics["loss"]))
print("RESULT", json.dumps({"spans": spans, "losses": losses}), flush=True)
"""


def _interleaved(processes: int) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _INTERLEAVED, str(processes), str(i),
                               str(port)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=subprocess_env(8 // processes))
             for i in range(processes)]
    logs = [p.communicate(timeout=HANG_SECONDS)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log_tail(log)
    return [json.loads(next(line for line in log.splitlines()
                            if line.startswith("RESULT"))[len("RESULT "):]) for log in logs]


@pytest.mark.slow
def test_processes_feed_the_non_contiguous_rows_their_devices_hold():
    """Two processes whose devices alternate in the mesh: each reads the rows of its own
    devices (spans with gaps, together the whole batch, once), and the losses equal one
    process's on the same mesh."""
    [one] = _interleaved(1)
    two = _interleaved(2)
    spans = [[tuple(s) for s in r["spans"]] for r in two]
    assert all(len(s) > 1 for s in spans)  # not one range each
    rows = sorted(r for s in spans for a, b in s for r in range(a, b))
    assert rows == list(range(16))
    for r in two:
        np.testing.assert_allclose(r["losses"], one["losses"], rtol=2e-5)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path, tiny_tokenizer):
    """A scheduler's SIGTERM reaching only process 0 of a two-process job: JAX's preemption
    service makes both save the same step and exit 143, and the same command finishes."""
    run = tmp_path / "run"
    port = free_port()
    common = [sys.executable, "main.py", "--config=tests/tiny_config.py", f"--workdir={run}",
              f"--config.tokenizer.model_path={tiny_tokenizer.model_path}",
              "--config.mesh.shape=(4,2,1)", "--config.train.checkpoint_every=100000",
              "--config.train.eval_every=100000", "--num_processes=2"]
    procs = [subprocess.Popen(common + ["--config.train.num_steps=100000",
                                        f"--coordinator_address=127.0.0.1:{port}",
                                        f"--process_id={i}"],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=subprocess_env(4)) for i in range(2)]
    deadline = time.monotonic() + HANG_SECONDS
    while not ((run / "metrics.jsonl").exists() and len(_train_losses(run)) >= 3):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.05)
    procs[0].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=HANG_SECONDS)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 143, log_tail(out)
    steps = [int(re.search(r"preempted: saved a checkpoint at step (\d+)", out).group(1))
             for out in outputs]
    assert steps[0] == steps[1] and (run / "checkpoints" / str(steps[0])).is_dir()
    port = free_port()
    finish = [subprocess.Popen(common + [f"--config.train.num_steps={steps[0] + 2}",
                                         f"--coordinator_address=127.0.0.1:{port}",
                                         f"--process_id={i}"],
                               cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=subprocess_env(4))
              for i in range(2)]
    outputs = [p.communicate(timeout=HANG_SECONDS)[0] for p in finish]
    for p, out in zip(finish, outputs, strict=True):
        assert p.returncode == 0, log_tail(out)
    assert f"resumed from checkpoint at step {steps[0]}" in outputs[0]
    assert max(_train_losses(run)) == steps[0] + 2


@pytest.mark.slow
def test_a_check_process_0_alone_makes_stops_both_processes_with_its_line(tmp_path,
                                                                          tiny_tokenizer):
    """Process 0 alone checks the workdir's record; when it refuses the run, the other
    process stops at once with the same one line (rather than wait for process 0's exit to
    give up on it minutes later and abort it), and the record is left as it was."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"mode": "finetune"}')
    port = free_port()
    started = time.monotonic()
    procs = [subprocess.Popen(
        [sys.executable, "main.py", "--config=tests/tiny_config.py", f"--workdir={run}",
         f"--config.tokenizer.model_path={tiny_tokenizer.model_path}",
         "--config.mesh.shape=(4,2,1)", f"--coordinator_address=127.0.0.1:{port}",
         "--num_processes=2", f"--process_id={i}"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=subprocess_env(4)) for i in range(2)]
    stderrs = [p.communicate(timeout=HANG_SECONDS)[1] for p in procs]
    line = (f"error: {run} holds a finetune run, not a pretraining run; use another "
            f"--workdir")
    for p, err in zip(procs, stderrs, strict=True):
        assert p.returncode == 1, log_tail(err)
        assert err.splitlines()[-1] == line
    assert time.monotonic() - started < 100  # process 0's exit gives up after 300 s
    assert [p.name for p in run.iterdir()] == ["config.json"]
    assert (run / "config.json").read_text() == '{"mode": "finetune"}'
