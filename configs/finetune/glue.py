"""Fine-tuning on a GLUE task (MAE-LM paper, Section 4.1 and Appendix D, Table 5).

    python main.py --config=configs/finetune/glue.py:rte --workdir=runs/rte \
        --config.init_from=runs/base --config.data.data_dir=glue_data

The variant is the task (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli; GLUE's
spellings such as SST-2 work too), optionally followed by ",large" for the large++
learning rates and ",3ml" for the 3ML paper's recipe (its Table 5 grid, weight decay 0.1,
its aggregation: each seed's best setting, then the median of the five bests, and its
Table 3 metrics: MRPC and QQP by the mean of F1 and accuracy, STS-B of Pearson and
Spearman, MNLI of matched and mismatched accuracy).
A single run uses one point of the grid (below); add --config.sweep=True to run the whole
grid x 5 seeds and aggregate them as the paper does (MAE-LM: the median of each setting,
then the best setting).
RoBERTa and 3ML start RTE, MRPC and STS-B from the MNLI model: --config.init_from=<the
MNLI fine-tuning workdir> (its encoder, a new head). --config.data.source=tfds reads a
prepared glue/<task> (ArrayRecord) instead of the TSV files.

The workdir gets results.json (dev metrics in percent; MNLI as m/accuracy, mm/accuracy),
predictions/<TASK>.tsv for GLUE's server (when the test split is there) and a checkpoint.
"""

from maelm_jax.config import variants
from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune.tasks import glue


def get_config(arg: str | None = None):
    task_name, options = variants.parse(arg, None, "sst2", {
        "size": finetune_config.MODEL_SIZES, "paper": finetune_config.PAPERS})
    task = glue.examples.get_task(task_name)
    c = finetune_config.finetune_defaults()
    c.task = task.tfds_config  # the canonical short name: sst2, mnli, ...
    c.data.source = "files"
    c.data.data_dir = ""  # the GLUE directory (<dir>/SST-2/train.tsv, ...) or a task's own
    c.data.max_seq_len = 0  # 0 = min(512, the encoder's positions); Table 5: 512
    grid = finetune_config.paper_grid(c.task, options["size"], options["paper"])
    finetune_config.set_grid(c, grid)
    c.grid.seeds = finetune_config.PAPER_SEEDS
    c.grid.aggregate = finetune_config.PAPER_AGGREGATE[options["paper"]]
    c.metric = options["paper"]
    # One point of the grid for a single run: the second learning rate, 32 (large tasks) or
    # 16 (small tasks) sequences per batch, 3 (large) or 10 (small) epochs, 6 % warmup.
    # Which tasks are small is the paper's own split (SST-2 is small for 3ML, large for
    # MAE-LM); both papers' small-task grids try batches of 16 and 32.
    small = len(grid["batch_size"]) > 1
    c.train.learning_rate = grid["learning_rate"][1]
    c.train.batch_size = grid["batch_size"][0]
    c.train.num_epochs = 10 if small else 3
    c.train.warmup_ratio = 0.06
    c.train.weight_decay = (0.01 if options["paper"] == "maelm"
                            else finetune_config.THREEML_WEIGHT_DECAY)
    c.train.clip_norm = 0.0  # Table 5: no clipping
    c.train.weight_decay_on = "all"  # every parameter, as the papers' fairseq code
    c.model.dropout = 0.1
    c.model.attention_dropout = 0.1
    return c
