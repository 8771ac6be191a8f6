r"""Every matmul of our compiled train step, timed alone under XLA and under PyTorch.

    pip install -r requirements-bench.txt   # torch (CPU build)
    python benchmarks/step_matmuls.py [--objective=mlm] [--config=configs/benchmark/peer.py] \
        [--config.<field>=<value> ...] [--threads=2 --repeats=21]

Compiles the objective's train step as peer_hf.py does (harness.Bench), reads XLA's
optimised HLO, and collects every dot instruction in it (inside fusions too): operand shapes,
batch and contracting dimensions, and where in the model it comes from (forward or
backward). Identical dots are grouped. Each group is then timed on its own, with operands
of those shapes in row-major order: a jitted `lax.dot_general` (XLA's CPU backend, which
picks its own kernel: YNNPACK, Eigen) and `torch.einsum` on the same contraction (PyTorch's
CPU kernels, `torch.set_num_threads(--threads)`). The sums per step say how fast the step's
matmul work can run under each library, one op at a time with nothing else running; with
the step's own time beside them, they say how much of the step is matmul and how far
XLA's matmuls are from PyTorch's on exactly these shapes.

That is the question behind peer_hf.py's MLM target: our MLM step does fewer FLOPs than the
peer's (its output layer runs at the masked positions only), and the ratio of the two
FLOP counts bounds the speed-up when both run their matmuls equally fast.

Operands whose layout in the step is not row-major are marked `*`: the isolated XLA time
then uses a row-major operand, which XLA may handle differently.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import statistics
import string

import jax
import numpy as np
from absl import app, flags
from jax import lax

from benchmarks import harness
from maelm_jax.infra import cli, records, timer

FLAGS = flags.FLAGS

# One HLO instruction: `%name = type[dims]{layout} opcode(operands), attributes`.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\](?:\{([\d,]*)[^}]*\})? (\w[\w-]*)\((.*)$",
    re.M)


@dataclasses.dataclass(frozen=True)
class Dot:
    """One dot_general contraction: operand shapes and dimension numbers (XLA's)."""

    dtype: str
    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]

    @property
    def flops(self) -> int:
        rhs_free = [d for i, d in enumerate(self.rhs)
                    if i not in self.rhs_batch and i not in self.rhs_contract]
        return 2 * int(np.prod(self.lhs)) * int(np.prod(rhs_free))

    def einsum(self) -> str:
        """The same contraction as an einsum spec (output: batch, lhs free, rhs free)."""
        letters = iter(string.ascii_letters)
        lhs = [next(letters) for _ in self.lhs]
        rhs = [next(letters) for _ in self.rhs]
        for l_dim, r_dim in zip(self.lhs_batch + self.lhs_contract,
                                self.rhs_batch + self.rhs_contract, strict=False):
            rhs[r_dim] = lhs[l_dim]
        batch = [lhs[i] for i in self.lhs_batch]
        lhs_free = [c for i, c in enumerate(lhs)
                    if i not in self.lhs_batch and i not in self.lhs_contract]
        rhs_free = [c for i, c in enumerate(rhs)
                    if i not in self.rhs_batch and i not in self.rhs_contract]
        return f"{''.join(lhs)},{''.join(rhs)}->{''.join(batch + lhs_free + rhs_free)}"


def _dims(attributes: str, key: str) -> tuple[int, ...]:
    match = re.search(key + r"=\{([\d,]*)\}", attributes)
    return tuple(int(x) for x in match.group(1).split(",") if x) if match else ()


def _where(attributes: str) -> str:
    """'fwd'/'bwd' and the op's path in the model, layers merged: 'bwd layer_N/mlp/wi'."""
    match = re.search(r'op_name="([^"]*)"', attributes)
    if not match:
        return "?"
    name = match.group(1)
    kind = "bwd" if "transpose(jvp" in name else "fwd"
    parts = [p for p in re.sub(r"layer_\d+", "layer_N", name).split("/")
             if p and not p.startswith(("jit(", "while", "body", "closed_call", "jvp(",
                                        "transpose(", "dot_general"))]
    return f"{kind} {'/'.join(parts[-3:])}"


def step_dots(hlo_text: str) -> tuple[collections.Counter, dict, set]:
    """Dots of an optimised HLO module: a Counter of `Dot`s, for each a Counter of where
    in the model it occurs (`_where`), and the set of those with an operand that is not
    row-major."""
    shapes, layouts = {}, {}
    instructions = list(_INSTRUCTION.finditer(hlo_text))
    for m in instructions:
        name, _, dims, layout = m.group(1, 2, 3, 4)
        shapes[name] = tuple(int(x) for x in dims.split(",") if x)
        layouts[name] = layout
    dots, where, strided = collections.Counter(), {}, set()
    for m in instructions:
        dtype, opcode, rest = m.group(2), m.group(5), m.group(6)
        if opcode != "dot":
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])[:2]
        dot = Dot(dtype, shapes[operands[0]], shapes[operands[1]],
                  _dims(rest, "lhs_batch_dims"), _dims(rest, "rhs_batch_dims"),
                  _dims(rest, "lhs_contracting_dims"), _dims(rest, "rhs_contracting_dims"))
        dots[dot] += 1
        where.setdefault(dot, collections.Counter())[_where(rest)] += 1
        for operand in operands:
            layout = layouts[operand]
            if layout and layout != ",".join(str(i) for i in reversed(range(
                    len(shapes[operand])))):
                strided.add(dot)
    return dots, where, strided


def _places(where: collections.Counter) -> str:
    """The commonest place of a dot shape, and how many others share the shape."""
    (first, _), others = where.most_common(1)[0], len(where) - 1
    return first + (f" (+{others} more)" if others else "")


def time_xla(dot: Dot, repeats: int) -> float:
    keys = jax.random.split(jax.random.PRNGKey(0))
    dtype = {"f32": jax.numpy.float32, "bf16": jax.numpy.bfloat16}[dot.dtype]
    lhs = jax.random.normal(keys[0], dot.lhs, dtype)
    rhs = jax.random.normal(keys[1], dot.rhs, dtype)
    numbers = ((dot.lhs_contract, dot.rhs_contract), (dot.lhs_batch, dot.rhs_batch))
    fn = jax.jit(lambda a, b: lax.dot_general(a, b, numbers))
    return timer.timed(lambda: fn(lhs, rhs), repeats)[1]


def time_torch(torch, dot: Dot, repeats: int) -> float:
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dot.dtype]
    lhs, rhs = torch.randn(dot.lhs, dtype=dtype), torch.randn(dot.rhs, dtype=dtype)
    spec = dot.einsum()
    with torch.no_grad():
        return timer.timed(lambda: torch.einsum(spec, lhs, rhs), repeats)[1]


def main(argv) -> None:
    del argv  # cli.tool_flags_parser refuses stray arguments
    harness.start_host_memory()
    try:
        import torch
    except ImportError as e:
        cli.fail(f"step_matmuls.py needs torch ({e}): pip install -r requirements-bench.txt",
                 cli.program())
    torch.set_num_threads(FLAGS.threads)
    config = harness.objective_configs(FLAGS.config, [FLAGS.objective])[FLAGS.objective]
    bench = harness.Bench(config, harness.random_tokens(config))
    dots, where, strided = step_dots(bench.step.as_text())
    bench.run(1)  # warm-up
    bench.clear()
    bench.run(5)
    step_seconds = statistics.median(bench.wall)
    print(f"jax {jax.__version__}, torch {torch.__version__} ({FLAGS.threads} threads); "
          f"fp32 jitted 2048x2048 matmul: {records.matmul_gflops():.1f} GFLOP/s")
    print(f"{FLAGS.objective} train step: {step_seconds * 1e3:.0f} ms (median of 5), "
          f"{sum(dots.values())} dots in {len(dots)} shapes\n")
    print(f"{'n':>3} {'lhs':>17} {'rhs':>17} {'einsum':>17} {'GFLOP':>6} {'XLA ms':>7} "
          f"{'GF/s':>5} {'torch ms':>8} {'GF/s':>5}  where")
    totals = collections.Counter()
    for dot, count in sorted(dots.items(), key=lambda kv: -kv[0].flops * kv[1]):
        xla, pt = time_xla(dot, FLAGS.repeats), time_torch(torch, dot, FLAGS.repeats)
        totals.update(flops=dot.flops * count, xla=xla * count, torch=pt * count)
        mark = "*" if dot in strided else " "
        print(f"{count:3d} {str(dot.lhs):>17} {str(dot.rhs):>17} {dot.einsum():>17} "
              f"{dot.flops / 1e9:6.3f} {xla * 1e3:7.2f} {dot.flops / xla / 1e9:5.0f} "
              f"{pt * 1e3:8.2f} {dot.flops / pt / 1e9:5.0f}{mark} {_places(where[dot])}",
              flush=True)
    gflop = totals["flops"] / 1e9
    print(f"\nper step, {gflop:.1f} GFLOP of matmuls: XLA {totals['xla'] * 1e3:.0f} ms "
          f"({gflop / totals['xla']:.0f} GFLOP/s), PyTorch {totals['torch'] * 1e3:.0f} ms "
          f"({gflop / totals['torch']:.0f} GFLOP/s), each op alone; the whole step "
          f"{step_seconds * 1e3:.0f} ms ({gflop / step_seconds:.0f} GFLOP/s of matmul work)")


def define_flags() -> None:
    harness.define_config("peer.py")
    flags.DEFINE_enum("objective", "mlm", ["mlm", "maelm"], "Whose train step to read.")
    flags.DEFINE_integer("threads", 2, "torch.set_num_threads for PyTorch's side.",
                         lower_bound=1)
    flags.DEFINE_integer("repeats", 21, "Timed calls per matmul and library; the median "
                         "counts.", lower_bound=1)
    harness.define_host_memory_flag()


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.tool_flags_parser)
