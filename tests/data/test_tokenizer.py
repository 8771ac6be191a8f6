"""Tests for the tokenizers (SentencePiece, a Hugging Face tokenizer.json) and the
special token ids."""

import json
import os

import hf_tokenizers
import numpy as np
import pytest
import sentencepiece as spm

from maelm_jax.data import builtin_corpus
from maelm_jax.text import tokenizer as tk

SP = tk.SENTENCEPIECE_IDS
pytestmark = pytest.mark.tier("unit")


@pytest.fixture(scope="module")
def documents():
    return list(builtin_corpus.iter_documents())


@pytest.fixture(scope="module")
def quickstart(documents, tmp_path_factory):
    """An 8192-piece BPE vocabulary on the built-in corpus (< 1 s)."""
    return tk.train_tokenizer(documents, tmp_path_factory.mktemp("tok") / "spm", 8192)


def test_special_token_constants_agree():
    assert tk.SPECIAL_TOKENS == ("<pad>", "<s>", "</s>", "<unk>", "<mask>")
    assert tk.SENTENCEPIECE_IDS == tk.SpecialIds(pad=0, bos=1, eos=2, unk=3, mask=4)
    assert tk.NUM_SPECIAL == 5


def test_trained_model_has_the_special_ids(quickstart):
    assert quickstart.vocab_size == 8192
    assert [quickstart.id_to_piece(i) for i in range(5)] == list(tk.SPECIAL_TOKENS)
    assert quickstart.model_path.endswith("spm.model") and os.path.isfile(quickstart.model_path)


def test_encode_is_batched_adds_no_bos_eos_and_keeps_mask(quickstart):
    texts = ["Return the value of the attribute.", "Fill in the <mask> here."]
    ids = quickstart.encode(texts)
    assert len(ids) == 2 and all(ids)
    flat = [i for seq in ids for i in seq]
    assert SP.bos not in flat and SP.eos not in flat and SP.pad not in flat
    assert SP.mask in ids[1] and SP.mask not in ids[0]
    assert quickstart.decode(ids) == texts
    assert quickstart.decode(np.asarray(ids[0])) == texts[0]
    with pytest.raises(TypeError, match="sequence of texts"):
        quickstart.encode("one string")


def test_byte_fallback_avoids_unk(quickstart):
    text = "Ünïcödé 漢字 and an emoji 🙂"
    ids = quickstart.encode([text])[0]
    assert SP.unk not in ids
    assert quickstart.decode(ids) == text


def test_lowercase_is_baked_into_the_model(documents, tmp_path):
    lower = tk.train_tokenizer(documents, tmp_path / "lower", 1000, lowercase=True)
    cased = tk.train_tokenizer(documents, tmp_path / "cased", 1000, lowercase=False)
    assert lower.encode(["The RETURN Value"]) == lower.encode(["the return value"])
    assert lower.decode(lower.encode(["The RETURN Value"])) == ["the return value"]
    assert cased.encode(["The RETURN Value"]) != cased.encode(["the return value"])
    assert cased.decode(cased.encode(["The RETURN Value"])) == ["The RETURN Value"]


def test_train_load_roundtrip_and_atomic_write(documents, tmp_path):
    trained = tk.train_tokenizer(documents[:50], str(tmp_path / "out" / "spm.model"), 600,
                                 model_type="unigram")
    assert os.listdir(tmp_path / "out") == ["spm.model"]  # no temporary leftovers
    loaded = tk.load_tokenizer(str(tmp_path / "out" / "spm.model"))
    texts = ["A docstring about files and sockets.", "Another <mask> one."]
    assert loaded.encode(texts) == trained.encode(texts)
    assert loaded.vocab_size == trained.vocab_size == 600


def test_training_is_deterministic_and_seeded(documents, tmp_path):
    def model_bytes(name, seed):
        tokenizer = tk.train_tokenizer(documents, tmp_path / name, 1000, max_sentences=3000,
                                       seed=seed)
        with open(tokenizer.model_path, "rb") as f:
            return f.read()

    first = model_bytes("a", seed=0)
    assert model_bytes("b", seed=0) == first
    # 3000 of ~31K lines are sampled, so another seed sees other lines.
    assert model_bytes("c", seed=1) != first


def _train_raw_spm(path, **special):
    """A SentencePiece model trained without train_tokenizer's special token layout."""
    sentences = [f"sentence number {i} about tokens and models" for i in range(200)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_prefix=str(path),
                                   vocab_size=40, minloglevel=2, **special)
    return f"{path}.model"


def test_load_rejects_a_model_without_mask(tmp_path):
    path = _train_raw_spm(tmp_path / "nomask", pad_id=0, bos_id=1, eos_id=2, unk_id=3,
                          pad_piece="<pad>", bos_piece="<s>", eos_piece="</s>")
    with pytest.raises(tk.TokenizerError,
                       match=r"nomask\.model': special token '<mask>' is missing; expected id 4"):
        tk.load_tokenizer(path)


def test_load_rejects_special_tokens_at_other_ids(tmp_path):
    path = _train_raw_spm(tmp_path / "spm_default")  # SentencePiece's own 0=<unk>, 1=<s>
    with pytest.raises(tk.TokenizerError, match=r"special token '<pad>' is missing"):
        tk.load_tokenizer(path)
    path = _train_raw_spm(tmp_path / "shifted", pad_id=0, bos_id=1, eos_id=2, unk_id=3,
                          user_defined_symbols=["<sep>", "<mask>"])
    with pytest.raises(tk.TokenizerError, match=r"special token '<mask>' has id 5; expected id 4"):
        tk.load_tokenizer(path)


def test_load_and_train_errors_are_clear(tmp_path):
    with pytest.raises(tk.TokenizerError, match=r"'.*missing\.model' does not exist"):
        tk.load_tokenizer(str(tmp_path / "missing.model"))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(tk.TokenizerError, match=r"is not a SentencePiece model"):
        tk.load_tokenizer(str(garbage))
    with pytest.raises(tk.TokenizerError,
                       match=r"^vocab_size=5000: the training text yields at most"):
        tk.train_tokenizer(["tiny corpus"] * 5, tmp_path / "big", 5000)
    with pytest.raises(tk.TokenizerError, match=r"^vocab_size: expected at least 262"):
        tk.train_tokenizer(["tiny corpus"], tmp_path / "small", 100)
    with pytest.raises(tk.TokenizerError, match=r"^model_type: expected one of bpe, unigram"):
        tk.train_tokenizer(["tiny corpus"], tmp_path / "wp", 1000, model_type="wordpiece")


# ------------------------------------------------------------- Hugging Face tokenizer.json


@pytest.fixture(scope="module")
def hf_files(documents, tmp_path_factory):
    """RoBERTa- and BERT-like tokenizer.json files built locally (tests/hf_tokenizers.py)."""
    directory = tmp_path_factory.mktemp("hf")
    return {"roberta": hf_tokenizers.roberta_like(documents, directory / "roberta.json"),
            "bert": hf_tokenizers.bert_like(documents, directory / "bert.json")}


def test_a_hugging_face_tokenizer_brings_its_own_special_ids(hf_files):
    roberta = tk.load_tokenizer(str(hf_files["roberta"]))
    assert roberta.kind == "huggingface" and roberta.vocab_size == 600
    # RoBERTa's layout: <s> <pad> </s> <unk> at 0-3, <mask> the last id (50264 in roberta-base).
    assert roberta.special == tk.SpecialIds(bos=0, pad=1, eos=2, unk=3, mask=599)
    bert = tk.load_tokenizer(str(hf_files["bert"]))
    assert bert.special == tk.SpecialIds(pad=0, unk=3, bos=4, eos=5, mask=6)
    # The interface SentencePiece's has: no special tokens added, a batch of texts.
    ids = roberta.encode(["Fill the <mask> here.", "Fill the<mask>here."])
    assert all(roberta.special.mask in row and roberta.special.bos not in row for row in ids)
    assert roberta.decode(ids[0]) == "Fill the<mask> here."  # <mask> took the space (lstrip)
    (encoded,) = bert.encode_with_offsets(["Return the VALUE."])
    text = "Return the VALUE."
    assert [text[a:b].lower() for a, b in encoded["offsets"]] == [
        bert.id_to_piece(i).removeprefix("##") for i in encoded["ids"]]
    words = [bert.is_word_start(i) for i in encoded["ids"]]
    assert words[0] and sum(words) == 4 and not bert.is_word_start(bert.special.mask)
    assert roberta.is_word_start(roberta.token_to_id("Ġthe"))
    assert not roberta.is_word_start(roberta.token_to_id("the"))


def test_a_hugging_face_tokenizer_that_cannot_serve_is_one_line(hf_files, tmp_path):
    without_mask = json.loads(hf_files["roberta"].read_text())
    without_mask["added_tokens"] = [t for t in without_mask["added_tokens"]
                                    if t["content"] != "<mask>"]
    (tmp_path / "no_mask.json").write_text(json.dumps(without_mask))
    with pytest.raises(tk.TokenizerError, match=r"^config.tokenizer.model_path '.*no_mask\.json' "
                                               r"has no mask token \(expected one of <mask> "
                                               r"\[MASK\]\)$"):
        tk.load_tokenizer(str(tmp_path / "no_mask.json"), "config.tokenizer.model_path")
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(tk.TokenizerError, match=r"'.*bad\.json' is not a Hugging Face "
                                               r"tokenizer\.json \("):
        tk.load_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(tk.TokenizerError, match=r"'.*missing\.json' does not exist"):
        tk.load_tokenizer(str(tmp_path / "missing.json"))
