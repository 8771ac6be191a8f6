"""Train-step throughput of our MLM and MAE-LM against Hugging Face's RobertaForMaskedLM
(PyTorch, CPU) at the same configuration, in one run.

    pip install -r requirements-bench.txt   # torch (CPU build) and transformers
    python benchmarks/peer_hf.py [--encoder_layers 4 --d_model 256 --batch_size 32 ...]

Our side is built by benchmarks/step_time.py's `Bench`: the real `make_train_step`
(masking, dropout, AdamW with clipping), compiled once, not timed. The peer is a
`RobertaForMaskedLM` of the same depth, width, heads, FFN, vocabulary and dropout (hidden
and attention) in train mode; one step masks the batch (15 %, 80-10-10, labels -100
elsewhere, as `DataCollatorForLanguageModeling` does, on the fly), runs forward with the
labels and backward, clips the gradient norm as ours does (and as the HF Trainer does by
default), then `AdamW.step()` and `zero_grad()`. Both sides train on the same random ids
(fixed seed). After an untimed warm-up, each side runs `--repeats` measurements of
`--steps` steps, the order rotated every repeat so that drift in the machine's speed hits
all alike; the medians give seconds/step and tokens/s (batch x seq_len / step time).

Targets, as throughput ratios ours / peer: MLM >= 1.5x and MAE-LM >= 1.2x. A jitted fp32
2048x2048 matmul's GFLOP/s, measured in the same run, lets absolute times be compared
across machines.

MAE-LM's decoder defaults to max(1, encoder_layers // 3) layers at full width: the base
model's encoder-to-decoder depth ratio (12:4), so the decoder's share of the step is the
paper's at any encoder depth; step_time.py's fixed 4-layer decoder would be as deep as the
default 4-layer encoder here.

Caveats:
- The peer's masking (a few small torch ops per step) is inside its timed step, as our
  masking is inside our compiled step.
- Our MLM replaces all of its 15 % with [MASK] (our objective as step_time.py builds it);
  the peer does 80-10-10. Our step masks exactly round(0.15 L) positions per sequence, the
  peer a Bernoulli 15 %. Neither changes the amount of compute.
- The models are not the same network: ours has a relative position bias (T5 buckets),
  RoBERTa learned absolute positions; and ours computes the output layer only at the
  masked positions, HF's at every position (B x L x vocab logits). That last one is a real
  difference of the implementations, which the ratio is meant to include.
- Threads: `torch.set_num_threads(--threads)`; XLA's CPU client uses every core and has no
  per-run setting. Both runtimes keep their thread pools in one process, idle while the
  other side runs.
- Run it on a quiet machine (the load average is printed). When other processes hold the
  cores, torch's OpenMP threads wait for each other at every op: a tiny model's step took
  4 ms with 1 thread and 600 ms with 2 on a 2-core machine busy with other work, while
  XLA's step barely slowed. `--threads=1` shows whether that is happening.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# Run as a plain script from anywhere: make the repository root and step_time importable.
_BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))
sys.path.insert(0, _BENCHMARKS)

import jax
import numpy as np

import step_time
from maelm_jax import tokenizer

TARGETS = {"mlm": 1.5, "maelm": 1.2}  # minimum throughput ratio ours / peer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--encoder_layers", type=int, default=4)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--d_ff", type=int, default=1024)
    p.add_argument("--vocab_size", type=int, default=8000)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.1,
                   help="hidden and attention dropout, both sides (our decoder has none)")
    p.add_argument("--decoder_layers", type=int, default=None,
                   help="MAE-LM decoder layers at full width; default max(1, encoder_layers // 3)")
    step_time.add_step_options(p, steps=3)
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch intra-op threads (XLA uses every core regardless)")
    p.add_argument("--peer", choices=("hf", "none"), default="hf",
                   help="none: time only our side (no torch needed)")
    # step_time.make_config reads it; 0 = the encoder's width, as MAE-LM's decoder is.
    p.set_defaults(decoder_d_model=0)
    args = p.parse_args(argv)
    if args.decoder_layers is None:
        args.decoder_layers = max(1, args.encoder_layers // 3)
    return args


class PeerBench:
    """RobertaForMaskedLM's train step, recording times the way step_time.Bench.run does."""

    def __init__(self, args: argparse.Namespace, tokens: np.ndarray):
        import torch
        import transformers

        self.torch = torch
        ours = step_time.make_config(args, "mlm")
        train, self.mask_ratio = ours.train, ours.masking.mask_ratio
        self.clip_norm = train.clip_norm
        self.vocab_size = args.vocab_size
        start = time.perf_counter()
        torch.manual_seed(0)  # initial weights and every step's masks
        config = transformers.RobertaConfig(
            vocab_size=args.vocab_size, hidden_size=args.d_model,
            num_hidden_layers=args.encoder_layers, num_attention_heads=args.num_heads,
            intermediate_size=args.d_ff,
            # RoBERTa numbers positions from padding_idx + 1 = 2.
            max_position_embeddings=args.seq_len + 2,
            hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout)
        self.model = transformers.RobertaForMaskedLM(config).train()
        self.attention = self.model.config._attn_implementation
        # Our optimiser's hyper-parameters (a constant rate: the schedule costs nothing).
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train.learning_rate, betas=(train.adam_b1, train.adam_b2),
            eps=train.adam_eps, weight_decay=train.weight_decay)
        self.tokens = torch.from_numpy(tokens).long()
        self.build_seconds = time.perf_counter() - start
        self.num_params = sum(p.numel() for p in self.model.parameters())  # tied counted once
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def mask(self):
        """DataCollatorForLanguageModeling.torch_mask_tokens, without a tokenizer (the random
        ids hold no special tokens)."""
        torch, ids = self.torch, self.tokens.clone()
        labels = ids.clone()
        masked = torch.bernoulli(torch.full(ids.shape, self.mask_ratio)).bool()
        labels[~masked] = -100
        replaced = torch.bernoulli(torch.full(ids.shape, 0.8)).bool() & masked
        ids[replaced] = tokenizer.MASK_ID
        randomized = torch.bernoulli(torch.full(ids.shape, 0.5)).bool() & masked & ~replaced
        ids[randomized] = torch.randint(self.vocab_size, ids.shape)[randomized]
        return ids, labels

    def step(self) -> None:
        ids, labels = self.mask()
        self.model(input_ids=ids, labels=labels).loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def run(self, num_steps: int) -> None:
        for _ in range(num_steps):
            wall, cpu = time.perf_counter(), time.process_time()
            self.step()  # synchronous on the CPU
            self.wall.append(time.perf_counter() - wall)
            self.cpu.append(time.process_time() - cpu)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.peer == "hf":
        try:
            import torch
            import transformers
        except ImportError as e:
            sys.exit(f"peer_hf.py: --peer=hf needs torch and transformers ({e}): "
                     f"pip install -r requirements-bench.txt (or pass --peer=none)")
        torch.set_num_threads(args.threads)
        print(f"torch {torch.__version__}, transformers {transformers.__version__}: "
              f"torch.get_num_threads() = {torch.get_num_threads()}")
    print(f"jax {jax.__version__} on {jax.default_backend()}: XLA's CPU client uses all "
          f"{os.cpu_count()} CPUs (by default; not set here)")
    print(f"load average {os.getloadavg()[0]:.1f} before starting (other work on the "
          f"machine skews the timings, torch's most)")
    print(f"fp32 jitted 2048x2048 matmul: {step_time.matmul_gflops():.1f} GFLOP/s (median of 5)")
    print(f"encoder {args.encoder_layers} x {args.d_model} ({args.num_heads} heads, "
          f"FFN {args.d_ff}), MAE-LM decoder {args.decoder_layers} x {args.d_model}, "
          f"L={args.seq_len}, batch={args.batch_size}, |V|={args.vocab_size}, "
          f"dropout {args.dropout} (our PRNG {args.prng_impl}); "
          f"{args.repeats} x {args.steps} timed steps per side")

    tokens = step_time.random_tokens(args)
    benches = {}
    for objective in ("mlm", "maelm"):
        b = benches[objective] = step_time.Bench(args, objective, tokens)
        print(f"  {objective:5s} compiled in {b.compile_seconds:.1f} s; "
              f"n_enc={b.counts.n_enc}, k={b.counts.k}")
    if args.peer == "hf":
        b = benches["peer"] = PeerBench(args, tokens)
        print(f"  peer  RobertaForMaskedLM built in {b.build_seconds:.1f} s; "
              f"attention {b.attention}; {b.mask_ratio:.0%} masked per step, 80-10-10")
    step_time.time_rotated(benches, args.warmup, args.repeats, args.steps)

    tokens_per_step = args.batch_size * args.seq_len
    print()
    print(f"{'side':5s} {'params':>12s} {'ms/step':>9s} {'min ms':>9s} {'cpu ms':>9s} "
          f"{'tokens/s':>9s}")
    wall = {}
    for side, b in benches.items():
        # "min ms" and "cpu ms" (process CPU time, all threads) show how much other load
        # on the machine inflated the median wall time.
        wall[side] = s = statistics.median(b.wall)
        print(f"{side:5s} {b.num_params:12,d} {1e3 * s:9.1f} {1e3 * min(b.wall):9.1f} "
              f"{1e3 * statistics.median(b.cpu):9.1f} {tokens_per_step / s:9.0f}")

    print()
    if "peer" not in wall:
        print("peer: skipped (--peer=none)")
        return 0
    for objective, target in TARGETS.items():
        ratio = wall["peer"] / wall[objective]  # tokens/s ours over tokens/s peer
        verdict = "meets" if ratio >= target else "misses"
        print(f"{objective} / peer: {ratio:.2f}x tokens/s (target >= {target}x: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
