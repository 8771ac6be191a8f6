"""The export's tokenizer.json: transformers' AutoTokenizer loads it as a fast tokenizer
that gives our ids (the slow tokenizer's, for a SentencePiece model; fine-tuning's layout
for a Hugging Face tokenizer), with offsets into the text, and transformers'
question-answering preprocessing (offsets -> start and end positions) finds the answer.

Needs transformers (requirements-hf.txt, which .ci/run installs).
"""

import json
import shutil
import unicodedata

import hf_tokenizers
import pytest

from maelm_jax.data import builtin_corpus
from maelm_jax.export import run as export_run
from maelm_jax.finetune import data as finetune_data
from maelm_jax.finetune.tasks.squad import examples as squad_examples
from maelm_jax.text import tokenizer as tokenizer_lib

from conftest import SHARED_DATA, require_shared_data

pytestmark = pytest.mark.tier("unit")

transformers = pytest.importorskip("transformers", reason="the export's tests need "
                                   "transformers (pip install -r requirements-hf.txt)")

from maelm_jax.export.remote import tokenization_maelm  # noqa: E402 (after the skip)

MAX_LEN = 64
# What the slow tokenizer already handles: <mask> with and without a space before it (and
# at either end, twice in a row), text outside the vocabulary (byte fallback), runs of
# spaces, tabs and newlines, full-width and composed characters (NFKC), a long text.
TRICKY = ["Fill the <mask> here.", "Fill the<mask>here", "<mask> starts, ends <mask>",
          "two <mask><mask> in a row", "a  <mask>   b", "Zürich, São Paulo — naïve café 東京 😀 ½",
          "ＦＵＬＬ width ﬁ ligature", "tabs\tand  double  spaces\nand a newline",
          " leading and trailing spaces ", "Ünïcödé 𝄞 ☃", " ".join(["a long sentence"] * 200)]


def _export_tokenizer(tok, directory):
    """The tokenizer files of an export of a run with `tok` (export/run.py's), and the
    slow tokenizer's code beside them as the export ships it."""
    directory.mkdir()
    for name, content in export_run._tokenizer_files(tok, MAX_LEN).items():
        (directory / name).write_bytes(content)
    shutil.copy(export_run.REMOTE_DIR / "tokenization_maelm.py", directory)
    return transformers.AutoTokenizer.from_pretrained(str(directory), trust_remote_code=True)


@pytest.fixture(scope="module")
def sentencepiece_models(tiny_tokenizer, tmp_path_factory):
    """The session's lowercasing BPE model and a cased unigram one."""
    unigram = tokenizer_lib.train_tokenizer(
        builtin_corpus.iter_documents(), str(tmp_path_factory.mktemp("uni") / "uni.model"),
        1000, model_type="unigram", lowercase=False)
    return {"bpe_lowercase": tiny_tokenizer, "unigram_cased": unigram}


@pytest.mark.parametrize("name", ["bpe_lowercase", "unigram_cased"])
def test_the_fast_tokenizer_gives_the_slow_ones_ids(sentencepiece_models, name, tmp_path):
    ours = sentencepiece_models[name]
    fast = _export_tokenizer(ours, tmp_path / "hf")
    assert isinstance(fast, transformers.PreTrainedTokenizerFast)
    slow = tokenization_maelm.MaelmTokenizer(vocab_file=ours.model_path,
                                             model_max_length=MAX_LEN)
    texts = TRICKY + _reference_sample()
    for text in texts:
        assert fast(text)["input_ids"] == slow(text)["input_ids"], text
    # Pairs, truncated longest first to the model's length: fine-tuning's sequences.
    got = fast(texts, texts[::-1], truncation=True)["input_ids"]
    assert got == slow(texts, texts[::-1], truncation=True)["input_ids"]
    no_mask = [t for t in texts if "<mask>" not in t]
    assert fast(no_mask, no_mask[::-1], truncation=True)["input_ids"] == [
        row.tolist() for row in finetune_data.encode_texts(ours, [no_mask, no_mask[::-1]],
                                                           MAX_LEN)]
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id, fast.mask_token_id) == (
        ours.special.bos, ours.special.eos, ours.special.pad, ours.special.mask)
    for text in TRICKY:
        _check_offsets(fast, ours, text)


def _reference_sample() -> list[str]:
    """Lines of the reference corpus and GLUE's dev texts, when present (development
    machines; the test below says when they are not)."""
    if not SHARED_DATA.exists():
        return []
    lines = (SHARED_DATA / "wiki" / "wiki_00").read_text(encoding="utf-8").splitlines()
    dev = (SHARED_DATA / "glue" / "MRPC" / "dev.tsv").read_text(encoding="utf-8").splitlines()
    return ([line for line in lines if line.strip()][:300]
            + [cell for row in dev[1:101] for cell in row.split("\t")[3:]])


def test_the_reference_data_is_in_the_sample():
    require_shared_data("wiki", "wiki_00")
    require_shared_data("glue", "MRPC", "dev.tsv")
    assert len(_reference_sample()) > 300


def _check_offsets(fast, ours, text):
    """Every token's offsets lie in the text, in order; a token of plain letters spans
    its own letters (a space before them aside)."""
    encoded = fast(text, return_offsets_mapping=True)
    last = 0
    for token_id, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"],
                                      strict=True):
        if token_id in ours.special.ids and token_id != ours.special.mask:
            assert (start, end) == (0, 0)
            continue
        assert last <= start <= end <= len(text), (text, start, end)
        piece = ours.id_to_piece(token_id).lstrip("\u2581")
        if piece.isascii() and piece.isalpha():
            # Read as the model's NFKC reads it; a ligature's pieces share its one character.
            spanned = unicodedata.normalize("NFKC", text[start:end])
            assert piece.lower() in spanned.strip().lower(), (text, piece)
        last = start


@pytest.mark.parametrize("layout", ["roberta", "bert"])
def test_a_hugging_face_tokenizer_is_exported_in_our_layout(layout, tmp_path):
    build = {"roberta": hf_tokenizers.roberta_like, "bert": hf_tokenizers.bert_like}[layout]
    ours = tokenizer_lib.load_tokenizer(str(build(builtin_corpus.iter_documents(),
                                                  tmp_path / f"{layout}.json")))
    fast = _export_tokenizer(ours, tmp_path / "hf")
    assert isinstance(fast, transformers.PreTrainedTokenizerFast)
    assert not (tmp_path / "hf" / "tokenizer.model").exists()  # no slow tokenizer of ours
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in config
    texts = [t for t in TRICKY if "<mask>" not in t]
    expected = finetune_data.encode_texts(ours, [texts, texts[::-1]], MAX_LEN)
    assert fast(texts, texts[::-1], truncation=True)["input_ids"] == [
        row.tolist() for row in expected]
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id, fast.mask_token_id) == (
        ours.special.bos, ours.special.eos, ours.special.pad, ours.special.mask)
    masked = fast("Fill the <mask> here." if layout == "roberta" else "fill the [MASK] here.")
    assert masked["input_ids"].count(ours.special.mask) == 1


def test_question_answering_preprocessing_finds_the_answer(tiny_tokenizer, tmp_path):
    """transformers' run_qa.py preparation of training features (windows over the context
    with return_offsets_mapping, start/end positions from the offsets) on our exported
    tokenizer: the positions are those of the answer, and the windows are ours."""
    fast = _export_tokenizer(tiny_tokenizer, tmp_path / "hf")
    context = ("The house by the tree was built in the long summer of the good year, "
               "and the garden behind it was planted in the autumn that followed it.")
    question, answer = "When was the garden planted?", "in the autumn"
    answer_start = context.index(answer)
    features = fast(question, context, truncation="only_second", max_length=32, stride=8,
                    return_overflowing_tokens=True, return_offsets_mapping=True)
    found = []
    for i, offsets in enumerate(features["offset_mapping"]):
        sequence_ids = features.sequence_ids(i)
        start, end = _positions(offsets, sequence_ids, answer_start,
                                answer_start + len(answer))
        if start is not None:
            found.append(context[offsets[start][0]:offsets[end][1]].strip())
    assert found and set(found) == {answer}
    # The windows are those our SQuAD preparation cuts at the same sizes (its doc_stride
    # is the step between windows, transformers' stride their overlap).
    example = squad_examples.SquadExample("q", question, context, [answer], [answer_start])
    window = 32 - len(tiny_tokenizer.encode([question])[0]) - 4
    ours = squad_examples.make_features([example], tiny_tokenizer, 32, window - 8,
                                        max_query_len=16, training=True)
    assert [row.tolist() for row in ours.sequences] == features["input_ids"]


def _positions(offsets, sequence_ids, start_char, end_char):
    """run_qa.py's prepare_train_features for one window: the answer's first and last
    token, or None when the window does not hold it."""
    first = sequence_ids.index(1)
    last = len(sequence_ids) - 1 - sequence_ids[::-1].index(1)
    if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
        return None, None
    while first < len(offsets) and offsets[first][0] <= start_char:
        first += 1
    while offsets[last][1] >= end_char:
        last -= 1
    return first - 1, last + 1
