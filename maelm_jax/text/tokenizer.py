"""The SentencePiece tokenizer and the special tokens' ids, defined in this one place.

Every model, packer and masker takes its special ids from here. The ids are fixed so a
checkpoint and a tokenizer can be checked against each other:

    0 <pad>   1 <s> (BOS)   2 </s> (EOS)   3 <unk>   4 <mask>

``<mask>`` is a SentencePiece *user-defined* symbol: a literal ``<mask>`` in text encodes
to ``MASK_ID`` (as in RoBERTa's tokenizer), which fill-mask demos rely on. BOS and EOS are
control symbols, never produced from text; the packer adds them.

A model file may be local or in a bucket (``gs://``): it is read and written as bytes
through `maelm_jax.infra.paths`, never by SentencePiece's own file access.
"""

import io
import os
import random
import re
from collections.abc import Iterable, Iterator, Sequence

import sentencepiece as spm
from absl import logging

from maelm_jax.infra import errors, paths

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
MASK_ID = 4
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<mask>")  # index == id
NUM_SPECIAL = len(SPECIAL_TOKENS)

MODEL_TYPES = ("bpe", "unigram")
# SentencePiece skips training sentences longer than this many bytes; the default (4192)
# would drop long Wikipedia paragraphs. The corpus readers split longer lines
# (maelm_jax/data/sources.py, MAX_LINE_CHARS * 4 bytes <= this), so none is lost there;
# text given straight to train_tokenizer has such lines skipped (and counted) before they
# are held in memory. With max_sentencepiece_length (pieces of at most 16 characters) and
# our own sample of at most max_sentences lines, this bounds what one document can cost.
_MAX_SENTENCE_BYTES = 16384
_MAX_PIECE_CHARS = 16  # SentencePiece's default, stated: candidate pieces stay short


class TokenizerError(errors.UserError):
    """A tokenizer file or training setting that cannot be used (one-line message)."""


class Tokenizer:
    """A loaded SentencePiece model with the special ids above (see ``load_tokenizer``)."""

    def __init__(self, processor: spm.SentencePieceProcessor, model_path: str):
        self._sp = processor
        self.model_path = model_path

    @property
    def vocab_size(self) -> int:
        """Number of pieces, special tokens and byte-fallback pieces included."""
        return self._sp.get_piece_size()

    def encode(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
        """Token ids of each text, no BOS/EOS added; encodes the batch on several threads.

        ``num_threads=-1`` lets SentencePiece use every core.
        """
        if isinstance(texts, str):
            raise TypeError("Tokenizer.encode takes a sequence of texts, not one string")
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def decode(self, ids: Sequence[int] | Sequence[Sequence[int]]) -> str | list[str]:
        """Text of one id sequence, or a list of texts for a batch of sequences."""
        return self._sp.decode(_as_int_lists(ids))

    def encode_with_offsets(self, texts: Sequence[str]) -> list[dict]:
        """Per text {"ids": [...], "offsets": [(start, end), ...]}: each piece's character
        span in the original text, whatever the normaliser did (SentencePiece's
        offset mapping)."""
        return self._sp.encode(list(texts), return_type="offset_mapping", num_threads=-1)

    def id_to_piece(self, token_id: int) -> str:
        """The piece string of one id (``"<mask>"`` for ``MASK_ID``)."""
        return self._sp.id_to_piece(int(token_id))

    def __repr__(self) -> str:
        return f"Tokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str) -> Tokenizer:
    """Loads a ``.model`` file and checks that the special tokens have the ids above."""
    file = paths.Path(path)
    if not file.is_file():
        raise TokenizerError(f"tokenizer model {path!r} does not exist")
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(file.read_bytes())
    except RuntimeError:
        raise TokenizerError(f"tokenizer model {path!r} is not a SentencePiece model (it does "
                             "not parse as one)") from None
    for token_id, piece in enumerate(SPECIAL_TOKENS):
        actual_id = processor.piece_to_id(piece)
        # piece_to_id returns the unk id for a missing piece, hence the reverse check.
        if actual_id != token_id or processor.id_to_piece(token_id) != piece:
            found = "is missing" if processor.id_to_piece(actual_id) != piece else (
                f"has id {actual_id}")
            raise TokenizerError(f"tokenizer model {path!r}: special token {piece!r} {found}; "
                                 f"expected id {token_id} (train it with train_tokenizer)")
    return Tokenizer(processor, path)


def train_tokenizer(documents: Iterable[str], model_prefix_or_path: str, vocab_size: int,
                    model_type: str = "bpe", lowercase: bool = False,
                    max_sentences: int = 2_000_000, seed: int = 0,
                    num_threads: int | None = None) -> Tokenizer:
    """Trains a SentencePiece model on documents and writes ``<prefix>.model`` atomically.

    Args:
      documents: texts; each is split into lines, the lines are the training sentences.
      model_prefix_or_path: ``"dir/spm"`` or ``"dir/spm.model"``; writes ``dir/spm.model``
        (``dir`` may be in a bucket).
      vocab_size: total pieces, including the 5 special tokens and 256 byte pieces
        (``byte_fallback``: text outside the vocabulary becomes bytes, not ``<unk>``).
      model_type: "bpe" or "unigram".
      lowercase: case-fold in the model's normaliser (``nmt_nfkc_cf``), so the model
        lowercases at encode time too and nobody has to remember to.
      max_sentences: at most this many lines are used, sampled uniformly (seeded) when the
        corpus has more, so big corpora train in bounded time and memory.
      seed: seeds the sampling; the same documents and settings give the same model.
      num_threads: training threads (default: all cores).

    Returns:
      The trained tokenizer, loaded and checked.
    """
    if model_type not in MODEL_TYPES:
        raise TokenizerError(f"model_type: expected one of {', '.join(MODEL_TYPES)}, "
                             f"got {model_type!r}")
    min_vocab = NUM_SPECIAL + 256 + 1
    if vocab_size < min_vocab:
        raise TokenizerError(f"vocab_size: expected at least {min_vocab} (5 special tokens + "
                             f"256 byte pieces + 1), got {vocab_size}")
    model_path = _model_path(model_prefix_or_path)
    model = io.BytesIO()  # SentencePiece writes the model here, never to a file
    try:
        _train(_sample_sentences(documents, max_sentences, seed), model, vocab_size,
               model_type, lowercase, num_threads or os.cpu_count() or 1)
    except RuntimeError as e:  # SentencePiece reports bad settings as RuntimeError
        most = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= "
                         r"(\d+)", str(e))
        if most:  # a small or repetitive corpus: the one error a user can act on directly
            raise TokenizerError(
                f"vocab_size={vocab_size}: the training text yields at most {most.group(1)} "
                f"{model_type} pieces; lower config.tokenizer.vocab_size or add text") from None
        raise TokenizerError(f"training tokenizer {model_path!r} failed: "
                             f"{str(e).splitlines()[0]}") from None
    # Readers never see a half-written model.
    paths.write_atomically(paths.Path(model_path), model.getvalue())
    return load_tokenizer(model_path)


def _train(sentences: list[str], writer, vocab_size: int, model_type: str,
           lowercase: bool, num_threads: int) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=writer,
        vocab_size=vocab_size,
        model_type=model_type,
        normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
        pad_id=PAD_ID, pad_piece=SPECIAL_TOKENS[PAD_ID],
        bos_id=BOS_ID, bos_piece=SPECIAL_TOKENS[BOS_ID],
        eos_id=EOS_ID, eos_piece=SPECIAL_TOKENS[EOS_ID],
        unk_id=UNK_ID, unk_piece=SPECIAL_TOKENS[UNK_ID],
        # The first free id after 0..3, so <mask> lands on MASK_ID (load_tokenizer checks).
        user_defined_symbols=[SPECIAL_TOKENS[MASK_ID]],
        byte_fallback=True,
        # The sentences are already sampled (see _sample_sentences): use them all, in order.
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=_MAX_SENTENCE_BYTES,
        max_sentencepiece_length=_MAX_PIECE_CHARS,
        num_threads=num_threads,
        minloglevel=2,  # errors only: the trainer's progress log is thousands of lines
    )


def _sample_sentences(documents: Iterable[str], max_sentences: int, seed: int) -> list[str]:
    """A uniform sample of at most ``max_sentences`` lines (reservoir sampling).

    Sampling here rather than with SentencePiece's ``input_sentence_size`` keeps training
    reproducible: SentencePiece's sampler is seeded once per process (a second
    ``set_random_generator_seed`` in the same process has no effect), so its sample would
    depend on what ran before.
    """
    if max_sentences < 1:
        raise TokenizerError(f"max_sentences: expected a positive number, got {max_sentences}")
    rng = random.Random(seed)
    sample: list[str] = []
    too_long = [0]
    for i, sentence in enumerate(_sentences(documents, too_long)):
        if i < max_sentences:
            sample.append(sentence)
        else:
            j = rng.randrange(i + 1)  # keeps every sentence with probability k / (i + 1)
            if j < max_sentences:
                sample[j] = sentence
    if too_long[0]:
        logging.warning("tokenizer training skipped %d line(s) longer than %d bytes "
                        "(SentencePiece's max_sentence_length)", too_long[0],
                        _MAX_SENTENCE_BYTES)
    if not sample:
        raise TokenizerError("train_tokenizer: the documents contain no text"
                             + (f" in lines of at most {_MAX_SENTENCE_BYTES} bytes"
                                if too_long[0] else ""))
    return sample


def _sentences(documents: Iterable[str], too_long: list[int]) -> Iterator[str]:
    """Non-empty lines; those SentencePiece would skip for length are counted instead."""
    for document in documents:
        for line in document.splitlines():
            line = line.strip()
            if len(line) * 4 > _MAX_SENTENCE_BYTES and len(
                    line.encode("utf-8")) > _MAX_SENTENCE_BYTES:
                too_long[0] += 1
            elif line:
                yield line


def _model_path(model_prefix_or_path: str) -> str:
    path = os.fspath(model_prefix_or_path)
    return path if path.endswith(".model") else path + ".model"


def _as_int_lists(ids):
    # numpy / jax arrays: SentencePiece wants Python ints.
    if hasattr(ids, "tolist"):
        return ids.tolist()
    return [_as_int_lists(x) if not isinstance(x, int) else x for x in ids]

