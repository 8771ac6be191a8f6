r"""benchmarks/step_time.py's default sizes: big enough that the dense matmuls dominate,
small enough to run in a few minutes on a 2-core CPU.

    python benchmarks/step_time.py --config=configs/benchmark/step_time.py \
        [--config.model.dropout=0 --config.model.attention_dropout=0]

A 4 x 768 encoder (12 heads, FFN 3072, dropout and attention dropout 0.1), L = 128,
batch 8, a 32,768-piece vocabulary; MAE-LM's decoder is the paper's 4 layers at full width
without dropout. The benchmark derives the MLM and 3ML models from this one (see its
docstring).
"""

from configs import benchmark
from maelm_jax.config import variants


def get_config(arg: str | None = None):
    variants.require_none(arg)
    return benchmark.sized(vocab_size=32768, seq_len=128, batch_size=8,
                           encoder=(4, 768, 12, 3072), decoder=(4, 768, 12, 3072))
