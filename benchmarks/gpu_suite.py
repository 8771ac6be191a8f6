r"""Everything the GPU path is judged by, measured in one call and written to one directory.

    python benchmarks/gpu_suite.py --out=DIR                       # 2 layers at BERT-base width
    python benchmarks/gpu_suite.py --out=DIR --config=configs/benchmark/peer.py:base  # 12 layers
    python benchmarks/gpu_suite.py --out=DIR --parts=attention --sweep=full

Writes DIR/gpu_suite.json and DIR/gpu_suite.md (and each part's record and log under
DIR/parts/ and DIR/logs/), rewritten after every part, so a call cut short still returns
what it measured; at the end, its record with the machine (recording.py) to --record_dir,
from which benchmarks/tables.py renders the suite's tables into the docs. Each part runs
in a process of its own, in this order, while --budget_seconds (default 510: a 9-minute
command with room to copy the results) lasts:

1. attention (benchmarks/attention.py): the Pallas kernel against the einsum reference at
   the compute dtype (outputs; gradients of q, k, v and the bias; the dropout's kept
   fraction, variance, forward/backward agreement and determinism), then forward +
   backward timed at the config's attention shapes for einsum with dropout, cuDNN without
   and Pallas with dropout in every variant of --sweep (tiles, warps, stages, the
   bias-gradient scheme, dropout elements per hash), each variant checked before it is
   timed, and the fastest option values combined greedily (kept only where faster).
2. throughput: the train step of each objective (--objectives) with each attention
   implementation (--impls: einsum and pallas with the config's attention dropout, cudnn
   without attention dropout, the only way its fused call runs in training; pallas with
   the fastest options part 1 found) and Hugging Face's RobertaForMaskedLM (eager and
   torch.compile, the faster counts, and eager at our work: its LM head and loss at the
   masked positions only; benchmarks/roberta_peer.py), timed in rotation in one process:
   ms/step, tokens/s, the ratio to the stock peer and to the equal-work peer, MFU (6 N T,
   and the model FLOPs, forward + backward = 3 x forward, for every side, the peers
   credited with MLM's) against a bf16 8192^3 matmul measured in the same process, and
   each objective's time
   ratio to MLM against its FLOPs ratio. MLM of the first kernel is built first, then the
   peer, then the rest while --timing_reserve_seconds would still be left to time them
   before the part's share of the budget ends: a short lease still gets figures (at 12
   layers every side's compiles took more than 4 minutes of an H200).
3. profile: a jax.profiler trace of a few train steps of each of --profile_sides (by
   default MLM and MAE-LM with the Pallas kernel where it runs, and MAE-LM without its
   relative bias: what the bias costs), its device time summed per XLA op (the HLO
   fusions and kernels), the top ops written to the table and each side's optimised HLO
   to DIR/profile/, where those names are defined.
4. quickstart: the README's command (`python main.py
   --config=configs/pretrain/quickstart.py --workdir=...`) timed end to end, in a fresh
   workdir, with the compilation cache of this call.
5. compile: the MLM step (pallas where offered) compiled in three fresh processes
   sharing a new cache directory: cold, cached (the same program), and a new program with
   the same matmul shapes (another learning rate), which shows what XLA's cached
   autotuning results buy a config that was never compiled.

Targets (docs/performance.md): tokens/s over the peer's >= 1.5x for MLM, 3ML_self and
3ML_cross and >= 1.3x for MAE-LM at BERT-base shapes; MFU >= 35 %; each objective's time
ratio to MLM within 5 % of its FLOPs ratio; cold compile <= 45 s, cached <= 5 s; the
quickstart <= 60 s. On a CPU the same runs at whatever sizes the config gives (the tests
run it tiny), without the peer unless torch is installed.
"""

from __future__ import annotations

import os

# Before JAX starts: the peer and several processes share the GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

from benchmarks import REPO_ROOT, harness, recording, suite_report  # noqa: E402
from benchmarks.suite_report import TARGETS  # noqa: E402
from maelm_jax.infra import cli, records, timer  # noqa: E402

PARTS = ("attention", "throughput", "profile", "quickstart", "compile")
IMPLS = ("einsum", "pallas", "cudnn")
# Least seconds worth starting a part with.
MIN_SECONDS = {"attention": 30, "throughput": 60, "profile": 45, "quickstart": 30,
               "compile": 45}


@dataclasses.dataclass(frozen=True)
class Suite:
    """One platform's suite: its name (its files NAME.json and NAME.md, its record and its
    table) and title, and the defaults of the flags that choose its sides."""

    name: str
    title: str
    kernel: str  # part 1's Pallas kernels: "auto" (the platform's own) or "tpu"
    peer: str  # part 2's peer: "hf" or "none"
    impls: tuple[str, ...]  # part 2's attention implementations; () chooses by platform


GPU = Suite("gpu_suite", "GPU suite", kernel="auto", peer="hf", impls=())
# No PyTorch peer on a TPU: it is a GPU measurement; no cuDNN either.
TPU = Suite("tpu_suite", "TPU suite", kernel="tpu", peer="none", impls=("einsum", "pallas"))

FLAGS = flags.FLAGS


def define_flags(suite: Suite) -> None:
    """The suite's flags, with `suite`'s defaults (the part processes run the same script
    again, so they get the same)."""
    harness.define_config("peer.py:base,layers=2")
    flags.DEFINE_string("out", "", "Directory for the suite's NAME.json and NAME.md, parts/, "
                        "logs/.")
    cli.directory_flag("out")
    recording.define_flag(suite.name)
    flags.DEFINE_list("parts", list(PARTS), f"Parts to run, from {', '.join(PARTS)}.")
    flags.DEFINE_enum("sweep", "quick", ["none", "quick", "full"], "Pallas variants of part 1.")
    flags.DEFINE_enum("kernel", suite.kernel, ["auto", "tpu"], "Part 1's Pallas kernels: the "
                      "platform's own, or the TPU's (interpreted on a CPU).")
    flags.DEFINE_list("impls", list(suite.impls), "Attention implementations of part 2, from "
                      f"{', '.join(IMPLS)} (empty: all three on a GPU, einsum and pallas on a "
                      "TPU, einsum elsewhere).")
    cli.choices_flag("parts", PARTS)
    cli.choices_flag("impls", IMPLS)
    harness.define_objectives_flag(list(harness.OBJECTIVES), "Objectives of part 2 (mlm "
                                   "always).")
    flags.DEFINE_enum("peer", suite.peer, ["hf", "none"], "Part 2's Hugging Face peer, or "
                      "none.")
    flags.DEFINE_integer("budget_seconds", 510, "Parts start while this many seconds last.",
                         lower_bound=1)
    flags.DEFINE_integer("steps", 5, "Part 2: timed steps per measurement.", lower_bound=1)
    flags.DEFINE_integer("repeats", 3, "Part 2: measurements per side, rotated.", lower_bound=1)
    flags.DEFINE_integer("attention_repeats", 10, "Part 1: timed calls per variant.",
                         lower_bound=1)
    flags.DEFINE_list("profile_sides", [], "Part 3's train steps, each OBJECTIVE/IMPL[:FIELD="
                      "VALUE[;FIELD=VALUE...]] (default: mlm/I, maelm/I and maelm/I:model."
                      "rel_pos_buckets=0, I = pallas on a GPU or TPU, einsum elsewhere).")
    flags.DEFINE_integer("profile_steps", 3, "Part 3: traced steps per side.", lower_bound=1)
    flags.DEFINE_integer("timing_reserve_seconds", 45, "Part 2: seconds kept for timing the "
                         "sides built; no side is built that would leave fewer before the "
                         "part's end, so a part cut by the budget still times what it built.",
                         lower_bound=0)
    flags.DEFINE_string("part", "", "Internal: run one part in this process.")
    flags.DEFINE_float("part_deadline", 0.0, "Internal: the Unix time the part is stopped "
                       "at.", lower_bound=0.0)
    flags.DEFINE_string("compile_case", "", "Internal: one compile process (cold, cached, "
                        "new).")
    flags.DEFINE_string("cache", "", "Internal: the compile part's cache directory.")


def run(suite: Suite) -> None:
    """Runs `suite` as this process's script: its flags, then `main`."""
    define_flags(suite)
    app.run(functools.partial(main, suite=suite), flags_parser=cli.tool_flags_parser)


# --- the parts, each in its own process ------------------------------------------------


def _write(path: pathlib.Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str))


def _log(line: str) -> None:
    print(line, flush=True)


def part_attention(out: pathlib.Path) -> dict:
    import jax.numpy as jnp

    from benchmarks import attention
    from maelm_jax.models import layers

    config = FLAGS.config
    m = config.model
    dtype = layers.resolve_dtype(m.dtype)
    shape = (config.train.batch_size, config.data.seq_len, m.num_heads,
             m.d_model // m.num_heads)
    _log(harness.device_line())
    record = attention.run(shape, jnp.dtype(dtype), m.attention_dropout,
                           FLAGS.attention_repeats,
                           attention.sweep_variants(FLAGS.sweep, FLAGS.kernel), _log,
                           kernel=FLAGS.kernel)
    record["device"] = harness.device_line()
    return record


def _impls() -> list[str]:
    if FLAGS.impls:
        return list(FLAGS.impls)
    if jax_backend() == "tpu":  # cuDNN is a GPU library
        return ["einsum", "pallas"]
    return list(IMPLS) if records.on_accelerator() else ["einsum"]


def jax_backend() -> str:
    import jax

    return jax.default_backend()


def _side_config(config, objective: str, impl: str, pallas: dict | None):
    c = config.copy_and_resolve_references()
    c.model.attention_impl = impl
    if impl == "pallas" and pallas:
        c.model.pallas.update(pallas)
    c = harness.objective_config(c, objective)
    if impl == "cudnn":  # its fused call runs in training only without attention dropout
        c.model.attention_dropout = c.model.decoder.attention_dropout = 0.0
    return c


def _sweep_options(out: pathlib.Path) -> dict | None:
    """The Pallas options part 1 found fastest in this call, if it ran."""
    record = out / "parts" / "attention.json"
    return json.loads(record.read_text()).get("fastest") if record.exists() else None


def part_throughput(out: pathlib.Path) -> dict:
    from maelm_jax.pretrain import config as pretrain_config

    config = FLAGS.config
    impls = _impls()
    objectives = ["mlm"] + [o for o in harness.OBJECTIVES[1:] if o in FLAGS.objectives]
    fastest = _sweep_options(out)
    what, peak = records.machine_speed()
    _log(f"{harness.device_line()}; {records.describe_speed(what, peak)}")
    tokens = harness.random_tokens(config)
    tokens_per_step = config.train.batch_size * config.data.seq_len
    benches, sides = {}, {}
    deadline = FLAGS.part_deadline or float("inf")
    last_build = 0.0  # the last side's build seconds: the next one's estimate

    def room(name: str) -> bool:
        """Whether building `name` (estimated as long as the last side) still leaves
        --timing_reserve_seconds before the part is stopped; else it is recorded skipped."""
        left = deadline - time.time()
        if not benches or left - last_build >= FLAGS.timing_reserve_seconds:
            return True
        sides[name] = {"skipped": f"{left:.0f} s left to build and time it"}
        _log(f"  {name}: not built ({sides[name]['skipped']})")
        return False

    # MLM of the first kernel, then the peer, then the rest: a part cut short by its time
    # still has MLM against the peer.
    plan = [(objective, impl) for impl in impls for objective in objectives]
    for k, (objective, impl) in enumerate(plan):
        name = f"{objective} / {impl}"
        if room(name):
            try:
                c = _side_config(config, objective, impl, fastest)
                pretrain_config.validate(c)
                start = time.perf_counter()
                b = harness.Bench(c, tokens)
                last_build = time.perf_counter() - start
            except Exception as e:  # noqa: BLE001 (a side that does not build is a finding)
                sides[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                _log(f"  {name}: not timed ({sides[name]['error']})")
            else:
                benches[name] = b
                sides[name] = {"objective": objective, "impl": impl,
                               "compile_s": b.compile_seconds, "num_params": b.num_params,
                               "flops": b.flops,
                               "attention_dropout": c.model.attention_dropout}
                _log(f"  {name}: compiled in {b.compile_seconds:.1f} s")
        if k == 0 and FLAGS.peer == "hf" and room("peer"):
            start = time.perf_counter()
            _add_peers(config, tokens, benches, sides)
            last_build = (time.perf_counter() - start) / 2
    timer.rotated(benches, 1, FLAGS.repeats, FLAGS.steps)
    for name, b in benches.items():
        s = statistics.median(b.wall)
        side = sides[name]
        side.update(ms=1e3 * s, tokens_per_s=tokens_per_step / s,
                    mfu_6nt=harness.six_nt_tflops(b.num_params, tokens_per_step, s) / peak)
        if "flops" in side:
            side["mfu_flops"] = side["flops"] / s / 1e12 / peak
        _log(f"  {name:28s} {1e3 * s:9.2f} ms/step {tokens_per_step / s:12.0f} tokens/s "
             f"MFU {side['mfu_6nt']:.1%}")
    # The stock peer (the faster of eager and compiled) and the peer at our work (its LM
    # head at the masked positions only): every side against both, and every side's MFU by
    # one count, MLM's model FLOPs for the peers (the work both do).
    peer_names = [n for n in benches if sides[n]["objective"] == "peer"]
    stock = [n for n in peer_names if not sides[n]["masked_head"]]
    peer = min(stock, key=lambda n: sides[n]["ms"]) if stock else None
    equal_work = next((n for n in peer_names if sides[n]["masked_head"]), None)
    mlm_flops = next((sides[n]["flops"] for n in benches if sides[n]["objective"] == "mlm"),
                     None)
    for name in peer_names:
        if mlm_flops:
            s = statistics.median(benches[name].wall)
            sides[name].update(flops=mlm_flops, mfu_flops=mlm_flops / s / 1e12 / peak)
    for name, b in benches.items():
        side = sides[name]
        if side["objective"] == "peer":
            continue
        for key, other in (("vs_peer", peer), ("vs_equal_work_peer", equal_work)):
            if other:
                side[key] = statistics.median(
                    timer.round_ratios(benches[other].wall, b.wall, FLAGS.steps))
        mlm = f"mlm / {side['impl']}"
        if side["objective"] not in ("peer", "mlm") and mlm in benches:
            side["time_ratio_to_mlm"] = statistics.median(
                timer.round_ratios(b.wall, benches[mlm].wall, FLAGS.steps))
            side["flops_ratio_to_mlm"] = side["flops"] / sides[mlm]["flops"]
    return {"device": harness.device_line(), "peak_tflops": peak, "peak_measured_by": what,
            "tokens_per_step": tokens_per_step, "peer": peer, "equal_work_peer": equal_work,
            "flops_count": harness.FLOPS_COUNT, "pallas_options": fastest,
            "sides": sides}


def _add_peers(config, tokens, benches: dict, sides: dict) -> None:
    """The peer's sides (eager and torch.compile) into benches and sides, or why not."""
    try:
        peers = _peers(config, tokens)
    except ImportError as e:
        peers = {}
        _log(f"  peer: not timed ({e}; pip install -r requirements-bench.txt)")
    except Exception as e:  # noqa: BLE001 (our sides are still worth timing)
        peers = {}
        _log(f"  peer: not timed ({type(e).__name__}: {str(e).splitlines()[0][:300]})")
    for name, b in peers.items():
        benches[name] = b
        sides[name] = {"objective": "peer", "impl": b.attention, "masked_head": b.masked_head,
                       "num_params": b.num_params, "build_s": b.build_seconds}


def _peers(config, tokens) -> dict:
    import torch

    from benchmarks import roberta_peer

    device = "cuda" if records.on_accelerator() and torch.cuda.is_available() else "cpu"
    mlm = harness.objective_config(config, "mlm")
    out = {}
    # The stock model (eager, and compiled on a GPU) and the one at our step's work (its LM
    # head at the masked positions only).
    kinds = [(False, False), (False, True)] + ([(True, False)] if device == "cuda" else [])
    for compiled, masked_head in kinds:
        b = roberta_peer.PeerBench(mlm, tokens, device, compiled, masked_head)
        out[b.name] = b
        _log(f"  {b.name}: built in {b.build_seconds:.1f} s ({b.attention})")
    return out


def _profile_side(spec: str, config):
    """(name, config) of a --profile_sides entry OBJECTIVE/IMPL[:FIELD=VALUE;...]."""
    import ast

    head, _, overrides = spec.partition(":")
    objective, _, impl = head.partition("/")
    if objective not in harness.OBJECTIVES or impl not in IMPLS:
        raise ValueError(f"--profile_sides: expected OBJECTIVE/IMPL[:FIELD=VALUE;...] with an "
                         f"objective of {', '.join(harness.OBJECTIVES)} and an implementation "
                         f"of {', '.join(IMPLS)}, got {spec!r}")
    c = config.copy_and_resolve_references()
    for item in filter(None, overrides.split(";")):
        field, _, value = item.partition("=")
        *path, last = field.split(".")
        parent = c
        for part in path:
            parent = parent.get(part) if hasattr(parent, "get") else None
        if not hasattr(parent, "get") or last not in parent:
            raise ValueError(f"--profile_sides: {spec!r}: no config field {field!r}")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass  # a string
        c.update_from_flattened_dict({field: value})
    return spec, _side_config(c, objective, impl, None)


def part_profile(out: pathlib.Path) -> dict:
    import jax

    from maelm_jax.pretrain import config as pretrain_config

    impl = "pallas" if records.on_accelerator() else "einsum"
    specs = FLAGS.profile_sides or [f"mlm/{impl}", f"maelm/{impl}",
                                    f"maelm/{impl}:model.rel_pos_buckets=0"]
    fastest = _sweep_options(out)
    _log(harness.device_line())
    tokens = harness.random_tokens(FLAGS.config)
    steps = FLAGS.profile_steps
    sides = {}
    for spec in specs:
        name, c = _profile_side(spec, FLAGS.config)
        if c.model.attention_impl == "pallas" and fastest:
            c.model.pallas.update(fastest)
        pretrain_config.validate(c)
        b = harness.Bench(c, tokens)
        b.run(2)
        slug = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)
        trace_dir = out / "profile" / slug
        shutil.rmtree(trace_dir, ignore_errors=True)
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            b.run(steps)
        ops = harness.trace_op_seconds(trace_dir)
        shutil.rmtree(trace_dir)  # large; the sums below are what is kept
        (out / "profile" / f"{slug}.hlo.txt").write_text(b.step.as_text())
        total = sum(ops.values())
        ranked = sorted(ops.items(), key=lambda kv: -kv[1])
        sides[name] = {
            "step_ms": 1e3 * statistics.median(b.wall[-steps:]),
            "op_ms_per_step": 1e3 * total / steps,
            "ops": [{"op": op, "ms_per_step": 1e3 * s / steps,
                     "share": s / total if total else 0.0} for op, s in ranked]}
        _log(f"  {name}: {sides[name]['step_ms']:.2f} ms/step, "
             f"{sides[name]['op_ms_per_step']:.2f} ms of ops; top: "
             + ", ".join(f"{o['op']} {o['ms_per_step']:.2f}" for o in sides[name]["ops"][:5]))
    return {"device": harness.device_line(), "steps": steps, "sides": sides}


def part_quickstart(out: pathlib.Path) -> dict:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="quickstart-"))
    command = [sys.executable, "main.py", "--config=configs/pretrain/quickstart.py",
               f"--workdir={workdir / 'run'}"]
    start = time.perf_counter()
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    record = {"command": " ".join(command[1:3]) + " --workdir=<fresh>", "seconds": seconds,
              "returncode": run.returncode, "tail": run.stderr.strip().splitlines()[-5:]}
    metrics = workdir / "run" / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
        evals = [r for r in rows if r.get("split") == "eval"]
        if evals:
            record["last_eval"] = evals[-1]
    shutil.rmtree(workdir, ignore_errors=True)
    _log(f"quickstart: {seconds:.1f} s, exit {run.returncode}")
    return record


def _compile_config(new_program: bool):
    impl = "pallas" if records.on_accelerator() else "einsum"
    c = _side_config(FLAGS.config, "mlm", impl, None)
    if new_program:  # another program (the schedule's constants), the same matmuls
        c.train.learning_rate = 2 * c.train.learning_rate
    return c


def compile_case(case: str, cache: str) -> dict:
    """One process: the MLM step built with the cache in `cache`; its compile seconds and
    its first steps."""
    from maelm_jax.infra import compile_cache

    compile_cache.enable(cache)
    c = _compile_config(case == "new_program")
    bench = harness.Bench(c, harness.random_tokens(c))
    bench.run(3)
    return {"compile_s": bench.compile_seconds, "step_ms": 1e3 * statistics.median(bench.wall),
            "impl": c.model.attention_impl}


def part_compile(out: pathlib.Path) -> dict:
    record = {}
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
        for case in ("cold", "cached", "new_program"):
            run = subprocess.run([sys.executable, sys.argv[0], *_child_argv(),
                                  f"--compile_case={case}", f"--cache={cache}"],
                                 capture_output=True, text=True, check=False)
            lines = run.stdout.strip().splitlines()
            if run.returncode or not lines:
                record[case] = {"error": (run.stderr.strip().splitlines() or ["?"])[-1]}
            else:
                record[case] = json.loads(lines[-1])
            _log(f"compile {case}: {record[case]}")
    return record


PART_FUNCTIONS = {"attention": part_attention, "throughput": part_throughput,
                  "profile": part_profile, "quickstart": part_quickstart,
                  "compile": part_compile}


# --- the parent: budget, records, the table ---------------------------------------------


def _child_argv() -> list[str]:
    """This call's flags for a child process, without the internal ones."""
    return [a for a in sys.argv[1:] if not a.startswith((
        "--part=", "--part_deadline=", "--compile_case=", "--cache=", "--parts="))]


def run_part(part: str, out: pathlib.Path, seconds: float) -> dict:
    log = out / "logs" / f"{part}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    (out / "parts" / f"{part}.json").unlink(missing_ok=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            run = subprocess.run([sys.executable, sys.argv[0], *_child_argv(), f"--part={part}",
                                  f"--part_deadline={time.time() + seconds}"],
                                 stdout=f, stderr=subprocess.STDOUT, timeout=seconds, check=False)
            code = run.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    elapsed = time.perf_counter() - start
    path = out / "parts" / f"{part}.json"
    if path.exists():
        record = json.loads(path.read_text())
    else:
        tail = log.read_text().strip().splitlines()[-3:]
        record = {"error": f"timed out after {seconds:.0f} s" if code == "timeout"
                  else f"exit {code}", "log_tail": tail}
    record["seconds"] = elapsed
    return record


def main(argv, suite: Suite) -> None:
    del argv
    if not FLAGS.out:
        cli.fail("--out: expected a directory for the results", cli.program())
    out = pathlib.Path(FLAGS.out).resolve()
    if FLAGS.compile_case:
        print(json.dumps(compile_case(FLAGS.compile_case, FLAGS.cache)))
        return
    if FLAGS.part:
        _write(out / "parts" / f"{FLAGS.part}.json", PART_FUNCTIONS[FLAGS.part](out))
        return
    harness.objective_configs(FLAGS.config, ["mlm"])  # a bad config: one line, now
    _impls()
    for spec in FLAGS.profile_sides:
        try:
            _profile_side(spec, FLAGS.config)
        except (ValueError, TypeError) as e:
            message = str(e).splitlines()[0]
            if not message.startswith("--profile_sides"):
                message = f"--profile_sides: {spec!r}: {message}"
            cli.fail(message, cli.program())
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = {"command": " ".join(["python", f"benchmarks/{suite.name}.py",
                                    *sys.argv[1:]]),
               "targets": TARGETS, "parts": {}}
    for part in [p for p in PARTS if p in FLAGS.parts]:
        left = FLAGS.budget_seconds - (time.perf_counter() - start)
        if left < MIN_SECONDS[part]:
            results["parts"][part] = {"skipped": f"budget: {left:.0f} s left"}
        else:
            print(f"{part}: running (up to {left:.0f} s; log in {out / 'logs'})", flush=True)
            results["parts"][part] = run_part(part, out, left)
        _write(out / f"{suite.name}.json", results)
        (out / f"{suite.name}.md").write_text(suite_report.markdown(results, suite.title))
    print((out / f"{suite.name}.md").read_text())
    recording.save(suite.name, results)


if __name__ == "__main__":
    run(GPU)
