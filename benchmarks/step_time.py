"""Measured train-step time of MAE-LM, 3ML_self and 3ML_cross vs MLM against the 3ML
Appendix D FLOPs ratios.

Builds every objective at the same encoder size with the real `make_train_step`
(masking, dropout, AdamW and all), compiles each once (not timed), then times `--steps`
steps per objective, `--repeats` times, rotating the order so that drift in the machine's
speed hits all alike, and reports the medians:

    python benchmarks/step_time.py [--encoder_layers 4 --seq_len 128 --objectives mlm,maelm]

The objectives: `mlm` (15 %, all [MASK]; the baseline), `maelm` (MAE-LM: 15 %, all [MASK]
removed, a decoder of `--decoder_layers` at full width, no decoder dropout), `3ml_self`
and `3ml_cross` (3ML: 40 %, 80-10-10, a 2-layer half-width decoder with dropout; pre-LN
for cross). The claim checked: each one's step time relative to MLM's follows its FLOPs
ratio (target: within 5 %). FLOPs use the paper's convention (forward + backward = 2 x
forward), so the absolute GFLOP/s are 2/3 of a "6 N T" count; ratios do not depend on it.

Work the formulas leave out falls mostly on MLM's side and pulls the measured ratio below
the FLOPs ratio: dropout (random bits for every encoder activation; the decoder has none)
and the relative position bias live only in the encoder, which MLM runs at full length,
while MAE-LM's extra cost, the decoder, is almost pure matmul. `--dropout 0` shows how much
of a gap is dropout. On a machine shared with other jobs wall times swing; the "cpu ms"
column and the CPU-time ratio (process CPU time, all threads) are steadier there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# Run as a plain script from anywhere: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import ml_collections
import numpy as np

from maelm_jax import config as config_lib
from maelm_jax import flops as flops_lib
from maelm_jax import sharding, tokenizer
from maelm_jax.models import layers
from maelm_jax.training import setup as setup_lib
from maelm_jax.training import steps as steps_lib

OBJECTIVES = ("mlm", "maelm", "3ml_self", "3ml_cross")
TARGET = 0.05  # allowed relative gap between the measured time ratio and the FLOPs ratio


def add_step_options(p: argparse.ArgumentParser, steps: int) -> None:
    """The options of how our step is built and timed, shared with peer_hf.py."""
    p.add_argument("--scan_layers", action="store_true", help="model.scan_layers")
    p.add_argument("--remat_policy", default="none", choices=tuple(layers.REMAT_POLICIES),
                   help="model.remat_policy")
    p.add_argument("--prng_impl", default="threefry2x32", choices=steps_lib.PRNG_IMPLS,
                   help="PRNG of masks and dropout (config.train.prng_impl)")
    p.add_argument("--steps", type=int, default=steps, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after compiling")
    p.add_argument("--repeats", type=int, default=5,
                   help="measurements per objective or side, alternated; the median is "
                        "reported")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Defaults: big enough that the dense matmuls dominate (768 wide), small enough to run
    # in a few minutes on a 2-core CPU.
    p.add_argument("--encoder_layers", type=int, default=4)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--num_heads", type=int, default=12)
    p.add_argument("--d_ff", type=int, default=0,
                   help="FFN width of the encoder and MAE-LM's decoder; 0 = 4 x d_model")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--decoder_layers", type=int, default=4,
                   help="MAE-LM decoder layers (the paper's 4; 3ML uses 2)")
    p.add_argument("--decoder_d_model", type=int, default=0,
                   help="decoder width; 0 = encoder width (MAE-LM); 3ML uses half")
    p.add_argument("--vocab_size", type=int, default=32768)
    p.add_argument("--dropout", type=float, default=0.1,
                   help="encoder dropout and attention dropout (the papers' 0.1); the "
                        "decoder never drops out")
    add_step_options(p, steps=2)
    p.add_argument("--objectives", default=",".join(OBJECTIVES),
                   help=f"comma-separated, from {', '.join(OBJECTIVES)} (mlm always runs)")
    args = p.parse_args(argv)
    chosen = [o.strip() for o in args.objectives.split(",") if o.strip()]
    unknown = sorted(set(chosen) - set(OBJECTIVES))
    if unknown:
        p.error(f"--objectives: unknown {', '.join(unknown)}; expected {', '.join(OBJECTIVES)}")
    args.objectives = ["mlm"] + [o for o in OBJECTIVES[1:] if o in chosen]
    return args


def make_config(args: argparse.Namespace, objective: str) -> ml_collections.ConfigDict:
    config = config_lib.pretrain_defaults()
    config.objective = "mlm" if objective == "mlm" else "maelm"
    config.data.seq_len = args.seq_len
    config.train.batch_size = args.batch_size
    config.tokenizer.vocab_size = args.vocab_size
    config.train.prng_impl = args.prng_impl
    config.model.scan_layers = args.scan_layers
    config.model.remat_policy = args.remat_policy
    m = config.model
    m.num_layers, m.d_model, m.num_heads = args.encoder_layers, args.d_model, args.num_heads
    m.d_ff = args.d_ff or 4 * args.d_model
    m.dropout = m.attention_dropout = args.dropout
    d_de = args.decoder_d_model or args.d_model
    # Keep the encoder's head size in the decoder (3ML's half width halves the heads).
    head_dim = args.d_model // args.num_heads
    m.decoder.num_layers = args.decoder_layers
    m.decoder.d_model = d_de
    m.decoder.num_heads = d_de // head_dim if d_de % head_dim == 0 else 1
    m.decoder.d_ff = args.d_ff if d_de == args.d_model and args.d_ff else 4 * d_de
    if objective.startswith("3ml"):
        # 3ML Table 4: 40 %, 80-10-10, 2 layers at half width, dropout on the whole model.
        config.masking.update(mask_ratio=0.4, mask_frac=0.8, random_frac=0.1)
        half = args.d_model // 2
        m.decoder.update(num_layers=2, d_model=half, d_ff=4 * half,
                         num_heads=max(half // head_dim, 1), dropout=args.dropout,
                         attention_dropout=args.dropout)
        if objective == "3ml_cross":
            m.decoder.kind = "cross"
            m.pre_ln = m.decoder.pre_ln = True
    config_lib.validate(config)
    return config


class Bench:
    """One objective's compiled train step, its state and its FLOPs per step.

    Built by `training.setup.build`, as the training loop builds it: state and step
    sharded over a mesh (here one device), the state donated, traced under the rules.
    """

    def __init__(self, args: argparse.Namespace, objective: str, tokens: np.ndarray):
        config = make_config(args, objective)
        self.objective = objective
        self.counts = config_lib.mask_counts(config)
        self.flops = flops_lib.step_flops(config, args.vocab_size)
        trainer = setup_lib.build(config, args.vocab_size,
                                  sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
        self.state = trainer.init()
        self.tokens = jax.device_put(tokens, sharding.batch_sharding(trainer.mesh))
        start = time.perf_counter()
        self.step = trainer.compile_train_step()
        self.compile_seconds = time.perf_counter() - start
        self.num_params = sum(x.size for x in jax.tree.leaves(self.state.params))
        self.wall: list[float] = []   # seconds per timed step
        self.cpu: list[float] = []    # process CPU seconds (all threads) per step

    def run(self, num_steps: int) -> None:
        """Runs num_steps steps, recording each one's wall and process-CPU seconds.

        Blocking after every step costs a dispatch round trip (microseconds against steps of
        milliseconds or more) and gives per-step samples whose median shrugs off bursts of
        other load on a shared machine.
        """
        for _ in range(num_steps):
            wall, cpu = time.perf_counter(), time.process_time()
            self.state, metrics = self.step(self.state, self.tokens)
            jax.block_until_ready((self.state, metrics))
            self.wall.append(time.perf_counter() - wall)
            self.cpu.append(time.process_time() - cpu)


def random_tokens(args: argparse.Namespace) -> np.ndarray:
    """[batch, L] int32 ids from the ordinary vocabulary (ids below NUM_SPECIAL are special)."""
    rng = np.random.default_rng(0)
    return rng.integers(tokenizer.NUM_SPECIAL, args.vocab_size,
                        (args.batch_size, args.seq_len)).astype(np.int32)


def time_rotated(benches: dict, warmup: int, repeats: int, steps: int) -> None:
    """Untimed warm-up steps for each, then `repeats` rounds of `steps` timed steps each,
    rotating which goes first every round so that a slow phase of the machine is shared."""
    for b in benches.values():
        if warmup:
            b.run(warmup)
            b.wall.clear()
            b.cpu.clear()
    order = list(benches)
    for r in range(repeats):
        for name in order[r % len(order):] + order[:r % len(order)]:
            benches[name].run(steps)


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """fp32 GFLOP/s of a jitted n x n matmul, the median of `repeats` after a warm-up: the
    machine's speed, printed beside absolute times."""
    x = jax.random.normal(jax.random.PRNGKey(0), (n, n), jax.numpy.float32)
    matmul = jax.jit(jax.numpy.matmul)
    matmul(x, x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x, x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / statistics.median(times) / 1e9


def main(argv=None) -> int:
    args = parse_args(argv)
    tokens = random_tokens(args)
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device(s), "
          f"{os.cpu_count()} CPUs); fp32 jitted 2048x2048 matmul: {matmul_gflops():.1f} GFLOP/s")
    print(f"encoder {args.encoder_layers} x {args.d_model} ({args.num_heads} heads), "
          f"MAE-LM decoder {args.decoder_layers} x {args.decoder_d_model or args.d_model}, "
          f"3ML decoders 2 x {args.d_model // 2}, "
          f"L={args.seq_len}, batch={args.batch_size}, |V|={args.vocab_size}, "
          f"dropout {args.dropout}; "
          f"{args.repeats} x {args.steps} timed steps per objective")

    benches = {}
    for objective in args.objectives:
        b = Bench(args, objective, tokens)
        benches[objective] = b
        print(f"  {objective:9s} compiled in {b.compile_seconds:.1f} s; "
              f"{b.num_params / 1e6:.1f} M params; n_enc={b.counts.n_enc}, k={b.counts.k}")

    time_rotated(benches, args.warmup, args.repeats, args.steps)

    tokens_per_step = args.batch_size * args.seq_len
    print()
    print(f"{'objective':9s} {'n_enc':>5s} {'ms/step':>9s} {'min ms':>9s} {'cpu ms':>9s} "
          f"{'steps/s':>8s} {'tokens/s':>9s} {'GFLOP/step':>10s} {'GFLOP/s':>8s}")
    wall, cpu = {}, {}
    for objective, b in benches.items():
        # Medians over all timed steps; "min ms" and "cpu ms" (process CPU time over all
        # threads) show how much other load on the machine inflated the wall time.
        wall[objective] = s = statistics.median(b.wall)
        cpu[objective] = statistics.median(b.cpu)
        print(f"{objective:9s} {b.counts.n_enc:5d} {1e3 * s:9.1f} {1e3 * min(b.wall):9.1f} "
              f"{1e3 * cpu[objective]:9.1f} {1 / s:8.3f} {tokens_per_step / s:9.0f} "
              f"{b.flops / 1e9:10.2f} {b.flops / 1e9 / s:8.1f}")

    print()
    for objective in args.objectives[1:]:
        flops_ratio = benches[objective].flops / benches["mlm"].flops
        time_ratio = wall[objective] / wall["mlm"]
        gap = time_ratio / flops_ratio - 1.0
        cpu_gap = (cpu[objective] / cpu["mlm"]) / flops_ratio - 1.0
        verdict = "holds" if abs(gap) <= TARGET else "MISSED"
        print(f"{objective} / mlm ratio: time {time_ratio:.3f}, FLOPs {flops_ratio:.3f}, "
              f"relative difference {gap:+.1%} (target within {TARGET:.0%}: {verdict}; "
              f"process CPU time {cpu_gap:+.1%})")
    print("FLOPs as in 3ML App. D: fwd+bwd = 2 x fwd; biases, norms, softmax, dropout, "
          "gathers/scatters and the optimiser update not counted.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
