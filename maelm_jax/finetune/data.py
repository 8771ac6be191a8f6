"""RoBERTa-style encoding and static-shape batches.

A single text is ``<s> A </s>``, a pair ``<s> A </s></s> B </s>``; pairs that do not fit
are truncated longest-first (one token at a time from the longer text). Batches always
hold ``batch_size`` rows (the last one is filled with weight-0 rows) and are padded to
the smallest of a few bucket lengths that fits their longest sequence, so XLA compiles
one step per bucket, not one per batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from maelm_jax.infra import errors
from maelm_jax.text import tokenizer as tokenizer_lib

# The id at a batch's padded positions: key_mask masks them out of attention and nothing
# reads their outputs, so any id does; the tokenizer's PAD is not needed (nor assumed) here.
PAD = 0


class FinetuneDataError(errors.UserError):
    """Data that cannot be encoded with the given settings (one-line message)."""


def truncate_longest_first(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths after removing tokens one at a time from the longer text (B on ties)."""
    excess = len_a + len_b - budget
    if excess <= 0:
        return len_a, len_b
    # Take from the longer until both are equal, then alternate (B first on ties).
    gap = abs(len_a - len_b)
    first = min(gap, excess)
    if len_a > len_b:
        len_a -= first
    else:
        len_b -= first
    rest = excess - first
    len_b -= (rest + 1) // 2
    len_a -= rest // 2
    if len_a < 0 or len_b < 0:
        raise FinetuneDataError(f"cannot fit a pair into {budget} text tokens")
    return len_a, len_b


def encode_single(a: Sequence[int], max_len: int,
                  special: tokenizer_lib.SpecialIds) -> np.ndarray:
    """``<s> A </s>`` (the tokenizer's BOS and EOS), A cut to max_len - 2 tokens. Returns
    [n] int32."""
    a = list(a)[: max_len - 2]
    return np.asarray([special.bos, *a, special.eos], np.int32)


def encode_pair(a: Sequence[int], b: Sequence[int], max_len: int,
                special: tokenizer_lib.SpecialIds) -> np.ndarray:
    """``<s> A </s></s> B </s>`` (RoBERTa's pair layout, in the tokenizer's BOS and EOS)
    with longest-first truncation to max_len. Returns [n] int32."""
    len_a, len_b = truncate_longest_first(len(a), len(b), max_len - 4)
    bos, eos = special.bos, special.eos
    return np.asarray([bos, *a[:len_a], eos, eos, *b[:len_b], eos], np.int32)


def encode_texts(tok: tokenizer_lib.Tokenizer, texts: Sequence[Sequence[str]],
                 max_len: int) -> list[np.ndarray]:
    """texts: one list per column ([A] or [A, B], each [N] strings) -> N id sequences."""
    if max_len < 8:
        raise FinetuneDataError(f"config.data.max_seq_len: expected at least 8, got {max_len}")
    columns = [tok.encode(list(column)) for column in texts]
    if len(columns) == 1:
        return [encode_single(a, max_len, tok.special) for a in columns[0]]
    return [encode_pair(a, b, max_len, tok.special) for a, b in zip(*columns, strict=False)]


def buckets_for(max_len: int, buckets: Sequence[int]) -> tuple[int, ...]:
    """The bucket lengths below max_len, and max_len itself as the last one."""
    return tuple(sorted({b for b in buckets if b < max_len} | {max_len}))


def one_bucket(buckets: Sequence[int], longest: int) -> tuple[int, ...]:
    """`buckets` from the smallest that holds `longest` tokens on: batches of texts up to
    `longest` all take that one."""
    first = bucket_length(longest, buckets)
    return tuple(b for b in buckets if b >= first)


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if length <= b:
            return b
    raise FinetuneDataError(f"a sequence of {length} tokens is longer than the last bucket "
                            f"{buckets[-1]}")


@dataclasses.dataclass
class Batch:
    """A padded batch. B = batch size, n = its bucket length."""

    tokens: np.ndarray  # [B, n] int32, PAD after each sequence
    key_mask: np.ndarray  # [B, n] bool, True at real tokens
    weights: np.ndarray  # [B] float32, 0 for filler rows of the last batch
    rows: np.ndarray  # [B] int64, the example (or feature) index; -1 for filler rows
    targets: dict  # name -> [B, ...] array (labels, start / end positions)

    def arrays(self) -> dict:
        return {"tokens": self.tokens, "key_mask": self.key_mask, "weights": self.weights,
                **self.targets}

    def padded(self, n: int) -> Batch:
        """The batch padded to length n >= its own (PAD tokens, masked out); the targets
        index real tokens, which padding after them leaves where they are."""
        extra = n - self.tokens.shape[1]
        if extra < 0:
            raise ValueError(f"cannot pad a batch of length {self.tokens.shape[1]} to {n}")
        return dataclasses.replace(
            self, tokens=np.pad(self.tokens, ((0, 0), (0, extra)), constant_values=PAD),
            key_mask=np.pad(self.key_mask, ((0, 0), (0, extra))))


def make_batch(sequences: Sequence[np.ndarray], rows: np.ndarray, batch_size: int,
               buckets: Sequence[int], targets: dict) -> Batch:
    """Pads len(rows) <= batch_size sequences (those at `rows`) into one Batch.

    targets: name -> [N_total, ...] arrays, gathered at `rows`; filler rows get zeros.
    """
    count = len(rows)
    n = bucket_length(max(len(sequences[r]) for r in rows), buckets)
    tokens = np.full((batch_size, n), PAD, np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(sequences[r])] = sequences[r]
    key_mask = np.zeros((batch_size, n), bool)
    lengths = np.asarray([len(sequences[r]) for r in rows])
    key_mask[:count] = np.arange(n)[None, :] < lengths[:, None]
    weights = np.zeros((batch_size,), np.float32)
    weights[:count] = 1.0
    padded_rows = np.full((batch_size,), -1, np.int64)
    padded_rows[:count] = rows
    gathered = {}
    for name, values in targets.items():
        out = np.zeros((batch_size,) + values.shape[1:], values.dtype)
        out[:count] = values[rows]
        gathered[name] = out
    return Batch(tokens, key_mask, weights, padded_rows, gathered)


def train_batches(sequences: Sequence[np.ndarray], targets: dict, batch_size: int,
                  buckets: Sequence[int], rng: np.random.Generator) -> Iterator[Batch]:
    """One epoch in a random order; every batch has batch_size rows."""
    order = rng.permutation(len(sequences))
    for start in range(0, len(order), batch_size):
        yield make_batch(sequences, order[start : start + batch_size], batch_size, buckets,
                         targets)


def eval_batches(sequences: Sequence[np.ndarray], targets: dict, batch_size: int,
                 buckets: Sequence[int]) -> Iterator[Batch]:
    """All examples once, shortest first (less padding); `Batch.rows` restores the order."""
    order = np.argsort([len(s) for s in sequences], kind="stable")
    for start in range(0, len(order), batch_size):
        yield make_batch(sequences, order[start : start + batch_size], batch_size, buckets,
                         targets)


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    return -(-num_examples // batch_size)


def scatter_rows(batches_out: Sequence[tuple[np.ndarray, np.ndarray]], total: int,
                 fill: float | None = None) -> np.ndarray:
    """Puts per-batch outputs back in example order.

    batches_out: (rows [B], values [B, ...]) pairs; rows of -1 (filler) are dropped.
    """
    first = batches_out[0][1]
    out = np.zeros((total,) + first.shape[1:], first.dtype)
    if fill is not None:
        out[...] = fill
    for rows, values in batches_out:
        keep = rows >= 0
        out[rows[keep]] = values[keep]
    return out
