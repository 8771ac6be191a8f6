"""Deterministic, resumable, per-process batches over the prepared blocks (grain).

The batch for a step is a pure function of (seed, step): each source is shuffled anew
every epoch and repeated forever, the sources are mixed by weight, and the global batch of
step s is blocks [s * B, (s + 1) * B) of that stream. Each process reads only its own rows
of it, so the global batch is the same whatever the number of processes, and resuming
means starting at step s: the data position saved in a checkpoint is the step itself.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import grain
import numpy as np

from maelm_jax.data import shards


def _mixed_indices(blocks: dict[str, np.ndarray], weights: dict[str, float],
                   seed: int) -> grain.MapDataset:
    """The stream of (source number, block index) pairs: each source shuffled anew every
    epoch and repeated forever, the sources mixed by weight. Indices, not blocks: a step's
    rows are then read with one request per source (a prepared set in a bucket answers a
    step's ranged reads at once)."""
    streams, mix_weights = [], []
    for i, name in enumerate(sorted(blocks)):
        if len(blocks[name]) == 0:
            continue
        indices = grain.MapDataset.range(len(blocks[name])).shuffle(seed=seed + i).repeat()
        streams.append(indices.map(functools.partial(lambda i, j: (i, j), i)))
        mix_weights.append(weights[name])
    if len(streams) == 1:
        return streams[0]
    return grain.MapDataset.mix(streams, mix_weights)


def train_batches(
    data: shards.PreparedData,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    spans: Sequence[tuple[int, int]] | None = None,
    prefetch: int = 2,
) -> Iterator[np.ndarray]:
    """Yields this process's rows of the global [batch_size, L] batch of steps
    start_step, start_step + 1, ... forever, as int32: the rows of `spans` (default: the
    whole batch), in order.

    A process reads only the rows its devices hold (sharding.process_spans; on a TPU
    mesh they need not be contiguous); row r of step s is block s * batch_size + r of the
    mixed stream, so every process count and mesh sees the same global batch in the same
    order, and resuming at step s is exact.
    """
    rows = span_rows(spans, batch_size)
    names = sorted(data.train)
    stream = _mixed_indices(data.train, data.weights, seed)

    def read(step: int) -> np.ndarray:
        picks = [stream[step * batch_size + int(r)] for r in rows]
        out = np.empty((len(rows), data.seq_len), np.int32)
        for number in {i for i, _ in picks}:
            where = [k for k, (i, _) in enumerate(picks) if i == number]
            out[where] = data.train[names[number]][[picks[k][1] for k in where]]
        return out

    steps = grain.MapDataset.range(start_step, _NO_END).map(read)
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=max(prefetch, 1))
    return iter(steps.to_iter_dataset(options))


# Steps are numbered without end: the loop stops the stream, not the data.
_NO_END = 2**62


def span_rows(spans: Sequence[tuple[int, int]] | None, batch_size: int) -> np.ndarray:
    """The row indices of `spans` (all rows when None), checked to lie in the batch."""
    if spans is None:
        return np.arange(batch_size)
    rows = np.concatenate([np.arange(a, b) for a, b in spans]) if spans else np.zeros(0, int)
    if len(rows) == 0 or rows.min() < 0 or rows.max() >= batch_size or \
            len(np.unique(rows)) != len(rows):
        raise ValueError(f"rows {list(spans)} are not distinct rows of a batch of {batch_size}")
    return rows


def eval_batches(data: shards.PreparedData, batch_size: int, num_batches: int) -> list[np.ndarray]:
    """The first num_batches full [batch_size, L] batches of the validation split, in
    fixed order (all sources concatenated), so successive evals are comparable. Only those
    blocks are read (the split of a large corpus is gigabytes)."""
    wanted, parts = num_batches * batch_size, []
    for name in sorted(data.valid):
        take = min(wanted - sum(len(p) for p in parts), len(data.valid[name]))
        if take > 0:
            parts.append(np.asarray(data.valid[name][:take]))
    blocks = (np.concatenate(parts, axis=0) if parts
              else np.zeros((0, data.seq_len), np.int32))
    count = min(num_batches, len(blocks) // batch_size)
    if count == 0:
        # Fewer validation blocks than one batch: use them all as a single smaller batch.
        return [blocks.astype(np.int32)] if len(blocks) else []
    return [blocks[i * batch_size : (i + 1) * batch_size].astype(np.int32) for i in range(count)]


def unigram_baseline(data: shards.PreparedData, vocab_size: int,
                     max_tokens: int = 10_000_000) -> tuple[int, float]:
    """(the most frequent piece of the training blocks, its share of their tokens).

    The share is the accuracy of always predicting that piece: the unigram plateau a model
    sits on before it uses context. Sources count by their mixing weights, as training
    sees them. A source larger than ``max_tokens`` is counted on evenly spaced blocks
    (deterministic), which keeps this a fraction of a second on any corpus.
    """
    mixed = np.zeros(vocab_size, np.float64)
    total_weight = sum(data.weights[n] for n in data.train if len(data.train[n]))
    for name, blocks in sorted(data.train.items()):
        if len(blocks) == 0:
            continue
        stride = max(1, -(-len(blocks) * blocks.shape[1] // max_tokens))
        counts = np.bincount(np.asarray(blocks[::stride]).reshape(-1), minlength=vocab_size)
        mixed += data.weights[name] / total_weight * counts[:vocab_size] / counts.sum()
    if not mixed.any():
        return 0, 0.0
    top = int(np.argmax(mixed))
    return top, float(mixed[top])
