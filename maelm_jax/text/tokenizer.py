"""A run's tokenizer: a SentencePiece model we train, or a Hugging Face ``tokenizer.json``
(`HfTokenizer`), and the record of its special tokens' ids (`SpecialIds`).

Every packer, masker, model, fill-mask, analysis, fine-tuning task and export takes the
special ids from the tokenizer's `special` record (carried into the model's config),
never from constants. A SentencePiece model we train has them at fixed ids:

    0 <pad>   1 <s> (BOS)   2 </s> (EOS)   3 <unk>   4 <mask>

(`SENTENCEPIECE_IDS`); a Hugging Face tokenizer has its own (RoBERTa's <mask> is 50264,
BERT's [CLS] [SEP] [PAD] [UNK] [MASK] are 101 102 0 100 103).

``<mask>`` is a SentencePiece *user-defined* symbol: a literal ``<mask>`` in text encodes
to the mask id (as in RoBERTa's tokenizer), which fill-mask demos rely on. BOS and EOS are
control symbols, never produced from text; the packer adds them.

A tokenizer file may be local or in a bucket (``gs://``): it is read and written as bytes
through `maelm_jax.infra.paths`, never by the libraries' own file access.
"""

import dataclasses
import io
import os
import random
import re
from collections.abc import Iterable, Iterator, Sequence

import sentencepiece as spm
from absl import logging

from maelm_jax.infra import errors, paths


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """The ids of a tokenizer's special tokens. BOS opens and EOS closes every packed
    sequence (RoBERTa's <s> </s>, BERT's [CLS] [SEP]); PAD fills; MASK is the [MASK] the
    maskers insert; UNK is never inserted, only excluded from random replacements."""

    pad: int
    bos: int
    eos: int
    unk: int
    mask: int

    @property
    def ids(self) -> tuple[int, ...]:
        """The distinct special ids, ascending."""
        return tuple(sorted({self.pad, self.bos, self.eos, self.unk, self.mask}))

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# The ids a SentencePiece model of ours has (train_tokenizer puts them there, load_tokenizer
# checks them); SPECIAL_TOKENS[i] is the piece of id i.
SENTENCEPIECE_IDS = SpecialIds(pad=0, bos=1, eos=2, unk=3, mask=4)
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<mask>")
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
_WORD_MARK = "▁"  # SentencePiece's mark of a space before a piece


class TokenizerError(errors.UserError):
    """A tokenizer file or training setting that cannot be used (one-line message)."""


class Tokenizer:
    """A loaded SentencePiece model with the special ids above (see ``load_tokenizer``).

    The interface every tokenizer kind has (HfTokenizer too): `kind`,
    `model_path`, `special`, `vocab_size`, `encode`, `decode`, `encode_with_offsets`,
    `id_to_piece`, `token_to_id`, `is_word_start`."""

    kind = "sentencepiece"
    special = SENTENCEPIECE_IDS

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
        """The piece string of one id (``"<mask>"`` for the mask id)."""
        return self._sp.id_to_piece(int(token_id))

    def token_to_id(self, piece: str) -> int | None:
        """The id of one piece, or None if the vocabulary lacks it."""
        token_id = self._sp.piece_to_id(piece)
        return token_id if self._sp.id_to_piece(token_id) == piece else None

    def is_word_start(self, token_id: int) -> bool:
        """Whether the piece starts a word with text of its own ("▁os", not "▁" or "os")."""
        piece = self._sp.id_to_piece(int(token_id))
        return (token_id not in self.special.ids and piece.startswith(_WORD_MARK)
                and len(piece) > 1)

    def __repr__(self) -> str:
        return f"Tokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str, field: str = "tokenizer model") -> Tokenizer:
    """Loads a tokenizer file: a Hugging Face ``tokenizer.json`` (a name ending in
    ``.json``; see HfTokenizer), else a SentencePiece ``.model``, whose special tokens
    must have the ids above. `field` names the setting the path came from in errors."""
    file = paths.Path(path)
    if not file.is_file():
        raise TokenizerError(f"{field} {path!r} does not exist")
    return from_bytes(file.read_bytes(), str(path), field)


def from_bytes(data: bytes, path: str, field: str = "tokenizer model") -> Tokenizer:
    """The tokenizer whose file `path` holds `data` (its name decides the kind, as for
    load_tokenizer): how a worker that was sent the file's bytes rebuilds it."""
    if path.endswith(".json"):
        return _load_hf(data, path, field)
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(data)
    except RuntimeError:
        raise TokenizerError(f"{field} {path!r} is not a SentencePiece model (it does not "
                             "parse as one) nor a Hugging Face tokenizer.json") from None
    for token_id, piece in enumerate(SPECIAL_TOKENS):
        actual_id = processor.piece_to_id(piece)
        # piece_to_id returns the unk id for a missing piece, hence the reverse check.
        if actual_id != token_id or processor.id_to_piece(token_id) != piece:
            found = "is missing" if processor.id_to_piece(actual_id) != piece else (
                f"has id {actual_id}")
            raise TokenizerError(f"{field} {path!r}: special token {piece!r} {found}; "
                                 f"expected id {token_id} (train it with train_tokenizer)")
    return Tokenizer(processor, path)


# A Hugging Face tokenizer's special tokens are found by name: RoBERTa's (and GPT-2-style
# BPE's) and BERT's WordPiece names, the two layouts published encoders use.
_HF_NAMES = {
    "pad": ("<pad>", "[PAD]"),
    "bos": ("<s>", "[CLS]"),
    "eos": ("</s>", "[SEP]"),
    "unk": ("<unk>", "[UNK]"),
    "mask": ("<mask>", "[MASK]"),
}


class HfTokenizer:
    """A Hugging Face ``tokenizer.json`` (the `tokenizers` library) with the Tokenizer
    interface; its special ids are read from its vocabulary (`_HF_NAMES`)."""

    kind = "huggingface"

    def __init__(self, tokenizer, model_path: str, special: SpecialIds):
        self._tok = tokenizer
        self.model_path = model_path
        self.special = special

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (RoBERTa's 50,265)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
        """Token ids of each text, no special tokens added (the packer adds BOS/EOS); the
        library encodes a batch on every core (num_threads is SentencePiece's knob)."""
        del num_threads
        if isinstance(texts, str):
            raise TypeError("Tokenizer.encode takes a sequence of texts, not one string")
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | Sequence[Sequence[int]]) -> str | list[str]:
        """Text of one id sequence, or a list of texts for a batch (special tokens kept,
        as SentencePiece keeps <mask>)."""
        ids = _as_int_lists(ids)
        if ids and not isinstance(ids[0], int):
            return self._tok.decode_batch(ids, skip_special_tokens=False)
        return self._tok.decode(ids, skip_special_tokens=False)

    def encode_with_offsets(self, texts: Sequence[str]) -> list[dict]:
        """Per text {"ids": [...], "offsets": [(start, end), ...]}: each token's character
        span in the original text."""
        return [{"ids": e.ids, "offsets": e.offsets}
                for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def id_to_piece(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, piece: str) -> int | None:
        return self._tok.token_to_id(piece)

    def is_word_start(self, token_id: int) -> bool:
        """Whether the token starts a word: byte-level BPE's "Ġword" (a space before it),
        WordPiece's tokens but "##" continuations."""
        if token_id in self.special.ids:
            return False
        piece = self._tok.id_to_token(int(token_id))
        if type(self._tok.model).__name__ == "WordPiece":
            return not piece.startswith(self._tok.model.continuing_subword_prefix)
        return piece.startswith("Ġ") and len(piece) > 1

    def __repr__(self) -> str:
        return f"HfTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def _load_hf(data: bytes, path: str, field: str) -> HfTokenizer:
    import tokenizers  # the SentencePiece path never needs it

    try:
        tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # the library raises plain Exception; bad UTF-8 a ValueError
        raise TokenizerError(f"{field} {path!r} is not a Hugging Face tokenizer.json "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                             ) from None
    found = {}
    for role, names in _HF_NAMES.items():
        ids = [tok.token_to_id(n) for n in names]
        present = [(n, i) for n, i in zip(names, ids, strict=True) if i is not None]
        if not present:
            raise TokenizerError(f"{field} {path!r} has no {role} token (expected one of "
                                 f"{' '.join(names)})")
        found[role] = present[0][1]
    special = SpecialIds(**found)
    if len(special.ids) != 5:
        raise TokenizerError(f"{field} {path!r}: two special tokens share an id "
                             f"({special.to_json()})")
    return HfTokenizer(tok, path, special)


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
    ids = SENTENCEPIECE_IDS
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=writer,
        vocab_size=vocab_size,
        model_type=model_type,
        normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
        pad_id=ids.pad, pad_piece=SPECIAL_TOKENS[ids.pad],
        bos_id=ids.bos, bos_piece=SPECIAL_TOKENS[ids.bos],
        eos_id=ids.eos, eos_piece=SPECIAL_TOKENS[ids.eos],
        unk_id=ids.unk, unk_piece=SPECIAL_TOKENS[ids.unk],
        # The first free id after 0..3, so <mask> lands on ids.mask (load_tokenizer checks).
        user_defined_symbols=[SPECIAL_TOKENS[ids.mask]],
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

