"""The export's ``tokenizer.json``: a run's tokenizer as a Hugging Face fast tokenizer
(the `tokenizers` library), which transformers loads as a PreTrainedTokenizerFast with
offset mappings (what its question-answering and token-classification scripts need).

A Hugging Face tokenizer's own file is copied with one change: its post-processor adds
the special tokens as fine-tuning does (`_our_layout`; RoBERTa's is the same, BERT's pair
differs). A SentencePiece model of ours is
converted with the `tokenizers` library alone (exporting needs no transformers), as
transformers' SpmConverter does: the model's vocabulary and scores, for BPE the merges
read back from the vocabulary (a merge's rank is its result's score, which is the order
SentencePiece applies them in), byte fallback, the model's own normaliser (its
precompiled character map: NFKC, and case folding for a lowercasing model), and
SentencePiece's spaces as "▁". Two things differ from transformers' conversion, so the
ids are exactly the slow tokenizer's (tokenization_maelm.MaelmTokenizer): ``<mask>``
takes the spaces before it (RoBERTa's lstrip), as the slow tokenizer drops a lone "▁"
before ``<mask>``; and "▁" is prepended only to a text's first part, not to the text
after a ``<mask>`` (SentencePiece's one dummy prefix per text). One difference stays:
the literals ``<s>``, ``</s>`` and ``<pad>`` in a text are those special tokens to the
fast tokenizer (as to RoBERTa's), plain text to SentencePiece.
"""

from __future__ import annotations

import sentencepiece as spm

from maelm_jax.infra import paths
from maelm_jax.text import tokenizer as tokenizer_lib

_SPACE = "\u2581"  # SentencePiece's space
_BPE = 2  # TrainerSpec.model_type's BPE (1 is unigram)


def tokenizer_json(tok: tokenizer_lib.Tokenizer) -> bytes:
    """tokenizer.json of `tok`: a Hugging Face tokenizer's file, or the conversion of a
    SentencePiece model, whose post-processor adds ``<s> A </s>`` and
    ``<s> A </s></s> B </s>`` in `tok`'s ids as fine-tuning does (truncation and padding
    are the caller's, as transformers asks for them)."""
    data = paths.Path(tok.model_path).read_bytes()
    if tok.kind == "huggingface":
        from tokenizers import Tokenizer

        converted = Tokenizer.from_str(data.decode("utf-8"))
        converted.post_processor = _our_layout(tok.special, tok.id_to_piece)
    else:
        converted = from_sentencepiece(data, tok.special)
    return converted.to_str(pretty=True).encode("utf-8")


def _our_layout(special: tokenizer_lib.SpecialIds, piece):
    """The post-processor of fine-tuning's layout (finetune/data.py): ``<s> A </s>`` and
    ``<s> A </s></s> B </s>`` in the tokenizer's BOS and EOS (`piece`: id -> token)."""
    from tokenizers import processors

    bos, eos = piece(special.bos), piece(special.eos)
    return processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, special.bos), (eos, special.eos)])


def from_sentencepiece(model: bytes, special: tokenizer_lib.SpecialIds):
    """The `tokenizers.Tokenizer` of a serialized SentencePiece model of ours."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(model)
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    model_type, charsmap = _model_type_and_charsmap(model)
    unk = sp.id_to_piece(special.unk)
    if model_type == _BPE:
        ids = {piece: i for i, (piece, _) in enumerate(vocab)}
        tokenizer = Tokenizer(models.BPE(ids, _merges(vocab, ids), unk_token=unk, fuse_unk=True,
                                         byte_fallback=True))
    else:
        tokenizer = Tokenizer(models.Unigram(vocab, unk_id=special.unk, byte_fallback=True))
    steps = [normalizers.Precompiled(charsmap)] if charsmap else []
    # SentencePiece drops surrounding spaces and collapses runs of them.
    tokenizer.normalizer = normalizers.Sequence(
        [*steps, normalizers.Strip(left=False, right=True),
         normalizers.Replace(Regex(" {2,}"), " ")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE,
                                                       prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Metaspace(replacement=_SPACE,
                                                              prepend_scheme="first"),
                                           decoders.ByteFallback(), decoders.Fuse()])
    # Control symbols (<pad> <s> </s>) and <mask> are special; <mask> is matched in text.
    tokens = {role: sp.id_to_piece(getattr(special, role)) for role in ("pad", "bos", "eos")}
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t in tokens.values()])
    tokenizer.add_special_tokens([AddedToken(sp.id_to_piece(special.mask), lstrip=True,
                                             normalized=False, special=True)])
    tokenizer.post_processor = _our_layout(special, sp.id_to_piece)
    return tokenizer


def _merges(vocab: list[tuple[str, float]], ids: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges from a SentencePiece BPE vocabulary: every split of a piece into two
    pieces of the vocabulary, ranked by the merged piece's score (SentencePiece merges the
    highest-scoring pair first), ties by the halves' ids."""
    found = []
    for piece, score in vocab:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append((-score, ids[left], ids[right], left, right))
    return [(left, right) for *_, left, right in sorted(found)]


def _model_type_and_charsmap(model: bytes) -> tuple[int, bytes]:
    """(TrainerSpec.model_type, NormalizerSpec.precompiled_charsmap) of a serialized
    ModelProto, read from its protobuf wire format (sentencepiece's own generated module
    needs a newer protobuf runtime than the one pinned)."""
    fields = dict(_fields(model, keep=(2, 3)))
    trainer = dict(_fields(fields.get(2, b""), keep=(3,)))
    normalizer = dict(_fields(fields.get(3, b""), keep=(2,)))
    return int(trainer.get(3, 1)), bytes(normalizer.get(2, b""))


def _fields(data: bytes, keep: tuple[int, ...]):
    """(field number, value) of a protobuf message's fields in `keep`: a varint's int or
    a length-delimited field's bytes."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            size, i = _varint(data, i)
            value, i = data[i:i + size], i + size
        elif wire in (1, 5):
            value, i = None, i + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        if number in keep:
            yield number, value


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i
