r"""benchmarks/step_time.py's default sizes: big enough that the dense matmuls dominate,
small enough to run in a few minutes on a 2-core CPU.

    python benchmarks/step_time.py --config=configs/benchmark/step_time.py \
        [--config.model.dropout=0 --config.model.attention_dropout=0]

A 4 x 768 encoder (12 heads, FFN 3072, dropout and attention dropout 0.1), L = 128,
batch 8, a 32,768-piece vocabulary; MAE-LM's decoder is the paper's 4 layers at full width
without dropout. The benchmark derives the MLM and 3ML models from this one (see its
docstring).
"""

from maelm_jax import config as config_lib
from maelm_jax import variants


def get_config(arg: str | None = None):
    if arg:
        raise variants.VariantError(f"config variant {arg!r}: this file has no variants "
                                    "or options")
    c = config_lib.pretrain_defaults()
    c.tokenizer.vocab_size = 32768
    c.data.seq_len = 128
    c.train.batch_size = 8
    m = c.model
    m.num_layers, m.d_model, m.num_heads, m.d_ff = 4, 768, 12, 3072
    m.dropout = m.attention_dropout = 0.1
    d = m.decoder
    d.num_layers, d.d_model, d.num_heads, d.d_ff = 4, 768, 12, 3072
    d.dropout = d.attention_dropout = 0.0
    return c
