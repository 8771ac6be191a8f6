"""SQuAD: reading the official JSON or TFDS, and windowed features.

A feature is ``<s> question </s></s> context window </s>``. Contexts longer than what
is left after the question are split into windows that start ``doc_stride`` tokens apart
(BERT's scheme); every context token keeps its character span in the original context
(sentencepiece's offset mapping), so a predicted token span maps back to exact text.
Training targets are the answer's first and last token in a window that holds all of
it, else position 0 (``<s>``): "no answer in this window" (SQuAD 2.0's null answer).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np
from absl import logging

from maelm_jax.infra import errors, paths
from maelm_jax.text import tokenizer as tokenizer_lib


class SquadDataError(errors.UserError):
    """A SQuAD file or setting that cannot be used (one-line message)."""


@dataclasses.dataclass
class SquadExample:
    qid: str
    question: str
    context: str
    answers: list[str]  # gold answer texts; [] = unanswerable
    answer_starts: list[int]  # their character offsets in context


def read_squad_json(path: str) -> list[SquadExample]:
    """The official format: {"data": [{"paragraphs": [{"context", "qas": [...]}]}]}."""
    if not paths.Path(path).is_file():
        raise SquadDataError(f"config.squad: SQuAD file {path} does not exist")
    try:
        articles = json.loads(paths.read_text(paths.Path(path)))["data"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise SquadDataError(f"config.squad: {path} is not a SQuAD JSON file ({e})") from None
    examples = []
    for article in articles:
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            for qa in paragraph["qas"]:
                answers = [] if qa.get("is_impossible") else qa["answers"]
                examples.append(SquadExample(
                    str(qa["id"]), qa["question"], context, [a["text"] for a in answers],
                    [int(a["answer_start"]) for a in answers]))
    if not examples:
        raise SquadDataError(f"config.squad: {path} holds no questions")
    return examples


def tfds_name(version: str, configured: str = "") -> str:
    return configured or f"squad/v{version}"


def read_squad_tfds(name: str, split: str, data_dir: str = "") -> list[SquadExample]:
    """A prepared TFDS SQuAD (``squad/v2.0`` or ``squad/v1.1``, ArrayRecord)."""
    import tensorflow_datasets as tfds  # heavy import: only TFDS users pay for it

    try:
        records = tfds.data_source(name, split=split, data_dir=data_dir or None)
    except Exception as e:  # tfds raises many types; the first line says what was wrong
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SquadDataError(f"config.data.tfds_name: TFDS dataset {name!r} split {split!r}: "
                             f"{message}") from None
    examples = []
    for r in records.__getitems__(list(range(len(records)))):
        impossible = bool(r.get("is_impossible", False))
        texts = [] if impossible else [_text(t) for t in r["answers"]["text"]]
        starts = [] if impossible else [int(s) for s in r["answers"]["answer_start"]]
        examples.append(SquadExample(_text(r["id"]), _text(r["question"]), _text(r["context"]),
                                     texts, starts))
    return examples


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def gold_answers(examples: Sequence[SquadExample]) -> dict[str, list[str]]:
    """qid -> gold texts, the evaluation's input."""
    return {e.qid: list(e.answers) for e in examples}


@dataclasses.dataclass
class SquadFeatures:
    """F windows over E examples. Context token t of example e spans characters
    offsets[e][t] = (begin, end) of its context."""

    sequences: list[np.ndarray]  # [F] of [n_f] int32
    example_index: np.ndarray  # [F] int
    context_start: np.ndarray  # [F] sequence position of the window's first context token
    window_start: np.ndarray  # [F] the window's first context token (index into offsets[e])
    window_len: np.ndarray  # [F] context tokens in the window
    max_context: list[np.ndarray]  # [F] of [window_len] bool: this window is the token's best
    offsets: list[np.ndarray]  # [E] of [T_e, 2] int character spans
    start_positions: np.ndarray  # [F] int32 training targets (0 = <s> = no answer here)
    end_positions: np.ndarray  # [F] int32

    def __len__(self) -> int:
        return len(self.sequences)


def windows(num_tokens: int, max_len: int, stride: int) -> list[tuple[int, int]]:
    """(start, length) of the context windows: at most max_len tokens, starts stride apart."""
    spans, start = [], 0
    while True:
        length = min(num_tokens - start, max_len)
        spans.append((start, length))
        if start + length >= num_tokens:
            return spans
        start += min(length, stride)


def max_context_masks(spans: Sequence[tuple[int, int]], num_tokens: int) -> list[np.ndarray]:
    """For each window, whether it gives each of its tokens the most context (BERT's
    score: min(left, right context) + 0.01 * window length; the first window wins ties)."""
    best = np.full(num_tokens, -np.inf)
    owner = np.full(num_tokens, -1)
    for k, (start, length) in enumerate(spans):
        pos = np.arange(start, start + length)
        score = np.minimum(pos - start, start + length - 1 - pos) + 0.01 * length
        better = score > best[pos]
        best[pos[better]] = score[better]
        owner[pos[better]] = k
    return [owner[start:start + length] == k for k, (start, length) in enumerate(spans)]


def answer_token_span(offsets: np.ndarray, char_start: int,
                      char_end: int) -> tuple[int, int] | None:
    """First and last context token covering characters [char_start, char_end)."""
    if len(offsets) == 0:
        return None
    covering_start = np.nonzero(offsets[:, 1] > char_start)[0]
    covering_end = np.nonzero(offsets[:, 0] < char_end)[0]
    if len(covering_start) == 0 or len(covering_end) == 0:
        return None
    first, last = int(covering_start[0]), int(covering_end[-1])
    # Byte-fallback pieces of one character: all but the last have empty spans; start at
    # the first of them.
    while first > 0 and offsets[first - 1, 1] == offsets[first - 1, 0] == offsets[first, 0]:
        first -= 1
    return (first, last) if first <= last else None


def _encode_contexts(tok: tokenizer_lib.Tokenizer,
                     contexts: Sequence[str]) -> dict[str, tuple]:
    """Unique context -> (ids [T] int32, offsets [T, 2]) from sentencepiece's offset mapping
    (character offsets into the original text, whatever the normaliser did)."""
    unique = list(dict.fromkeys(contexts))
    encoded = tok.encode_with_offsets(unique)
    return {c: (np.asarray(e["ids"], np.int32), np.asarray(e["offsets"], np.int64).reshape(-1, 2))
            for c, e in zip(unique, encoded, strict=False)}


def make_features(examples: Sequence[SquadExample], tok: tokenizer_lib.Tokenizer,
                  max_seq_len: int, doc_stride: int, max_query_len: int,
                  training: bool) -> SquadFeatures:
    """Windows of every example; training drops answers that do not match their context."""
    if max_seq_len < max_query_len + 4 + 8:
        raise SquadDataError(f"config.data.max_seq_len={max_seq_len} leaves too little context "
                             f"after squad.max_query_len={max_query_len}; raise it")
    questions = tok.encode([e.question for e in examples])
    contexts = _encode_contexts(tok, [e.context for e in examples])
    out = SquadFeatures([], [], [], [], [], [], [], [], [])
    misaligned = 0
    for e_index, (example, q_ids) in enumerate(zip(examples, questions, strict=False)):
        ids, offsets = contexts[example.context]
        out.offsets.append(offsets)
        span = None
        if training and example.answers:
            start = example.answer_starts[0]
            end = start + len(example.answers[0])
            if " ".join(example.context[start:end].split()) != " ".join(
                    example.answers[0].split()):
                misaligned += 1  # the text is not at answer_start: skip, as BERT does
                continue
            span = answer_token_span(offsets, start, end)
        q_ids = q_ids[:max_query_len]
        context_start = len(q_ids) + 3
        spans = windows(len(ids), max_seq_len - len(q_ids) - 4, doc_stride)
        is_max_context = max_context_masks(spans, len(ids))
        bos, eos = tok.special.bos, tok.special.eos
        for (w_start, w_len), is_max in zip(spans, is_max_context, strict=True):
            out.sequences.append(np.asarray(
                [bos, *q_ids, eos, eos, *ids[w_start:w_start + w_len], eos], np.int32))
            out.example_index.append(e_index)
            out.context_start.append(context_start)
            out.window_start.append(w_start)
            out.window_len.append(w_len)
            out.max_context.append(is_max)
            inside = span is not None and w_start <= span[0] and span[1] < w_start + w_len
            out.start_positions.append(context_start + span[0] - w_start if inside else 0)
            out.end_positions.append(context_start + span[1] - w_start if inside else 0)
    if misaligned:
        logging.warning("SQuAD: skipped %d training question(s) whose answer text is not at "
                        "its answer_start", misaligned)
    for name in ("example_index", "context_start", "window_start", "window_len"):
        setattr(out, name, np.asarray(getattr(out, name), np.int64))
    out.start_positions = np.asarray(out.start_positions, np.int32)
    out.end_positions = np.asarray(out.end_positions, np.int32)
    return out
