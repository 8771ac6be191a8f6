r"""What a train step moves besides its matmuls, read from the exported program on any host.

    python benchmarks/program_cost.py --config=configs/benchmark/peer.py:base \
        [--objectives=maelm] [--platform=cuda] [--json=cost.json] [--bandwidth_tbs=3.35]

Exports each objective's train step (the one pretrain/setup.py builds, with the compute
dtype and attention kernel "auto" takes on the platform) with `jax.export` for CUDA or
TPU, as the lowering tests do, and reads its StableHLO: every op's operand and result
bytes, multiplied by the trip counts of the loops it sits in (the scanned layers, gradient
accumulation) and by the calls of the function that holds it. Ops are grouped by class:
gather, scatter (and how many lack `unique_indices`), transpose, convert, pad, concatenate,
dynamic slices, reduce, sort, custom calls by target (the Pallas kernels, cuDNN), dot_general
by operand dtypes, and the rest (elementwise, which XLA fuses). The data-movement classes'
bytes, over --bandwidth_tbs, are the predicted non-matmul time per step: an estimate before
XLA's fusion (which removes some of it), not a GPU timing; ratios between objectives and
before/after a change are what it is for. The largest tensors of each class are listed.

The same functions (`parse`, `summarize`) hold the tests' properties of the exported
programs (tests/benchmarks/test_program_cost.py), so a regression shows in CPU CI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Iterable

import numpy as np
from absl import app, flags

from benchmarks import harness
from maelm_jax.infra import cli, markdown, sharding
from maelm_jax.pretrain import setup as setup_lib

FLAGS = flags.FLAGS

# Bytes per element of StableHLO's element types.
_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "i64": 8, "ui64": 8, "i32": 4, "ui32": 4,
          "i16": 2, "ui16": 2, "i8": 1, "ui8": 1, "i1": 1, "f8E4M3FN": 1, "f8E5M2": 1}
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-zA-Z]\w*)>")
_OP = re.compile(r'(?:=\s*|^\s*)"?stablehlo\.(\w+)"?')
_CALL = re.compile(r"\b(?:func\.)?call @([\w.$-]+)\(")
_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)\(")
_CONST = re.compile(r"(%[\w#]+) = stablehlo\.constant dense<(-?\d+)> : tensor<i\d+>")
_COMPARE = re.compile(r"stablehlo\.compare\s+(LT|LE|GT|GE|NE),\s*(%[\w#]+),\s*(%[\w#]+)")
_TARGET = re.compile(r"stablehlo\.custom_call @([\w.$-]+)")
_KERNEL = re.compile(r'name\s*=\s*\\?"(\w+)')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# Classes whose bytes are data movement XLA does not fuse away into a matmul's epilogue.
MOVEMENT = ("gather", "scatter", "transpose", "convert", "pad", "concatenate",
            "dynamic_slice", "dynamic_update_slice", "reduce", "sort", "select_and_scatter")


@dataclasses.dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]
    dtype: str

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * _BYTES.get(self.dtype, 4)

    def __str__(self) -> str:
        return "x".join(map(str, self.shape)) + "x" + self.dtype


@dataclasses.dataclass
class Op:
    """One op of the program: its class, operands and results, and how often it runs."""

    kind: str  # "gather", "dot_general:bf16xbf16", "custom_call:<target>", ...
    operands: list[Tensor]
    results: list[Tensor]
    times: int = 1  # trip counts of the loops around it, calls of its function
    unique: bool = False  # a scatter with unique_indices

    @property
    def bytes(self) -> int:
        """Bytes read and written once, before fusion: every operand and result; a gather
        reads the slices it takes (its results), not its whole operand; a scatter and a
        dynamic-update-slice read and write what they update, a dynamic slice what it
        takes, not their whole operand."""
        if self.kind == "gather":
            return 2 * sum(t.bytes for t in self.results) + self.operands[-1].bytes
        if self.kind == "scatter" and len(self.operands) >= 3:
            return 2 * self.operands[2].bytes + self.operands[1].bytes
        # In place (XLA aliases the operand and result, as inside a layer scan, where the
        # operand is the whole stack of layers): a dynamic-update-slice reads and writes
        # its update, a dynamic slice reads and writes its result.
        if self.kind == "dynamic_update_slice" and len(self.operands) >= 2:
            return 2 * self.operands[1].bytes
        if self.kind == "dynamic_slice" and self.results:
            return 2 * self.results[0].bytes
        return sum(t.bytes for t in self.operands) + sum(t.bytes for t in self.results)


def _tensors(text: str) -> list[Tensor]:
    return [Tensor(tuple(int(d) for d in dims.split("x") if d), dtype)
            for dims, dtype in _TENSOR.findall(text)]


def _signature(line: str) -> tuple[list[Tensor], list[Tensor]] | None:
    """(operands, results) of an op line's trailing type signature, if it has one."""
    tail = line.split(" loc(")[0]
    if "->" in tail and ": (" in tail:
        head, _, result = tail.rpartition("->")
        return _tensors(head.rpartition(": (")[2]), _tensors(result)
    if ") : " in tail or " : tensor<" in tail:
        types = _tensors(tail.rpartition(" : ")[2])
        if types:  # one type: the operands' and the result's
            operands = max(1, tail.split(" : ")[0].count("%") - 1)
            return types * operands, types[:1]
    return None


def parse(text: str) -> list[Op]:
    """Every op of the exported module `text` with the times it runs per step."""
    functions: dict[str, list] = {}  # name -> [(op or ("call", callee), local times)]
    name, depth, loops, pending = None, 0, [], []
    constants: dict[str, int] = {}
    for line in text.splitlines():
        # Braces inside string attributes (a Triton kernel's serialised IR) are not regions.
        bare = _STRING.sub('""', line)
        opened, closed = bare.count("{"), bare.count("}")
        found = _FUNC.match(line)
        if found:
            name, constants, loops, pending = found.group(1), {}, [], []
            functions[name] = []
        if name is None:
            depth += opened - closed
            continue
        for constant, value in _CONST.findall(line):
            constants[constant] = int(value)
        times = math.prod(trip for trip, _ in loops) if loops else 1
        if loops and loops[-1][0] == 0 and (compare := _COMPARE.search(line)):
            op, left, right = compare.groups()
            bound = constants.get(right if op in ("LT", "LE", "NE") else left, 1)
            loops[-1] = (max(bound + (op in ("LE", "GE")), 1), loops[-1][1])
        call = _CALL.search(line)
        kind = _OP.search(line)
        if call and (not kind or "custom_call" not in line):
            functions[name].append((("call", call.group(1)), times))
        elif kind and kind.group(1) not in ("return", "constant"):
            op_name = kind.group(1)
            if op_name == "while":
                loops.append((0, depth))  # trip found in its cond; ends back at `depth`
            if op_name == "custom_call":
                target = _TARGET.search(line)
                kernel = _KERNEL.search(line)
                op_name = f"custom_call:{target.group(1) if target else '?'}" + (
                    f":{kernel.group(1)}" if kernel else "")
            op = Op(op_name, [], [], times, unique="unique_indices = true" in line)
            signature = _signature(line)
            if signature and op_name != "while":
                op.operands, op.results = signature
                functions[name].append((op, times))
            elif op_name != "while":  # a region op: its types close the region
                pending.append((op, depth))
        depth += opened - closed
        if pending and depth <= pending[-1][1] and (signature := _signature(line)):
            op, _ = pending.pop()
            op.operands, op.results = signature
            functions[name].append((op, op.times))
        while loops and depth <= loops[-1][1] and closed:
            loops.pop()
    return _flatten(functions)


def _flatten(functions: dict[str, list]) -> list[Op]:
    """Each function's ops with the times of the calls that reach it, from `main`."""
    calls: dict[str, int] = {}

    def visit(function: str, times: int) -> None:
        calls[function] = calls.get(function, 0) + times
        for item, local in functions.get(function, []):
            if isinstance(item, tuple):
                visit(item[1], times * local)

    visit("main", 1)
    out = []
    for function, times in calls.items():
        for item, _ in functions.get(function, []):
            if not isinstance(item, tuple):
                out.append(dataclasses.replace(item, times=item.times * times))
    return out


def _dot_kind(op: Op) -> str:
    return "dot_general:" + "x".join(t.dtype for t in op.operands[:2])


def summarize(ops: Iterable[Op], bandwidth_tbs: float = 3.35, top: int = 5) -> dict:
    """Per class: ops, bytes per step and the largest tensors; scatters without
    unique_indices; the data-movement bytes and their time at `bandwidth_tbs`."""
    classes: dict[str, dict] = {}
    for op in ops:
        kind = _dot_kind(op) if op.kind == "dot_general" else op.kind
        entry = classes.setdefault(kind, {"ops": 0, "bytes": 0, "largest": []})
        entry["ops"] += op.times
        entry["bytes"] += op.bytes * op.times
        entry["largest"].append((op.bytes, [str(t) for t in op.results], op.times))
        if op.kind == "scatter" and not op.unique:
            entry["without_unique_indices"] = entry.get("without_unique_indices", 0) + op.times
    for entry in classes.values():
        entry["largest"] = [{"bytes": b, "results": r, "times": t}
                            for b, r, t in sorted(entry["largest"], reverse=True)[:top]]
    movement = sum(e["bytes"] for k, e in classes.items() if k in MOVEMENT)
    return {"classes": dict(sorted(classes.items(), key=lambda kv: -kv[1]["bytes"])),
            "movement_bytes": movement, "bandwidth_tbs": bandwidth_tbs,
            "movement_ms": movement / (bandwidth_tbs * 1e12) * 1e3}


def largest_f32(ops: Iterable[Op], rank: int | None = None) -> int:
    """The elements of the largest float32 tensor (of `rank` dimensions, if given) any op
    makes (a result)."""
    return max((math.prod(t.shape) for op in ops for t in op.results if t.dtype == "f32"
                and (rank is None or len(t.shape) == rank)), default=0)


@contextlib.contextmanager
def _gpu_libraries_on_this_host():
    """Lowering for CUDA asks the installed cuDNN for its version (answered 9.8 here) and,
    from jax 0.11, the device for Triton's compute capability (an H100)."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    saved = fused.check_cudnn_version
    fused.check_cudnn_version = lambda: 90800
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        gpu_info = None
    if gpu_info is not None:
        saved_info = gpu_info.get_gpu_info
        h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
        gpu_info.get_gpu_info = lambda: h100
    try:
        yield
    finally:
        fused.check_cudnn_version = saved
        if gpu_info is not None:
            gpu_info.get_gpu_info = saved_info


def export_train_step(config, platform: str) -> str:
    """The StableHLO text of `config`'s train step exported for `platform`."""
    import jax
    from jax import export

    checks = [export.DisabledSafetyCheck.custom_call(t) for t in (
        "__gpu$xla.gpu.triton", *(f"__cudnn$fmha{k}{s}" for k in (
            "Softmax", "ScaleBiasSoftmax", "SoftmaxDropout", "ScaleBiasSoftmaxDropout")
            for s in ("", "Backward")))]
    with _gpu_libraries_on_this_host():
        program = setup_lib.build(config, config.tokenizer.vocab_size,
                                  sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    with _gpu_libraries_on_this_host(), sharding.activate(program.mesh, program.rules):
        exported = export.export(program.step, platforms=[platform],
                                 disabled_checks=checks)(
            program.state.abstract, program.batch_spec(), program.schedule_spec())
    return exported.mlir_module()


def kernel_calls(ops: Iterable[Op]) -> dict[str, int]:
    """Calls per step of each named kernel (a Pallas kernel's name, else the custom call's
    target): e.g. {"flash_attention_forward": 12, ...}."""
    calls: dict[str, int] = {}
    for op in ops:
        if op.kind.startswith("custom_call:"):
            name = op.kind.split(":")[-1]
            calls[name] = calls.get(name, 0) + op.times
    return calls


def backward_residuals(config) -> list[dict]:
    """What the backward pass keeps of each scanned stack of `config`'s train step (one
    micro-batch's loss, pretrain/steps.make_micro_loss, differentiated as the step does),
    read from the jaxpr of its VJP: the residuals a layer scan stacks, per stack (its
    layers, the bytes and tensors kept per layer, largest first). Weights the layer takes
    as they are (arguments) are not counted; their bf16 copies are. Traced, not compiled:
    fast at any size, on any host, with the GPU kernels the platform's "auto" picks."""
    import jax
    import jax.numpy as jnp

    from maelm_jax.pretrain import steps as pretrain_steps

    vocab = config.tokenizer.vocab_size
    with _gpu_libraries_on_this_host():
        program = setup_lib.build(config, vocab, sharding.make_mesh((1, 1, 1),
                                                                    jax.devices()[:1]))
    loss = pretrain_steps.make_micro_loss(
        program.model, setup_lib.model_config(config, vocab, program.shape),
        program.shape.objective, program.counts, vocab)
    key_words = pretrain_steps.train_key_data(0, config.train.prng_impl).shape[0]
    args = (program.state.abstract.params,
            jax.ShapeDtypeStruct((config.train.batch_size // config.train.grad_accum_steps,
                                  config.data.seq_len), jnp.int32),
            jax.ShapeDtypeStruct((key_words,), jnp.uint32))
    leaves, tree = jax.tree.flatten(args)

    def vjp(*xs):
        params, tokens, key = jax.tree.unflatten(tree, xs)
        key = jax.random.wrap_key_data(key, impl=config.train.prng_impl)
        return jax.vjp(lambda p: loss(p, tokens, key)[0], params)

    with _gpu_libraries_on_this_host(), sharding.activate(program.mesh, program.rules):
        closed, shapes = jax.make_jaxpr(vjp, return_shape=True)(*leaves)
    jaxpr = closed.jaxpr
    residuals = jaxpr.outvars[len(jaxpr.outvars) - len(jax.tree.leaves(shapes[1])):]
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    stacks: dict[int, dict] = {}
    for v in residuals:
        eqn = None if type(v).__name__ == "Literal" else producer.get(v)
        if eqn is None or eqn.primitive.name != "scan":
            continue
        layers = eqn.params["length"]
        stack = stacks.setdefault(id(eqn), {"layers": layers, "bytes_per_layer": 0,
                                            "tensors": []})
        tensor = Tensor(tuple(v.aval.shape[1:]), _HLO_NAMES.get(v.aval.dtype.name,
                                                                 v.aval.dtype.name))
        stack["bytes_per_layer"] += tensor.bytes
        stack["tensors"].append(str(tensor))
    for stack in stacks.values():
        stack["tensors"].sort(key=lambda t: -Tensor(*_parse_one(t)).bytes)
    return sorted(stacks.values(), key=lambda s: -s["layers"])


# numpy's dtype names as StableHLO writes them (Tensor.bytes reads the latter).
_HLO_NAMES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "i32",
              "uint32": "ui32", "bool": "i1", "int8": "i8", "uint8": "ui8"}


def _parse_one(text: str) -> tuple[tuple[int, ...], str]:
    *dims, dtype = text.split("x")
    return tuple(int(d) for d in dims), dtype


def table(name: str, summary: dict) -> str:
    title = (f"### {name}: {summary['movement_bytes'] / 1e9:.2f} GB of data movement per step "
             f"before fusion (~{summary['movement_ms']:.2f} ms at "
             f"{summary['bandwidth_tbs']:g} TB/s)")
    rows = []
    for kind, entry in summary["classes"].items():
        if entry["bytes"] < 1e6:
            continue
        largest = entry["largest"][0]["results"] if entry["largest"] else []
        extra = (f" ({entry['without_unique_indices']} without unique_indices)"
                 if "without_unique_indices" in entry else "")
        rows.append([f"{kind}{extra}", entry["ops"], f"{entry['bytes'] / 1e9:.3f}",
                     ", ".join(largest[:2])])
    head = ["class", "ops per step", "GB per step", "largest result"]
    return "\n".join([title, "", *markdown.table(head, rows)])


def backward_table(summary: dict) -> str:
    """What the backward keeps per layer of each stack, each kernel's calls per step and
    the attention forwards per backward (1: none is run again by rematerialisation)."""
    rows = [[f"{stack['layers']}-layer stack", f"{stack['bytes_per_layer'] / 1e6:.1f} MB",
             ", ".join(stack["tensors"][:4])] for stack in summary["residuals"]]
    calls = summary["kernel_calls"]
    listed = ", ".join(f"{name} {count}" for name, count in sorted(calls.items()))
    lines = ["Residuals kept per layer (the backward's; traced):", "",
             *markdown.table(["stack", "per layer", "largest"], rows), "",
             f"Kernel calls per step: {listed or 'none'}"]
    if calls.get("flash_attention_dq"):
        lines.append(f"Attention forwards per backward: "
                     f"{calls['flash_attention_forward'] / calls['flash_attention_dq']:g}")
    return "\n".join(lines)


def define_flags() -> None:
    harness.define_config("step_time.py")
    harness.define_objectives_flag(list(harness.OBJECTIVES), "Comma-separated, from "
                                   f"{', '.join(harness.OBJECTIVES)}.")
    flags.DEFINE_enum("platform", "cuda", ["cuda", "tpu"], "The platform to export for.")
    flags.DEFINE_float("bandwidth_tbs", 3.35, "Memory bandwidth (TB/s) for the time estimate "
                       "(H100 SXM 3.35, H200 4.8, TPU v5e 0.82).", lower_bound=0.001)
    flags.DEFINE_string("json", None, "Also write the summaries to this JSON file.")
    cli.output_file_flag("json")


def main(argv) -> None:
    del argv  # cli.tool_flags_parser refuses stray arguments
    backend = "gpu" if FLAGS.platform == "cuda" else "tpu"
    summaries = {}
    for objective, config in harness.objective_configs(FLAGS.config,
                                                       FLAGS.objectives).items():
        setup_lib.resolve_auto(config, backend)
        ops = parse(export_train_step(config, FLAGS.platform))
        summaries[objective] = summary = summarize(ops, FLAGS.bandwidth_tbs)
        summary["kernel_calls"] = kernel_calls(ops)
        summary["residuals"] = backward_residuals(config)
        print(table(f"{objective} ({config.model.attention_impl}, {config.model.dtype}, "
                    f"remat {config.model.remat_policy}, {FLAGS.platform})", summary))
        print()
        print(backward_table(summary))
        print()
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(summaries, f, indent=1, default=np.asarray)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.tool_flags_parser)
