"""benchmarks/compile_time.py's default sizes: narrow, since compile time follows the
program's size, not its tensors'.

    python benchmarks/compile_time.py --config=configs/benchmark/compile_time.py

A 128-wide encoder (2 heads, FFN 512, dropout 0.1), L = 64, batch 4, a 1,024-piece
vocabulary, a 2-layer MAE-LM decoder at full width. The benchmark sets the encoder's depth
(model.num_layers) and model.scan_layers itself, from --depths and for both layouts.
"""

from maelm_jax import config as config_lib
from maelm_jax import variants


def get_config(arg: str | None = None):
    if arg:
        raise variants.VariantError(f"config variant {arg!r}: this file has no variants "
                                    "or options")
    c = config_lib.pretrain_defaults()
    c.tokenizer.vocab_size = 1024
    c.data.seq_len = 64
    c.train.batch_size = 4
    m = c.model
    m.num_layers, m.d_model, m.num_heads, m.d_ff = 2, 128, 2, 512
    m.dropout = m.attention_dropout = 0.1
    d = m.decoder
    d.num_layers, d.d_model, d.num_heads, d.d_ff = 2, 128, 2, 512
    return c
