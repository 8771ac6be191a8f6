"""A small MAE-LM on the built-in corpus (Python stdlib docstrings): minutes on a laptop CPU.

    python main.py --config=configs/pretrain/quickstart.py --workdir=runs/quickstart

`quickstart.py:mlm` trains the MLM baseline with the same settings.
"""

from configs.pretrain import base
from maelm_jax import config as config_lib


def get_config(arg: str | None = None):
    c = config_lib.pretrain_defaults()
    c.objective = base.objective_from_arg(arg)
    c.tokenizer.vocab_size = 8192
    c.data.seq_len = 128
    c.data.validation_fraction = 0.02
    c.model.num_layers = 4
    c.model.d_model = 256
    c.model.num_heads = 4
    c.model.d_ff = 1024
    c.model.rel_pos_buckets = 32
    c.model.rel_pos_max_distance = 128
    c.model.decoder.num_layers = 2
    c.model.decoder.d_model = 256
    c.model.decoder.num_heads = 4
    c.model.decoder.d_ff = 1024
    c.train.batch_size = 32
    c.train.num_steps = 300
    c.train.learning_rate = 1e-3
    c.train.warmup_steps = 30
    c.train.log_every = 25
    c.train.eval_every = 100
    c.train.eval_batches = 8
    c.train.checkpoint_every = 100
    return c
