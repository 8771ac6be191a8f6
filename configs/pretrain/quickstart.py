"""A small MAE-LM on the built-in corpus that leaves the unigram plateau in minutes on a CPU.

    python main.py --config=configs/pretrain/quickstart.py --workdir=runs/quickstart

`quickstart.py:mlm` trains the MLM baseline with the same settings.

Sized for a 2-core laptop, where the tokenizer, data, 1,500 steps, evals and the closing
fill-mask examples take minutes. Two choices differ from the papers' base model, both for
laptop scale (see docs/plateau.md):

* `rel_pos_init="local"`: the relative position bias starts as a locality prior instead
  of N(0, 0.02). With the papers' init a model this small predicts word frequencies for
  thousands of steps, until Adam has grown a preference for neighbouring tokens.
* the decoder has a relative position bias of its own (an option of the official MAE-LM
  code), so the removed positions find their neighbours without learning it from absolute
  positions first.
"""

from configs.pretrain import base
from maelm_jax.pretrain import config as pretrain_config


def get_config(arg: str | None = None):
    c = pretrain_config.pretrain_defaults()
    c.objective = base.objective_from_arg(arg)
    c.tokenizer.vocab_size = 1024
    c.data.seq_len = 64
    c.data.validation_fraction = 0.02
    c.model.num_layers = 2
    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.d_ff = 256
    c.model.rel_pos_buckets = 32
    c.model.rel_pos_max_distance = 128
    c.model.rel_pos_init = "local"
    c.model.decoder.num_layers = 2
    c.model.decoder.d_model = 64
    c.model.decoder.num_heads = 4
    c.model.decoder.d_ff = 256
    c.model.decoder.rel_pos_buckets = 32
    c.model.decoder.rel_pos_init = "local"
    c.train.batch_size = 32
    c.train.num_steps = 1500
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 100
    c.train.log_every = 100
    c.train.eval_every = 500
    c.train.eval_batches = 8
    c.train.checkpoint_every = 500
    c.train.fill_mask_examples = 3  # end by showing what the model predicts
    return c
