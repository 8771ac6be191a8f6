"""benchmarks/program_cost.py reads exported programs right (loops' trip counts, calls,
region ops), and the properties it guards hold on the train steps exported for CUDA: what
MAE-LM's per-example relative bias costs, beside MLM's step."""

import math

import pytest

from benchmarks import program_cost
from configs.benchmark import peer
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.pretrain.objectives import recipes

pytestmark = pytest.mark.tier("integration")

_MODULE = """module @jit_step {
  func.func public @main(%arg0: tensor<4x8xf32>) -> (tensor<4x8xf32>) {
    %c = stablehlo.constant dense<3> : tensor<i32>
    %0:2 = stablehlo.while(%iterArg = %c0, %iterArg_1 = %arg0) : tensor<i32>, tensor<4x8xf32>
    cond {
      %1 = stablehlo.compare LT, %iterArg, %c, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %1 : tensor<i1>
    } do {
      %2 = func.call @body(%iterArg_1) : (tensor<4x8xf32>) -> tensor<4x8xf32>
      %3 = stablehlo.convert %2 : (tensor<4x8xf32>) -> tensor<4x8xbf16>
      stablehlo.return %iterArg, %2 : tensor<i32>, tensor<4x8xf32>
    }
    %4 = "stablehlo.scatter"(%arg0, %idx, %upd) <{unique_indices = true}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      stablehlo.return %b : tensor<f32>
    }) : (tensor<4x8xf32>, tensor<2x1xi32>, tensor<2x8xf32>) -> tensor<4x8xf32>
    return %0#1 : tensor<4x8xf32>
  }
  func.func private @body(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %0 = stablehlo.add %arg0, %arg0 : tensor<4x8xf32>
    %1 = stablehlo.dot_general %arg0, %arg0, contracting_dims = [1] x [1] : DOT_TYPES
    return %0 : tensor<4x8xf32>
  }
}
""".replace("DOT_TYPES", "(tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x4xf32>")


def test_loops_calls_and_regions_are_counted():
    ops = program_cost.parse(_MODULE)
    by_kind = {op.kind: op for op in ops}
    assert by_kind["add"].times == 3 and by_kind["dot_general"].times == 3  # through a call
    assert by_kind["convert"].times == 3
    assert [str(t) for t in by_kind["convert"].results] == ["4x8xbf16"]
    assert by_kind["add"].bytes == 3 * 4 * 8 * 4  # two operands and the result
    scatter = by_kind["scatter"]
    assert scatter.times == 1 and scatter.unique  # its types close its region
    assert scatter.bytes == 2 * 2 * 8 * 4 + 2 * 4  # updates read and written, indices read
    summary = program_cost.summarize(ops)
    assert summary["classes"]["dot_general:f32xf32"]["ops"] == 3
    assert summary["movement_bytes"] == 3 * (4 * 8 * 4 + 4 * 8 * 2) + scatter.bytes


def test_dynamic_slices_count_what_they_move():
    """Inside a layer scan a dynamic-update-slice writes one layer into the whole stack
    (aliased in place) and a dynamic slice reads one: counted by the update and by the
    result, not by the stacked operand."""
    stack, layer, index = (program_cost.Tensor((12, 4, 8), "bf16"),
                           program_cost.Tensor((1, 4, 8), "bf16"), program_cost.Tensor((), "i32"))
    update = program_cost.Op("dynamic_update_slice", [stack, layer, index], [stack])
    take = program_cost.Op("dynamic_slice", [stack, index], [layer])
    assert update.bytes == take.bytes == 2 * layer.bytes


def _config(model: str, scan: bool, **changes):
    c = recipes.MODELS[model].apply(peer.get_config("small,layers=2"))
    c.model.scan_layers = scan
    for name, value in changes.items():
        c.model[name] = value
    setup_lib.resolve_auto(c, "gpu")
    pretrain_config.validate(c)
    return c


def test_scanned_layers_count_as_many_as_unrolled_ones():
    """The scan's trip count applied: a 2-layer encoder's matmuls are the same per step
    scanned or not."""
    dots = {}
    for scan in (False, True):
        summary = program_cost.summarize(program_cost.parse(
            program_cost.export_train_step(_config("mlm", scan), "cuda")))
        dots[scan] = sum(e["ops"] for k, e in summary["classes"].items()
                         if k.startswith("dot_general"))
    assert dots[True] == dots[False] > 0


@pytest.fixture(scope="module")
def maelm_ops():
    """MAE-LM's train step at the small peer size (2 x 256, 4 heads, L 128, batch 32,
    dropout 0.1), bfloat16 with the Pallas kernel, exported for CUDA."""
    return program_cost.parse(program_cost.export_train_step(_config("maelm", False), "cuda"))


def test_the_per_example_bias_costs_what_a_bias_costs(maelm_ops):
    """The bias [B, heads, n, n] (32 x 4 x 112 x 112 at n_enc 109 padded to 112) and its
    gradient never exist: the kernels read their tiles from the relative grid's row of
    diagonals by distance, and the grid's gradient [heads, P, P] is summed over the batch
    inside its own kernel (no per-example dS in memory, no scatter-add: deterministic)."""
    bias = 32 * 4 * 112 * 112
    kernels = [op for op in maelm_ops if op.kind.startswith("custom_call")]
    assert kernels and not [op for op in kernels for t in op.operands + op.results
                            if math.prod(t.shape) >= bias]
    assert not [t for op in maelm_ops for t in op.operands + op.results
                if t.shape == (32, 4, 112, 112)]
    grid_dbias = [op for op in kernels if op.kind.endswith("flash_attention_grid_dbias")]
    assert len(grid_dbias) == 2  # one a layer
    assert {tuple(t.shape) for op in grid_dbias for t in op.results} == {(4, 128, 128)}
    assert any(t.shape == (4, 256) for op in kernels for t in op.operands)  # the diagonals
    assert program_cost.largest_f32(maelm_ops, rank=4) < bias
    targets = {op.operands[0].shape for op in maelm_ops if op.kind == "scatter"}
    # Into the bias, the position grid [heads, P, P] or the bucket table [buckets, heads]:
    assert not [t for t in targets if len(t) == 4 or t == (4, 128, 128) or t == (32, 4)]


def test_the_small_gradients_scatter_nothing_they_need_not(maelm_ops):
    """The decoder's input is a plain scatter (unique, sorted indices: no buffer of ids and
    no scatter-add), and neither the [MASK] row's gradient nor the position tables' is a
    scatter into the table (the row is a static slice; the kept positions' rows are
    gathered back; the decoder takes its whole table)."""
    scatters = [op for op in maelm_ops if op.kind == "scatter"]
    assert not [op for op in scatters if op.operands[0].dtype.startswith("ui")]
    decoder_input = [op for op in scatters if op.operands[0].shape == (32, 128, 256)
                     and op.operands[2].shape == (32, 109, 256)]
    assert decoder_input and all(op.unique for op in decoder_input)
    targets = {op.operands[0].shape: op.operands[2].shape for op in scatters}
    assert (128, 256) not in targets  # the encoder's and the decoder's position tables
    assert targets.get((8000, 256)) != (256,)  # the [MASK] row into the word table


def test_the_output_layer_in_the_compute_dtype():
    """model.output_dtype="compute": the output layer's dots take bfloat16 operands (float32
    accumulation); "float32" keeps them float32 (TF32)."""
    def f32_dots(ops):
        return sum(op.times for op in ops if op.kind == "dot_general"
                   and any(t.shape[-1] == 8000 or 8000 in t.shape for t in op.results)
                   and op.operands[0].dtype == "f32")

    full = program_cost.parse(program_cost.export_train_step(_config("mlm", False), "cuda"))
    half = program_cost.parse(program_cost.export_train_step(
        _config("mlm", False, output_dtype="compute"), "cuda"))
    assert f32_dots(full) >= 2 and f32_dots(half) == 0


@pytest.mark.parametrize("objective", ["mlm", "maelm"])
def test_bert_base_backward_keeps_under_300_mb_a_layer(objective):
    """BERT-base (L 512, batch 32, bfloat16, dropout 0.1, the Pallas kernel) exported for
    CUDA with the default remat policy ("auto": the matmuls and the kernel's named outputs):
    each encoder layer keeps <= 300 MB for the backward (897 MB keeping everything, 252 MB
    with "dots_no_batch", which runs the attention forward twice), and each attention
    layer runs exactly one forward."""
    c = recipes.MODELS[objective].apply(peer.get_config("base"))
    setup_lib.resolve_auto(c, "gpu")
    pretrain_config.validate(c)
    assert c.model.attention_impl == "pallas" and c.model.remat_policy == "auto"
    encoder = program_cost.backward_residuals(c)[0]
    assert encoder["layers"] == 12 and 200e6 < encoder["bytes_per_layer"] <= 300e6
    ops = program_cost.parse(program_cost.export_train_step(c, "cuda"))
    calls = program_cost.kernel_calls(ops)
    layers = 12 + (c.model.decoder.num_layers if objective == "maelm" else 0)
    assert calls["flash_attention_forward"] == calls["flash_attention_dq"] == layers
    if objective == "maelm":  # the per-example bias: no [B, H, n, m] tensor; its gradient
        # 12.6 MB a layer (the float32 grid [12, 512, 512]), once per encoder layer
        assert not [t for op in ops for t in op.operands + op.results
                    if t.shape[:2] == (32, 12) and len(t.shape) == 4 and t.shape[2] >= 435]
        [grid_dbias] = [op for op in ops if op.kind.endswith("flash_attention_grid_dbias")]
        assert grid_dbias.times == 12 and grid_dbias.results[0].bytes <= 0.1e9 / 4
