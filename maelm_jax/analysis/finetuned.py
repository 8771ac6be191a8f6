"""The effective rank of fine-tuned encoders: the MAE-LM paper's Table 3 after fine-tuning
(MNLI 211 against RoBERTa's 149, SQuAD 2.0 260 against 103), for the runs of a
fine-tuning seed group.

At the end of a group (finetune/seed_group.py) each run's encoder, with the parameters
its results report (the best evaluation's, or the last), reads the task's dev sequences as
fine-tuning encoded them; the rank statistics of its layers are those of the rank
analysis (analysis/measures.py, one group, no bootstrap): the same sequences for every
run of the group, so models fine-tuned with one seed compare paired.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from maelm_jax.analysis import config as rank_config
from maelm_jax.analysis import inputs, measures, rank
from maelm_jax.models import encoder as encoder_lib

TAU = 0.9
MASK_RATIO = 0.15  # as the rank analysis's default
BATCH_SIZE = 32


def last_layer(found: dict) -> dict:
    """{view: {stat: {"rank", "continuous", "entropy"}}} at the last layer, from
    measures.run_measures's "statistics"."""
    return {view: {stat: {k: s[k][-1] for k in ("rank", "continuous", "entropy")}
                   for stat, s in stats.items()}
            for view, stats in found["statistics"].items()}


def run_ranks(encoder_cfg: encoder_lib.EncoderConfig, stacked_params: Any,
              sequences: Sequence[np.ndarray], seq_len: int, seed: int = 0) -> list[dict]:
    """Per run of `stacked_params` (encoder parameters with a leading runs axis, numpy):
    {"tau", "tokens", "last_layer": `last_layer`} of its representations of `sequences`
    (at most 1,000 x d real tokens of them)."""
    d = encoder_cfg.stack.d_model
    num_tokens = rank_config.DEFAULT_TOKENS_PER_DIM * d
    batches, n, _ = inputs.make_batches(sequences, seq_len, BATCH_SIZE, num_tokens, MASK_RATIO,
                                        seed, special=encoder_cfg.special)
    step = jax.jit(rank.make_gram_step(encoder_cfg))
    runs = jax.tree.leaves(stacked_params)[0].shape[0]
    out = []
    for i in range(runs):
        params = jax.tree.map(lambda x, i=i: x[i], stacked_params)
        grams = rank.zero_grams(encoder_cfg.stack.num_layers, d)
        for batch in batches:
            grams = step(params, grams, batch)
        grouped = jax.tree.map(lambda x: np.asarray(x)[None], jax.device_get(grams))
        found = measures.run_measures(grouped, TAU, center=True, replicates=0, seed=seed)
        out.append({"tau": TAU, "tokens": n, "last_layer": last_layer(found)})
    return out
