r"""Train-step throughput of our MLM and MAE-LM against Hugging Face's RobertaForMaskedLM
(PyTorch, CPU) at the same configuration, in one run.

    pip install -r requirements-bench.txt   # torch (CPU build) and transformers
    python benchmarks/peer_hf.py [--config=configs/benchmark/peer.py[:layers=12]] \
        [--config.train.batch_size=64 --config.train.prng_impl=rbg --threads=1 ...]

The configuration is a pretraining config's, as for main.py: --config (default
configs/benchmark/peer.py: 4 layers x 256, 4 heads, FFN 1024, vocabulary 8000, L = 128,
batch 32, dropout 0.1) and any --config.<field>=<value>. Dropout is two fields,
--config.model.dropout (the peer's hidden_dropout_prob) and
--config.model.attention_dropout (its attention_probs_dropout_prob).

Our side is built by benchmarks/harness.py's `Bench`: the real train step (masking,
dropout, AdamW with clipping), compiled once, not timed; MLM masks as the config says,
MAE-LM removes the same masks from the encoder and runs the config's decoder
(`harness.objective_config`). The peer is a `RobertaForMaskedLM` of the same depth, width,
heads, FFN, vocabulary and dropout (hidden and attention) in train mode; one step masks
the batch (the config's masking.mask_ratio, 15 %; 80-10-10, labels -100 elsewhere, as
`DataCollatorForLanguageModeling` does, on the fly), runs forward with the labels and
backward, clips the gradient norm as ours does (and as the HF Trainer does by default),
then `AdamW.step()` (our optimiser's settings) and `zero_grad()`. Both sides train on the
same random ids (fixed seed). After an untimed warm-up, each side runs `--repeats`
measurements of `--steps` steps, the order rotated every repeat so that drift in the
machine's speed hits all alike; the medians give seconds/step and tokens/s (batch x
seq_len / step time). The verdict is on the median over rounds of the ratio within each
round (`harness.round_ratios`), printed with its range and the ratio of the fastest steps:
the two sides of a round ran back to back, so a slow phase of the machine that spans a
round hits both, and the paired ratio moves less between runs than the ratio of medians.

Targets, as throughput ratios ours / peer: MLM >= 1.5x and MAE-LM >= 1.2x. A jitted fp32
2048x2048 matmul's GFLOP/s, measured in the same run, lets absolute times be compared
across machines.

MAE-LM's decoder in configs/benchmark/peer.py has max(1, layers // 3) layers at full width:
the base model's encoder-to-decoder depth ratio (12:4), so the decoder's share of the step
is the paper's at any encoder depth (set it with the file's option, `peer.py:layers=12`);
step_time.py's 4-layer decoder would be as deep as the default 4-layer encoder here.

Caveats:
- The peer's masking (a few small torch ops per step) is inside its timed step, as our
  masking is inside our compiled step.
- Our MLM replaces all of its 15 % with [MASK] (the default masking); the peer does
  80-10-10. Our step masks exactly round(0.15 L) positions per sequence, the peer a
  Bernoulli 15 %. Neither changes the amount of compute.
- The models are not the same network: ours has a relative position bias (T5 buckets),
  RoBERTa learned absolute positions; and ours computes the output layer only at the
  masked positions, HF's at every position (B x L x vocab logits). That last one is a real
  difference of the implementations, which the ratio is meant to include.
- Threads: `torch.set_num_threads(--threads)`; XLA's CPU client uses every core and has no
  per-run setting. Both runtimes keep their thread pools in one process, idle while the
  other side runs.
- Host memory: the process starts as main.py does, with glibc's malloc keeping freed
  memory (maelm_jax/host_memory.py), which spares both sides the page faults of mapping
  their large temporaries afresh every step (the "faults" column); the peer profits as
  much as our MLM. --keep_host_memory=false runs both with the C allocator's defaults.
- Run it on a quiet machine (the load average is printed). When other processes hold the
  cores, torch's OpenMP threads wait for each other at every op: a tiny model's step took
  4 ms with 1 thread and 600 ms with 2 on a 2-core machine busy with other work, while
  XLA's step barely slowed. `--threads=1` shows whether that is happening.
"""

from __future__ import annotations

import os
import statistics
import time

import harness
import jax
import ml_collections
import numpy as np
from absl import app, flags

from maelm_jax import cli, tokenizer

TARGETS = {"mlm": 1.5, "maelm": 1.2}  # minimum throughput ratio ours / peer

FLAGS = flags.FLAGS
harness.define_config("peer.py")
harness.define_timing_flags(steps=3)
flags.DEFINE_integer("threads", os.cpu_count(), "torch intra-op threads (XLA uses every "
                     "core regardless).", lower_bound=1)
flags.DEFINE_enum("peer", "hf", ["hf", "none"], "none: time only our side (no torch needed).")


class PeerBench(harness.Timed):
    """RobertaForMaskedLM's train step, recording times the way harness.Bench.run does.

    `ours` is our MLM's config: the peer takes its encoder's sizes and dropout, its
    vocabulary, length, masking rate and optimiser settings.
    """

    def __init__(self, ours: ml_collections.ConfigDict, tokens: np.ndarray):
        super().__init__()
        import torch
        import transformers

        self.torch = torch
        train, m = ours.train, ours.model
        self.mask_ratio = ours.masking.mask_ratio
        self.clip_norm = train.clip_norm
        self.vocab_size = ours.tokenizer.vocab_size
        start = time.perf_counter()
        torch.manual_seed(0)  # initial weights and every step's masks
        config = transformers.RobertaConfig(
            vocab_size=self.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads, intermediate_size=m.d_ff,
            # RoBERTa numbers positions from padding_idx + 1 = 2.
            max_position_embeddings=ours.data.seq_len + 2,
            hidden_dropout_prob=m.dropout, attention_probs_dropout_prob=m.attention_dropout)
        self.model = transformers.RobertaForMaskedLM(config).train()
        self.attention = self.model.config._attn_implementation
        # Our optimiser's hyper-parameters (a constant rate: the schedule costs nothing).
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train.learning_rate, betas=(train.adam_b1, train.adam_b2),
            eps=train.adam_eps, weight_decay=train.weight_decay)
        self.tokens = torch.from_numpy(tokens).long()
        self.build_seconds = time.perf_counter() - start
        self.num_params = sum(p.numel() for p in self.model.parameters())  # tied counted once

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

    def step_once(self) -> None:  # synchronous on the CPU
        ids, labels = self.mask()
        self.model(input_ids=ids, labels=labels).loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()


def main(argv) -> None:
    del argv  # cli.tool_flags_parser refuses stray arguments
    kept = harness.start_host_memory()
    config = FLAGS.config
    configs = harness.objective_configs(config, ("mlm", "maelm"))
    if FLAGS.peer == "hf":
        try:
            import torch
            import transformers
        except ImportError as e:
            cli.fail(f"--peer=hf needs torch and transformers ({e}): "
                     f"pip install -r requirements-bench.txt (or pass --peer=none)", cli.program())
        torch.set_num_threads(FLAGS.threads)
        print(f"torch {torch.__version__}, transformers {transformers.__version__}: "
              f"torch.get_num_threads() = {torch.get_num_threads()}")
    print(f"jax {jax.__version__} on {jax.default_backend()}: XLA's CPU client uses all "
          f"{os.cpu_count()} CPUs (by default; not set here)")
    print("host memory: " + ("glibc malloc keeps freed memory (--keep_host_memory)" if kept
                             else "the C allocator's defaults"))
    print(f"load average {os.getloadavg()[0]:.1f} before starting (other work on the "
          f"machine skews the timings, torch's most)")
    print(f"fp32 jitted 2048x2048 matmul: {harness.matmul_gflops():.1f} GFLOP/s (median of 5)")
    m = config.model
    print(f"encoder {m.num_layers} x {m.d_model} ({m.num_heads} heads, FFN {m.d_ff}), "
          f"MAE-LM decoder {m.decoder.num_layers} x {m.decoder.d_model}, "
          f"L={config.data.seq_len}, batch={config.train.batch_size}, "
          f"|V|={config.tokenizer.vocab_size}, dropout {m.dropout} (attention "
          f"{m.attention_dropout}; our PRNG {config.train.prng_impl}); "
          f"{FLAGS.repeats} x {FLAGS.steps} timed steps per side")

    tokens = harness.random_tokens(config)
    benches = {}
    for objective, objective_config in configs.items():
        b = benches[objective] = harness.Bench(objective_config, tokens)
        print(f"  {objective:5s} compiled in {b.compile_seconds:.1f} s; "
              f"n_enc={b.counts.n_enc}, k={b.counts.k}")
    if FLAGS.peer == "hf":
        b = benches["peer"] = PeerBench(configs["mlm"], tokens)
        print(f"  peer  RobertaForMaskedLM built in {b.build_seconds:.1f} s; "
              f"attention {b.attention}; {b.mask_ratio:.0%} masked per step, 80-10-10")
    harness.time_rotated(benches, FLAGS.warmup, FLAGS.repeats, FLAGS.steps)

    tokens_per_step = config.train.batch_size * config.data.seq_len
    print()
    print(f"{'side':5s} {'params':>12s} {'ms/step':>9s} {'min ms':>9s} {'cpu ms':>9s} "
          f"{'faults':>8s} {'tokens/s':>9s}")
    wall = {}
    for side, b in benches.items():
        # "min ms" and "cpu ms" (process CPU time, all threads) show how much other load
        # on the machine inflated the median wall time; "faults" (minor page faults per
        # step) how much fresh memory the step had the kernel map and zero.
        wall[side] = s = statistics.median(b.wall)
        print(f"{side:5s} {b.num_params:12,d} {1e3 * s:9.1f} {1e3 * min(b.wall):9.1f} "
              f"{1e3 * statistics.median(b.cpu):9.1f} {statistics.median(b.faults):8.0f} "
              f"{tokens_per_step / s:9.0f}")

    print()
    if "peer" not in wall:
        print("peer: skipped (--peer=none)")
        return
    # The verdict is on the median of the per-round ratios (each round times both sides
    # back to back); the ratio of the fastest steps shows each side's best on this machine.
    for objective, target in TARGETS.items():
        ratios = harness.round_ratios(benches["peer"].wall, benches[objective].wall, FLAGS.steps)
        ratio = statistics.median(ratios)  # tokens/s ours over tokens/s peer
        verdict = "meets" if ratio >= target else "misses"
        best = min(benches["peer"].wall) / min(benches[objective].wall)
        print(f"{objective} / peer: {ratio:.2f}x tokens/s, median of {len(ratios)} rounds "
              f"(range {min(ratios):.2f}-{max(ratios):.2f}x; fastest steps {best:.2f}x; "
              f"target >= {target}x: {verdict})")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.tool_flags_parser)
