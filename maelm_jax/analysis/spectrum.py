"""What a layer's spectrum says: ranks of it, continuous and integer, its entropy effective
rank, and the share of one set of rows' energy outside another's leading subspace.

A spectrum here is the eigenvalues of a Gram matrix G = H^T H (d x d), i.e. the squared
singular values s_i^2 of H (n x d), in any order. With cumulative energy fractions
c_k = (s_1^2 + ... + s_k^2) / (s_1^2 + ... + s_d^2) (s sorted descending, c_0 = 0):

* rank_tau (the MAE-LM paper's, after Cai et al. 2021): the smallest k with c_k >= tau
  (rank.effective_rank).
* the continuous rank_tau: k - 1 + (tau - c_{k-1}) / (c_k - c_{k-1}) for that k, the point
  where the piecewise-linear cumulative curve crosses tau. Its ceiling is rank_tau; a
  difference of 0.3 between two models shows, where the integer rank moves by 0 or 1.
* the entropy effective rank (Roy and Vetterli 2007): exp(-sum_i p_i log p_i) with
  p_i = s_i / sum_j s_j (singular values, not their squares), between 1 (one direction)
  and d (all equal); no tau.
* rank_tau at each tau of TAUS: how the energy spreads, where one tau shows one point.
"""

from __future__ import annotations

import numpy as np

# The taus of the spread beside config.tau (rank.json's "at").
TAUS = (0.5, 0.8, 0.9, 0.95, 0.99)
# As rank.effective_rank: a cumulative fraction this close below tau reaches it.
_TOLERANCE = 1e-9


def eigenvalues(gram: np.ndarray) -> np.ndarray:
    """The spectra of Gram matrices [..., d, d], descending along the last axis, float64;
    round-off below 0 clipped to 0."""
    g = np.asarray(gram, np.float64)
    values = np.linalg.eigvalsh((g + np.swapaxes(g, -1, -2)) / 2.0)
    return np.clip(values[..., ::-1], 0.0, None)


def _cumulative(energy: np.ndarray) -> np.ndarray | None:
    energy = np.sort(np.clip(np.asarray(energy, np.float64), 0.0, None))[::-1]
    total = energy.sum()
    return None if total <= 0.0 else np.cumsum(energy) / total


def continuous_rank(energy: np.ndarray, tau: float) -> float:
    """The interpolated rank_tau of a spectrum (0.0 for an all-zero one)."""
    cumulative = _cumulative(energy)
    if cumulative is None:
        return 0.0
    k = int(np.searchsorted(cumulative, tau * (1.0 - _TOLERANCE), side="left"))
    below = cumulative[k - 1] if k else 0.0
    step = cumulative[k] - below
    return float(k + (min(max((tau - below) / step, 0.0), 1.0) if step > 0 else 1.0))


def integer_rank(energy: np.ndarray, tau: float) -> int:
    """rank_tau (0 for an all-zero spectrum)."""
    cumulative = _cumulative(energy)
    if cumulative is None:
        return 0
    return int(np.searchsorted(cumulative, tau * (1.0 - _TOLERANCE), side="left")) + 1


def entropy_rank(energy: np.ndarray) -> float:
    """Roy and Vetterli's effective rank of a spectrum of squared singular values (0.0 for
    an all-zero one)."""
    s = np.sqrt(np.clip(np.asarray(energy, np.float64), 0.0, None))
    total = s.sum()
    if total <= 0.0:
        return 0.0
    p = s[s > 0] / total
    return float(np.exp(-np.sum(p * np.log(p))))


def summary(spectra: np.ndarray, tau: float) -> dict:
    """Per layer of spectra [layers, d]: "rank" (rank_tau, int), "continuous", "entropy" and
    "at" {str(t): rank_t for t in TAUS}."""
    return {"rank": [integer_rank(e, tau) for e in spectra],
            "continuous": [continuous_rank(e, tau) for e in spectra],
            "entropy": [entropy_rank(e) for e in spectra],
            "at": {f"{t:g}": [integer_rank(e, t) for e in spectra] for t in TAUS}}


def outside_share(rows_gram: np.ndarray, basis_gram: np.ndarray, k: int) -> float:
    """The share of the energy of a set of rows (their Gram matrix, d x d) outside the
    span of the top-k eigenvectors of another set's (basis_gram): 1 - tr(U_k^T G U_k) /
    tr(G). 0 when the rows lie in that subspace, about 1 - k/d for rows spread evenly
    over all directions; 0.0 for rows without energy."""
    g = np.asarray(rows_gram, np.float64)
    total = float(np.trace(g))
    if total <= 0.0:
        return 0.0
    b = np.asarray(basis_gram, np.float64)
    _, vectors = np.linalg.eigh((b + b.T) / 2.0)
    top = vectors[:, ::-1][:, :k]
    return float(1.0 - np.trace(top.T @ g @ top) / total)
