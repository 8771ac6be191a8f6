r"""Compile time of the train step against encoder depth, with and without scanned layers.

    python benchmarks/compile_time.py [--depths=2,24 --objective=maelm] \
        [--config=configs/benchmark/compile_time.py --config.model.remat_policy=dots]

Builds each step as benchmarks/step_time.py does (the real train step, one device) at a
small width, since compile time follows the program's size, not its tensors', and prints
XLA's compile seconds per depth for per-layer and scanned (model.scan_layers) stacks. The
sizes are a pretraining config's (--config, default configs/benchmark/compile_time.py: 128
wide, L = 64, batch 4; any --config.<field>=<value> applies) except model.num_layers and
model.scan_layers, which the benchmark sets: each of --depths, per layer and scanned.
--objective picks the step, derived from the config as step_time.py's objectives are. The
claim checked: a scanned deep encoder compiles within 1.5x of a scanned 2-layer one (a
per-layer stack grows about linearly with depth). Each run writes its record (recording.py)
to --record_dir; docs/performance.md's table is generated from the committed ones.
"""

from __future__ import annotations

from absl import app, flags

from benchmarks import harness, recording
from maelm_jax.infra import cli

TARGET = 1.5  # scanned deepest / scanned shallowest compile time

FLAGS = flags.FLAGS


def _positive_depths(depths: list[str]) -> bool:
    if len(depths) < 2 or not all(d.isdigit() and int(d) >= 1 for d in depths):
        raise flags.ValidationError("expected two or more positive integers")
    return True


def define_flags() -> None:
    harness.define_config("compile_time.py")
    flags.DEFINE_list("depths", ["2", "24"], "Comma-separated encoder depths, two or more.")
    flags.register_validator("depths", _positive_depths)
    flags.DEFINE_enum("objective", "maelm", harness.OBJECTIVES, "The objective whose step is "
                      "compiled.")
    recording.define_flag("compile_time")


def main(argv) -> None:
    del argv  # cli.tool_flags_parser refuses stray arguments
    depths = [int(d) for d in FLAGS.depths]
    config = FLAGS.config
    tokens = harness.random_tokens(config)
    # Every step's config first, so that one which does not validate stops the run at once.
    configs = {}
    for scan in (False, True):
        for depth in depths:
            config.model.num_layers, config.model.scan_layers = depth, scan
            configs[scan, depth] = harness.objective_configs(
                config, [FLAGS.objective])[FLAGS.objective]
    seconds = {}
    for (scan, depth), step_config in configs.items():
        bench = harness.Bench(step_config, tokens)
        seconds[scan, depth] = bench.compile_seconds
        print(f"{FLAGS.objective} encoder {depth:3d} layers, "
              f"{'scanned  ' if scan else 'per layer'}: compiled in "
              f"{bench.compile_seconds:6.1f} s", flush=True)
    lo, hi = min(depths), max(depths)
    for scan, name in ((False, "per layer"), (True, "scanned")):
        ratio = seconds[scan, hi] / seconds[scan, lo]
        note = f" (target <= {TARGET}x: {'meets' if ratio <= TARGET else 'misses'})" if scan \
            else ""
        print(f"{name}: {hi} layers / {lo} layers = {ratio:.2f}x{note}")
    recording.save("compile_time", {
        "objective": FLAGS.objective, "sizes": harness.sizes(config), "target": TARGET,
        "seconds": {layout: {str(depth): seconds[scan, depth] for depth in depths}
                    for scan, layout in ((False, "per_layer"), (True, "scanned"))}})


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.tool_flags_parser)
