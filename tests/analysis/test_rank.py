"""The effective-rank analysis: rank_tau of known spectra, the [MASK] gap of an encoder
built to show one, sums on a mesh, and the entry point on tiny runs (files, errors)."""

import json
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.analysis import rank as rank_config
from configs.finetune import glue as glue_config
from maelm_jax.analysis import inputs, measures, rank, report, spectrum
from maelm_jax.analysis import run as analysis_run
from maelm_jax.finetune import train as finetune_train
from maelm_jax.infra import errors, sharding
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import layers
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.text import tokenizer
from maelm_jax.workdirs import layout

from conftest import REPO_ROOT, require_shared_data, subprocess_env
from tiny_config import tiny_config

SP = tokenizer.SENTENCEPIECE_IDS

pytestmark = pytest.mark.tier("integration")


def _gram_ranks(grams, tau):
    """rank_tau per layer of Gram matrices [layers, d, d]."""
    return spectrum.summary(spectrum.eigenvalues(grams), tau)["rank"]


def _with_spectrum(singular_values, n, seed=0):
    """An [n, d] matrix U diag(s) V^T with random orthonormal U and V."""
    d = len(singular_values)
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.normal(size=(n, d)))
    v, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return (u * np.asarray(singular_values, np.float64)) @ v.T


@pytest.mark.parametrize("energy, tau, expected", [
    ([1.0] * 10 + [0.0] * 6, 0.9, 9),  # 9 of 10 equal directions hold exactly 0.9
    ([1.0] * 10 + [0.0] * 6, 0.91, 10),
    ([1.0] * 16, 0.5, 8),
    ([100.0] + [1e-3] * 15, 0.9, 1),  # one dominant direction
    ([2.0 ** -i for i in range(16)], 0.9, 4),  # 1, 1/2, 1/4, 1/8: 15/16 of the total
    ([2.0 ** -i for i in range(16)], 0.999, 10),
    ([5.0, 3.0, 2.0] + [0.0] * 13, 1.0, 3),  # tau = 1: the exact rank
])
def test_known_spectra_give_the_known_rank(energy, tau, expected):
    energy = np.asarray(energy)
    cumulative = np.cumsum(np.sort(energy)[::-1]) / energy.sum()
    assert cumulative[expected - 1] >= tau - 1e-12 and (
        expected == 1 or cumulative[expected - 2] < tau)  # the cases say what they claim
    assert rank.effective_rank(energy, tau) == expected
    h = _with_spectrum(np.sqrt(energy), n=400)
    assert rank.effective_rank_of_matrix(h, tau) == expected
    # From the Gram matrix summed batch by batch on the device, with rows left out.
    weights = np.ones((4, 100), np.float32)
    weights[3, 50:] = 0.0  # not rows of H
    batches = h.reshape(4, 100, 16).astype(np.float32)
    g = rank.gram(jnp.asarray(batches)[None], jnp.asarray(weights))[0]
    kept = batches.reshape(400, 16)[weights.reshape(-1) > 0].astype(np.float64)
    np.testing.assert_allclose(np.asarray(g), kept.T @ kept, rtol=1e-5, atol=1e-6)
    # The eigenvalues of H^T H (float64) give the same rank.
    assert _gram_ranks((h.T @ h)[None], tau) == [expected]


def test_degenerate_matrices():
    assert rank.effective_rank(np.zeros(8), 0.9) == 0
    assert rank.effective_rank(np.array([-1e-9, 0.0, 4.0]), 0.9) == 1  # round-off below 0
    assert rank.effective_rank_of_matrix(np.ones((50, 8)), 0.99) == 1  # uncentred: 1 direction


def _mask_gap_encoder(d=16, k=8, num_layers=2, vocab=64, seed=0):
    """An encoder whose real tokens live in k of the d dimensions and whose [MASK] embedding
    lies outside them: attention and MLP outputs are zero (each layer is the identity up to
    its LayerNorms), positions are zero and there is no relative bias, so every layer keeps
    the embedding's geometry. [MASK] rows add exactly one direction."""
    stack = layers.StackConfig(num_layers=num_layers, d_model=d, num_heads=2, d_ff=2 * d)
    cfg = encoder_lib.EncoderConfig(stack=stack, vocab_size=vocab, max_positions=32,
                                    rel_pos_buckets=0)
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = nn.meta.unbox(encoder_lib.Encoder(cfg).init(jax.random.PRNGKey(0), tokens,
                                                         tokens)["params"])
    params = jax.tree.map(np.array, params)
    rng = np.random.default_rng(seed)
    table = np.zeros((vocab, d), np.float32)
    table[:, :k] = rng.normal(size=(vocab, k))
    table[SP.mask] = 0.0
    table[SP.mask, k:] = rng.normal(size=d - k)
    params["word_embeddings"]["embedding"] = table
    params["position_embeddings"]["embedding"][:] = 0.0
    for i in range(num_layers):
        layer = params["stack"][f"layer_{i}"]
        for leaf in ("out_kernel", "out_bias"):
            layer["attention"][leaf][:] = 0.0
        for leaf in ("kernel", "bias"):
            layer["mlp"]["wo"][leaf][:] = 0.0
    return cfg, params


def test_an_encoder_whose_mask_inputs_use_extra_dimensions_shows_the_gap():
    cfg, params = _mask_gap_encoder()
    rng = np.random.default_rng(1)
    rows = rng.integers(tokenizer.NUM_SPECIAL, 64, (60, 32)).astype(np.int32)
    rows[:, 20:] = SP.pad  # padding is never a row of H
    batches, n, n_mask = inputs.make_batches(rows, 32, 8, 1000, 0.15, seed=0, special=SP)
    assert (n, n_mask) == (1000, 150)  # 50 sequences of 20 real tokens, 3 masked in each
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    grouped = analysis_run.gram_sums(cfg, params, batches, mesh, groups=4)
    # 7 batches in 4 groups of consecutive batches; the embedding output + 2 layers.
    assert grouped["with_mask"]["gram"].shape == (4, 3, 16, 16)
    assert grouped["with_mask"]["count"].tolist() == [320, 320, 320, 40]  # batches of 8 x 20
    grams = {name: measures.total(g) for name, g in grouped.items()}
    one = analysis_run.gram_sums(cfg, params, batches, mesh)
    np.testing.assert_allclose(one["with_mask"]["gram"][0], grams["with_mask"]["gram"],
                               rtol=1e-5, atol=1e-4)
    assert grams["with_mask"]["sum"].shape == (3, 16)
    assert float(grams["with_mask"]["count"]) == 1000 and float(grams["mask_only"]["count"]) == 150
    for tau in (0.999, 0.9999):  # every direction that carries energy
        ranks = {name: _gram_ranks(g["gram"], tau) for name, g in grams.items()}
        assert ranks["without_mask"] == [8, 8, 8]
        assert ranks["with_mask"] == [9, 9, 9]
        assert ranks["mask_only"] == [1, 1, 1]


def test_batches_count_exactly_the_asked_tokens_and_mask_only_real_ones():
    rows = [np.arange(n, dtype=np.int32) + tokenizer.NUM_SPECIAL for n in (10, 3, 12, 7)]
    batches, n, n_mask = inputs.make_batches(rows, 12, 2, 20, 0.3, seed=2, special=SP)
    assert (n, len(batches)) == (20, 2)  # 10 + 3 + the first 7 of the third row's 12
    assert all(b[k].shape == (2, 12) for b in batches for k in b)
    counted = np.concatenate([b["counted"] for b in batches])
    np.testing.assert_array_equal(counted.sum(axis=1), [10, 3, 7, 0])
    original = np.concatenate([b["original"] for b in batches])
    masked = np.concatenate([b["masked"] for b in batches])
    is_mask = np.concatenate([b["is_mask"] for b in batches])
    assert np.all(original[3:] == SP.pad) and np.all(counted[original == 0] == 0)
    changed = masked != original
    assert np.all(masked[changed] == SP.mask)
    assert changed.sum(axis=1)[:3].tolist() == [3, 1, 4]  # round(0.3 x real tokens)
    assert np.all(is_mask <= changed) and n_mask == int(is_mask.sum())


def test_gram_sums_agree_on_a_mesh():
    """Parameters sharded over fsdp and tensor, the batch over data x fsdp: the same sums."""
    cfg, params = _mask_gap_encoder(d=16, num_layers=1)
    params = jax.tree.map(lambda x: x + np.random.default_rng(0).normal(0, 0.02, x.shape)
                          .astype(np.float32), params)  # every layer does something
    rows = np.random.default_rng(3).integers(tokenizer.NUM_SPECIAL, 64, (16, 32))
    batches, _, _ = inputs.make_batches(rows, 32, 8, 512, 0.15, seed=0, special=SP)
    one = analysis_run.gram_sums(cfg, params, batches,
                                 sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    many = analysis_run.gram_sums(cfg, params, batches,
                                  sharding.make_mesh((2, 2, 2), jax.devices()[:8]))
    for name in rank.STATS:
        for moment in ("gram", "sum", "count"):
            np.testing.assert_allclose(many[name][moment], one[name][moment], rtol=2e-4,
                                       atol=1e-3)


def test_centring_leaves_out_a_common_offset():
    """H = a large offset along one axis + noise in five others: uncentred, the offset is
    the one dimension that holds 90 % of the energy; centred, the five noise dimensions."""
    rng = np.random.default_rng(0)
    h = np.zeros((4000, 12))
    h[:, 0] = 10.0
    h[:, 1:6] = rng.normal(size=(4000, 5))
    moments = {"gram": (h.T @ h)[None], "sum": h.sum(axis=0)[None], "count": len(h)}
    centred = h - h.mean(axis=0)
    np.testing.assert_allclose(measures.centred_grams(moments)[0], centred.T @ centred,
                               rtol=1e-9, atol=1e-6)
    assert _gram_ranks(moments["gram"], 0.9) == [1]
    assert _gram_ranks(measures.centred_grams(moments), 0.9) == [5]
    assert rank.effective_rank_of_matrix(centred, 0.9) == 5


# ------------------------------------------------------------------ on tiny runs

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_tokenizer):
    """A tiny MLM pretraining of 6 steps: config.json, tokenizer, checkpoints/6."""
    c = tiny_config("mlm", tiny_tokenizer.model_path)
    c.train.num_steps = c.train.checkpoint_every = c.train.eval_every = 6
    workdir = tmp_path_factory.mktemp("rank_runs") / "mlm"
    pretrain_train.train_and_evaluate(c, str(workdir))
    return workdir


def _config(runs, **fields):
    c = rank_config.get_config()
    c.runs = runs
    c.mesh.shape = (1, 1, 1)
    for name, value in fields.items():
        c[name] = value
    return c


def test_the_layer_plots_show_the_centred_ranks_beside_the_papers(tmp_path):
    """Fig. 1(a) and (b) of every run, with and without [MASK]; with centred ranks a second
    panel of them, so the study's rank_layers.png shows all four of each model's curves."""
    from matplotlib.image import imread

    from maelm_jax.infra import paths

    def run(label, centred):
        ranks = {"with_mask": [9, 7, 6], "without_mask": [9, 6, 4], "mask_only": [1, 2, 3]}
        return {"label": label, "layers": [0, 1, 2], **ranks,
                **({"centred": {s: [r + 1 for r in v] for s, v in ranks.items()}}
                   if centred else {})}

    widths = {}
    for centred in (False, True):
        report_ = {"tau": 0.9, "runs": [run("mlm", centred), run("maelm", centred)]}
        layers, mask = tmp_path / f"layers{centred}.png", tmp_path / f"mask{centred}.png"
        report.plot(report_, paths.Path(str(layers)), paths.Path(str(mask)))
        widths[centred] = [imread(p).shape[1] for p in (layers, mask)]
    assert widths[True] == [2 * w for w in widths[False]]


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_analysis_of_a_workdir_and_a_checkpoint_writes_its_files(tiny_run, tmp_path):
    step_dir = tiny_run / "checkpoints" / "6"
    out = analysis_run.analyse(_config(f"{tiny_run},{step_dir}", num_tokens=1600),
                               str(tmp_path / "rank"))
    saved = json.loads((tmp_path / "rank" / layout.RANK_JSON_FILE).read_text())
    assert saved == json.loads(json.dumps(out))
    assert [r["label"] for r in saved["runs"]] == ["mlm", "mlm@6"]
    for run in saved["runs"]:
        assert run["layers"] == [0, 1, 2] and run["kind"] == "pretraining"
        assert run["objective"] == "mlm" and run["seq_len"] == 32
        # 50 validation blocks of 32 tokens, 5 (round(4.8)) of each masked.
        assert (run["tokens"], run["mask_tokens"]) == (1600, 250)
        for stat in rank.STATS:
            assert all(isinstance(r, int) and 1 <= r <= 32 for r in run[stat]), run[stat]
            assert run["last_layer"][stat] == run[stat][-1]
            centred = run["centred"][stat]
            assert all(isinstance(r, int) and 1 <= r <= 32 for r in centred), centred
            assert run["centred"]["last_layer"][stat] == centred[-1]
    # The same encoder read the same masked blocks: the same ranks.
    assert {s: saved["runs"][0][s] for s in rank.STATS} == {
        s: saved["runs"][1][s] for s in rank.STATS}
    table = (tmp_path / "rank" / layout.RANK_MARKDOWN_FILE).read_text()
    stats = saved["runs"][0]["statistics"]
    for view in ("uncentred", "centred"):
        for stat in rank.STATS:
            found = stats[view][stat]
            assert len(saved["runs"][0]["spectra"][view][stat]) == 3  # layers
            assert all(len(e) == 32 for e in saved["runs"][0]["spectra"][view][stat])
            # rank_tau is the continuous rank's ceiling; the interval is around the latter.
            assert [int(np.ceil(c - 1e-6)) for c in found["continuous"]] == found["rank"]
            assert found["rank"] == (run[stat] if view == "uncentred" else
                                     run["centred"][stat])
            assert all(lo <= hi for lo, hi in found["interval"]["continuous"])
            assert set(found["at"]) == {"0.5", "0.8", "0.9", "0.95", "0.99"}
            assert len(saved["runs"][0]["replicates"][view][stat]) == 200
    outside = saved["runs"][0]["outside_energy"]
    assert all(0.0 <= x <= 1.0 for x in outside["mask"] + outside["null"])
    # The same encoder on the same sequences: paired differences of exactly 0.
    assert saved["differences"] and all(
        d["difference"] == 0 and d["interval"] == [0, 0] for d in saved["differences"])
    assert (f"| mlm | pretraining | 32 | 2 | 1600 | "
            f"{report.rank_text(saved['runs'][0], 'uncentred', 'without_mask', 0.9)} |") in table
    assert "held-out real tokens outside" in table and "mlm@6 minus mlm" in table
    assert table.count("| 2 |") >= 2  # per-layer rows of both runs
    for line in table.splitlines():  # every header as many cells as its rows
        if line.startswith(("| run |", "| layer |", "| runs |")):
            header = line.count("|")
        elif line.startswith("| mlm") or re.match(r"\| \d+ \|", line):
            assert line.count("|") == header, line
    from matplotlib.image import imread

    for name in (layout.RANK_LAYERS_PLOT, layout.RANK_MASK_PLOT):
        image = imread(tmp_path / "rank" / name)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # something is drawn


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_a_corpus_source_and_a_glue_dev_set(tiny_run, tmp_path):
    corpus = tmp_path / "held_out.txt"
    corpus.write_text("\n\n".join(f"document {i}: the quick brown fox jumps over the lazy "
                                  f"dog number {i} again and again." for i in range(200)))
    c = _config(str(tiny_run), num_tokens=640, seq_len=16, batch_size=4)
    c.source = {"kind": "text", "path": str(corpus)}
    out = analysis_run.analyse(c, str(tmp_path / "text"))
    assert out["runs"][0]["tokens"] == 640 and out["runs"][0]["seq_len"] == 16
    glue_dir = require_shared_data("glue")
    c.source = {"kind": "glue", "task": "rte", "data_dir": str(glue_dir)}
    c.num_tokens, c.seq_len = 100_000, 32  # the whole (40-row) dev file
    out = analysis_run.analyse(c, str(tmp_path / "glue"))
    run = out["runs"][0]
    assert 40 * 8 < run["tokens"] <= 40 * 32 and run["mask_tokens"] > 0.1 * run["tokens"]


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_a_finetuned_workdir_reads_its_own_dev_set(tiny_run, tmp_path):
    c = glue_config.get_config("rte")
    c.init_from = str(tiny_run)
    c.data.data_dir = str(require_shared_data("glue"))
    c.data.max_seq_len, c.data.buckets = 32, (32,)
    c.train.batch_size = c.train.eval_batch_size = 8
    c.train.num_epochs, c.train.log_every = 1, 1
    c.mesh.shape, c.fast_compile, c.predict_test = (1, 1, 1), True, False
    finetune_train.run(c, str(tmp_path / "rte"))
    out = analysis_run.analyse(_config(str(tmp_path / "rte")), str(tmp_path / "rank"))
    run = out["runs"][0]
    assert run["kind"] == "fine-tuning" and run["task"] == "rte" and run["seq_len"] == 32
    assert 40 * 8 < run["tokens"] <= 40 * 32  # RTE's 40 dev pairs, cut to 32 tokens


@pytest.mark.parametrize("fields, message", [
    (dict(tau=0.0), "config.tau: expected a number in (0, 1], got 0.0"),
    (dict(num_tokens=-1), "config.num_tokens: expected an int >= 0"),
    (dict(mask_ratio=1.0), "config.mask_ratio: expected a number in (0, 1)"),
    (dict(runs=""), "config.runs: expected workdirs"),
    (dict(source={"kind": "nope"}), "config.source.kind: expected one of validation"),
    (dict(source={"kind": "glue", "task": "rte"}), "config.source.data_dir: required"),
    (dict(source={"kind": "squad", "path": "x.json", "split": "dev"}),
     "config.source.split: unknown field for a 'squad' source"),
    (dict(source={"kind": "text"}), "config.source.path: required for a 'text' source"),
    (dict(batch_size=3, mesh={"shape": (2, 1, 1), "dcn_shape": (-1, 1, 1)}),
     "config.batch_size: 3 sequences"),
])
def test_bad_fields_are_named(tmp_path, fields, message):
    c = _config(str(tmp_path))
    for name, value in fields.items():
        c[name] = value
    with pytest.raises(errors.UserError, match="^" + re.escape(message)):
        analysis_run.analyse(c, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_main_runs_the_analysis_and_names_a_run_that_is_not_a_workdir(tiny_run, tmp_path):
    base = [sys.executable, "main.py", "--config=configs/analysis/rank.py",
            f"--workdir={tmp_path / 'rank'}"]
    ok = subprocess.run(base + [f"--config.runs={tiny_run}", "--config.num_tokens=640"],
                        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert {p.name for p in (tmp_path / "rank").iterdir()} == {
        layout.RANK_JSON_FILE, layout.RANK_MARKDOWN_FILE, layout.RANK_LAYERS_PLOT,
        layout.RANK_MASK_PLOT}
    for runs in (str(tmp_path), f"{tiny_run},{tmp_path / 'missing'}"):
        bad = subprocess.run(base + [f"--config.runs={runs}"], cwd=REPO_ROOT,
                             env=subprocess_env(), capture_output=True, text=True)
        lines = [line for line in bad.stderr.splitlines() if line.strip()]
        assert bad.returncode == 1 and len(lines) == 1, bad.stderr[-3000:]
        assert lines[0].startswith("error: config.runs: "), lines[0]
