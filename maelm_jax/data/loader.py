"""Deterministic, resumable, per-process batches over the prepared blocks (grain).

The batch for a step is a pure function of (seed, step): each source is shuffled anew
every epoch and repeated forever, the sources are mixed by weight, and the global batch of
step s is blocks [s * B, (s + 1) * B) of that stream. Each process reads only its own rows
of it, so the global batch is the same whatever the number of processes, and resuming
means starting at step s: the data position saved in a checkpoint is the step itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np

from maelm_jax.data import packing


def _mixed_stream(
    blocks: dict[str, np.ndarray], weights: dict[str, float], seed: int
) -> grain.MapDataset:
    streams, mix_weights = [], []
    for i, name in enumerate(sorted(blocks)):
        if len(blocks[name]) == 0:
            continue
        streams.append(grain.MapDataset.source(blocks[name]).shuffle(seed=seed + i).repeat())
        mix_weights.append(weights[name])
    if len(streams) == 1:
        return streams[0]
    return grain.MapDataset.mix(streams, mix_weights)


def train_batches(
    data: packing.PreparedData,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    row_start: int = 0,
    row_count: int | None = None,
    prefetch: int = 2,
) -> Iterator[np.ndarray]:
    """Yields rows [row_start, row_start + row_count) of the global [batch_size, L] batch of
    steps start_step, start_step + 1, ... forever, as int32.

    A process reads only the rows its devices hold (see sharding.process_rows); the rows
    of step s are blocks s * batch_size + row_start + j of the mixed stream, so every
    process count and mesh sees the same global batch in the same order.
    """
    row_count = batch_size if row_count is None else row_count
    if batch_size % row_count or row_start % row_count:
        raise ValueError(
            f"rows [{row_start}, {row_start + row_count}) do not tile a batch of {batch_size}"
        )
    stream = _mixed_stream(data.train, data.weights, seed)
    per_step = batch_size // row_count
    batches = stream.batch(row_count)[row_start // row_count :: per_step][start_step:]
    batches = batches.map(lambda b: np.asarray(b, dtype=np.int32))
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=max(prefetch, 1))
    return iter(batches.to_iter_dataset(options))


def eval_batches(data: packing.PreparedData, batch_size: int, num_batches: int) -> list[np.ndarray]:
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


def unigram_baseline(data: packing.PreparedData, vocab_size: int,
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
