"""Whether a pretrained model left the unigram plateau (docs/plateau.md): asked before
anything of its objective is read into its fine-tuning scores or ranks, by the study's
report (study/report.py) and by the pool of its calls (study/pool.py).

A model whose [MASK] accuracy at the end of pretraining is under PLATEAU_FACTOR times that
of always predicting the most frequent piece learnt word frequencies, not context: its
results measure that, not its objective.
"""

PLATEAU_FACTOR = 1.5


def on_plateau(pretraining: dict) -> bool:
    """Whether a model's pretraining record (study/report.py's `pretraining_record`: its
    eval_mask_accuracy and eval_unigram_accuracy) ended on the unigram plateau; False where
    it has no evaluation to tell."""
    acc, unigram = pretraining.get("eval_mask_accuracy"), pretraining.get("eval_unigram_accuracy")
    return acc is not None and bool(unigram) and acc < PLATEAU_FACTOR * unigram
