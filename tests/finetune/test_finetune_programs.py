"""How few programs fine-tuning compiles: the learning-rate schedule is data in the state
(one program serves every learning rate, warmup and length of a task, encoder, head and
bucket), and with data.one_bucket every train and dev batch takes one length."""

import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from maelm_jax.finetune import data, inputs
from maelm_jax.finetune import setup as setup_lib
from maelm_jax.infra import sharding
from maelm_jax.training import optimizer as optimizer_lib

from support import tiny_finetuning

pytestmark = pytest.mark.tier("integration")


def _lowered_step(settings, tmp_path, **changes) -> str:
    p = inputs.read_inputs(*inputs.check_run(tiny_finetuning(settings, **changes), str(tmp_path)))
    t = p.config.train
    program = setup_lib.build(p.config, p.encoder_cfg, p.task,
                              p.steps_per_epoch * t.num_epochs, p.buckets[0])
    layout = sharding.batch_sharding(program.mesh)
    size = t.batch_size
    batch = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=layout)
             for name, shape, dtype in (("tokens", (size, 16), np.int32),
                                        ("key_mask", (size, 16), bool),
                                        ("labels", (size,), np.int32),
                                        ("weights", (size,), np.float32))}
    with sharding.activate(program.mesh, program.rules):
        return program.train_step.lower(program.state.abstract, batch).as_text()


def test_one_program_serves_every_learning_rate_warmup_and_length(sst2_settings, tmp_path):
    first = _lowered_step(sst2_settings, tmp_path / "a")
    other = _lowered_step(sst2_settings, tmp_path / "b", **{
        "train.learning_rate": 3e-5, "train.num_epochs": 7, "train.warmup_ratio": 0.2})
    assert first == other
    # The check is real: another batch size is another program.
    assert _lowered_step(sst2_settings, tmp_path / "c", **{"train.batch_size": 4}) != first


@pytest.mark.parametrize("counts_updates", [False, True])
def test_the_schedule_as_data_is_optax_schedule_and_updates_alike(counts_updates):
    """Every step of warmup, decay and beyond: the same rates as optax's compiled
    schedule, and optax.adamw's updates bit for bit; counting the updates, the state has
    optax.adamw's tree (pretraining's checkpoints from before restore)."""
    t = ml_collections.ConfigDict(dict(
        learning_rate=1e-3, warmup_steps=3, num_steps=10, weight_decay=0.01,
        weight_decay_on="weights", adam_b1=0.9, adam_b2=0.98, adam_eps=1e-6, clip_norm=1.0))
    schedule = optax.join_schedules([optax.linear_schedule(0.0, 1e-3, 3),
                                     optax.linear_schedule(1e-3, 0.0, 7)], [3])
    compiled = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        schedule, b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.01,
        mask=optimizer_lib.weight_decay_mask))
    runtime = optimizer_lib.make_optimizer(t, counts_updates)
    values = jnp.asarray(optimizer_lib.schedule_values(t), jnp.float32)
    params = {"dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones(4)}}
    a, b = params, params
    state_a, state_b = compiled.init(a), runtime.init(b)
    same_tree = jax.tree.structure(state_a) == jax.tree.structure(state_b)
    assert same_tree == counts_updates
    for step in range(13):
        rate = optimizer_lib.learning_rate_at(jnp.int32(step), values)
        assert float(rate) == pytest.approx(float(schedule(step)), rel=1e-6, abs=1e-12)
        grads = jax.tree.map(lambda x, step=step: jnp.sin(x * step + 1.0), a)
        update_a, state_a = compiled.update(grads, state_a, a)
        update_b, state_b = runtime.update(grads, state_b, b, learning_rate=rate)
        a, b = optax.apply_updates(a, update_a), optax.apply_updates(b, update_b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_one_bucket_holds_every_train_and_dev_text(sst2_settings, tmp_path):
    """SST-2's tiny texts fit 16 tokens: with one_bucket every batch is 16 long; without,
    buckets (16, 32) and batches of the shorter texts take 16 still."""
    buckets = {"data.buckets": (8, 16, 32), "data.max_seq_len": 32}
    p = inputs.read_inputs(*inputs.check_run(
        tiny_finetuning(sst2_settings, **buckets, **{"data.one_bucket": True}),
        str(tmp_path / "one")))
    longest = max(len(s) for split in (p.task.train, *p.task.eval_splits())
                  for s in split.sequences)
    assert 8 < longest <= 16
    assert p.buckets == (16, 32)  # longer test texts would still have a bucket
    lengths = {b.tokens.shape[1] for b in itertools.chain(
        data.train_batches(p.task.train.sequences, p.task.train.targets, 8, p.buckets,
                           np.random.default_rng(0)),
        data.eval_batches(p.task.eval_splits()[0].sequences, p.task.eval_splits()[0].targets,
                          8, p.buckets))}
    assert lengths == {16}
    many = inputs.read_inputs(*inputs.check_run(tiny_finetuning(sst2_settings, **buckets),
                                               str(tmp_path / "many")))
    assert many.buckets == (8, 16, 32)
    assert data.one_bucket((8, 16, 32), 17) == (32,)
