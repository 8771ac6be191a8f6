"""Compile time of the train step against encoder depth, with and without scanned layers.

    python benchmarks/compile_time.py [--depths 2,24 --objective maelm]

Builds each step as benchmarks/step_time.py does (the real make_train_step, one device)
at a small width, since compile time follows the program's size, not its tensors', and
prints XLA's compile seconds per depth for per-layer and scanned (model.scan_layers)
stacks. The claim checked: a scanned deep encoder compiles within 1.5x of a scanned
2-layer one (a per-layer stack grows about linearly with depth).
"""

from __future__ import annotations

import argparse
import os
import sys

_BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))
sys.path.insert(0, _BENCHMARKS)

import step_time  # noqa: E402

TARGET = 1.5  # scanned deepest / scanned shallowest compile time


def _depths(text: str) -> list[int]:
    try:
        depths = [int(d) for d in text.split(",")]
    except ValueError:
        depths = []
    if len(depths) < 2 or min(depths) < 1:
        raise argparse.ArgumentTypeError(f"expected two or more positive integers, got {text!r}")
    return depths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", default=[2, 24], type=_depths,
                   help="comma-separated encoder depths (default 2,24)")
    p.add_argument("--objective", default="maelm", choices=step_time.OBJECTIVES)
    p.add_argument("--remat_policy", default="none",
                   choices=tuple(step_time.layers.REMAT_POLICIES))
    args = p.parse_args(argv)
    depths = args.depths
    base = step_time.parse_args([
        "--d_model=128", "--num_heads=2", "--seq_len=64", "--batch_size=4",
        "--vocab_size=1024", "--decoder_layers=2", f"--remat_policy={args.remat_policy}"])
    tokens = step_time.random_tokens(base)
    seconds = {}
    for scan in (False, True):
        for depth in depths:
            base.encoder_layers, base.scan_layers = depth, scan
            bench = step_time.Bench(base, args.objective, tokens)
            seconds[scan, depth] = bench.compile_seconds
            print(f"{args.objective} encoder {depth:3d} layers, "
                  f"{'scanned  ' if scan else 'per layer'}: compiled in "
                  f"{bench.compile_seconds:6.1f} s", flush=True)
    lo, hi = min(depths), max(depths)
    for scan, name in ((False, "per layer"), (True, "scanned")):
        ratio = seconds[scan, hi] / seconds[scan, lo]
        note = f" (target <= {TARGET}x: {'meets' if ratio <= TARGET else 'misses'})" if scan \
            else ""
        print(f"{name}: {hi} layers / {lo} layers = {ratio:.2f}x{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
