"""The programs users run on GPUs and TPUs, lowered on this CPU host with jax.export: the
whole pretraining train step of the four models with every attention implementation that
claims each platform (bfloat16), and the fine-tuning step.

Lowering is not compiling (Triton's own compile, register pressure and speed need the
GPU), but it catches what a CPU test never sees: a Pallas call that goes to Mosaic GPU and
overflows its shared memory, the interpreter exported instead of the kernel, cuDNN's
length rules, a TPU program that does not lower. cuDNN's version check needs the library:
on this host it is answered with a version (`cudnn_on_this_host`), and jax 0.11's
Triton lowering is told of an H100 (`h100_on_this_host`); the rest of jax's checks run as
they are.
"""

from __future__ import annotations

import re
import types

import jax
import numpy as np
import optax
import pytest
from jax import export

from configs.benchmark import peer
from maelm_jax.finetune import heads
from maelm_jax.finetune import setup as finetune_setup
from maelm_jax.infra import sharding
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.pretrain.objectives import recipes
from maelm_jax.training import steps

pytestmark = pytest.mark.tier("integration")

TRITON = "__gpu$xla.gpu.triton"
CUDNN = tuple(f"__cudnn$fmha{kind}{suffix}" for kind in (
    "Softmax", "ScaleBiasSoftmax", "SoftmaxDropout", "ScaleBiasSoftmaxDropout")
    for suffix in ("", "Backward"))
MOSAIC = "tpu_custom_call"
# What each platform is offered (models/layers.py ATTENTION_IMPLS; "pallas": the Triton
# kernels on CUDA, the Mosaic ones on TPU).
IMPLS = {"cuda": ("einsum", "xla", "cudnn", "pallas"), "tpu": ("einsum", "xla", "pallas")}
CASES = [(platform, impl, model) for platform, impls in IMPLS.items() for impl in impls
         for model in recipes.MODELS]


@pytest.fixture(autouse=True)
def cudnn_on_this_host(monkeypatch):
    """jax asks the installed cuDNN for its version whenever it traces a fused-attention
    call (building the state traces the model too); here there is none, so the check
    answers 9.8 while the test runs."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError:
        pytest.skip("this jax has no cuDNN fused-attention module to lower with")
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 90800)


@pytest.fixture(autouse=True)
def h100_on_this_host(monkeypatch):
    """From jax 0.11 Pallas' Triton lowering asks the device for its compute capability;
    here the devices are CPUs, so it is told of an H100 (jax 0.10 does not ask)."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        return
    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: h100)


def lower(fn, platform: str, *args) -> str:
    """The StableHLO text of `fn` exported for `platform` (Triton and cuDNN calls allowed:
    their IR carries no stability guarantee, which export otherwise insists on)."""
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in (TRITON, *CUDNN, MOSAIC)]
    exported = export.export(fn, platforms=[platform], disabled_checks=checks)(*args)
    assert exported.platforms == (platform,)
    return exported.mlir_module()


def pretraining_config(size: str, model: str, impl: str):
    c = peer.get_config(size)
    c.model.dtype = "bfloat16"
    c.model.attention_impl = impl
    if impl == "cudnn":  # cuDNN's fused call is taken only without attention dropout
        c.model.attention_dropout = c.model.decoder.attention_dropout = 0.0
    c = recipes.MODELS[model].apply(c)
    if impl == "cudnn":
        c.model.decoder.attention_dropout = 0.0  # 3ML's decoders copy the encoder's
    pretrain_config.validate(c)
    return c


def lower_train_step(config, platform: str) -> str:
    program = setup_lib.build(config, config.tokenizer.vocab_size,
                              sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    with sharding.activate(program.mesh, program.rules):
        return lower(program.step, platform, program.state.abstract, program.batch_spec(),
                     program.schedule_spec())


def check_kernels(text: str, impl: str, attention_layers: int, cross: bool = False,
                  batch_dims: int = 1, platform: str = "cuda") -> None:
    """The attention implementation is in the program as itself: the Pallas kernels'
    three calls per attention layer (the forward, dK/dV, dQ; Triton's on CUDA, Mosaic's on
    TPU; no interpreter), cuDNN's fused calls, or neither. cross: the program has a cross
    decoder, whose [MASK] queries and encoder keys each layer pads to the kernel's
    multiple. batch_dims: 2 for a seed group's [runs, B]."""
    mosaic = text.count(f"@{MOSAIC}")
    if platform == "tpu":
        assert text.count(f"@{TRITON}") == 0
        assert mosaic == (3 * attention_layers if impl == "pallas" else 0), mosaic
        # The TPU kernels pad q, k and v to their 128-wide tiles in the transposes to
        # their layout; nothing else is checked for pads.
        return
    assert mosaic == 0
    triton = text.count(f"@{TRITON}")
    cudnn = sum(text.count(f"@{t}") for t in CUDNN)
    cudnn_backward = sum(text.count(f"@{t}") for t in CUDNN if t.endswith("Backward"))
    if impl == "pallas":
        # A layer whose bias is read by position (MAE-LM's and 3ML's encoders) has a fourth
        # kernel, its grid's gradient.
        grid_kernel = "@" + re.escape(TRITON) + r"[^\n]*flash_attention_grid_dbias"
        grid_gradients = len(re.findall(grid_kernel, text))
        assert triton - grid_gradients == 3 * attention_layers, (triton, attention_layers)
        assert grid_gradients <= attention_layers
        for name in ("flash_attention_forward", "flash_attention_dkv", "flash_attention_dq"):
            assert name in text
    else:
        assert triton == 0
    if impl == "cudnn":
        assert cudnn_backward == attention_layers, (cudnn_backward, attention_layers)
        assert cudnn > cudnn_backward
    else:
        assert cudnn == 0
    # Nothing pads a [B, n, heads, head_dim] (or wider) activation: lengths are padded
    # once, on the encoder's integer inputs.
    wide = r"stablehlo\.pad .*tensor<(\d+x){" + str(2 + batch_dims) + r",}\d+xbf16>"
    assert cross or not re.search(wide, text)


def _attention_layers(config) -> int:
    """Attention calls the lowered program holds: one per layer, or one per scanned stack."""
    m = config.model
    encoder = 1 if m.scan_layers else m.num_layers
    if config.objective == "mlm":
        return encoder
    decoder = m.decoder.num_layers
    if m.decoder.kind == "self":
        return encoder + (1 if m.scan_layers else decoder)
    return encoder + 2 * decoder  # self- and cross-attention in each cross decoder layer


@pytest.mark.parametrize("platform, impl, model", CASES)
def test_train_step_lowers(platform, impl, model):
    """2 x 256 encoder (4 heads of 64), L 128, batch 32, dropout 0.1 (attention dropout 0
    for cuDNN): MAE-LM's n_enc is 109, 3ML's 87, neither a multiple of anything."""
    c = pretraining_config("small,layers=2", model, impl)
    text = lower_train_step(c, platform)
    check_kernels(text, impl, _attention_layers(c), cross=c.model.decoder.kind != "self",
                  platform=platform)
    if platform == "cuda" and impl == "pallas" and model != "mlm":
        # The kernel's tiles shrink to the kept tokens: 109 pad to 112 (blocks of 16), 87
        # to 96 (32), not to 128 (the configured 64).
        length = {"maelm": 112}.get(model, 96)
        assert f"32x{length}x4x64xbf16" in text


@pytest.mark.parametrize("impl", ["pallas", "cudnn"])
@pytest.mark.parametrize("model", ["mlm", "maelm"])
def test_bert_base_train_step_lowers_for_cuda(model, impl):
    """The papers' base shapes (12 x 768, L 512, batch 32, vocabulary 32768, scanned
    layers): the kernels' tiles fit, and MAE-LM's 435 kept tokens (padded to 448 for the
    kernel, 436 for cuDNN) lower."""
    c = pretraining_config("base", model, impl)
    text = lower_train_step(c, "cuda")
    check_kernels(text, impl, _attention_layers(c))
    if model == "maelm":
        length = {"pallas": 448, "cudnn": 436}[impl]
        assert f"32x{length}x12x64xbf16" in text


@pytest.mark.parametrize("runs", [None, 3])
@pytest.mark.parametrize("platform, impl", [(p, i) for p, impls in IMPLS.items()
                                            for i in impls])
def test_finetuning_step_lowers(platform, impl, runs):
    """A GLUE classifier's step on a 2 x 256 encoder, batch 32 of length 128 with padding
    (the key mask) and dropout, as fine-tuning builds it; runs=3: a seed group's step
    (finetune/seed_group.py), three runs vmapped over one stacked state, whose kernels
    take the runs as more batch."""
    arch = {"num_layers": 2, "d_model": 256, "num_heads": 4, "d_ff": 1024, "pre_ln": False,
            "vocab_size": 8000, "max_positions": 128, "rel_pos_buckets": 32,
            "rel_pos_max_distance": 128, "rel_pos_bucket_fn": "t5"}
    attention_dropout = 0.0 if impl == "cudnn" else 0.1
    encoder = encoder_lib.from_architecture(arch, dtype="bfloat16", dropout=0.1,
                                            attention_dropout=attention_dropout,
                                            attention_impl=impl)
    model = heads.SequenceClassifier(encoder, 2, 0.1, "first")
    task = types.SimpleNamespace(loss_sums=lambda outputs, batch: heads.classification_loss_sums(
        outputs, batch["labels"], batch["weights"]))
    tx = optax.adamw(1e-4)
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    rules = sharding.rules_from_config(sharding.DEFAULT_RULES)
    if runs is None:
        setup = finetune_setup.state_setup(model, tx, 0, 128, mesh, rules)
        step = steps.jit_train_step(
            finetune_setup.make_train_step(model, task, tx, 0), setup, mesh)
        batch_sharding, lead = sharding.batch_sharding(mesh), ()
    else:
        group = finetune_setup.Runs.of_seeds(range(runs), (1e-4, 0.0, 100.0))
        setup = finetune_setup.stacked_state_setup(model, tx, group, 128, mesh, rules)
        batch_sharding, lead = sharding.stacked_batch_sharding(mesh), (runs,)
        step = steps.jit_train_step(finetune_setup.stacked_train_step(
            finetune_setup.make_seeded_train_step(model, task, tx), group),
            setup, mesh, batch_layout=batch_sharding)
    batch = {name: jax.ShapeDtypeStruct(lead + shape, dtype, sharding=batch_sharding)
             for name, shape, dtype in (("tokens", (32, 128), np.int32),
                                        ("key_mask", (32, 128), bool),
                                        ("labels", (32,), np.int32),
                                        ("weights", (32,), np.float32))}
    with sharding.activate(mesh, rules):
        text = lower(step, platform, setup.abstract, batch)
    check_kernels(text, impl, 2, batch_dims=1 + len(lead), platform=platform)
    if runs:  # the parameters carry the runs axis: [3, 256, 1024] feed-forward kernels
        assert "tensor<3x256x1024x" in text


def test_pallas_runs_per_shard_on_a_mesh():
    """On 8 devices split 4 ways over the batch and 2 over the heads, the Triton kernels
    take each device's rows and heads (shard_map), not the whole batch gathered onto every
    device: [32 / 4, 128, 4 / 2, 64] blocks."""
    c = pretraining_config("small,layers=2", "mlm", "pallas")
    program = setup_lib.build(c, c.tokenizer.vocab_size, sharding.make_mesh((4, 1, 2)))
    with sharding.activate(program.mesh, program.rules):
        text = lower(program.step, "cuda", program.state.abstract, program.batch_spec(),
                     program.schedule_spec())
    calls = [line for line in text.splitlines() if f"@{TRITON}" in line]
    assert len(calls) == 6 and all("tensor<8x128x2x64xbf16>" in line for line in calls)
    assert "tensor<32x128x4x64xbf16>" not in " ".join(calls)
