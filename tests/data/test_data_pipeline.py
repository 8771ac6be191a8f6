"""Packing into blocks of exactly L, reuse of prepared data, and the resumable loader."""

import json
import logging
import os
import pathlib

import numpy as np
import pytest

from maelm_jax.data import loader, packing, run_data, shards
from maelm_jax.text import tokenizer

from tiny_config import tiny_config

SP = tokenizer.SENTENCEPIECE_IDS
pytestmark = pytest.mark.tier("unit")


def test_packer_makes_full_sentences_blocks():
    packer = packing.BlockPacker(seq_len=5, special=SP)
    blocks = packer.add([10, 11, 12]) + packer.add([20, 21, 22, 23, 24]) + packer.add([30])
    B, E = SP.bos, SP.eos
    # Stream: 10 11 12 </s> 20 21 22 23 24 </s> 30 </s>; each block is <s> + 4 tokens.
    assert blocks == [[B, 10, 11, 12, E], [B, 20, 21, 22, 23], [B, 24, E, 30, E]]


def _write_corpus(path, n_docs=300):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "music", "paper"]
    docs = [" ".join(rng.choice(words, size=rng.integers(20, 80))) for _ in range(n_docs)]
    path.write_text("\n\n".join(docs))
    return docs


def _config(tmp_path, tok):
    c = tiny_config("maelm", tok.model_path)
    c.data.sources.main.kind = "text"
    c.data.sources.main.path = str(tmp_path / "corpus.txt")
    return c


def test_prepare_packs_every_token_and_reuses_the_result(tmp_path, tiny_tokenizer):
    docs = _write_corpus(tmp_path / "corpus.txt")
    c = _config(tmp_path, tiny_tokenizer)
    data = run_data.build_blocks(c, tmp_path, tiny_tokenizer)
    train, valid = np.asarray(data.train["main"]), np.asarray(data.valid["main"])
    L = c.data.seq_len
    assert train.shape[1] == valid.shape[1] == L and len(valid) > 0
    assert np.all(train[:, 0] == SP.bos)
    assert SP.bos not in train[:, 1:] and SP.pad not in train
    # Every training document's tokens appear in order, each followed by </s>.
    train_docs = [d for d in docs if not packing.is_validation(d, c.data.validation_fraction)]
    stream = np.concatenate([train[:, 1:].ravel()])
    expected = np.concatenate([ids + [SP.eos]
                               for ids in tiny_tokenizer.encode(train_docs)])
    n = len(stream)
    assert n == (len(expected) // (L - 1)) * (L - 1)
    np.testing.assert_array_equal(stream, expected[:n])

    # One format: the set is what mode prepare writes (shards, manifest, tokenizer), and
    # reads as config.data.prepared of another run.
    manifest = shards.read_manifest(data.directory)
    assert manifest["fingerprint"] == data.directory.name
    assert manifest["sources"]["main"]["train"]["blocks"] == len(train)
    assert sorted(p.name for p in data.directory.iterdir()) == [
        "manifest.json", "tokenizer.model", "train_main-00000-of-00001.blocks",
        "valid_main-00000-of-00001.blocks"]
    shards.verify_shards(data.directory, manifest, digests=True)
    as_prepared = c.copy_and_resolve_references()
    as_prepared.data.prepared = str(data.directory)
    assert shards.check_run(as_prepared) == manifest  # it fits a run as its data.prepared
    np.testing.assert_array_equal(shards.load(data.directory).train["main"][:], train)

    # Same settings: the same directory is reused, untouched.
    meta = data.directory / "manifest.json"
    mtime = os.stat(meta).st_mtime_ns
    again = run_data.build_blocks(c, tmp_path, tiny_tokenizer)
    assert again.directory == data.directory and os.stat(meta).st_mtime_ns == mtime
    # Mixing weights come from the config, never from the cache (whose key leaves them
    # out): a second source and a new weight reuse the same blocks with the new mixture.
    assert data.weights == {"main": 1.0}
    c.data.sources.second = c.data.sources.main.to_dict()
    c.data.sources.second.weight = 3.0
    mixed = run_data.build_blocks(c, tmp_path, tiny_tokenizer)
    assert mixed.weights == {"main": 1.0, "second": 3.0}
    c.data.sources.second.weight = 0.5
    reused = run_data.build_blocks(c, tmp_path, tiny_tokenizer)
    assert reused.directory == mixed.directory and reused.weights["second"] == 0.5
    assert "weight" not in json.loads((mixed.directory / "manifest.json").read_text())[
        "sources"]["second"]
    del c.data.sources["second"]
    # A changed corpus is prepared anew.
    _write_corpus(tmp_path / "corpus.txt", n_docs=200)
    assert run_data.build_blocks(c, tmp_path, tiny_tokenizer).directory != data.directory
    assert not list((tmp_path / "data").glob(".tmp-*"))


def test_a_cache_of_the_earlier_in_job_format_is_prepared_again(tmp_path, tiny_tokenizer,
                                                                 caplog):
    """Before one format, in-job preparation wrote meta.json and raw .bin files under the
    same fingerprint: a cache, so it is replaced by shards (and the log says so)."""
    _write_corpus(tmp_path / "corpus.txt")
    c = _config(tmp_path, tiny_tokenizer)
    old = tmp_path / "data" / run_data.data_fingerprint(c, tiny_tokenizer)
    old.mkdir(parents=True)
    (old / "meta.json").write_text('{"format": 1, "seq_len": 16, "sources": {}}')
    (old / "train_main.bin").write_bytes(b"\0" * 64)
    with caplog.at_level(logging.WARNING):
        data = run_data.build_blocks(c, tmp_path, tiny_tokenizer)
    assert data.directory == old and not (old / "meta.json").exists()
    assert not (old / "train_main.bin").exists() and (old / "manifest.json").is_file()
    assert "earlier in-job format" in caplog.text


def test_too_little_text_is_a_clear_error(tmp_path, tiny_tokenizer):
    (tmp_path / "corpus.txt").write_text("just a few words")
    c = _config(tmp_path, tiny_tokenizer)
    with pytest.raises(ValueError, match="data.sources.main: .* do not fill one training block"):
        run_data.build_blocks(c, tmp_path, tiny_tokenizer)
    assert not list((tmp_path / "data").iterdir())  # nothing half-written stays behind


def _fake_data(tmp_path, sizes, weights):
    blocks = {}
    for i, (name, n) in enumerate(sizes.items()):
        blocks[name] = np.arange(n * 4, dtype=np.int32).reshape(n, 4) + 1000 * i
    return shards.PreparedData(tmp_path, 4, blocks, blocks, weights)


def test_loader_is_a_function_of_the_step(tmp_path):
    data = _fake_data(tmp_path, {"a": 50}, {"a": 1.0})
    run = loader.train_batches(data, 8, seed=3)
    first = [next(run) for _ in range(20)]          # 160 rows: more than 3 epochs
    resumed = loader.train_batches(data, 8, seed=3, start_step=13)
    for step in range(13, 20):
        np.testing.assert_array_equal(next(resumed), first[step])
    # Each epoch is a fresh permutation of all blocks.
    rows = np.concatenate(first)[:, 0]
    assert sorted(rows[:50]) == sorted(data.train["a"][:, 0])
    assert not np.array_equal(rows[:50], rows[50:100])
    other_seed = loader.train_batches(data, 8, seed=4)
    assert not np.array_equal(next(other_seed), first[0])


def test_processes_split_the_same_global_batch(tmp_path):
    """Contiguous halves, quarters, and the interleaved spans a TPU mesh gives a host: each
    part is the global batch's rows of its spans, in order."""
    data = _fake_data(tmp_path, {"a": 64}, {"a": 1.0})
    for layout in ([[(2 * p, 2 * p + 2)] for p in range(4)],
                   [[(0, 1), (4, 6), (7, 8)], [(1, 4), (6, 7)]]):
        whole = loader.train_batches(data, 8, seed=0, start_step=5)
        parts = [loader.train_batches(data, 8, seed=0, start_step=5, spans=spans)
                 for spans in layout]
        rows = np.concatenate([np.arange(a, b) for spans in layout for a, b in spans])
        for _ in range(3):
            local = [next(p) for p in parts]
            assert [len(x) for x in local] == [sum(b - a for a, b in s) for s in layout]
            np.testing.assert_array_equal(np.concatenate(local), next(whole)[rows])
    for bad in ([(6, 9)], [(0, 2), (1, 3)], []):
        with pytest.raises(ValueError, match="are not distinct rows of a batch of 8"):
            loader.train_batches(data, 8, seed=0, spans=bad)


def test_sources_are_mixed_by_weight(tmp_path):
    data = _fake_data(tmp_path, {"a": 40, "b": 40}, {"a": 3.0, "b": 1.0})
    run = loader.train_batches(data, 100, seed=0)
    rows = np.concatenate([next(run) for _ in range(10)])
    share_b = np.mean(rows[:, 0] >= 1000)
    assert 0.2 < share_b < 0.3


def test_eval_batches_are_fixed_and_full(tmp_path):
    data = _fake_data(tmp_path, {"a": 30}, {"a": 1.0})
    batches = loader.eval_batches(data, 8, 10)
    assert len(batches) == 3 and all(b.shape == (8, 4) for b in batches)
    np.testing.assert_array_equal(batches[0], data.valid["a"][:8])


def test_unigram_baseline_is_the_top_piece_share_weighted_by_source():
    a = np.array([[5, 5, 5, 6], [5, 7, 7, 7]])  # piece 5: 4 of 8
    b = np.array([[7, 7, 7, 7]])  # piece 7: 4 of 4
    data = shards.PreparedData(pathlib.Path("."), 4, {"a": a, "b": b},
                                {"a": a[:0], "b": b[:0]}, {"a": 3.0, "b": 1.0})
    # Mixed 3:1 -> p(5) = 0.75 * 4/8 = 0.375, p(7) = 0.75 * 3/8 + 0.25 * 1 = 0.53125.
    assert loader.unigram_baseline(data, 10) == (7, 0.53125)
    data.weights.update({"a": 1.0, "b": 0.0})
    assert loader.unigram_baseline(data, 10) == (5, 0.5)
    # Subsampled to at most max_tokens tokens: every other block of "a".
    assert loader.unigram_baseline(data, 10, max_tokens=4) == (5, 0.75)


def test_a_set_another_run_finished_first_is_used_and_sets_get_umask_modes(
        tmp_path, tiny_tokenizer, monkeypatch, caplog):
    """Two runs sharing data.cache_dir pack the same set at once: the one that finishes
    second uses the first one's (the same blocks: the fingerprint names them) instead of
    failing on its rename. What packing publishes has the umask's modes (not mkdtemp's
    0700), and a scratch directory a killed packer left is removed."""
    _write_corpus(tmp_path / "corpus.txt")
    c = _config(tmp_path, tiny_tokenizer)
    cache = tmp_path / "data"
    (cache / ".tmp-killed").mkdir(parents=True)
    (cache / ".tmp-killed" / ".lock").write_text("")  # its owner's flock died with it
    pack_source, rivals = packing.pack_source, []

    def pack_source_while_a_rival_finishes(*args, **kwargs):
        if not rivals:  # the other run: it packs the same set and renames it first
            rivals.append(None)
            rivals[0] = run_data.build_blocks(c, tmp_path, tiny_tokenizer)
        return pack_source(*args, **kwargs)

    monkeypatch.setattr(packing, "pack_source", pack_source_while_a_rival_finishes)
    old = os.umask(0o027)
    try:
        with caplog.at_level(logging.INFO):
            data = run_data.build_blocks(c, tmp_path, tiny_tokenizer)
    finally:
        os.umask(old)
    assert data.directory == rivals[0].directory
    assert "another run finished packing" in caplog.text
    assert [p.name for p in cache.iterdir()] == [data.directory.name]  # no scratch left
    assert os.stat(data.directory).st_mode & 0o777 == 0o750
    assert {os.stat(p).st_mode & 0o777 for p in pathlib.Path(data.directory).iterdir()} == {
        0o640}


def test_a_set_without_validation_blocks_is_refused_and_nothing_is_scored_as_loss_0(
        tmp_path, tiny_tokenizer):
    """What a preparation cut short leaves can be self-consistent: a manifest recording
    no validation block. A run evaluates (at its last step at least) and would log loss
    0, accuracy 0, perplexity 1: the set is refused, and an evaluation over no token is
    an error, never a score."""
    from maelm_jax.infra import errors
    from maelm_jax.pretrain import evaluation

    _write_corpus(tmp_path / "corpus.txt")
    c = _config(tmp_path, tiny_tokenizer)
    data = run_data.build_blocks(c, tmp_path, tiny_tokenizer)
    manifest_file = pathlib.Path(data.directory) / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["sources"]["main"]["valid"]["shards"] = []
    manifest_file.write_text(json.dumps(manifest))
    c.data.prepared = str(data.directory)
    with pytest.raises(shards.PreparedDataError, match=r"manifest.json records no validation "
                                                       r"block, and a run evaluates on them"):
        shards.check_run(c)
    with pytest.raises(errors.UserError, match="config.data.validation_fraction: the "
                                               "evaluation has no validation token"):
        evaluation.evaluate(lambda *args: {}, None, [], 0)
