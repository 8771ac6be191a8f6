"""Fill-mask: the pieces a pretrained model predicts for the ``<mask>`` marks of a text.

    python main.py --config=configs/fill_mask.py --workdir=runs/quickstart \
        --config.text="The <mask> module provides functions for working with files."

One ``<mask>`` (``[MASK]`` for a BERT tokenizer: the tokenizer's mask token) is one piece
(the tokenizer encodes the literal to its mask id). The model
is the pretraining run's whole network: for MAE-LM and 3ML the masked positions are left
out of the encoder and the decoder predicts them, exactly as in pretraining; for MLM the
encoder reads ``<mask>`` there. The workdir is only read. A pretraining run with
``train.fill_mask_examples > 0`` ends with the same predictions for held-out blocks
(`after_pretraining`, which main.py calls when the run has finished), written to
``<workdir>/fill_mask.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from maelm_jax import run_configs, runs
from maelm_jax.config import schema
from maelm_jax.fill_mask import config as fill_mask_config
from maelm_jax.fill_mask.config import FillMaskError
from maelm_jax.infra import paths
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.sources import source as source_lib
from maelm_jax.text import masking
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.workdirs import layout

# Held-out examples mask this share of a block's word-initial pieces, as pretraining masks
# 15 % of positions.
EXAMPLE_MASK_RATIO = 0.15
# The held-out blocks the closing examples are spread over (the first of the validation
# split; reading the whole split would only cost memory).
_EXAMPLE_POOL = 4096


@dataclasses.dataclass(frozen=True)
class Filled:
    """One text's predictions: `top_ids`/`top_probs` [k, top_k] per masked position."""

    ids: np.ndarray  # [n] the input ids, the mask id at the masked positions
    masked: np.ndarray  # [k] masked positions, ascending
    top_ids: np.ndarray
    top_probs: np.ndarray
    targets: np.ndarray | None = None  # [k] the true pieces, when known


class FillMasker:
    """A pretraining run's model and parameters, ready to predict masked pieces."""

    def __init__(self, run_config: ml_collections.ConfigDict,
                 tok: tokenizer_lib.Tokenizer, params: Any):
        self.config = run_config
        self.tok = tok
        self.params = params
        self.seq_len = int(run_config.data.seq_len)
        self._applies: dict[int, Any] = {}  # one jitted model per text length

    @classmethod
    def from_workdir(cls, workdir: str) -> FillMasker:
        """The newest finished checkpoint of a pretraining workdir (read only)."""
        try:
            source = source_lib.read(workdir)  # its config.json read once
            if source.step_dir is None:
                raise FillMaskError(f"--workdir: {workdir} is a Hugging Face model; fill-mask "
                                    "reads a pretraining workdir of ours")
            run_dir, step_dir, recorded = source.path, source.step_dir, source.config
            if recorded.get("mode", "pretrain") != "pretrain":
                raise FillMaskError(f"--workdir: {run_dir} is a {recorded['mode']} run; "
                                    "fill-mask needs a pretraining workdir (its decoder and "
                                    "LM head)")
            tok = runs.find_tokenizer(source, "")
            config = run_configs.run_config(recorded)
            params = runs.restore_params(step_dir, field="--workdir",
                                            stacked=config.model.scan_layers)
        except runs.CheckpointError as e:
            raise FillMaskError(str(e).replace("config.init_from", "--workdir")) from None
        return cls(config, tok, params)

    def _apply(self, n: int):
        """The model for texts of n pieces, as the objective fits it to n (a decoder that
        spans the whole sequence is built for n positions)."""
        if n not in self._applies:
            objective = pretrain_config.objective(self.config)
            run_shape = setup_lib.shape(self.config, self.tok.vocab_size, self.tok.special)
            cfg, params = objective.for_length(
                setup_lib.model_config(self.config, self.tok.vocab_size, run_shape),
                self.params, n)
            self._applies[n] = (jax.jit(objective.model(cfg).apply), params)
        return self._applies[n]

    def predict(self, ids: Sequence[int], masked: Sequence[int], top_k: int = 5,
                targets: Sequence[int] | None = None) -> Filled:
        """ids [n] with the mask id at `masked` [k] (ascending positions)."""
        ids, masked = np.asarray(ids, np.int32), np.asarray(sorted(masked), np.int32)
        n, k = len(ids), len(masked)
        kept = np.setdiff1d(np.arange(n, dtype=np.int32), masked)
        removed = pretrain_config.objective(self.config).removes_masks
        batch = masking.MaskedBatch(
            inputs=ids[None],
            enc_index=(kept if removed else np.arange(n, dtype=np.int32))[None],
            pred_index=masked[None],
            targets=np.zeros((1, k), np.int32),
            weights=np.ones((1, k), np.float32),
        )
        apply, params = self._apply(n)
        logits = np.asarray(apply({"params": params}, batch))[0]  # [k, V]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
        return Filled(ids, masked, top, np.take_along_axis(probs, top, -1),
                      None if targets is None else np.asarray(targets, np.int32))

    def encode_text(self, text: str, field: str = "config.text") -> tuple[np.ndarray, np.ndarray]:
        """(<s> text </s> as ids [n], the positions of its <mask> marks [k])."""
        special, mark = self.tok.special, mask_mark(self.tok)
        pieces = self.tok.encode([text])[0]
        # SentencePiece encodes "word <mask>" with the space as a piece of its own before
        # <mask>; the mask then stands for a word-initial piece ("▁os"), as in pretraining.
        # (RoBERTa's <mask> takes the space itself; BERT's tokens carry no spaces.)
        space = [i for i, p in enumerate(pieces[:-1])
                 if pieces[i + 1] == special.mask and self.tok.id_to_piece(p) == "▁"]
        pieces = [p for i, p in enumerate(pieces) if i not in set(space)]
        ids = np.asarray([special.bos, *pieces, special.eos], np.int32)
        masked = np.flatnonzero(ids == special.mask)
        if not len(masked):
            raise FillMaskError(f"{field}: {text!r} has no {mark}; mark each piece to "
                                f"predict with {mark}")
        if len(ids) > self.seq_len:
            raise FillMaskError(f"{field}: {text!r} is {len(ids)} pieces with <s> and </s>; "
                                f"the model was pretrained on {self.seq_len}")
        return ids, masked


def examples_from_blocks(masker: FillMasker, blocks: np.ndarray, count: int, seed: int,
                         top_k: int = 5) -> list[Filled]:
    """`count` held-out blocks [N, L] (evenly spaced), each with 15 % of its word-initial
    pieces (at least one) masked, deterministically from `seed`."""
    rng = np.random.default_rng(seed)
    chosen = np.linspace(0, len(blocks) - 1, num=min(count, len(blocks))).astype(int)
    out = []
    for i in chosen:
        block = np.asarray(blocks[i], np.int32)
        starts = [j for j, t in enumerate(block) if masker.tok.is_word_start(int(t))]
        if not starts:
            continue
        k = max(1, round(EXAMPLE_MASK_RATIO * len(starts)))
        masked = np.sort(rng.choice(starts, size=k, replace=False))
        ids = block.copy()
        ids[masked] = masker.tok.special.mask
        out.append(masker.predict(ids, masked, top_k, targets=block[masked]))
    return out


def format_filled(filled: Filled, tok: tokenizer_lib.Tokenizer) -> str:
    """The text with <mask>, then a line per mask: (true piece,) top-k with probabilities."""
    body = [int(t) for t in filled.ids if t not in (tok.special.bos, tok.special.eos)]
    lines = [f"input: {_decode(body, tok)}"]
    for m in range(len(filled.masked)):
        guesses = " | ".join(f"{tok.id_to_piece(int(t))} {p:.3f}"
                             for t, p in zip(filled.top_ids[m], filled.top_probs[m], strict=False))
        truth = ("" if filled.targets is None
                 else f" (true: {tok.id_to_piece(int(filled.targets[m]))})")
        lines.append(f"  {mask_mark(tok)} {m + 1}{truth}: {guesses}")
    return "\n".join(lines)


def mask_mark(tok: tokenizer_lib.Tokenizer) -> str:
    """The text that marks a piece to predict: the tokenizer's mask token."""
    return tok.id_to_piece(tok.special.mask)


def _decode(ids: list[int], tok: tokenizer_lib.Tokenizer) -> str:
    """Decodes around each <mask> (sentencepiece drops the spaces next to a user-defined
    symbol): a mask stands for a word-initial piece, and a run after it starts with a space
    only if its first piece does ("the <mask> module", "the <mask>."). A Hugging Face
    tokenizer decodes its mask token in place."""
    if tok.kind != "sentencepiece":
        return tok.decode(ids)
    text, run = "", []
    for t in ids + [None]:
        if t is not None and t != tok.special.mask:
            run.append(t)
            continue
        if run:
            space = " " if text and tok.id_to_piece(run[0]).startswith("▁") else ""
            text += space + tok.decode(run)
            run = []
        if t is not None:
            text += (" " if text else "") + mask_mark(tok)
    return text


def write_examples(workdir: paths.Path, examples: list[Filled],
                   tok: tokenizer_lib.Tokenizer, step: int) -> str:
    """Writes <workdir>/fill_mask.md and returns its text."""
    text = (f"# Fill-mask on held-out blocks, step {step}\n\n"
            + "\n\n".join(f"```\n{format_filled(f, tok)}\n```" for f in examples) + "\n")
    paths.write_text(workdir / layout.FILL_MASK_FILE, text)
    return text


def after_pretraining(workdir: str) -> str | None:
    """What a finished pretraining run learned: fill-mask on its train.fill_mask_examples
    held-out blocks (from its first validation blocks), logged and written to
    <workdir>/fill_mask.md. Returns the text; None when the run asks for no examples."""
    run_dir = paths.resolve(workdir, "--workdir")
    masker = FillMasker.from_workdir(str(run_dir))
    count = masker.config.train.fill_mask_examples
    if not count:
        return None
    _, blocks = runs.validation_blocks(run_dir, masker.config, masker.tok)
    blocks = np.stack(list(itertools.islice(blocks, _EXAMPLE_POOL)))
    examples = examples_from_blocks(masker, blocks, count, masker.config.seed)
    text = write_examples(run_dir, examples, masker.tok, masker.config.train.num_steps)
    logging.info("what the model predicts on held-out text (also in %s):\n%s",
                 run_dir / layout.FILL_MASK_FILE, text)
    return text


def run(config: ml_collections.ConfigDict, workdir: str) -> list[Filled]:
    """The fill-mask command: prints each text's predictions."""
    schema.check(config, fill_mask_config.FIELDS, fill_mask_config.fill_mask_defaults(),
                 fill_mask_config.FillMaskError)
    masker = FillMasker.from_workdir(str(paths.resolve(workdir, "--workdir")))
    results = []
    for text in fill_mask_config.texts(config.text):
        ids, masked = masker.encode_text(text)
        filled = masker.predict(ids, masked, config.top_k)
        print(format_filled(filled, masker.tok), flush=True)
        results.append(filled)
    return results
