"""Parquet files and Hugging Face datasets saved to disk as corpus sources
(maelm_jax/data/columnar.py): row order across files and row groups, nulls, a column
filter, compression codecs, buckets, fingerprints, one-line errors, and the same blocks from
the job and from the Beam preparation."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maelm_jax.data import prepare, run_data, shards, sources
from maelm_jax.infra import paths
from maelm_jax.pretrain import config as pretrain_config

from fake_bucket import fake_gcs
from support import made_up_documents
from tiny_config import tiny_config

pytestmark = pytest.mark.tier("unit")

DOCS = made_up_documents(60, seed=4)


def _table(texts, langs=None):
    columns = {"id": pa.array(range(len(texts)), pa.int64()),
               "text": pa.array(texts, pa.string())}
    if langs is not None:
        columns["lang"] = pa.array(langs, pa.string())
    return pa.table(columns)


def _parquet_dir(root, compression="snappy"):
    """Three files of 20 rows in row groups of 7 (the last two rows: a null, then text)."""
    root.mkdir(parents=True)
    for i in range(3):
        texts = DOCS[i * 20:(i + 1) * 20]
        if i == 1:
            texts = texts[:18] + [None] + texts[19:]
        langs = ["en" if j % 3 else "de" for j in range(len(texts))]
        pq.write_table(_table(texts, langs), root / f"part-{i:05d}.parquet", row_group_size=7,
                       compression=compression)
    (root / "_SUCCESS").write_text("")
    return root


def _expected(rows=range(60), skip=(38,)):
    return [DOCS[i] for i in rows if i not in skip]


def test_parquet_rows_in_file_and_row_order_nulls_skipped(tmp_path):
    root = _parquet_dir(tmp_path / "pq")
    stats = sources.ReadStats()
    source = {"kind": "parquet", "path": str(root)}
    sources.validate_source(source, "data.sources.main")
    assert list(sources.iter_documents(source, stats=stats)) == _expected()
    assert (stats.files, stats.nulls) == (3, 1)
    assert "1 null text value(s) skipped" in stats.bounded_summary()
    assert pq.ParquetFile(root / "part-00000.parquet").num_row_groups == 3  # several read


def test_a_column_filter_keeps_the_rows_of_one_value(tmp_path):
    root = _parquet_dir(tmp_path / "pq")
    got = list(sources.iter_documents({"kind": "parquet", "path": str(root / "*.parquet"),
                                       "filter_field": "lang", "filter_value": "de"}))
    assert got == [DOCS[i] for i in range(60) if i % 20 % 3 == 0 and i != 38]  # 38: null


@pytest.mark.parametrize("codec", ["none", "gzip", "zstd", "brotli", "lz4"])
def test_compressed_parquet_reads_alike(tmp_path, codec):
    root = _parquet_dir(tmp_path / "pq", compression=codec)
    assert list(sources.iter_documents({"kind": "parquet", "path": str(root)})) == _expected()


def _save_to_disk(directory, texts, files=2):
    """A Dataset directory as datasets.save_to_disk writes one: Arrow IPC stream files,
    state.json listing them, dataset_info.json."""
    directory.mkdir(parents=True)
    names = []
    for i, part in enumerate(np.array_split(np.arange(len(texts)), files)):
        name = f"data-{i:05d}-of-{files:05d}.arrow"
        table = _table([texts[j] for j in part])
        with pa.OSFile(str(directory / name), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=4):
                writer.write_batch(batch)
        names.append(name)
    (directory / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": n} for n in names], "_fingerprint": "f"}))
    (directory / "dataset_info.json").write_text("{}")


def test_a_saved_dataset_and_a_split_of_a_saved_dataset_dict(tmp_path):
    _save_to_disk(tmp_path / "single", DOCS[:30])
    got = list(sources.iter_documents({"kind": "hf_disk", "path": str(tmp_path / "single")}))
    assert got == DOCS[:30]
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train",
                                                                               "test"]}))
    _save_to_disk(tmp_path / "dict" / "train", DOCS[:40], files=3)
    _save_to_disk(tmp_path / "dict" / "test", DOCS[40:])
    source = {"kind": "hf_disk", "path": str(tmp_path / "dict")}
    sources.validate_source(source, "data.sources.main")
    assert list(sources.iter_documents(source)) == DOCS[:40]
    assert list(sources.iter_documents({**source, "split": "test"})) == DOCS[40:]
    with pytest.raises(sources.SourceError, match=r"^data.sources.main.split: .*dict has no "
                                                  r"split 'valid'; available: train, test$"):
        sources.validate_source({**source, "split": "valid"}, "data.sources.main")


def test_bad_columnar_input_is_one_line_naming_the_file_and_field(tmp_path):
    root = _parquet_dir(tmp_path / "pq")
    field = "data.sources.main"

    def refused(source, pattern):
        with pytest.raises(sources.SourceError, match=pattern) as e:
            sources.validate_source(source, field)
        assert "\n" not in str(e.value)

    first = root / "part-00000.parquet"
    refused({"kind": "parquet", "path": str(root), "text_field": "body"},
            rf"^{field}.text_field: {first} has no column 'body'; columns: id, text, lang$")
    refused({"kind": "parquet", "path": str(root), "text_field": "id"},
            rf"^{field}.text_field: column 'id' of {first} is int64, expected strings$")
    refused({"kind": "parquet", "path": str(root), "filter_field": "language"},
            rf"^{field}.filter_field: {first} has no column 'language'")
    empty = tmp_path / "empty.parquet"
    pq.write_table(_table([]), empty)
    refused({"kind": "parquet", "path": str(empty)}, rf"^{field}.path: .* holds no rows$")
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(first.read_bytes()[:-300])
    refused({"kind": "parquet", "path": str(cut)},
            rf"^{field}.path: {cut} cannot be read as Parquet \(")
    refused({"kind": "hf_disk", "path": str(root)},
            rf"^{field}.path: {root} is not a directory written by datasets' save_to_disk")
    refused({"kind": "parquet", "path": str(root), "filter_value": [1]},
            rf"^{field}.filter_value: expected a column value")


def test_a_changed_shard_is_a_changed_corpus(tmp_path):
    root = _parquet_dir(tmp_path / "pq")
    source = {"kind": "parquet", "path": str(root)}
    before = sources.source_fingerprint(source)
    assert sources.source_fingerprint({**source, "path": str(root) + "/"}) == before
    pq.write_table(_table(DOCS[:5]), root / "part-00001.parquet")
    assert sources.source_fingerprint(source) != before
    assert sources.source_fingerprint({**source, "filter_field": "lang",
                                       "filter_value": "en"}) != sources.source_fingerprint(
        source)


def test_parquet_in_a_bucket(tmp_path):
    _parquet_dir(tmp_path / "gcs" / "bucket" / "wiki")
    with fake_gcs(tmp_path / "gcs"):
        source = {"kind": "parquet", "path": "gs://bucket/wiki/*.parquet"}
        sources.validate_source(source, "data.sources.main")
        assert list(sources.iter_documents(source)) == _expected()
        assert sources.source_files(sources.source_settings(source))[0] == (
            "gs://bucket/wiki/part-00000.parquet")


@pytest.mark.slow
def test_the_job_and_beam_cut_the_same_blocks_from_columnar_sources(tmp_path, tiny_tokenizer):
    """Parquet and a saved dataset mixed with a text file, by weight: in-job preparation
    and the Beam pipeline (one work item per Parquet or Arrow file) give the same blocks."""
    _parquet_dir(tmp_path / "pq")
    _save_to_disk(tmp_path / "hf", made_up_documents(50, seed=9), files=3)
    (tmp_path / "plain.txt").write_text("\n\n".join(made_up_documents(40, seed=8)) + "\n")
    c = tiny_config("maelm", tiny_tokenizer.model_path)
    c.data.sources = {
        "wiki": {"kind": "parquet", "path": str(tmp_path / "pq"), "weight": 2.0},
        "hub": {"kind": "hf_disk", "path": str(tmp_path / "hf"), "weight": 1.0},
        "books": {"kind": "text", "path": str(tmp_path / "plain.txt")},
    }
    c.data.validation_fraction = 0.1
    c.prepare.update(num_workers=1, blocks_per_shard=16)
    pretrain_config.validate(c)
    c = pretrain_config.resolve_paths(c)
    run_data.validate_sources(c)
    in_job = run_data.build_blocks(c, paths.Path(tmp_path / "job"), tiny_tokenizer)
    manifest = prepare.run(c, str(tmp_path / "beam"))
    beam = shards.load(tmp_path / "beam", run_data.source_weights(c))
    assert manifest["fingerprint"] == in_job.directory.name
    assert beam.weights == {"wiki": 2.0, "hub": 1.0, "books": 1.0}
    for split in ("train", "valid"):
        for name in ("wiki", "hub", "books"):
            np.testing.assert_array_equal(getattr(beam, split)[name][:],
                                          np.asarray(getattr(in_job, split)[name]))
    assert len(manifest["sources"]["hub"]["train"]["shards"]) >= 1


def _no_document(source, field="config.data.sources.main"):
    with pytest.raises(sources.SourceError) as raised:
        run_data.validate_sources(_one_source_config(source))
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{field}: ")
    return message


def _one_source_config(source):
    c = tiny_config("mlm")
    c.data.sources = {"main": source}
    return c


def test_a_source_that_yields_no_document_is_one_line_with_what_was_read(tmp_path):
    """Every value null (Parquet, a saved dataset), a filter no row matches, JSONL and text
    whose documents are all empty once cleaned: one line naming the source's field, what
    was read and skipped, and where to look; before any tokenizer is trained."""
    root = tmp_path / "nulls"
    root.mkdir()
    pq.write_table(_table([None] * 5), root / "a.parquet")
    pq.write_table(_table([None] * 3), root / "b.parquet")
    message = _no_document({"kind": "parquet", "path": str(root)})
    assert (f"{root} yields no document (8 row(s) or document(s) read in 2 file(s); 8 null "
            "'text' value(s) skipped); check config.data.sources.main.text_field") in message
    message = _no_document({"kind": "parquet", "path": str(_parquet_dir(tmp_path / "pq")),
                            "filter_field": "lang", "filter_value": "fr"})
    assert ("60 row(s) or document(s) read in 3 file(s); 60 row(s) whose 'lang' is not 'fr' "
            "left out" in message and "check config.data.sources.main.filter_value" in message)
    _save_to_disk(tmp_path / "hf", [None] * 6)
    message = _no_document({"kind": "hf_disk", "path": str(tmp_path / "hf")})
    assert "6 null 'text' value(s) skipped" in message
    (tmp_path / "empty.jsonl").write_text('{"text": "  "}\n{"text": "\\u0000\\f"}\n')
    message = _no_document({"kind": "jsonl", "path": str(tmp_path / "empty.jsonl")})
    assert "2 row(s) or document(s) read in 1 file(s); 2 empty once cleaned" in message
    (tmp_path / "blank.txt").write_text("\x00 \x0b\n\n\x1b\n")
    message = _no_document({"kind": "text", "path": str(tmp_path / "blank.txt")})
    assert "empty once cleaned" in message and "give a source with text" in message
    # The check is real: a source with one document passes.
    run_data.validate_sources(_one_source_config(
        {"kind": "parquet", "path": str(_parquet_dir(tmp_path / "ok"))}))


def test_an_arrow_file_in_the_ipc_file_format_reads_as_a_stream_does(tmp_path):
    """A Feather v2 file (Arrow's IPC file format, not the stream save_to_disk writes) is
    read alike, not refused with Arrow's own message."""
    import pyarrow.feather as feather

    feather.write_feather(_table(DOCS[:9]), str(tmp_path / "part.arrow"), chunksize=4)
    source = {"kind": "hf_disk", "path": str(tmp_path / "part.arrow")}
    sources.validate_source(source, "data.sources.main")
    assert list(sources.iter_documents(source)) == DOCS[:9]
    (tmp_path / "bad.arrow").write_bytes(b"ARROW1 but nothing else")
    with pytest.raises(sources.SourceError, match=r"bad.arrow cannot be read as Arrow \(IPC "
                                                  r"stream or file\)"):
        sources.validate_source({"kind": "hf_disk", "path": str(tmp_path / "bad.arrow")},
                                "data.sources.main")
