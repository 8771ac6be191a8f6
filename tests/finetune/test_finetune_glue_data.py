"""GLUE reading (TSV and TFDS), RoBERTa-style encoding, static-shape batches, submissions."""

import numpy as np
import pytest

from maelm_jax.finetune import data
from maelm_jax.finetune.tasks.glue import examples, outputs
from maelm_jax.text import tokenizer as tokenizer_lib

from conftest import require_shared_data

pytestmark = pytest.mark.tier("unit")

SP = tokenizer_lib.SENTENCEPIECE_IDS
BOS, EOS, PAD = SP.bos, SP.eos, data.PAD


# --- encoding ----------------------------------------------------------------------------

def _longest_first_by_loop(a, b, budget):
    while a + b > budget:
        if a > b:
            a -= 1
        else:
            b -= 1
    return a, b


def test_truncation_is_longest_first():
    rng = np.random.default_rng(0)
    for _ in range(500):
        a, b, budget = (int(x) for x in rng.integers(0, 60, 3))
        assert data.truncate_longest_first(a, b, budget) == _longest_first_by_loop(a, b, budget)


def test_pairs_and_singles_are_encoded_as_roberta_does():
    assert data.encode_single([7, 8], 16, SP).tolist() == [BOS, 7, 8, EOS]
    assert data.encode_pair([7, 8], [9], 16, SP).tolist() == [BOS, 7, 8, EOS, EOS, 9, EOS]
    long_a, short_b = list(range(10, 30)), [5, 6]
    pair = data.encode_pair(long_a, short_b, 12, SP)  # 8 text tokens: A keeps 6, B both
    assert pair.tolist() == [BOS, 10, 11, 12, 13, 14, 15, EOS, EOS, 5, 6, EOS]
    assert data.encode_single(long_a, 8, SP).tolist() == [BOS, 10, 11, 12, 13, 14, 15, EOS]


def test_encode_texts_uses_the_tokenizer(tiny_tokenizer):
    a, b = "the value is returned", "a list of names"
    pair = data.encode_texts(tiny_tokenizer, [[a], [b]], 64)[0]
    ids_a, ids_b = tiny_tokenizer.encode([a, b])
    assert pair.tolist() == [BOS, *ids_a, EOS, EOS, *ids_b, EOS]


def test_batches_have_static_shapes_masks_and_weights():
    sequences = [np.arange(1, n + 1, dtype=np.int32) for n in (3, 10, 17, 5, 40, 8, 9)]
    labels = np.arange(7, dtype=np.int32) * 10
    buckets = data.buckets_for(48, (16, 32, 64))
    assert buckets == (16, 32, 48)
    batches = list(data.eval_batches(sequences, {"labels": labels}, 4, buckets))
    assert [b.tokens.shape for b in batches] == [(4, 16), (4, 48)]
    last = batches[-1]
    assert last.weights.tolist() == [1, 1, 1, 0] and last.rows.tolist()[-1] == -1
    for b in batches:
        for i, r in enumerate(b.rows):
            if r < 0:
                assert not b.key_mask[i].any() and (b.tokens[i] == PAD).all()
                continue
            n = len(sequences[r])
            assert b.key_mask[i].sum() == n and b.key_mask[i, :n].all()
            assert b.tokens[i, :n].tolist() == sequences[r].tolist()
            assert b.targets["labels"][i] == labels[r]
    # Outputs come back in example order; filler rows are dropped.
    restored = data.scatter_rows([(b.rows, b.targets["labels"]) for b in batches], 7)
    assert restored.tolist() == labels.tolist()
    train = list(data.train_batches(sequences, {"labels": labels}, 4,
                                    buckets, np.random.default_rng(0)))
    assert sorted(r for b in train for r in b.rows if r >= 0) == list(range(7))
    assert {b.tokens.shape[0] for b in train} == {4}
    assert {b.tokens.shape[1] for b in train} <= set(buckets)


# --- TSV files ---------------------------------------------------------------------------

def test_reads_the_shared_glue_tsvs():
    root = str(require_shared_data("glue"))
    cola = examples.read_tsv(root, examples.get_task("CoLA"), "train")  # no header row
    assert len(cola) == 8551 and set(cola.labels.tolist()) == {0, 1}
    assert cola.texts[0][0].startswith("Our friends won't buy this analysis")
    assert len(examples.read_tsv(root, examples.get_task("cola"), "dev")) == 1043
    sst2 = examples.read_tsv(root, examples.get_task("sst2"), "dev")
    assert len(sst2) == 872 and int(sst2.labels.sum()) == 444  # 444 positive of 872
    mrpc = examples.read_tsv(root, examples.get_task("mrpc"), "train")  # starts with a BOM
    assert len(mrpc) == 3668 and len(mrpc.texts) == 2
    stsb = examples.read_tsv(root, examples.get_task("stsb"), "dev")
    assert stsb.labels.dtype == np.float32 and stsb.labels[:2].tolist() == [5.0, 4.75]
    rte = examples.read_tsv(root, examples.get_task("rte"), "dev")
    assert rte.labels[0] == examples.get_task("rte").label_names.index("not_entailment")
    test = examples.read_tsv(root, examples.get_task("SST-2"), "test", require_labels=False)
    assert len(test) == 1821 and test.index[:2] == ["0", "1"] and (test.labels == -1).all()


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")


def test_mnli_and_qqp_layouts_and_malformed_rows(tmp_path):
    mnli_header = ["index", "promptID", "pairID", "genre", "sentence1", "sentence2", "label1",
                   "gold_label"]
    _write(tmp_path / "MNLI" / "dev_mismatched.tsv", [
        mnli_header,
        ["0", "1", "1n", "fiction", "A man sleeps.", "Nobody sleeps.", "x", "contradiction"],
        ["1", "2", "2e", "fiction", 'He said "hi".', "He spoke.", "x", "entailment"],
    ])
    mnli = examples.read_tsv(str(tmp_path), examples.get_task("mnli"), "dev_mismatched")
    assert mnli.labels.tolist() == [2, 0] and mnli.texts[0][1] == 'He said "hi".'
    _write(tmp_path / "QQP" / "train.tsv", [
        ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
        ["0", "1", "2", "How old?", "What age?", "1"],
        ["1", "3", "4", "A broken row"],  # a few QQP rows are cut short: skipped
        ["2", "5", "6", "Why?", "", "0"],  # an empty question: skipped
        ["3", "7", "8", "Where?", "Which place?", "0"],
    ])
    qqp = examples.read_tsv(str(tmp_path), examples.get_task("qqp"), "train")
    assert qqp.labels.tolist() == [1, 0] and qqp.texts[1] == ["What age?", "Which place?"]
    _write(tmp_path / "QQP" / "test.tsv", [["id", "question1", "question2"], ["7", "a?", "b?"]])
    assert examples.read_tsv(str(tmp_path), examples.get_task("qqp"), "test", False).index == ["7"]


def test_tsv_errors_name_the_file_and_the_problem(tmp_path):
    with pytest.raises(examples.GlueDataError, match=r"RTE train file .*train.tsv does not exist"):
        examples.read_tsv(str(tmp_path), examples.get_task("rte"), "train")
    _write(tmp_path / "RTE" / "train.tsv", [["index", "sentence1", "sentence2", "label"],
                                            ["0", "a", "b", "maybe"]])
    with pytest.raises(examples.GlueDataError, match=r"row 1: label 'maybe' is not one of"):
        examples.read_tsv(str(tmp_path), examples.get_task("rte"), "train")
    with pytest.raises(examples.GlueDataError, match=r"unknown GLUE task 'sst3'"):
        examples.get_task("sst3")


# --- TFDS --------------------------------------------------------------------------------

def test_reads_a_tfds_glue_dataset_without_tensorflow(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    tfds.disable_progress_bar()
    rows = [("hello there", 1), ("awful", 0), ("fine", 1)]

    class TinyGlue(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """The features of TFDS's glue/rte: sentence1, sentence2, label (ClassLabel), idx."""

        VERSION = tfds.core.Version("2.0.0")

        def _info(self):
            features = tfds.features.FeaturesDict({
                "sentence1": tfds.features.Text(), "sentence2": tfds.features.Text(),
                "label": tfds.features.ClassLabel(names=["entailment", "not_entailment"]),
                "idx": np.int32})
            return tfds.core.DatasetInfo(builder=self, features=features,
                                         disable_shuffling=True)

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(rows),
                    "validation": self._generate_examples(rows[:2]),
                    "test": self._generate_examples([("x", -1)])}

        def _generate_examples(self, items):
            for i, (text, label) in enumerate(items):
                yield i, {"sentence1": text, "sentence2": "B", "label": label, "idx": i}

    TinyGlue(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    rte = examples.get_task("rte")
    args = {"source": "tfds", "tfds_dataset": "tiny_glue", "tfds_data_dir": str(tmp_path)}
    train = examples.read_split(rte, "train", **args)
    assert train.texts == [["hello there", "awful", "fine"], ["B", "B", "B"]]
    assert train.labels.tolist() == [1, 0, 1] and train.index == ["0", "1", "2"]
    assert len(examples.read_split(rte, "dev", **args)) == 2
    test = examples.read_split(rte, "test", **args)
    assert test.labels.tolist() == [-1]
    assert examples.split_available(rte, "test", **args)
    with pytest.raises(examples.GlueDataError, match="config.data.tfds_name: TFDS dataset 'nope"):
        examples.read_split(rte, "train", source="tfds", tfds_dataset="nope",
                        tfds_data_dir=str(tmp_path))


# --- submission files --------------------------------------------------------------------

def test_submission_files_use_glue_names_and_labels(tmp_path):
    path = outputs.write_submission(tmp_path, examples.get_task("rte"), "test", ["0", "1"], [1, 0])
    assert path.name == "RTE.tsv"
    assert path.read_text() == "index\tprediction\n0\tnot_entailment\n1\tentailment\n"
    mm = outputs.write_submission(tmp_path, examples.get_task("mnli"), "test_mismatched",
                                     ["5"], [1])
    assert mm.name == "MNLI-mm.tsv" and mm.read_text().endswith("5\tneutral\n")
    m = outputs.write_submission(tmp_path, examples.get_task("mnli"), "test_matched", ["5"], [2])
    assert m.name == "MNLI-m.tsv" and m.read_text().endswith("5\tcontradiction\n")
    sts = outputs.write_submission(tmp_path, examples.get_task("stsb"), "test", ["0"], [3.14159])
    assert sts.name == "STS-B.tsv" and sts.read_text().endswith("0\t3.142\n")
    sst = outputs.write_submission(tmp_path, examples.get_task("sst2"), "test", ["0"], [1])
    assert sst.name == "SST-2.tsv" and sst.read_text().endswith("0\t1\n")
