"""Scanned and rematerialised layers: the same function as the per-layer stack, the same
train step, one compilation, and checkpoints that restore across the two layouts."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax import runs
from maelm_jax.infra import sharding
from maelm_jax.models import layer_layout, layers
from maelm_jax.models import stack as stack_lib
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.text import tokenizer
from maelm_jax.training import checkpoint

from tiny_config import TINY_VOCAB, tiny_config

pytestmark = pytest.mark.tier("integration")


def _stack_outputs(cfg, params, x, deterministic=True):
    stack = stack_lib.TransformerStack(cfg)
    out, state = stack.apply({"params": params}, x, None, None, deterministic,
                             mutable=[layers.HIDDEN_STATES])
    return out, state[layers.HIDDEN_STATES]["layers"]


@pytest.mark.parametrize("pre_ln", [False, True])
def test_scanned_stack_computes_the_per_layer_function(pre_ln):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 32))
    cfg = layers.StackConfig(num_layers=3, d_model=32, num_heads=4, d_ff=64, pre_ln=pre_ln)
    params = nn.meta.unbox(stack_lib.TransformerStack(cfg).init(
        jax.random.PRNGKey(1), x, None, None, True)["params"])
    scanned_cfg = layers.StackConfig(num_layers=3, d_model=32, num_heads=4, d_ff=64,
                                     pre_ln=pre_ln, scan_layers=True)
    stacked = layer_layout.to_stacked({"stack": params})["stack"]
    assert jax.tree.leaves(stacked["scan"])[0].shape[0] == 3
    out, hidden = _stack_outputs(cfg, params, x)
    scanned_out, scanned_hidden = _stack_outputs(scanned_cfg, stacked, x)
    np.testing.assert_allclose(scanned_out, out, atol=1e-5)
    # Every layer's output is sown alike (the rank analysis reads them), the last after
    # ln_final for pre-LN.
    assert len(scanned_hidden) == len(hidden) == 3
    for a, b in zip(scanned_hidden, hidden, strict=False):
        np.testing.assert_allclose(a, b, atol=1e-5)
    back = layer_layout.to_per_layer({"stack": stacked})["stack"]
    jax.tree.map(np.testing.assert_array_equal, back, params)


def _train_step(c):
    program = setup_lib.build(c, TINY_VOCAB, sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    return program.init(), program.state, program.train_step


@pytest.mark.parametrize("objective, policy", [("maelm", "full"), ("mlm", "dots_no_batch")])
def test_scanned_rematerialised_step_matches_the_plain_one(objective, policy):
    """Same initial parameters (converted), no dropout: the scanned, rematerialised step
    gives the plain step's loss and new parameters, and compiles once."""
    c = tiny_config(objective)
    state, _, plain_step = _train_step(c)
    c.model.scan_layers, c.model.remat_policy = True, policy
    scanned_state, setup, scanned_step = _train_step(c)
    assert layer_layout.is_stacked(setup.abstract.params)
    spec = setup.logical_specs.params["encoder"]["stack"]["scan"]["layer"]["mlp"]["wi"]["kernel"]
    assert spec[0] == "layers"
    host = jax.device_get(state)
    converted = jax.device_put(layer_layout.to_stacked(host), setup.shardings)
    tokens = jnp.asarray(np.random.default_rng(0).integers(
        tokenizer.NUM_SPECIAL, TINY_VOCAB, (8, 32)), jnp.int32)
    new_plain, m_plain = plain_step(jax.device_put(host), tokens)
    new_scanned, m_scanned = scanned_step(converted, tokens)
    np.testing.assert_allclose(float(m_scanned["loss"]), float(m_plain["loss"]), rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4),
                 jax.device_get(layer_layout.to_per_layer(new_scanned.params)),
                 jax.device_get(new_plain.params))
    for _ in range(2):
        new_scanned, _ = scanned_step(new_scanned, tokens)
    assert scanned_step.__self__.step._cache_size() == 1  # the program's jitted step


def test_checkpoints_restore_across_layouts_and_fine_tuning_reads_stacked(tmp_path):
    c = tiny_config("maelm")
    state, _, _ = _train_step(c)
    old = checkpoint.Checkpointer(tmp_path / "per_layer", keep=1)
    old.save(1, state, {"step": 1, "data_position": 1})
    old.wait()
    c.model.scan_layers = True
    _, setup, _ = _train_step(c)
    restored, meta = old.restore(1, setup.abstract)  # a checkpoint from before scanning
    old.close()
    assert meta["step"] == 1 and layer_layout.is_stacked(restored)
    word = restored.params["encoder"]["stack"]["scan"]["layer"]["mlp"]["wi"]["kernel"]
    assert word.sharding == setup.shardings.params["encoder"]["stack"]["scan"]["layer"][
        "mlp"]["wi"]["kernel"]
    jax.tree.map(np.testing.assert_array_equal,
                 jax.device_get(layer_layout.to_per_layer(restored)), jax.device_get(state))

    new = checkpoint.Checkpointer(tmp_path / "stacked", keep=1)
    new.save(1, restored, {"step": 1, "data_position": 1})
    new.wait()
    new.close()
    # Fine-tuning's encoder is per layer: it reads the stacked checkpoint converted.
    encoder = runs.restore_encoder_params(tmp_path / "stacked" / "1")
    assert not layer_layout.is_stacked({"encoder": encoder})
    jax.tree.map(np.testing.assert_array_equal, encoder,
                 jax.device_get(state.params["encoder"]))


def test_attention_kernel_policy_keeps_the_gradients():
    """"dots_attention" (the matmuls and the Pallas kernel's named outputs kept, the rest
    recomputed) gives the loss and gradients of keeping everything, with dropout on (its
    bits are recomputed alike), on a tiny float32 MAE-LM with the kernel interpreted."""
    from maelm_jax.pretrain import config as pretrain_config
    from maelm_jax.pretrain import steps as pretrain_steps

    def loss_and_grads(policy):
        c = tiny_config("maelm")
        c.model.scan_layers, c.model.remat_policy = True, policy
        c.model.attention_impl, c.model.attention_dropout = "pallas", 0.1
        program = setup_lib.build(c, TINY_VOCAB,
                                  sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
        assert program.model.cfg.encoder.stack.remat_policy == policy
        loss = pretrain_steps.make_micro_loss(
            program.model, setup_lib.model_config(c, TINY_VOCAB),
            pretrain_config.objective(c), program.counts, TINY_VOCAB)
        tokens = jnp.asarray(np.random.default_rng(0).integers(
            tokenizer.NUM_SPECIAL, TINY_VOCAB, (4, 32)), jnp.int32)
        with sharding.activate(program.mesh, program.rules):
            return jax.jit(jax.value_and_grad(lambda p: loss(p, tokens, jax.random.key(3))[0]))(
                program.init().params)

    (plain, plain_grads), (kept, kept_grads) = map(loss_and_grads, ("none", "dots_attention"))
    np.testing.assert_allclose(float(kept), float(plain), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jax.device_get(kept_grads), jax.device_get(plain_grads))
