"""TPU slices on this CPU host: libtpu's compile-only devices (maelm_jax/infra/topology.py).

Without compiling: every host of a v5e-16, v5e-64 and v4-32 slice reads exactly the batch
rows its devices hold, however the mesh orders them, and a multislice mesh lays slices
along its DCN axes. Compiled by XLA:TPU for real (marked slow; a step takes 25-60 s on 2
cores): the train step of the four objectives and the fine-tuning step on a v5e-8 on an
FSDP mesh, MLM's on a data-parallel one and across two slices; each fits the chip's HBM
and keeps what FSDP promises: no whole stacked parameter gathered, gradients
reduce-scattered (never all-reduced whole), parameters and Adam's moments sharded in the
step's entry.

The FSDP steps have BERT-base's parameters (12 x 768, a 32,768-piece vocabulary) on one
row of 128 tokens per device: XLA:TPU chooses each gradient's collective by the
parameter's size, so the width is what the checks need, and the shorter batch halves the
compile. (At a 4 x 256 encoder it all-reduces and slices even the feed-forward
gradients.) The data-parallel step, where every device holds the whole state, compiles
at the full BERT-base batch (32 x 512), so the HBM check sees the largest step."""

from __future__ import annotations

import re
import types

import jax
import numpy as np
import optax
import pytest

from configs.benchmark import peer
from maelm_jax.finetune import heads
from maelm_jax.finetune import setup as finetune_setup
from maelm_jax.infra import sharding, topology
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.pretrain.objectives import recipes
from maelm_jax.training import steps

pytestmark = pytest.mark.tier("integration")

pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -r "
                                     "requirements-tpu-check.txt): no compile-only TPU devices")


# ----------------------------------------------------------- rows per host, no compiling

def _rows_by_index_map(mesh, batch: int, process: int) -> list[int]:
    """The rows `process`'s devices hold, straight from the sharding's own index map."""
    index_map = sharding.batch_sharding(mesh).devices_indices_map((batch,))
    return sorted({r for d, (rows,) in index_map.items() if d.process_index == process
                   for r in range(*rows.indices(batch))})


@pytest.mark.parametrize("name, shapes", [
    ("v5e:4x4", [(-1, 1, 1), (4, 4, 1), (2, 4, 2), (1, 16, 1)]),
    ("v5e:8x8", [(-1, 1, 1), (16, 4, 1), (8, 8, 1), (8, 4, 2), (1, 64, 1)]),
    ("v4:2x2x4", [(-1, 1, 1), (4, 4, 1), (4, 2, 2)]),
])
def test_every_host_of_a_slice_reads_the_rows_its_devices_hold(name, shapes):
    devices = topology.devices(name)
    processes = sorted({d.process_index for d in devices})
    assert len(processes) == len(devices) // 4  # 4 chips per host
    gaps = 0
    for shape in shapes:
        mesh = sharding.make_mesh(shape, devices)
        batch = 4 * sharding.data_parallel_size(mesh)
        seen = []
        for p in processes:
            spans = sharding.process_spans(mesh, batch, p)
            rows = [r for a, b in spans for r in range(a, b)]
            assert rows == _rows_by_index_map(mesh, batch, p), (shape, p)
            gaps += len(spans) > 1
            seen += rows
        # Every row is fed, by as many hosts as hold a copy of it (the tensor axis).
        copies = mesh.shape["tensor"]
        per_row = np.bincount(seen, minlength=batch)
        assert per_row.min() >= 1 and per_row.max() <= copies, (shape, per_row)
    if name == "v5e:8x8":
        assert gaps > 0  # the ICI order gives hosts rows with gaps: the case this guards


def test_slices_lie_along_the_dcn_axes():
    devices = topology.devices("v5e:2x4", num_slices=2)
    slice_of = {d.id: d.slice_index for d in devices}
    mesh = sharding.make_mesh((1, 8, 1), devices)  # default dcn_shape: data across slices
    assert dict(mesh.shape) == {"data": 2, "fsdp": 8, "tensor": 1}
    for i in range(2):
        assert {slice_of[d.id] for d in mesh.devices[i].flat} == {i}
    wide = sharding.make_mesh((-1, 1, 1), devices, (2, 1, 1))
    assert dict(wide.shape) == {"data": 16, "fsdp": 1, "tensor": 1}
    with pytest.raises(sharding.MeshError, match=r"config.mesh.dcn_shape=\(3, 1, 1\) needs 3 "
                                                 "slices, but 2 are available"):
        sharding.make_mesh((1, 8, 1), devices, (3, 1, 1))
    with pytest.raises(sharding.MeshError, match=r"config.mesh.shape=\(1, 16, 1\) needs 16 "
                                                 "devices, but 8 are available"):
        sharding.make_mesh((1, 16, 1), devices)


def test_a_mesh_the_links_cannot_carry_is_one_line():
    with pytest.raises(sharding.MeshError, match=r"config.mesh.shape=\(2, 2, 4\) does not fit "
                                                 "the slice's 2x2x4 chips"):
        sharding.make_mesh((2, 2, 4), topology.devices("v4:2x2x4"))


def test_a_topology_libtpu_does_not_know_is_one_line():
    for name, message in [("v9:2x2", "expected <generation>:<chips per axis>"),
                          ("v5e:3x3", "libtpu does not take 'v5e:3x3'")]:
        with pytest.raises(topology.TopologyError, match=message) as e:
            topology.devices(name)
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------ compiled for TPU

_COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|reduce-scatter)\(")
_SHAPE = re.compile(r"\b(?:bf16|f32|s32|u32|pred)\[([\d,]*)\]")
# XLA:TPU writes a reduce-scatter as a fusion of its own computation, named so, holding an
# all-reduce whose result is dynamically sliced (the TPU runs it as one reduce-scatter).
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.-]+) \(")


def collectives(text: str) -> dict[str, list[tuple[int, ...]]]:
    """Collective kind -> the shapes of its results (a tuple result: each part), in the
    optimised HLO; a collective inside a loop appears once."""
    out: dict[str, list[tuple[int, ...]]] = {"all-gather": [], "all-reduce": [],
                                              "reduce-scatter": []}
    computation = ""
    for line in text.splitlines():
        if not line.startswith(" ") and (found := _COMPUTATION.match(line)):
            computation = found.group(1)
        for result, kind in _COLLECTIVE.findall(line):
            if kind == "all-reduce" and computation.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"
            out[kind] += [tuple(int(d) for d in dims.split(",") if d)
                          for dims in _SHAPE.findall(result)]
    return out


def entry_parameter_shapes(text: str) -> list[tuple[int, ...]]:
    signature = next(line for line in text.splitlines() if line.startswith("ENTRY"))
    return [tuple(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(signature)]


def whole_shapes(params) -> tuple[set, set]:
    """(the unsharded shapes of the stacked parameters, those and every other large
    parameter's unsharded shape plus one layer's of a stacked one): what an FSDP step may
    never gather whole, and what it may never all-reduce or take whole."""
    stacked, whole = set(), set()
    for leaf in jax.tree.leaves(params):
        if leaf.size >= 2**18:
            whole.add(tuple(leaf.shape))
            if leaf.ndim >= 3:
                stacked.add(tuple(leaf.shape))
                whole.add(tuple(leaf.shape[1:]))
    return stacked, whole


def check_fits(compiled, devices) -> int:
    """The compiled step's peak bytes per device (the TPU compiler's figure), checked
    against the chip's HBM."""
    mem = compiled.memory_analysis()
    total = mem.peak_memory_in_bytes
    hbm = topology.chip_facts(devices[0].device_kind).hbm_bytes
    assert 0 < total <= hbm, (total, hbm)
    return total


def check_fsdp(compiled, abstract_state, fsdp: int) -> None:
    """What FSDP promises, read from the TPU compiler's program."""
    text = compiled.as_text()
    found = collectives(text)
    stacked, whole = whole_shapes(abstract_state.params)
    assert stacked and found["all-gather"]  # the parser sees the stack and the gathers
    for shape in found["all-gather"]:  # one layer's weights at a time, inside the scan
        assert shape not in stacked, shape
    # Gradients reduce-scattered over fsdp (then summed over data on the shards), never
    # all-reduced whole: checked on the feed-forward kernels, the largest of a layer. Two
    # smaller ones XLA:TPU (libtpu 0.0.42) all-reduces over data x fsdp and slices
    # (docs/scaling.md): the four attention projections, combined into one all-reduce,
    # and fine-tuning's embedding, whose gradient is a scatter-add with no tied head.
    feed_forward = {s[1:] for s in stacked if len(s) == 3}
    assert feed_forward <= set(found["reduce-scatter"]), found["reduce-scatter"]
    for shape in found["all-reduce"]:
        assert shape not in stacked | feed_forward, shape
    for shape in entry_parameter_shapes(text):  # parameters and moments come in sharded
        assert shape not in whole, shape
    # Parameters and both Adam moments: a 1/fsdp share per device (+ small replicated).
    state = sum(leaf.size * leaf.dtype.itemsize
                for leaf in jax.tree.leaves((abstract_state.params, abstract_state.opt_state)))
    assert compiled.memory_analysis().argument_size_in_bytes < 1.2 * state / fsdp


_KERNEL_CALL = re.compile(r"%(flash_attention_tpu_\w+?)(?:\.\d+)? = \(?bf16\[([\d,]+)\]"
                          r".*custom_call_target=\"tpu_custom_call\"")


def check_attention_kernels(text: str, rows: int, heads: int, decoder_heads: int) -> None:
    """The step attends through the Mosaic kernels (models/flash_attention_tpu.py: forward,
    dK/dV and dQ), each on its device's rows of the batch and all of a layer's heads
    (jax.shard_map: the partitioner cannot split a kernel), not on the whole batch
    gathered; the encoder's layers among them (3ML's decoder has half its heads)."""
    calls = _KERNEL_CALL.findall(text)
    kernels = {f"flash_attention_tpu_{k}" for k in ("forward", "dkv", "dq")}
    assert {name for name, _ in calls} == kernels, calls
    for name, dims in calls:  # the first result: out, dK or dQ [rows, heads, length, D]
        assert tuple(map(int, dims.split(",")))[:2] in {(rows, heads), (rows, decoder_heads)}, \
            (name, dims)
    assert {name for name, dims in calls if int(dims.split(",")[1]) == heads} == kernels


# The FSDP steps' batch: one row per device, of SEQ_LEN tokens (module docstring).
SEQ_LEN = 128


def pretraining_step(model: str, shape, devices, dcn_shape=(-1, 1, 1), full_batch=False):
    """The model's BERT-base train step (12 x 768, vocabulary 32768, scanned layers,
    dropout 0.1) compiled for `devices`, as a TPU resolves "auto" (in bfloat16, attention
    through the Pallas kernels), on one row of SEQ_LEN tokens per device or, with
    `full_batch`, on BERT-base's batch (32 x 512)."""
    c = recipes.MODELS[model].apply(peer.get_config("base"))
    if not full_batch:
        c.data.seq_len, c.train.batch_size = SEQ_LEN, len(devices)
    setup_lib.resolve_auto(c, "tpu")
    pretrain_config.validate(c)
    mesh = sharding.make_mesh(shape, devices, dcn_shape)
    program = setup_lib.build(c, c.tokenizer.vocab_size, mesh)
    return program, program.compile_train_step()


@pytest.fixture(scope="module")
def v5e_8():
    return topology.devices("v5e:2x4")


# The two decoders (MAE-LM's self-attention one, which 3ML_self shares, and 3ML_cross's);
# MLM's encoder alone compiles in the data-parallel and two-slice tests below.
@pytest.mark.slow
@pytest.mark.parametrize("model", ["maelm", "3ml_cross"])
def test_pretraining_step_compiles_for_a_v5e_8_with_fsdp(model, v5e_8):
    program, compiled = pretraining_step(model, (2, 4, 1), v5e_8)
    assert program.config.model.attention_impl == "pallas"
    check_fits(compiled, v5e_8)
    check_fsdp(compiled, program.state.abstract, fsdp=4)
    decoder = program.config.model.get("decoder")
    check_attention_kernels(compiled.as_text(), rows=1, heads=12,
                            decoder_heads=decoder.num_heads if decoder else 12)


@pytest.mark.slow
def test_data_parallel_step_all_reduces_whole_gradients(v5e_8):
    """On (8, 1, 1) every device holds whole parameters, so gradients are all-reduced
    whole: the same checks that pass on the FSDP mesh see it (they can fail)."""
    program, compiled = pretraining_step("mlm", (8, 1, 1), v5e_8, full_batch=True)
    check_fits(compiled, v5e_8)
    _, whole = whole_shapes(program.state.abstract.params)
    assert any(shape in whole for shape in collectives(compiled.as_text())["all-reduce"])
    with pytest.raises(AssertionError):
        check_fsdp(compiled, program.state.abstract, fsdp=8)


@pytest.mark.slow
def test_step_compiles_across_two_slices():
    """Two v5e-8 slices: FSDP inside each slice, data parallel across them (DCN)."""
    devices = topology.devices("v5e:2x4", num_slices=2)
    program, compiled = pretraining_step("mlm", (1, 8, 1), devices)
    assert dict(program.mesh.shape) == {"data": 2, "fsdp": 8, "tensor": 1}
    check_fits(compiled, devices)
    check_fsdp(compiled, program.state.abstract, fsdp=8)


@pytest.mark.slow
def test_finetuning_step_compiles_for_a_v5e_8(v5e_8):
    """A GLUE classifier on the BERT-base encoder, one row of SEQ_LEN tokens per device
    with padding, dropout 0.1, on the FSDP mesh."""
    arch = {"num_layers": 12, "d_model": 768, "num_heads": 12, "d_ff": 3072, "pre_ln": False,
            "vocab_size": 32768, "max_positions": 512, "rel_pos_buckets": 32,
            "rel_pos_max_distance": 128, "rel_pos_bucket_fn": "t5"}
    encoder = encoder_lib.from_architecture(arch, dtype="bfloat16", dropout=0.1,
                                            attention_dropout=0.1, attention_impl="einsum",
                                            scan_layers=True)
    model = heads.SequenceClassifier(encoder, 2, 0.1, "first")
    task = types.SimpleNamespace(loss_sums=lambda outputs, batch: heads.classification_loss_sums(
        outputs, batch["labels"], batch["weights"]))
    tx = optax.adamw(1e-5)
    mesh = sharding.make_mesh((2, 4, 1), v5e_8)
    rules = sharding.rules_from_config(sharding.DEFAULT_RULES)
    setup = finetune_setup.state_setup(model, tx, 0, SEQ_LEN, mesh, rules)
    step = steps.jit_train_step(finetune_setup.make_train_step(model, task, tx, 0), setup, mesh)
    layout = sharding.batch_sharding(mesh)
    rows = len(v5e_8)
    batch = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=layout)
             for name, shape, dtype in (("tokens", (rows, SEQ_LEN), np.int32),
                                        ("key_mask", (rows, SEQ_LEN), bool),
                                        ("labels", (rows,), np.int32),
                                        ("weights", (rows,), np.float32))}
    with sharding.activate(mesh, rules):
        compiled = step.lower(setup.abstract, batch).compile()
    check_fits(compiled, v5e_8)
    check_fsdp(compiled, setup.abstract, fsdp=4)
