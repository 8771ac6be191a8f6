"""MAE-LM *large++* (Table 4): a 24-layer, 1024-wide encoder and a 4-layer decoder of the
same width, trained for 1M steps.

    python main.py --config=configs/pretrain/large_plus.py[:mlm] --workdir=runs/large_plus
"""

from configs.pretrain import base_plus


def get_config(arg: str | None = None):
    c = base_plus.get_config(arg)
    c.model.num_layers = 24
    c.model.d_model = 1024
    c.model.num_heads = 16
    c.model.d_ff = 4096
    c.model.rel_pos_buckets = 128
    c.model.rel_pos_max_distance = 256
    c.model.decoder.num_layers = 4
    c.model.decoder.d_model = 1024
    c.model.decoder.num_heads = 16
    c.model.decoder.d_ff = 4096
    c.train.num_steps = 1_000_000
    c.train.learning_rate = 1e-4
    c.train.clip_norm = 1.0
    # 24 x 1024: keep only the weight matmuls' outputs and recompute the rest, the usual
    # trade for a useful batch per device (scripts/plan_memory.py --remat_policies=all).
    c.model.remat_policy = "dots_no_batch"
    return c
