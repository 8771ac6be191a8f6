"""MAE-LM *base* (MAE-LM paper, Section 4.1 and Table 4): BERT-base encoder, 4-layer decoder,
and every row of its Table 2 ablations as a variant.

    python main.py --config=configs/pretrain/base.py --workdir=runs/base          # MAE-LM
    python main.py --config=configs/pretrain/base.py:mlm --workdir=runs/base_mlm  # baseline
    python main.py --config=configs/pretrain/base.py:misaligned --workdir=runs/abl  # a row

The paper trains on Wikipedia + BookCorpus (16 GB); point data.sources at your copy.
"""

from maelm_jax.config import variants
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import objectives
from maelm_jax.pretrain.objectives import recipes

# MAE-LM Table 2, one variant per row (maelm_jax/pretrain/objectives/recipes.py).
TABLE2 = recipes.TABLE2


def objective_from_arg(arg: str | None) -> str:
    """The objective a variant string names (the small configs offer the registered
    objectives: `maelm`, `mlm`, ...)."""
    return variants.parse(arg, objectives.names(), "maelm")[0]


def get_config(arg: str | None = None):
    name, _ = variants.parse(arg, tuple(TABLE2), "maelm")
    c = pretrain_config.pretrain_defaults()
    c.tokenizer.vocab_size = 32768  # BPE, uncased
    c.tokenizer.lowercase = True
    c.data.seq_len = 512
    c.masking.mask_ratio = 0.15  # all [MASK], no 80-10-10 (Appendix C)
    c.model.num_layers = 12
    # 12 layers and more: scanned, so compile time does not grow with depth. Base fits
    # without rematerialisation at the paper's per-device batches.
    c.model.scan_layers = True
    c.model.d_model = 768
    c.model.num_heads = 12
    c.model.d_ff = 3072
    c.model.dropout = 0.1  # encoder only; the decoder has none
    c.model.attention_dropout = 0.1
    c.model.rel_pos_buckets = 32
    c.model.rel_pos_max_distance = 128
    c.model.decoder.num_layers = 4  # same width as the encoder
    c.model.decoder.d_model = 768
    c.model.decoder.num_heads = 12
    c.model.decoder.d_ff = 3072
    c.train.batch_size = 2048
    c.train.num_steps = 125_000
    c.train.learning_rate = 5e-4
    c.train.warmup_steps = 10_000
    c.train.adam_b1, c.train.adam_b2, c.train.adam_eps = 0.9, 0.98, 1e-6
    c.train.clip_norm = 2.0
    c.train.weight_decay = 0.01
    c.train.weight_decay_on = "all"  # every parameter, as the papers' fairseq code
    return TABLE2[name].apply(c)
