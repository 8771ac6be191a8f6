"""MAE-LM *base++* (Table 4): the base architecture trained longer on 160 GB, with a
64K cased vocabulary and 64 relative-position buckets.

    python main.py --config=configs/pretrain/base_plus.py[:mlm] --workdir=runs/base_plus
"""

from configs.pretrain import base


def get_config(arg: str | None = None):
    c = base.get_config(arg)
    c.tokenizer.vocab_size = 64000  # cased
    c.tokenizer.lowercase = False
    c.model.rel_pos_buckets = 64
    c.model.rel_pos_max_distance = 128
    c.train.num_steps = 2_000_000
    c.train.learning_rate = 2e-4
    return c
