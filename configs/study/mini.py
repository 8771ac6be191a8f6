"""The laptop-scale study: MLM, MAE-LM, 3ML_self and 3ML_cross pretrained alike, their
effective ranks, and GLUE fine-tuning with several seeds.

    python main.py --config=configs/study/mini.py --workdir=runs/study \
        --config.glue_dir=/data/glue

Presets: `mini` (the default; the quickstart's model for each objective, sized for 2 CPU
cores with 5 seeds; docs/results.md has the recorded run) and `mini.py:small` (a 6 x 256
encoder, 8K vocabulary, blocks of 128, 20K steps: sized for one GPU).
Pretrain on another corpus with e.g. `--config.pretrain.data.sources.main.kind=wikiextractor
--config.pretrain.data.sources.main.path=/data/wiki`. Without glue_dir the study
pretrains and analyses only. Run the same command again to resume; finished parts are
reused. The workdir gets study.md, study.json and the plots (maelm_jax/study/report.py).
"""

from configs.pretrain import quickstart
from maelm_jax.study import config as study_config

PRESETS = ("mini", "small")


def get_config(arg: str | None = None):
    preset = arg or "mini"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    c = study_config.study_defaults()
    c.title = "Laptop-scale study" if preset == "mini" else "Study at mini.py:small size"
    c.pretrain = quickstart.get_config("maelm")
    if preset == "mini":
        c.finetune.max_seq_len = 64
        c.finetune.max_train_examples = 2000
        c.finetune.num_epochs = 3
        c.finetune.learning_rate = 1e-3
        return c
    p = c.pretrain
    p.tokenizer.vocab_size = 8192
    p.data.seq_len = 128
    p.model.num_layers = 6
    p.model.d_model = 256
    p.model.d_ff = 1024
    p.model.decoder.d_model = 256
    p.model.decoder.d_ff = 1024
    p.train.batch_size = 128
    p.train.num_steps = 20_000
    p.train.learning_rate = 1e-3
    p.train.warmup_steps = 1000
    p.train.eval_every = 2000
    p.train.checkpoint_every = 2000
    c.finetune.max_seq_len = 128
    c.finetune.max_train_examples = 20_000
    c.finetune.learning_rate = 2e-4
    return c
