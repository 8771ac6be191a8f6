"""The study at one-GPU scale: MLM, MAE-LM, 3ML_self and 3ML_cross pretrained alike on real
Wikipedia, their effective ranks (centred and not), and GLUE against the from-scratch
control.

    python main.py --config=configs/study/gpu.py:one_call --workdir=runs/study \
        --time_limit_minutes=9 \
        --config.pretrain.tokenizer.model_path=runs/study_tokenizer/tokenizer.model \
        --config.pretrain.data.sources.large.path=/data/wiki_large \
        --config.pretrain.data.sources.wiki.path=/data/wiki --config.glue_dir=/data/glue

Two WikiExtractor corpora (`large`: long established articles, `wiki`: newer ones), mixed
by weight. Presets:

* `one_call` (claim (c), the MAE-LM paper's mechanism, and MAE-LM leaving the unigram
  plateau at a GPU's batch, in one command of a lent GPU of about 9 minutes): MLM, MAE-LM
  and the control; a 6 x 256 encoder (4 heads, FFN 1024) on an 8,192-piece BPE trained
  beforehand on a CPU and given by path (scripts/study_tokenizer.py), blocks of 128, batches
  of 512; the rank analysis; SST-2 (its first 8,000 examples), STS-B, MRPC and CoLA in that
  order (a time limit cuts the least informative last), every model and the control with 5
  seeds as one program per task, at one learning rate for all, texts of up to 64 tokens. The
  pretraining steps are sized at the start of the command from the times measured there
  (config.sizing; at most 8,000 per model, a cap the sizing, not the design, should reach),
  so the call ends within --time_limit_minutes. MAE-LM's step costs 1.48x MLM's FLOPs at
  this shape (its 4-layer decoder on 6 layers; 1.16x at the paper's base): every comparison
  states it.
* `seeds` (claims (b) and (d), one call per pretraining seed: --config.pretrain.seed=N):
  MLM, MAE-LM and 3ML_self on the same pretraining design, 10 fine-tuning seeds on SST-2
  and STS-B (30 runs a task, one program), no control, the rank analysis; calls pool
  with `one_call`'s (configs/study/pool.py).

`one_call`, `seeds` and `mechanism` analyse the ranks in every call and pack each
pretrained encoder (bfloat16, config and tokenizer: study/encoders.py) into
encoders/<model>.npz, which benchmarks/gpu_study.sh brings back.
* `mechanism` (claims (c0)-(c2'), one call per pretraining seed: --config.pretrain.seed=N):
  MLM, MAE-LM and MAE-LM with [MASK] in the encoder (`enc_mask`, MAE-LM Table 2's "enc.
  w. [MASK]", masking.delta = 1) on the same pretraining design, the rank analysis, no
  fine-tuning: the mechanism's own contrast at MAE-LM's decoder and FLOPs, with the
  minutes of a call spent on three pretrainings.
* `gpu` (the whole study in several leases, a 6 x 512 encoder, every GLUE task found; run
  in parts and merged, configs/study/merge.py).

In `one_call` and `seeds` 3ML_self pretrains 86 % of the others' steps (config.step_scale):
its step costs 0.87x MLM's FLOPs at 6 x 256, so it trains on 0.75x MLM's FLOPs, the budget
of the 3ML paper's claim. Option `tiny` (`one_call,tiny`, `seeds,tiny`, `mechanism,tiny`)
shrinks them to laptop sizes, for tests and a dry run on a CPU; `gpu.py:tiny` is the `gpu`
preset's twin and `gpu.py:pretrain` the `gpu` preset's MLM pretraining config (what the
benchmarks take).
`gpu.py:one_call_pretrain` is the pretraining of `one_call`'s MAE-LM (`--config.objective=mlm`
gives its MLM), to probe one model of the design on its own, e.g. on a CPU at a smaller
batch (docs/study.md).
benchmarks/gpu_study.sh runs a call on a lent GPU.

The models are still small, so the quickstart's two aids stay (the relative bias's
locality prior and the decoder's own relative bias; see docs/plateau.md). In `gpu` MAE-LM's
decoder keeps the base model's 12:4 depth ratio at full width; in `one_call` and `seeds` it
has the paper's 4 layers at full width, since with 2 MAE-LM stays on the unigram plateau
(docs/study.md); the 3ML decoders are 2 layers at half width (3ML Table 4).
"""

from configs.pretrain import quickstart
from maelm_jax.config import variants
from maelm_jax.study import config as study_config

PRESETS = ("gpu", "one_call", "seeds", "mechanism", "tiny", "pretrain", "one_call_pretrain")
OPTIONS = {"size": ("full", "tiny")}
# The GLUE tasks of the one-call design, the most informative first.
ONE_CALL_TASKS = ("SST-2", "STS-B", "MRPC", "CoLA")


def _corpora(p) -> None:
    p.data.sources = {"large": {"kind": "wikiextractor", "path": "", "weight": 1.0},
                      "wiki": {"kind": "wikiextractor", "path": "", "weight": 1.0}}
    p.data.validation_fraction = 0.01
    p.train.fill_mask_examples = 0


def _tiny_model(p) -> None:
    p.tokenizer.vocab_size = 512
    p.data.seq_len = 32
    p.model.update(num_layers=2, d_model=32, num_heads=2, d_ff=64, rel_pos_buckets=8,
                   rel_pos_max_distance=16)
    p.model.decoder.update(num_layers=1, d_model=32, num_heads=2, d_ff=64, rel_pos_buckets=8)


def _pretrain(preset: str):
    """The shared pretraining config of the `gpu` preset (or its tiny twin)."""
    p = quickstart.get_config("maelm")
    _corpora(p)
    if preset == "tiny":
        _tiny_model(p)
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


def _one_call_pretrain(tiny: bool):
    """The pretraining design `one_call` and `seeds` share (steps at most; sized)."""
    p = quickstart.get_config("maelm")
    _corpora(p)
    if tiny:
        _tiny_model(p)
        p.train.update(batch_size=8, num_steps=6, warmup_steps=1, eval_every=6,
                       checkpoint_every=6, log_every=2, eval_batches=2)
        return p
    p.tokenizer.vocab_size = 8192
    p.tokenizer.max_sentences = 1_000_000
    p.data.seq_len = 128
    p.model.update(num_layers=6, d_model=256, num_heads=4, d_ff=1024, scan_layers=True)
    # MAE-LM's decoder: the paper's 4 layers (its decoder's depth at base and large alike)
    # rather than its 1/6-1/3 of the encoder's depth, which gives 2 here. With 2 layers
    # MAE-LM stays on the unigram plateau; with 4 it leaves it about as MLM does
    # (docs/study.md). The 3ML recipes set their own decoders, and MLM has none.
    p.model.decoder.update(num_layers=4, d_model=256, num_heads=4, d_ff=1024)
    # 1e-3, a peak at which MLM and 3ML leave the unigram plateau. The peak is not what
    # holds MAE-LM there (with a 2-layer decoder it stays at lower and higher peaks alike,
    # docs/study.md), so the one the other models are known to train at stays.
    # Batches of 512 (at 256 a GPU runs far below its peak at this width); at most
    # 8,000 steps, so that the sizing, not this cap, decides; the warmup a tenth of the
    # planned steps (sizing.apply keeps this share).
    p.train.update(batch_size=512, num_steps=8000, learning_rate=1e-3, warmup_steps=800,
                   eval_every=8000, eval_batches=8, checkpoint_every=8000, log_every=100)
    return p


def _one_call_design(c, tiny: bool) -> None:
    """What `one_call` and `seeds` share: pretraining, the fine-tuning recipe, sizing."""
    c.pretrain = _one_call_pretrain(tiny)
    c.step_scale = {"3ml_self": 0.86}
    f = c.finetune
    # One peak learning rate for every model and the control, by a rule fixed before any
    # call: ELECTRA's for an encoder of this width (Clark et al. 2020, Table 7: 3e-4 for
    # Small, 256 wide; 1e-4 for Base). The control takes the models' rate: a larger one of
    # its own would be an asymmetry in its favour.
    f.update(max_seq_len=64, max_train_examples=8000, min_train_examples=500, num_epochs=3,
             batch_size=32, learning_rate=3e-4, scratch_learning_rate=0.0, warmup_ratio=0.06)
    c.sizing.enabled = True
    c.sizing.overhead_seconds = 15.0  # the reports and plots at the end
    c.reserve_seconds = 20.0
    # Every call of the design analyses its ranks and brings back its encoders (bfloat16,
    # about 14 MB each at 6 x 256), so a seed's replicate counts toward claim (c) and
    # anything it trained can be analysed again on a CPU.
    c.rank = True
    c.return_encoders = True
    if tiny:  # a CPU's seconds, no time limit needed
        f.update(max_seq_len=32, max_train_examples=16, min_train_examples=8, num_epochs=1,
                 batch_size=4, learning_rate=1e-3)
        c.sizing.update(budget_seconds=3600.0, step_multiple=2, min_steps=2,
                        overhead_seconds=5.0, measure_steps=2)
        c.rank_tokens = 256


def get_config(arg: str | None = None):
    preset, options = variants.parse(arg, PRESETS, "gpu", OPTIONS)
    tiny = options["size"] == "tiny"
    if tiny and preset not in ("one_call", "seeds", "mechanism"):
        raise variants.VariantError(f"variant option tiny: for one_call and seeds (the gpu "
                                    f"preset's twin is gpu.py:tiny), not {preset}")
    if preset == "pretrain":
        return _pretrain("gpu")
    if preset == "one_call_pretrain":
        return _one_call_pretrain(False)
    c = study_config.study_defaults()
    if preset == "one_call":
        c.title = "The papers' claims in one GPU call" + (" (tiny)" if tiny else "")
        _one_call_design(c, tiny)
        c.models = ("mlm", "maelm")
        c.tasks = ONE_CALL_TASKS
        c.seeds = (1, 2, 3, 4, 5)
        c.finetune.seeds_per_program = 5
        return c
    if preset == "seeds":
        c.title = "More pretraining and fine-tuning seeds" + (" (tiny)" if tiny else "")
        _one_call_design(c, tiny)
        c.models = ("mlm", "maelm", "3ml_self")
        c.scratch = False
        c.tasks = ("SST-2", "STS-B")
        c.seeds = tuple(range(1, 11))
        c.finetune.seeds_per_program = 10
        return c
    if preset == "mechanism":
        c.title = "The [MASK] mechanism: MLM, MAE-LM and MAE-LM with [MASK] in the encoder" + (
            " (tiny)" if tiny else "")
        _one_call_design(c, tiny)
        # MAE-LM Table 2's "enc. w. [MASK]" (masking.delta = 1): MAE-LM's decoder and FLOPs
        # with the [MASK]s in the encoder, the contrast of claim (c2'). Pretraining and the
        # rank analysis only: no GLUE directory is read (benchmarks/gpu_study.sh gives none).
        c.models = ("mlm", "maelm", "enc_mask")
        c.scratch = False
        c.glue_dir = ""
        return c
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
