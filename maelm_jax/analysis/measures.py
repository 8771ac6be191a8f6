"""One run's rank measures from its per-group moments: what rank.json holds of a run beside
its settings, and the paired differences between runs.

Input: per statistic (STATS) the moments summed per group of batches (bootstrap.py):
"gram" [G, layers, d, d], "sum" [G, layers, d], "count" [G]. Views: "uncentred" (the
paper's H) and "centred" (each statistic's mean row subtracted, centred_grams).
"""

from __future__ import annotations

import numpy as np

from maelm_jax.analysis import bootstrap, spectrum

# What rank.make_gram_step sums: rows of the inputs with [MASK], of the same inputs without,
# and the [MASK] rows alone.
STATS = ("with_mask", "without_mask", "mask_only")
VIEWS = ("uncentred", "centred")
_SIGNIFICANT = 4  # digits of the stored eigenvalues: rank.json stays a few hundred KB


def _gram(moments: dict, view: str) -> np.ndarray:
    """[layers, d, d] of summed moments in `view`."""
    return (np.asarray(moments["gram"], np.float64) if view == "uncentred"
            else centred_grams(moments))


def centred_grams(moments: dict) -> np.ndarray:
    """[layers, d, d] Gram matrices of the rows minus their mean, from a statistic's
    summed moments ("gram" [layers, d, d], "sum" [layers, d], "count" []): G - s s^T / n."""
    g = np.asarray(moments["gram"], np.float64)
    s = np.asarray(moments["sum"], np.float64)
    n = float(moments["count"])
    if n <= 0:
        return np.zeros_like(g)
    return g - s[:, :, None] * s[:, None, :] / n


def total(grouped: dict) -> dict:
    """A statistic's moments summed over its groups."""
    return bootstrap.weighted(grouped, np.ones(len(grouped["count"])))


def _rounded(values: np.ndarray) -> list:
    return [[float(f"{float(v):.{_SIGNIFICANT}g}") for v in layer] for layer in values]


def _boot_statistic(view: str, tau: float):
    def statistic(moments: dict) -> np.ndarray:
        eig = spectrum.eigenvalues(_gram(moments, view))
        return np.array([[spectrum.continuous_rank(e, tau) for e in eig],
                         [spectrum.entropy_rank(e) for e in eig]])
    return statistic


def outside_energy(grouped: dict, tau: float) -> dict:
    """Per layer, the share of the [MASK] rows' energy outside the real tokens' top-k
    subspace, k = rank_tau of those real tokens (uncentred, as Theorem 2.2 of the MAE-LM
    paper reads): "mask", with the subspace fitted on the real tokens (of the inputs with
    [MASK]) of the even groups; "null", the same share for the real tokens of the odd
    groups, which that subspace was not fitted on; "k".

    MLM's [MASK] rows occupying directions of their own shows as "mask" above "null".
    """
    real = {k: np.asarray(grouped["with_mask"][k], np.float64)
            - np.asarray(grouped["mask_only"][k], np.float64) for k in ("gram", "count")}
    groups = len(real["count"])
    even = np.arange(groups) % 2 == 0
    basis = real["gram"][even].sum(0)
    held_out = real["gram"][~even].sum(0)
    mask = np.asarray(grouped["mask_only"]["gram"], np.float64).sum(0)
    out = {"k": [], "mask": [], "null": []}
    for layer in range(basis.shape[0]):
        k = spectrum.integer_rank(spectrum.eigenvalues(basis[layer]), tau)
        out["k"].append(k)
        out["mask"].append(spectrum.outside_share(mask[layer], basis[layer], k))
        out["null"].append(spectrum.outside_share(held_out[layer], basis[layer], k))
    return out


def run_measures(grouped: dict[str, dict], tau: float, center: bool, replicates: int,
                 seed: int) -> dict:
    """What rank.json holds of one run's statistics:

    * "spectra" {view: {stat: [layers][d]}}: every layer's eigenvalues, descending, to
      _SIGNIFICANT digits;
    * "statistics" {view: {stat: spectrum.summary, with "interval": {"continuous",
      "entropy": [layers][2]} when replicates > 0}};
    * "replicates" {view: {stat: [replicates]}}: the last layer's continuous rank_tau per
      bootstrap replicate (for paired differences, `differences`);
    * "outside_energy" (`outside_energy`).
    """
    views = VIEWS if center else VIEWS[:1]
    groups = len(grouped[STATS[0]]["count"])
    draws = bootstrap.counts(groups, replicates, seed) if replicates else None
    out: dict = {"spectra": {}, "statistics": {}, "replicates": {}}
    for view in views:
        for stat in STATS:
            eig = spectrum.eigenvalues(_gram(total(grouped[stat]), view))
            out["spectra"].setdefault(view, {})[stat] = _rounded(eig)
            found = spectrum.summary(eig, tau)
            if draws is not None:
                values = bootstrap.replicate_values(grouped[stat], draws,
                                                    _boot_statistic(view, tau))
                bounds = bootstrap.interval(values)  # [2 (lo, hi), 2 (which), layers]
                found["interval"] = {name: bounds[:, i, :].T.tolist()
                                     for i, name in enumerate(("continuous", "entropy"))}
                out["replicates"].setdefault(view, {})[stat] = values[:, 0, -1].tolist()
            out["statistics"].setdefault(view, {})[stat] = found
    out["outside_energy"] = outside_energy(grouped, tau)
    return out


def continuous_from_spectra(run: dict, view: str, stat: str, tau: float) -> list[float] | None:
    """A run's continuous rank_tau per layer, recomputed from its stored spectra (None for a
    record without them)."""
    spectra = run.get("spectra", {}).get(view, {}).get(stat)
    if spectra is None:
        return None
    return [spectrum.continuous_rank(np.asarray(e), tau) for e in spectra]


def difference(a: dict, b: dict, view: str, stat: str = "without_mask") -> dict | None:
    """Run a minus run b, last-layer continuous rank_tau in `view`, with the bootstrap
    interval of the paired replicates: None unless both have replicates drawn on the same
    sequences (their inputs' digest) with the same draws."""
    if a.get("inputs_sha256") is None or a.get("inputs_sha256") != b.get("inputs_sha256"):
        return None
    ra = a.get("replicates", {}).get(view, {}).get(stat)
    rb = b.get("replicates", {}).get(view, {}).get(stat)
    if not ra or not rb or len(ra) != len(rb):
        return None
    values = np.asarray(ra) - np.asarray(rb)
    point = (a["statistics"][view][stat]["continuous"][-1]
             - b["statistics"][view][stat]["continuous"][-1])
    low, high = bootstrap.interval(values)
    return {"a": a["label"], "b": b["label"], "view": view, "statistic": stat,
            "difference": float(point), "interval": [float(low), float(high)]}


def differences(runs: list[dict]) -> list[dict]:
    """Every pair of runs read on the same sequences: `difference` per view, of the real
    tokens without [MASK] (Table 3) and of the [MASK] rows (Fig. 1(b))."""
    out = []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            for view in VIEWS:
                for stat in ("without_mask", "mask_only"):
                    found = difference(b, a, view, stat)
                    if found:
                        out.append(found)
    return out
