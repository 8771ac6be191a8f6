"""The study at one-GPU scale: MLM, MAE-LM, 3ML_self and 3ML_cross pretrained alike on real
Wikipedia, their effective ranks (centred and not), and GLUE against the from-scratch
control, sized to take about 20 minutes of one H100 in all.

    python main.py --config=configs/study/gpu.py --workdir=runs/study_gpu \
        --config.pretrain.data.sources.large.path=/data/wiki_large \
        --config.pretrain.data.sources.wiki.path=/data/wiki --config.glue_dir=/data/glue

Two WikiExtractor corpora (`large`: long established articles, `wiki`: newer ones), mixed
by weight. The GLUE tasks are whichever of SST-2, CoLA, MRPC, STS-B, RTE, QNLI, MNLI and
QQP the GLUE directory holds, 3 seeds each (medians), at most 20,000 training examples per
task (SST-2 has 67K), so that 5 encoders x 4 to 8 tasks x 3 seeds of fine-tuning stay in
minutes: a task's three seeds train as one program (finetune.seeds_per_program, a seed
group: one step for three runs), and the compilation cache (main.py, on by default)
compiles each shape once. benchmarks/finetune_seeds.py measures what the group buys.

The size is a first estimate, to be set from the step time measured on the GPU
(`benchmarks/step_time.py --config=configs/study/gpu.py:pretrain`): a 6 x 512 encoder
(8 heads, FFN 2048) on a 16,384-piece BPE of both corpora (about 30M tokens), blocks of
128, batches of 256, 6,000 steps (197M tokens: about 6 passes over the corpus), so each
model pretrains in about 2.5 minutes if the step reaches about 1.3M tokens/s in bfloat16.
The first GPU figures bear that out for MLM, not yet measured on this config: on an H200
the MLM step at 2 layers of BERT-base width, which does about as many FLOPs per token as
this one (117M against 126M), ran at 1.45M tokens/s, and MAE-LM and 3ML at 0.83-0.88M
(docs/performance.md), so those take about 4 minutes each here.
MAE-LM's decoder keeps the base model's 12:4 depth ratio (2 layers at full width); the
3ML decoders are 2 layers at half width (3ML Table 4). The model is still small, so the
quickstart's two aids stay (the relative bias's locality prior and the decoder's own
relative bias; see docs/plateau.md).

Where a machine is held for less than the whole study, run it in parts, a share of the
models each (`--config.models`, `--config.scratch`), and merge them with
configs/study/merge.py; benchmarks/gpu_study.sh shows how.

`gpu.py:tiny` is the same study with laptop sizes, for tests and a dry run on a CPU.
`gpu.py:pretrain` is the MLM pretraining config the study's models start from (what the
benchmarks take).
"""

from configs.pretrain import quickstart
from maelm_jax import variants
from maelm_jax.study import config as config_lib

PRESETS = ("gpu", "tiny", "pretrain")


def _pretrain(preset: str):
    """The shared pretraining config: the corpora, then the size of the preset."""
    p = quickstart.get_config("maelm")
    p.data.sources = {"large": {"kind": "wikiextractor", "path": "", "weight": 1.0},
                      "wiki": {"kind": "wikiextractor", "path": "", "weight": 1.0}}
    p.data.validation_fraction = 0.01
    p.train.fill_mask_examples = 0
    if preset == "tiny":
        p.tokenizer.vocab_size = 512
        p.data.seq_len = 32
        p.model.update(num_layers=2, d_model=32, num_heads=2, d_ff=64, rel_pos_buckets=8,
                       rel_pos_max_distance=16)
        p.model.decoder.update(num_layers=1, d_model=32, num_heads=2, d_ff=64,
                               rel_pos_buckets=8)
        p.train.update(batch_size=8, num_steps=4, warmup_steps=1, eval_every=4,
                       checkpoint_every=4, log_every=2)
        return p
    p.tokenizer.vocab_size = 16384
    p.tokenizer.max_sentences = 1_000_000
    p.data.seq_len = 128
    p.model.update(num_layers=6, d_model=512, num_heads=8, d_ff=2048, scan_layers=True)
    p.model.decoder.update(num_layers=2, d_model=512, num_heads=8, d_ff=2048)
    p.train.update(batch_size=256, num_steps=6000, learning_rate=1e-3, warmup_steps=500,
                   eval_every=1000, eval_batches=16, checkpoint_every=2000, log_every=200)
    return p


def get_config(arg: str | None = None):
    preset, _ = variants.parse(arg, PRESETS, "gpu")
    if preset == "pretrain":
        return _pretrain("gpu")
    c = config_lib.study_defaults()
    c.title = "One-GPU study" + (" (tiny preset)" if preset == "tiny" else "")
    c.pretrain = _pretrain(preset)
    c.tasks = ("SST-2", "CoLA", "MRPC", "STS-B", "RTE", "QNLI", "MNLI", "QQP")
    c.seeds = (1, 2, 3)
    f = c.finetune
    # The three seeds of a task train as one program (finetune/seed_group.py), as in the
    # tiny preset, so a dry run on a CPU takes the GPU's path.
    f.seeds_per_program = 3
    if preset == "tiny":
        f.update(max_seq_len=32, max_train_examples=16, min_train_examples=8, num_epochs=1,
                 batch_size=4, learning_rate=1e-3)
        c.rank_tokens = 256
        return c
    f.update(max_seq_len=128, max_train_examples=20_000, num_epochs=3, batch_size=32,
             learning_rate=1e-4)
    return c
