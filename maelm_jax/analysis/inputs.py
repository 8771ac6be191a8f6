"""Held-out sequences for the rank analysis, masked on the host, in fixed-shape batches.

Which text (config.source) is described in maelm_jax/analysis/config.py. Masking follows
Section 2.2 of the MAE-LM paper ("15 % random masks ... same as the pretraining setting"):
in each sequence round(mask_ratio x its real tokens) positions, uniformly among its real
(non-padding) positions, special tokens included as in pretraining, become [MASK]; there is
no 80-10-10. The rows of H are the first num_tokens real tokens in reading order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import ml_collections
import numpy as np

from maelm_jax import runs
from maelm_jax.analysis import config as rank_config
from maelm_jax.data import packing, sources
from maelm_jax.finetune import tasks
from maelm_jax.finetune.tasks import glue, squad
from maelm_jax.infra import paths
from maelm_jax.text import masking
from maelm_jax.text import tokenizer as tokenizer_lib

_ENCODE_CHUNK = 256  # documents per tokenizer call


def corpus_blocks(source: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
                  seq_len: int, num_tokens: int) -> np.ndarray:
    """The source's documents packed into [N, seq_len] blocks as pretraining packs them,
    read until the blocks hold num_tokens tokens (or the source ends)."""
    packer, blocks = packing.BlockPacker(seq_len, tok.special), []
    chunk: list[str] = []

    def flush():
        for ids in tok.encode(chunk):
            blocks.extend(packer.add(ids))
        chunk.clear()

    for document in sources.iter_documents(source):
        chunk.append(document)
        if len(chunk) == _ENCODE_CHUNK:
            flush()
            if len(blocks) * seq_len >= num_tokens:
                break
    if chunk:
        flush()
    return np.asarray(blocks, np.int32).reshape(-1, seq_len)


def glue_dev(task_name: str, split: str, tok: tokenizer_lib.Tokenizer, seq_len: int,
             **read_args) -> list[np.ndarray]:
    """A GLUE split encoded as fine-tuning encodes it (<s> A </s></s> B </s>)."""
    try:
        task = glue.examples.get_task(task_name)
    except glue.examples.GlueDataError:
        raise rank_config.RankConfigError(
            f"config.source.task: expected a GLUE task "
            f"({', '.join(glue.examples.TASK_NAMES)}), got "
            f"{task_name!r}") from None
    return glue.task.split_sequences(task, split, tok, seq_len, **read_args)


def squad_dev(examples: Sequence[squad.examples.SquadExample], tok: tokenizer_lib.Tokenizer,
              seq_len: int, doc_stride: int = 0, max_query_len: int = 0) -> list[np.ndarray]:
    """SQuAD questions with their context windows, as fine-tuning reads them (by default
    with fine-tuning's stride 128 and questions of up to 64 tokens, less for short
    sequences)."""
    doc_stride = doc_stride or min(128, seq_len // 2)
    max_query_len = max_query_len or min(64, seq_len // 4)
    features = squad.examples.make_features(examples, tok, seq_len, doc_stride, max_query_len,
                                   training=False)
    return features.sequences


def finetune_dev(run_cfg: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
                 seq_len: int) -> list[np.ndarray]:
    """A fine-tuning run's own dev set, read as its config says (by its task's kind)."""
    return tasks.kind_for(run_cfg.task).dev_sequences(run_cfg, tok, seq_len)


def sequences(config: ml_collections.ConfigDict, workdir: paths.Path,
              run_cfg: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
              seq_len: int, num_tokens: int) -> Iterable[np.ndarray]:
    """The held-out sequences config.source names, for one run (each at most seq_len)."""
    source = config.source
    kind = source.kind
    if kind == "validation" and run_cfg.get("mode") == "finetune":
        return finetune_dev(run_cfg, tok, seq_len)
    if kind == "validation":
        length, blocks = runs.validation_blocks(workdir, run_cfg, tok)
        if length != seq_len:
            raise rank_config.RankConfigError(
                f"config.seq_len: the validation blocks of {workdir} have length {length}; "
                f"set 0 (or {length}), or read a corpus (config.source)")
        return blocks
    if kind in rank_config.CORPUS_KINDS:
        return corpus_blocks(source, tok, seq_len, num_tokens)
    if kind == "glue":
        return glue_dev(source.task, source.get("split", ""), tok, seq_len, source="files",
                        data_dir=source.data_dir)
    return squad_dev(squad.examples.read_squad_json(source.path), tok, seq_len)


def make_batches(rows: Iterable[np.ndarray], seq_len: int, batch_size: int, num_tokens: int,
                 mask_ratio: float, seed: int, *, special: tokenizer_lib.SpecialIds
                 ) -> tuple[list[dict], int, int]:
    """Masked and original batches holding the first num_tokens real tokens of `rows`
    (`special`: the tokenizer's ids, its PAD and MASK).

    Returns (batches, tokens counted, [MASK] tokens counted). Every batch is [batch_size,
    seq_len] (rows padded with PAD, the last batch filled with padding rows), so the
    step compiles once. See rank.make_gram_step for the arrays.
    """
    pad = special.pad
    rng = np.random.default_rng(seed)
    arrays: dict[str, list[np.ndarray]] = {"original": [], "masked": [], "counted": [],
                                           "is_mask": []}
    total = 0
    for row in rows:
        if total >= num_tokens:
            break
        row = np.asarray(row, np.int32)[:seq_len]
        real = np.flatnonzero(row != pad)
        if not len(real):
            continue
        original = np.full(seq_len, pad, np.int32)
        original[: len(row)] = row
        chosen = np.zeros(seq_len, bool)
        picked = rng.choice(real, masking.round_half_up(mask_ratio * len(real)), replace=False)
        chosen[picked] = True
        counted = np.zeros(seq_len, np.float32)
        counted[real[: num_tokens - total]] = 1.0
        total += int(counted.sum())
        arrays["original"].append(original)
        arrays["masked"].append(np.where(chosen, np.int32(special.mask), original))
        arrays["counted"].append(counted)
        arrays["is_mask"].append(counted * chosen)
    fill = (-len(arrays["original"])) % batch_size
    for name, values in arrays.items():  # padding rows: nothing counted
        values += [np.full(seq_len, pad, np.int32) if name in ("original", "masked")
                   else np.zeros(seq_len, np.float32)] * fill
    batches = [{name: np.stack(values[start:start + batch_size])
                for name, values in arrays.items()}
               for start in range(0, len(arrays["original"]), batch_size)]
    mask_total = int(sum(b["is_mask"].sum() for b in batches))
    return batches, total, mask_total
