"""MAE-LM *base* (MAE-LM paper, Section 4.1 and Table 4): BERT-base encoder, 4-layer decoder.

    python main.py --config=configs/pretrain/base.py --workdir=runs/base          # MAE-LM
    python main.py --config=configs/pretrain/base.py:mlm --workdir=runs/base_mlm  # baseline

The paper trains on Wikipedia + BookCorpus (16 GB); point data.sources at your copy.
"""

from maelm_jax import config as config_lib

VARIANTS = ("maelm", "mlm")


def objective_from_arg(arg: str | None) -> str:
    """The config-file variant (`file.py:<variant>`) selects the objective."""
    objective = arg or "maelm"
    if objective not in VARIANTS:
        raise ValueError(f"unknown variant {objective!r}; expected one of {VARIANTS}")
    return objective


def get_config(arg: str | None = None):
    c = config_lib.pretrain_defaults()
    c.objective = objective_from_arg(arg)
    c.tokenizer.vocab_size = 32768  # BPE, uncased
    c.tokenizer.lowercase = True
    c.data.seq_len = 512
    c.masking.mask_ratio = 0.15  # all [MASK], no 80-10-10 (Appendix C)
    c.model.num_layers = 12
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
    return c
