r"""Cold and cached compile time of a train step, and what XLA flags do to both and to the
step time.

    python benchmarks/compile_cache.py [--config=configs/benchmark/peer.py:base] \
        [--objective=mlm --xla_flag_sets=";--xla_gpu_autotune_level=2"]

For each set of XLA flags (--xla_flag_sets, separated by ';'; the empty set is XLA's
defaults), two fresh processes build the objective's step as benchmarks/step_time.py does,
one after the other, with JAX's persistent compilation cache in a new empty directory
(maelm_jax/infra/compile_cache.py, as main.py enables it): the first compiles cold (on a GPU
mostly XLA's GEMM autotuning) and fills the cache, the second loads from it. Each process
then times --steps steps. Printed per set: cold and cached compile seconds and the median
step time, so a flag that shortens the cold compile can be checked against what it costs
the step. Targets (BERT-base step on one H100): cold <= 45 s, cached <= 5 s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

from benchmarks import harness
from maelm_jax.infra import cli

TARGETS = {"cold": 45.0, "cached": 5.0}  # seconds, BERT-base on one H100

FLAGS = flags.FLAGS


def define_flags() -> None:
    harness.define_config("compile_time.py")
    flags.DEFINE_enum("objective", "mlm", harness.OBJECTIVES, "The objective whose step is "
                      "built.")
    flags.DEFINE_string("xla_flag_sets", "", "XLA flag sets to compare, separated by ';' (the "
                        "empty set: XLA's defaults), each added to $XLA_FLAGS.")
    flags.DEFINE_integer("steps", 10, "Steps timed after each compile.", lower_bound=1)
    flags.DEFINE_string("child", "", "Internal: a cache directory; build, time and print JSON.")


def child(cache_dir: str) -> None:
    """One process: the step built with the cache in `cache_dir`, its compile and step
    seconds as one JSON line."""
    from maelm_jax.infra import compile_cache

    compile_cache.enable(cache_dir)
    config = harness.objective_configs(FLAGS.config, [FLAGS.objective])[FLAGS.objective]
    bench = harness.Bench(config, harness.random_tokens(config))
    bench.run(1)  # warm-up
    bench.clear()
    bench.run(FLAGS.steps)
    print(json.dumps({"compile": bench.compile_seconds,
                      "step": statistics.median(bench.wall)}))


def measure(flag_set: str) -> tuple[dict, dict]:
    """(cold, cached) measurements of one flag set, each in a process of its own."""
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag_set}".strip())
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    argv = [a for a in sys.argv[1:] if not a.startswith(("--xla_flag_sets", "--child"))]
    results = []
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
        for _ in range(2):
            run = subprocess.run([sys.executable, sys.argv[0], *argv, f"--child={cache}"],
                                 env=env, capture_output=True, text=True, check=False)
            if run.returncode:
                cli.fail(f"flags {flag_set!r}: the measuring process failed: "
                         f"{run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ''}",
                         cli.program())
            results.append(json.loads(run.stdout.strip().splitlines()[-1]))
    return results[0], results[1]


def main(argv) -> None:
    del argv  # cli.tool_flags_parser refuses stray arguments
    if FLAGS.child:
        child(FLAGS.child)
        return
    harness.objective_configs(FLAGS.config, [FLAGS.objective])  # a bad config: one line, now
    m, config = FLAGS.config.model, FLAGS.config
    print(f"{harness.device_line()}; {FLAGS.objective} step, encoder {m.num_layers} x "
          f"{m.d_model}, L={config.data.seq_len}, batch={config.train.batch_size}, "
          f"scanned={m.scan_layers}; {FLAGS.steps} timed steps after each compile")
    print(f"{'XLA flags':40s} {'cold s':>8s} {'cached s':>9s} {'ms/step':>9s} {'cached ms':>9s}")
    for flag_set in FLAGS.xla_flag_sets.split(";"):
        cold, cached = measure(flag_set.strip())
        print(f"{flag_set.strip() or '(defaults)':40s} {cold['compile']:8.1f} "
              f"{cached['compile']:9.1f} {1e3 * cold['step']:9.1f} {1e3 * cached['step']:9.1f}",
              flush=True)
    print(f"targets for a BERT-base step on one H100: cold <= {TARGETS['cold']:.0f} s, "
          f"cached <= {TARGETS['cached']:.0f} s")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.tool_flags_parser)
