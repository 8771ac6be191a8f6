"""Fine-tuning on SQuAD 2.0 (MAE-LM paper, Appendix D, Table 6), or 1.1.

    python main.py --config=configs/finetune/squad.py --workdir=runs/squad \
        --config.init_from=runs/base \
        --config.squad.train_file=squad/train-v2.0.json \
        --config.squad.dev_file=squad/dev-v2.0.json

Variants: "v2" (default) or "v1" (SQuAD 1.1: no unanswerable questions), optionally
followed by ",large" for the large++ learning rates. --config.data.source=tfds reads a
prepared squad/v2.0 instead of the JSON files. Metrics are the official script's of the
version: v2.0's exact, f1, HasAns_*, NoAns_*, best_exact, best_f1 and their no-answer
thresholds; v1.1's exact_match and f1.
A single run uses one point of Table 6's grid; --config.sweep=True runs all of it.
"""

from maelm_jax.config import variants
from maelm_jax.finetune import config as finetune_config

VERSIONS = {"v2": "2.0", "v1": "1.1", "2.0": "2.0", "1.1": "1.1"}


def get_config(arg: str | None = None):
    version, options = variants.parse(arg, tuple(VERSIONS), "v2",
                                      {"size": finetune_config.MODEL_SIZES})
    c = finetune_config.finetune_defaults()
    c.task = "squad"
    c.squad.version = VERSIONS[version]
    c.squad.train_file = ""  # the official train-v2.0.json (or train-v1.1.json)
    c.squad.dev_file = ""  # the official dev-v2.0.json (or dev-v1.1.json)
    c.squad.doc_stride = 128
    c.squad.max_query_len = 64
    c.squad.max_answer_len = 30
    c.squad.n_best = 20
    c.squad.null_score_diff_threshold = 0.0
    c.data.max_seq_len = 0  # 0 = min(512, the encoder's positions); Table 6: 512
    grid = finetune_config.paper_grid("squad", options["size"])
    finetune_config.set_grid(c, grid)
    c.grid.seeds = finetune_config.PAPER_SEEDS
    # One point of the grid for a single run.
    c.train.learning_rate = grid["learning_rate"][1]
    c.train.batch_size = 32
    c.train.num_epochs = 3
    c.train.warmup_ratio = 0.06
    c.train.eval_batch_size = 64
    c.train.clip_norm = 0.0
    c.train.weight_decay_on = "all"  # every parameter, as the papers' fairseq code
    return c
