"""benchmarks/peer_hf.py's default: the configuration compared with Hugging Face's
RobertaForMaskedLM.

    python benchmarks/peer_hf.py --config=configs/benchmark/peer.py
    python benchmarks/peer_hf.py --config=configs/benchmark/peer.py:layers=12

A 4 x 256 encoder (4 heads, FFN 1024, dropout and attention dropout 0.1), L = 128,
batch 32, an 8,000-piece vocabulary. MAE-LM's decoder has max(1, layers // 3) layers at
full width and no dropout: the base model's 12:4 encoder-to-decoder depth ratio, so the
decoder's share of the step is the paper's at any depth. The option `layers=` sets the
encoder's depth and the decoder's with it; --config.model.num_layers alone changes only the
encoder.
"""

from configs import benchmark
from maelm_jax import variants


def get_config(arg: str | None = None):
    name, options = variants.parse(arg, None, "", {"layers": 4})
    if name:
        raise variants.VariantError(f"unknown config variant {name!r}; this file has none, "
                                    "only the option layers=<encoder depth>")
    layers = options["layers"]
    if layers < 1:
        raise variants.VariantError(f"variant option layers: expected >= 1, got {layers}")
    return benchmark.sized(vocab_size=8000, seq_len=128, batch_size=32,
                           encoder=(layers, 256, 4, 1024),
                           decoder=(max(1, layers // 3), 256, 4, 1024))
