"""The rank statistics on spectra and matrices whose ranks are known, the [MASK] energy
outside the real tokens' subspace, and the bootstrap: its coverage on a synthetic case and
its pairing of two runs read on the same sequences."""

import numpy as np
import pytest

from maelm_jax.analysis import bootstrap, measures, rank, spectrum

pytestmark = pytest.mark.tier("unit")


@pytest.mark.parametrize("energy, tau, continuous, entropy", [
    ([1.0] * 10 + [0.0] * 6, 0.9, 9.0, 10.0),  # 9 of 10 equal directions hold exactly 0.9
    ([1.0] * 4, 0.6, 2.4, 4.0),  # 2 hold 0.5, the third 0.25 more: 2 + 0.1 / 0.25
    ([1.0] * 16, 0.5, 8.0, 16.0),
    ([1.0] + [0.0] * 7, 0.9, 0.9, 1.0),  # one direction: the crossing inside the first
])
def test_known_spectra_give_the_known_continuous_and_entropy_ranks(energy, tau, continuous,
                                                                   entropy):
    assert spectrum.continuous_rank(np.asarray(energy), tau) == pytest.approx(continuous)
    assert np.ceil(continuous - 1e-9) == spectrum.integer_rank(np.asarray(energy), tau)
    assert spectrum.entropy_rank(np.asarray(energy)) == pytest.approx(entropy)


def test_a_matrix_of_known_rank_through_its_gram_matrix():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(500, 5)) @ rng.normal(size=(5, 12))  # rank 5 in 12 dimensions
    eig = spectrum.eigenvalues((h.T @ h)[None])
    found = spectrum.summary(eig, 0.9)
    assert found["at"]["0.99"][0] <= 5 and spectrum.integer_rank(eig[0], 1.0) == 5
    assert 1.0 < found["entropy"][0] < 5.0 + 1e-6
    assert found["rank"] == [rank.effective_rank(eig[0], 0.9)]
    assert spectrum.continuous_rank(np.zeros(4), 0.9) == 0.0
    assert spectrum.entropy_rank(np.zeros(4)) == 0.0


def test_energy_outside_a_subspace():
    rng = np.random.default_rng(1)
    inside = rng.normal(size=(200, 3)) @ np.eye(3, 8)  # rows in the first 3 dimensions
    outside = rng.normal(size=(50, 8)) * (np.arange(8) >= 3)  # rows in the other 5
    basis = inside.T @ inside
    assert spectrum.outside_share(inside.T @ inside, basis, 3) == pytest.approx(0.0, abs=1e-9)
    assert spectrum.outside_share(outside.T @ outside, basis, 3) == pytest.approx(1.0)
    assert spectrum.outside_share(np.zeros((8, 8)), basis, 3) == 0.0


def _grouped(rows_per_group: list[dict[str, np.ndarray]]) -> dict:
    """Per-group moments of each statistic from explicit rows: one layer."""
    out = {}
    for stat in rank.STATS:
        hs = [g[stat] for g in rows_per_group]
        out[stat] = {"gram": np.stack([(h.T @ h)[None] for h in hs]),
                     "sum": np.stack([h.sum(0)[None] for h in hs]),
                     "count": np.array([float(len(h)) for h in hs])}
    return out


def test_mask_rows_outside_the_real_tokens_subspace_stand_above_the_null():
    rng = np.random.default_rng(2)
    d, k = 12, 4
    groups = []
    for _ in range(8):
        real = rng.normal(size=(60, d)) * np.where(np.arange(d) < k, 1.0, 0.05)
        mask = rng.normal(size=(10, d)) * np.where(np.arange(d) < k, 0.2, 1.0)
        groups.append({"with_mask": np.vstack([real, mask]), "without_mask": real,
                       "mask_only": mask})
    found = measures.outside_energy(_grouped(groups), 0.9)
    assert found["k"] == [k]
    assert found["null"][0] < 0.1 < 0.5 < found["mask"][0]


def test_the_bootstrap_interval_covers_the_estimate_about_95_percent_of_the_time():
    """200 data sets of 20 groups of 40 rows in 6 dimensions (a decaying spectrum): the
    interval of the continuous rank covers the estimator's mean over data sets in about
    95 % of them."""
    rng = np.random.default_rng(3)
    scale = np.sqrt([4.0, 2.0, 1.0, 0.5, 0.25, 0.1])
    tau, groups, data_sets, replicates = 0.9, 20, 120, 200
    draws = bootstrap.counts(groups, replicates, seed=0)
    estimates, intervals = [], []
    for _ in range(data_sets):
        hs = [rng.normal(size=(40, 6)) * scale for _ in range(groups)]
        grouped = {"gram": np.stack([(h.T @ h)[None] for h in hs]),
                   "sum": np.stack([h.sum(0)[None] for h in hs]),
                   "count": np.full(groups, 40.0)}
        estimates.append(spectrum.continuous_rank(
            spectrum.eigenvalues(measures.total(grouped)["gram"][0]), tau))
        values = bootstrap.replicate_values(
            grouped, draws,
            lambda m: [spectrum.continuous_rank(spectrum.eigenvalues(m["gram"][0]), tau)])
        intervals.append(bootstrap.interval(values)[:, 0])
    target = np.mean(estimates)
    covered = np.mean([lo <= target <= hi for lo, hi in intervals])
    assert 0.85 <= covered <= 1.0
    widths = [hi - lo for lo, hi in intervals]
    assert 0.0 < np.median(widths) < 1.0  # an interval, not the whole axis


def test_runs_on_the_same_sequences_pair_replicate_by_replicate():
    rng = np.random.default_rng(4)
    d, groups = 8, 10
    base = [rng.normal(size=(50, d)) for _ in range(groups)]

    def run(label, widen):
        hs = [np.hstack([h[:, :6], widen * h[:, 6:]]) for h in base]
        grouped = _grouped([{"with_mask": h, "without_mask": h, "mask_only": h[:5]}
                            for h in hs])
        found = measures.run_measures(grouped, 0.9, center=True, replicates=50, seed=7)
        return {"label": label, "inputs_sha256": "same", **found}

    a, b = run("narrow", 0.1), run("wide", 1.0)
    for view in measures.VIEWS:
        interval = a["statistics"][view]["without_mask"]["interval"]["continuous"][0]
        assert interval[0] <= a["statistics"][view]["without_mask"]["continuous"][0] <= interval[1]
    found = measures.differences([a, b])
    diff = next(x for x in found if x["view"] == "uncentred" and x["statistic"] == "without_mask")
    assert diff["a"] == "wide" and diff["difference"] > 0
    # Paired: the same resampled groups in both, so the interval is far narrower than
    # either run's own.
    low, high = diff["interval"]
    assert 0 < low <= diff["difference"] <= high
    assert measures.differences([a, {**b, "inputs_sha256": "other"}]) == []
    assert measures.continuous_from_spectra(a, "uncentred", "without_mask", 0.9) == \
        pytest.approx(a["statistics"]["uncentred"]["without_mask"]["continuous"], rel=1e-3)
