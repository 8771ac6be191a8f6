"""Tiny Hugging Face tokenizers built with the `tokenizers` library itself, in the two
special-token layouts published encoders use (no network): RoBERTa's byte-level BPE
(<s> <pad> </s> <unk> at 0-3, <mask> the last id) and BERT's WordPiece ([PAD] at 0,
[UNK] [CLS] [SEP] [MASK] further on, as in bert-base's 0, 100, 101, 102, 103)."""

import pathlib
from collections.abc import Iterable

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

ROBERTA_SPECIAL = {"bos": 0, "pad": 1, "eos": 2, "unk": 3}  # and mask: the last id
BERT_SPECIAL = {"pad": 0, "unk": 3, "bos": 4, "eos": 5, "mask": 6}


def roberta_like(texts: Iterable[str], path: pathlib.Path, vocab_size: int = 600) -> pathlib.Path:
    """A byte-level BPE tokenizer.json laid out as roberta-base's, at `path`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, show_progress=False,
                                  special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    # RoBERTa's <mask> takes the space before it (lstrip), and is the last id.
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok.save(str(path))
    return path


def bert_like(texts: Iterable[str], path: pathlib.Path, vocab_size: int = 600) -> pathlib.Path:
    """A lowercasing WordPiece tokenizer.json with BERT's special tokens, at `path`."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, show_progress=False,
        special_tokens=["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.BertProcessing(("[SEP]", 5), ("[CLS]", 4))
    tok.save(str(path))
    return path
