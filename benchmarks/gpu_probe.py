r"""One prepared GPU call: what a CPU cannot say about the BERT-base step, measured in one
process within a time budget, each figure a JSON line appended and flushed as soon as it
is measured (a call cut short keeps every line it wrote).

    python benchmarks/gpu_probe.py --out=$OUT --budget_seconds=420 \
        [--config=configs/benchmark/peer.py:base] [--sections=matmul,step,...]

Sections, in this order (a section, or a side of one, whose estimated cost no longer fits
the budget is skipped with a line saying so):

- matmul: the device's bf16 matmul rate (the peak MFU is given against).
- step: MLM's and MAE-LM's default train steps: ms, tokens/s, MFU by the model FLOPs
  (forward + backward = 3 x forward).
- profile: one MLM step traced, its device time summed per op class: each attention
  kernel, cuDNN's attention, the GEMMs, the optimiser (its ops under the "optimizer"
  scope of pretrain/steps.py), the other fusions and ops, and the gaps between them (the
  step's time less its ops').
- attention: one layer's attention at the config's shape, forward and forward + backward:
  ours with the shared bias and dropout (the default), without bias, without dropout,
  with MAE-LM's per-example bias (read from its grid by position), with the tile and
  bias-gradient candidates; against jax's own Pallas `mha` (no bias, no dropout) and cuDNN
  (a bias, with and without its gradient; on a GPU only).
- variants: the train step's variants timed in rotation with the default MLM step: the
  remat policy kept whole or dots_no_batch, no relative bias (MLM and MAE-LM), the output
  layer in bf16, the rbg PRNG, no dropout (a ceiling), the bias gradient's own kernel,
  the combined tile wins.
- peer: Hugging Face's RobertaForMaskedLM, stock and at our work (its LM head at the
  masked positions), beside the default MLM step (needs requirements-bench.txt).
- xla_flags: the MLM step in a child process for each set of XLA flags (flags are read
  when a process starts): on a GPU the command buffers off, and on; on a CPU a flag of
  its own, so that the mechanism runs in CI.

Every line holds "section" and "name"; the first one the device, jax's version and the
commit. docs/performance.md ("The GPU probe") has the rules the lines are read by, written
before any call. On a CPU the script runs at any size with the kernels interpreted (CI
runs it tiny: every side built, every line written).
"""

from __future__ import annotations

import os

# Before JAX starts: the peer shares the GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks import attention as attention_bench  # noqa: E402
from benchmarks import harness  # noqa: E402
from maelm_jax.infra import cli, records, timer  # noqa: E402
from maelm_jax.models import by_position  # noqa: E402
from maelm_jax.models import flash_attention as fa  # noqa: E402
from maelm_jax.pretrain import config as pretrain_config  # noqa: E402

FLAGS = flags.FLAGS
SECTIONS = ("matmul", "step", "profile", "attention", "variants", "peer", "xla_flags")
# The train step's variants (section "variants"): name -> (objective, config changes).
VARIANTS = {
    "mlm remat none": ("mlm", {"model.remat_policy": "none"}),
    "mlm remat dots_no_batch": ("mlm", {"model.remat_policy": "dots_no_batch"}),
    "mlm no relative bias": ("mlm", {"model.rel_pos_buckets": 0}),
    "maelm no relative bias": ("maelm", {"model.rel_pos_buckets": 0}),
    "mlm output layer bf16": ("mlm", {"model.output_dtype": "compute"}),
    "mlm prng rbg": ("mlm", {"train.prng_impl": "rbg"}),
    "mlm no dropout": ("mlm", {"model.dropout": 0.0, "model.attention_dropout": 0.0,
                               "model.attention_impl": "pallas"}),
    "mlm bias_grad kernel": ("mlm", {"model.pallas.bias_grad": "kernel"}),
    "mlm combined tile wins": ("mlm", {f"model.pallas.{k}": v
                                       for k, v in attention_bench.COMBINED_WINS.items()}),
}
# XLA flags per platform (section "xla_flags"): name -> the flags added to XLA_FLAGS.
XLA_FLAG_SETS = {
    "gpu": {"command buffers off": "--xla_gpu_enable_command_buffer=",
            "command buffers on fusions, cuBLAS and custom calls":
                "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL"},
    # A flag every jaxlib knows (the CPU's own come and go between versions).
    "cpu": {"backend optimisation level 1": "--xla_backend_optimization_level=1"},
}
# The attention kernels' candidates (section "attention"): the sweep's combined wins and the
# bias gradient's own kernel.
KERNEL_CANDIDATES = {"combined tile wins": attention_bench.COMBINED_WINS,
                     "bias_grad kernel": {"bias_grad": "kernel"},
                     "bias_grad kernel, 1 group": {"bias_grad": "kernel",
                                                   "bias_grad_groups": 1}}


def define_flags() -> None:
    harness.define_config("peer.py:base")
    flags.DEFINE_string("out", None, "Directory of gpu_probe.jsonl (appended).", required=True)
    flags.DEFINE_float("budget_seconds", 420.0, "Stop starting sections and sides once this "
                       "much time has passed (the call's limit less a margin).", lower_bound=1)
    flags.DEFINE_list("sections", list(SECTIONS), f"Sections to run, from {', '.join(SECTIONS)}.")
    cli.choices_flag("sections", SECTIONS)
    flags.DEFINE_integer("steps", 5, "Timed steps per round.", lower_bound=1)
    flags.DEFINE_integer("repeats", 3, "Rounds, rotated between sides; medians reported.",
                         lower_bound=1)
    flags.DEFINE_integer("profile_steps", 2, "Steps traced by the profile.", lower_bound=1)


class Probe:
    """The call's clock and its record: `line` appends one measurement and flushes it;
    `fits` says whether something estimated to take `seconds` still fits the budget, and
    writes the line that says it was skipped where it does not."""

    def __init__(self, out: pathlib.Path, budget_seconds: float, tag: dict | None = None):
        self.tag = tag or {}  # in every line (a child's flag set)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "gpu_probe.jsonl"
        self.deadline = time.monotonic() + budget_seconds
        self.start = time.monotonic()

    def line(self, section: str, name: str, **figures) -> None:
        entry = {"section": section, "name": name, **self.tag, **figures,
                 "at_s": round(time.monotonic() - self.start, 1)}
        with open(self.path, "a") as f:
            f.write(json.dumps(entry, default=float) + "\n")
            f.flush()
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}
        print(f"[{section}] {name}: {shown}", flush=True)

    def fits(self, section: str, name: str, seconds: float) -> bool:
        left = self.deadline - time.monotonic()
        if left >= seconds:
            return True
        self.line(section, name, skipped=f"{left:.0f} s left, about {seconds:.0f} s needed")
        return False


def _config(objective: str, changes: dict | None = None):
    c = harness.objective_config(FLAGS.config, objective)
    for field, value in (changes or {}).items():
        section, _, name = field.rpartition(".")
        node = c
        for part in section.split("."):
            node = node[part]
        node[name] = value
    pretrain_config.validate(c)
    return c


def _bench(probe: Probe, section: str, name: str, c, tokens, estimate: float):
    """harness.Bench of `c` (None with an "error" line if it does not build, or a
    "skipped" line if it would not fit), and the seconds it took."""
    if not probe.fits(section, name, estimate):
        return None, estimate
    start = time.perf_counter()
    try:
        b = harness.Bench(c, tokens)
    except Exception as e:  # noqa: BLE001 (a side that does not build is a finding)
        probe.line(section, name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return None, time.perf_counter() - start
    return b, time.perf_counter() - start


def section_matmul(probe: Probe) -> float:
    what, peak = records.machine_speed()
    probe.line("matmul", what, tflops=peak)
    return peak


def _step_figures(b, peak: float, tokens_per_step: int) -> dict:
    s = statistics.median(b.wall)
    return {"ms": 1e3 * s, "tokens_per_s": tokens_per_step / s,
            "mfu": b.flops / s / 1e12 / peak, "compile_s": b.compile_seconds,
            "flops_count": harness.FLOPS_COUNT}


def section_step(probe: Probe, peak: float, tokens) -> dict:
    """The default MLM and MAE-LM steps, built and timed in rotation; returns the benches
    (the later sections time their sides against them)."""
    benches, estimate = {}, 60.0
    for objective in ("mlm", "maelm"):
        b, estimate = _bench(probe, "step", f"{objective} default", _config(objective),
                             tokens, estimate)
        if b is not None:
            benches[objective] = b
    timer.rotated(benches, 1, FLAGS.repeats, FLAGS.steps)
    for objective, b in benches.items():
        probe.line("step", f"{objective} default", **_step_figures(b, peak, tokens.size),
                   remat_policy=b.remat_policy, attention_impl=b.attention_impl)
    return benches


# ------------------------------------------------------------------------------ profile

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = ")


def op_classes(hlo: str) -> dict[str, str]:
    """Each instruction of the compiled HLO text `hlo` by the class the profile sums it in:
    "attention:<kernel>" (our Pallas kernels by name), "attention:cudnn", "gemm" (cuBLAS
    and XLA's Triton GEMMs), "optimizer" (under the train step's "optimizer" scope),
    "fusion" or "other"."""
    classes = {}
    for line in hlo.splitlines():
        found = _INSTRUCTION.match(line)
        if not found:
            continue
        kernel = re.search(r'"name"\s*:\s*"(flash_attention_\w+)"|name=\\?"(flash_attention_\w+)',
                           line)
        if kernel:
            kind = f"attention:{kernel.group(1) or kernel.group(2)}"
        elif "__cudnn$fmha" in line:
            kind = "attention:cudnn"
        elif "__cublas" in line or "triton_gemm" in line or " dot(" in line:
            kind = "gemm"
        elif "/optimizer/" in line:
            kind = "optimizer"
        elif " fusion(" in line:
            kind = "fusion"
        else:
            kind = "other"
        classes[found.group(1)] = kind
    return classes


def section_profile(probe: Probe, benches: dict, out: pathlib.Path) -> None:
    from maelm_jax.training import profiler

    b = benches.get("mlm")
    if b is None or not probe.fits("profile", "mlm default", 30.0):
        return
    steps = FLAGS.profile_steps
    trace_dir = out / "probe_trace"
    shutil.rmtree(trace_dir, ignore_errors=True)
    b.clear()
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        b.run(steps)
    ops = profiler.op_seconds(trace_dir)
    shutil.rmtree(trace_dir, ignore_errors=True)  # large; the sums are what is kept
    classes = op_classes(b.step.as_text())
    per_class: dict[str, float] = {}
    for op, seconds in ops.items():
        kind = classes.get(op, classes.get(op.split(":")[0], "other"))
        per_class[kind] = per_class.get(kind, 0.0) + 1e3 * seconds / steps
    step_ms = 1e3 * sum(b.wall) / steps
    probe.line("profile", "mlm default", step_ms=step_ms,
               ops_ms=sum(per_class.values()), gaps_ms=step_ms - sum(per_class.values()),
               ms_per_class=dict(sorted(per_class.items(), key=lambda kv: -kv[1])),
               top_ops={op: 1e3 * s / steps for op, s in
                        sorted(ops.items(), key=lambda kv: -kv[1])[:12]})


# ---------------------------------------------------------------------------- attention


def _timed(fn: Callable, *args) -> tuple[float, float]:
    """(compile seconds, median ms) of jitted `fn` on `args` (the one timer)."""
    jitted = jax.jit(fn)
    compile_s, seconds = timer.timed(lambda: jitted(*args), FLAGS.repeats * FLAGS.steps)
    return compile_s, 1e3 * seconds


def _per_example_bias(bias, B: int, n: int, L: int, key) -> by_position.GridBias:
    """MAE-LM's bias: each row's n kept positions of L (sorted, distinct), read from the
    [heads, L, L] grid by position."""
    scores = jax.random.uniform(key, (B, L))
    kept = jnp.sort(jnp.argsort(scores, axis=1)[:, :n], axis=1).astype(jnp.int32)
    return by_position.GridBias(bias[0], kept, kept)


def section_attention(probe: Probe) -> None:
    c = FLAGS.config
    B, L = c.train.batch_size, c.data.seq_len
    H = c.model.num_heads
    D = c.model.d_model // H
    rate = c.model.attention_dropout
    dtype = jnp.bfloat16 if records.on_accelerator() else jnp.float32
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    q, k, v = (jax.random.normal(key, (B, L, H, D), dtype) for key in keys[:3])
    bias = 0.5 * jax.random.normal(keys[3], (1, H, L, L), jnp.float32)
    seed = jax.random.bits(keys[4], (2,), jnp.uint32)
    n_enc = pretrain_config.mask_counts(_config("maelm")).n_enc
    grid_bias = _per_example_bias(bias, B, n_enc, L, keys[5])
    q_enc, k_enc, v_enc = (x[:, :n_enc] for x in (q, k, v))
    scale = 1 / np.sqrt(D)

    def ours(options=fa.KernelOptions(), with_bias=True, dropout=rate):  # noqa: B008
        def f(q, k, v, b):
            return fa.attention(q, k, v, b if with_bias else None, None, seed, scale=scale,
                                dropout_rate=dropout, options=options)
        return f

    sides = {"ours, bias and dropout": (ours(), (q, k, v, bias)),
             "ours, no bias": (ours(with_bias=False), (q, k, v, bias)),
             "ours, no dropout": (ours(dropout=0.0), (q, k, v, bias)),
             "ours, no bias, no dropout": (ours(with_bias=False, dropout=0.0), (q, k, v, bias)),
             "ours, MAE-LM's per-example bias": (ours(), (q_enc, k_enc, v_enc, grid_bias))}
    for name, changes in KERNEL_CANDIDATES.items():
        options = fa.KernelOptions.from_fields({**fa.KernelOptions().fields(), **changes})
        sides[f"ours, {name}"] = (ours(options), (q, k, v, bias))
    sides["jax's Pallas mha (no bias, no dropout)"] = (_jax_mha(scale), (q, k, v, bias))
    if records.on_accelerator():
        sides["cuDNN, bias without its gradient"] = (_cudnn(bias_grad=False), (q, k, v, bias))
        sides["cuDNN, bias with its gradient"] = (_cudnn(bias_grad=True), (q, k, v, bias))
    else:
        probe.line("attention", "cuDNN", skipped="not on a GPU")
    estimate = 20.0
    for name, (f, args) in sides.items():
        if not probe.fits("attention", name, estimate):
            continue
        start = time.perf_counter()
        try:
            forward = _timed(f, *args)
            # The bias's gradient too (a GridBias's grid; its positions are integers).
            backward = _timed(jax.grad(lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32)),
                                       argnums=(0, 1, 2, 3), allow_int=True), *args)
        except Exception as e:  # noqa: BLE001 (a side that does not run is a finding)
            probe.line("attention", name,
                       error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        estimate = time.perf_counter() - start
        probe.line("attention", name, forward_ms=forward[1], forward_backward_ms=backward[1],
                   shape=[B, args[0].shape[1], H, D], dtype=jnp.dtype(dtype).name)


def _jax_mha(scale: float) -> Callable:
    from jax.experimental.pallas.ops.gpu import attention as jax_attention

    def f(q, k, v, b):
        del b
        return jax_attention.mha(q, k, v, None, sm_scale=scale,
                                 interpret=not records.on_accelerator())
    return f


def _cudnn(bias_grad: bool) -> Callable:
    def f(q, k, v, b):
        b = b.astype(q.dtype)
        if not bias_grad:
            b = jax.lax.stop_gradient(b)
        return jax.nn.dot_product_attention(q, k, v, bias=b, implementation="cudnn")
    return f


# --------------------------------------------------------------------- variants and peer


def section_variants(probe: Probe, peak: float, benches: dict, tokens) -> None:
    """Each variant timed in rotation with its objective's default step: its ms and its
    speed-up over the default (round-paired medians)."""
    sides, estimate = {}, max((b.compile_seconds for b in benches.values()), default=30.0)
    for name, (objective, changes) in VARIANTS.items():
        if objective not in benches:
            probe.line("variants", name, skipped=f"the default {objective} step was not built")
            continue
        b, estimate = _bench(probe, "variants", name, _config(objective, changes), tokens,
                             estimate + 5.0)
        if b is not None:
            sides[name] = (objective, b)
    if not sides:
        return
    everything = {**{f"{o} default": b for o, b in benches.items()},
                  **{name: b for name, (_, b) in sides.items()}}
    for b in everything.values():
        b.clear()
    timer.rotated(everything, 1, FLAGS.repeats, FLAGS.steps)
    for name, (objective, b) in sides.items():
        default = benches[objective]
        speedup = statistics.median(timer.round_ratios(default.wall, b.wall, FLAGS.steps))
        probe.line("variants", name, **_step_figures(b, peak, tokens.size),
                   speedup_over_default=speedup, changes=VARIANTS[name][1])


def section_peer(probe: Probe, peak: float, benches: dict, tokens) -> None:
    try:
        import torch

        from benchmarks import roberta_peer
    except ImportError as e:
        probe.line("peer", "RobertaForMaskedLM",
                   skipped=f"{e} (pip install -r requirements-bench.txt)")
        return
    mlm = benches.get("mlm")
    if mlm is None:
        probe.line("peer", "RobertaForMaskedLM", skipped="the default MLM step was not built")
        return
    device = "cuda" if records.on_accelerator() and torch.cuda.is_available() else "cpu"
    peers = {}
    for compiled, masked_head in ((False, False), (False, True)) + (
            ((True, False),) if device == "cuda" else ()):
        name = "peer (torch.compile)" if compiled else (
            "peer (masked head)" if masked_head else "peer")
        if probe.fits("peer", name, 30.0):
            peers[name] = roberta_peer.PeerBench(_config("mlm"), tokens, device, compiled,
                                                 masked_head)
    everything = {"mlm default": mlm, **peers}
    for b in everything.values():
        b.clear()
    timer.rotated(everything, 1, FLAGS.repeats, FLAGS.steps)
    for name, p in peers.items():
        s = statistics.median(p.wall)
        probe.line("peer", name, ms=1e3 * s, mfu=mlm.flops / s / 1e12 / peak,
                   ours_speedup=statistics.median(
                       timer.round_ratios(p.wall, mlm.wall, FLAGS.steps)),
                   attention=p.attention, device=device)


# ---------------------------------------------------------------------------- XLA flags


def section_xla_flags(probe: Probe) -> None:
    """The MLM step in a child process per flag set, each writing its "step" line into
    this call's file (the child runs only that section)."""
    platform = "gpu" if records.on_accelerator() else "cpu"
    for name, extra in XLA_FLAG_SETS[platform].items():
        if not probe.fits("xla_flags", name, 90.0):
            continue
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {extra}".strip())
        left = max(probe.deadline - time.monotonic(), 1.0)
        argv = [a for a in sys.argv[1:]
                if not a.startswith(("--sections", "--budget_seconds", "--xla_flags_name"))]
        try:
            done = subprocess.run(
                [sys.executable, str(pathlib.Path(__file__).resolve()), *argv,
                 "--sections=matmul,step", f"--budget_seconds={left:.0f}",
                 f"--xla_flags_name={name}"],
                env=env, capture_output=True, text=True, timeout=left + 30)
            error = None if done.returncode == 0 else done.stderr.strip().splitlines()[-1:]
        except subprocess.TimeoutExpired:
            error = ["timed out"]
        probe.line("xla_flags", name, flags=extra, returncode=None if error == ["timed out"]
                   else done.returncode, error=error[0] if error else None)


def main(argv) -> None:
    del argv  # cli.tool_flags_parser refuses stray arguments
    out = pathlib.Path(FLAGS.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_probe.jsonl").touch()
    except OSError as e:
        cli.fail(f"--out: cannot write {out / 'gpu_probe.jsonl'} ({e.strerror or e}); expected a "
                 "directory this process can write", cli.program())
    probe = Probe(out, FLAGS.budget_seconds,
                  {"flag_set": FLAGS.xla_flags_name} if FLAGS.xla_flags_name else None)
    machine = records.machine(("not measured", 0.0))
    probe.line("machine", harness.device_line(), device=machine["device"],
               jax=jax.__version__, commit=machine["commit"], sizes=harness.sizes(FLAGS.config),
               xla_flags=os.environ.get("XLA_FLAGS", ""))
    sections = set(FLAGS.sections)
    peak = section_matmul(probe) if "matmul" in sections else 1.0
    tokens = harness.random_tokens(FLAGS.config)
    needs_steps = sections & {"step", "profile", "variants", "peer"}
    benches = section_step(probe, peak, tokens) if needs_steps else {}
    if "profile" in sections:
        section_profile(probe, benches, out)
    if "attention" in sections:
        section_attention(probe)
    if "variants" in sections:
        section_variants(probe, peak, benches, tokens)
    if "peer" in sections:
        section_peer(probe, peak, benches, tokens)
    if "xla_flags" in sections:
        section_xla_flags(probe)
    probe.line("done", "probe", seconds=time.monotonic() - probe.start)


if __name__ == "__main__":
    define_flags()
    flags.DEFINE_string("xla_flags_name", "", "Set by the xla_flags section on its child "
                        "processes: the flag set their lines were measured under.")
    app.run(main, flags_parser=cli.tool_flags_parser)
