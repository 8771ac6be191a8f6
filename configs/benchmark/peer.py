"""benchmarks/peer_hf.py's default: the configuration compared with Hugging Face's
RobertaForMaskedLM.

    python benchmarks/peer_hf.py --config=configs/benchmark/peer.py
    python benchmarks/peer_hf.py --config=configs/benchmark/peer.py:layers=12
    python benchmarks/peer_hf.py --config=configs/benchmark/peer.py:base      # on a GPU
    python benchmarks/peer_hf.py --config=configs/benchmark/peer.py:base,layers=2

`small` (the default, sized for a 2-core CPU): a 4 x 256 encoder (4 heads, FFN 1024),
L = 128, batch 32, an 8,000-piece vocabulary. `base` (for a GPU): the papers' base model,
12 x 768 (12 heads, FFN 3072), L = 512, batch 32, a 32,768-piece vocabulary, scanned
layers. Both: dropout and attention dropout 0.1, and MAE-LM's decoder has
max(1, layers // 3) layers at full width and no dropout (the base model's 12:4
encoder-to-decoder depth ratio, so the decoder's share of the step is the paper's at any
depth). The option `layers=` sets the encoder's depth and the decoder's with it (iterate
at 2-4 layers of full width; --config.model.num_layers alone changes only the encoder).
"""

from configs import benchmark
from maelm_jax.config import variants

# variant -> (vocabulary, L, batch, width, heads, FFN, default depth, scanned layers)
SIZES = {"small": (8000, 128, 32, 256, 4, 1024, 4, False),
         "base": (32768, 512, 32, 768, 12, 3072, 12, True)}


def get_config(arg: str | None = None):
    name, options = variants.parse(arg, tuple(SIZES), "small", {"layers": 0})
    vocab, seq_len, batch, width, heads, ffn, depth, scan = SIZES[name]
    layers = options["layers"] or depth
    if layers < 1:
        raise variants.VariantError(f"variant option layers: expected >= 1, got {layers}")
    c = benchmark.sized(vocab_size=vocab, seq_len=seq_len, batch_size=batch,
                        encoder=(layers, width, heads, ffn),
                        decoder=(max(1, layers // 3), width, heads, ffn))
    c.model.scan_layers = scan
    return c
