"""benchmarks/compile_time.py's default sizes: narrow, since compile time follows the
program's size, not its tensors'.

    python benchmarks/compile_time.py --config=configs/benchmark/compile_time.py

A 128-wide encoder (2 heads, FFN 512, dropout 0.1), L = 64, batch 4, a 1,024-piece
vocabulary, a 2-layer MAE-LM decoder at full width. The benchmark sets the encoder's depth
(model.num_layers) and model.scan_layers itself, from --depths and for both layouts.
"""

from configs import benchmark
from maelm_jax.config import variants


def get_config(arg: str | None = None):
    variants.require_none(arg)
    return benchmark.sized(vocab_size=1024, seq_len=64, batch_size=4,
                           encoder=(2, 128, 2, 512), decoder=(2, 128, 2, 512))
