"""Bootstrap intervals of the rank statistics, from Gram matrices summed per group of
batches.

The analysis sums each statistic's moments (rank.moments: Gram matrix, row sum, row count)
separately for `groups` consecutive groups of its batches (every group of about the same
number of sequences). A replicate draws `groups` groups with replacement (multinomial
counts w_g), sums their moments weighted by w_g, and takes that sum's spectrum: the
sequences are resampled in blocks, so the correlation between the tokens of one sequence
is kept. The 95 % interval is the 2.5th to 97.5th percentile over replicates. The same
counts (one seed) serve every run analysed on the same sequences, so the difference of two
models' statistics gets its interval replicate by replicate, paired.

What an interval covers: the measurement, i.e. which held-out sequences the ranks were
taken on. Not the pretraining seed: two models trained again from other seeds differ by
more, which only replicate calls measure (study/claims.py).

Cost: replicates x (layers + 1) x statistics x views eigendecompositions of d x d (at
d = 256, 7 layers, 200 replicates: about half a minute on a CPU core); memory: groups x
statistics x (layers + 1) x d^2 float32 on the host, whatever the number of tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

LEVEL = 0.95


def group_of(batch: int, num_batches: int, groups: int) -> int:
    """Which group batch `batch` of `num_batches` is summed into: consecutive runs of
    batches, the groups as equal as the count allows (fewer batches than groups: one
    batch each)."""
    return batch * min(groups, num_batches) // num_batches


def counts(groups: int, replicates: int, seed: int) -> np.ndarray:
    """[replicates, groups] multinomial counts (each row sums to groups): the resampling
    every run on the same sequences shares."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(groups, np.full(groups, 1.0 / groups), size=replicates)


def weighted(moments: dict, w: np.ndarray) -> dict:
    """One replicate's moments from per-group ones ("gram" [G, layers, d, d], "sum"
    [G, layers, d], "count" [G]): their sums weighted by the counts w [G]."""
    w = np.asarray(w, np.float64)
    return {"gram": np.tensordot(w, np.asarray(moments["gram"], np.float64), 1),
            "sum": np.tensordot(w, np.asarray(moments["sum"], np.float64), 1),
            "count": float(w @ np.asarray(moments["count"], np.float64))}


def replicate_values(moments: dict, draws: np.ndarray,
                     statistic: Callable[[dict], np.ndarray]) -> np.ndarray:
    """[replicates, ...]: `statistic` (moments -> an array, e.g. a value per layer) of
    every replicate."""
    return np.stack([np.asarray(statistic(weighted(moments, w)), np.float64) for w in draws])


def interval(values: np.ndarray) -> np.ndarray:
    """[2, ...]: the percentile interval at LEVEL over the replicates (axis 0)."""
    tail = 100.0 * (1.0 - LEVEL) / 2.0
    return np.percentile(np.asarray(values, np.float64), [tail, 100.0 - tail], axis=0)
