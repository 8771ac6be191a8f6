"""A finished run, read back from its workdir: config, tokenizer, checkpoints, encoder.

Fine-tuning (its init_from), the rank analysis, fill-mask and the study read pretraining
and fine-tuning runs through this module only; a local Hugging Face RoBERTa/BERT directory
reads as an encoder too. Each is resolved and its config read once, into a
sources.source.Source, from which the checks, the tokenizer and the architecture here
derive. A run's workdir holds

* ``config.json``: the run's config (``mode`` says its kind; absent means pretraining),
  read over its kind's defaults so a run recorded before a field existed still reads;
* ``checkpoints/<step>/state``: orbax checkpoints of the train state (pretraining) or of
  the selected parameters (fine-tuning, with ``encoder.json``, its encoder's architecture);
* ``tokenizer.model`` (unless the run was given an existing model);
* ``metrics.jsonl``: a JSON line per log, eval or dev evaluation;
* a pretraining run's prepared data (its validation blocks), under data.cache_dir or
  the shards of data.prepared.

Parameters are read partially (sources/source.py) and checked here against the
architecture the config describes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from maelm_jax.config import schema
from maelm_jax.data import packing, run_data, shards
from maelm_jax.infra import paths
from maelm_jax.models import builder
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.sources import huggingface
from maelm_jax.sources import source as source_lib
from maelm_jax.sources.source import CheckpointError, read_json, restore_params
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.training import state as state_lib
from maelm_jax.workdirs import layout


@dataclasses.dataclass
class Pretrained:
    """What a fine-tuning run takes from init_from."""

    encoder_cfg: encoder_lib.EncoderConfig
    params: Any  # the encoder's parameter tree, numpy arrays (None: weights not read)
    tokenizer: tokenizer_lib.Tokenizer
    description: str  # e.g. "pretraining checkpoint <dir>/checkpoints/300"


def resolve_checkpoint(init_from: str) -> tuple[paths.Path, paths.Path]:
    """(workdir, checkpoint step directory) for a workdir of ours or a checkpoints/<step>
    path."""
    source = source_lib.read(init_from)
    if source.step_dir is None:
        raise CheckpointError(f"config.init_from: {init_from} is a Hugging Face model, not a "
                              "run of ours")
    return source.path, source.step_dir


def architecture(source: source_lib.Source, vocab_size: int) -> tuple[dict, str]:
    """(the architecture record of the encoder `source` holds, where it was read (for
    errors))."""
    if source.kind == source_lib.FINETUNING:
        path = source.path / layout.ENCODER_FILE
        return read_json(path), f"config.init_from: {path}"
    config_path = source.path / (huggingface.CONFIG_FILE if source.kind == source_lib.HUGGING_FACE
                                 else layout.CONFIG_FILE)
    where = f"config.init_from: {config_path}"
    if source.kind == source_lib.HUGGING_FACE:
        try:
            return huggingface.architecture(source.config, where), where
        except huggingface.HuggingFaceError as e:
            raise CheckpointError(str(e)) from None
    try:
        arch = pretrained_architecture(source.config, vocab_size)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where} is not a pretraining config "
                              f"({type(e).__name__}: {e})") from None
    return arch, where


def pretrained_architecture(run_config: Mapping[str, Any], vocab_size: int) -> dict:
    """The architecture record of the encoder a pretraining config (a dict, as config.json
    holds it) trains, for a vocabulary of `vocab_size`: what fine-tuning, the analyses
    and the study's sizing build their encoder from (models/builder.py), each with its
    own run settings."""
    # Defaults first: a run recorded before a field existed still describes its model.
    merged = schema.over_defaults(pretrain_config.pretrain_defaults().to_dict(),
                                  dict(run_config))
    return encoder_lib.model_architecture(merged["model"], vocab_size=vocab_size,
                                          max_positions=int(merged["data"]["seq_len"]))


def find_tokenizer(source: source_lib.Source, configured: str) -> tokenizer_lib.Tokenizer:
    """config.tokenizer_path, else the workdir's tokenizer.model, else the pretraining
    config's tokenizer.model_path (a run given an existing model does not copy it); a
    Hugging Face model's own tokenizer.json."""
    if configured:
        return tokenizer_lib.load_tokenizer(configured)
    if source.kind == source_lib.HUGGING_FACE:
        path = source.path / layout.HF_TOKENIZER_FILE
        if not path.is_file():
            raise CheckpointError(f"config.init_from: {source.path} has no "
                                  f"{layout.HF_TOKENIZER_FILE}; set config.tokenizer_path")
        return tokenizer_lib.load_tokenizer(str(path))
    own = layout.tokenizer_file(source.path)  # tokenizer.model, or a copied tokenizer.json
    if own is not None:
        return tokenizer_lib.load_tokenizer(str(own))
    model_path = (source.config.get("tokenizer") or {}).get("model_path") or ""
    if model_path and paths.Path(model_path).is_file():
        return tokenizer_lib.load_tokenizer(model_path)
    raise CheckpointError(f"config.init_from: {source.path} has no {layout.TOKENIZER_FILE} (and "
                          f"its config's tokenizer.model_path {model_path!r} is not a file); "
                          f"set config.tokenizer_path")


def restore_encoder_params(step_dir: paths.Path) -> Any:
    """params["encoder"] of the checkpoint's ``state`` item, as numpy arrays, nothing else."""
    return restore_params(step_dir, "encoder")


def check_encoder_params(params: Any, expected: Any, where: str, tokenizer_path: str) -> None:
    """Raises CheckpointError naming the first difference of structure or shape.

    expected: the freshly initialised encoder's parameters (arrays or shape structs).
    """
    got = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(params)}
    want = {jax.tree_util.keystr(k): v.shape
            for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    word = "['word_embeddings']['embedding']"
    if word in got and got[word][0] != want[word][0]:
        raise CheckpointError(f"config.init_from: {where} has a vocabulary of {got[word][0]} "
                              f"pieces but the tokenizer {tokenizer_path} has {want[word][0]}; "
                              f"use the pretraining run's tokenizer")
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        raise CheckpointError(f"config.init_from: {where} does not match its config's encoder "
                              f"(layers, relative bias or LayerNorms differ): "
                              f"{'missing ' + missing[0] if missing else 'unexpected ' + extra[0]}")
    for name, shape in want.items():
        if got[name] != shape:
            raise CheckpointError(f"config.init_from: {where}: parameter {name} has shape "
                                  f"{got[name]}, the encoder in its config needs {shape} "
                                  f"(another width, position count or head count)")


def encoder_init(cfg: encoder_lib.EncoderConfig) -> Callable[[], Any]:
    """A fresh encoder's parameters, boxed with their logical axes: what
    training/state.py lays out (the values are never read, only shapes and axes)."""
    tokens = jnp.zeros((1, 8), jnp.int32)
    return lambda: encoder_lib.Encoder(cfg).init(jax.random.PRNGKey(0), tokens,
                                                 tokens)["params"]


def abstract_encoder_params(cfg: encoder_lib.EncoderConfig) -> Any:
    """The encoder's parameter shapes, without allocating them."""
    return state_lib.abstract_params(encoder_init(cfg))


def load_pretrained(init_from: str, run: builder.Run, tokenizer_path: str = "",
                    weights: bool = True) -> Pretrained:
    """Resolves, reads and checks the encoder a fine-tuning run (or an analysis) starts
    from (a workdir of ours, a checkpoint or a Hugging Face directory), built with
    `run`'s settings. weights=False reads only its architecture and tokenizer (params
    None: the from-scratch control)."""
    source = source_lib.read(init_from)
    tok = find_tokenizer(source, tokenizer_path)
    arch, record = architecture(source, tok.vocab_size)
    try:
        # The encoder carries its tokenizer's special ids (EncoderConfig.special).
        cfg = builder.encoder(arch, dataclasses.replace(run, special=tok.special),
                              record=record)
    except encoder_lib.ArchitectureError as e:
        raise CheckpointError(str(e)) from None
    if cfg.vocab_size != tok.vocab_size:
        raise CheckpointError(f"config.init_from: {source.path} was trained with a vocabulary "
                              f"of {cfg.vocab_size} pieces but the tokenizer {tok.model_path} "
                              f"has {tok.vocab_size}; use the run's own tokenizer")
    if not weights:
        return Pretrained(cfg, None, tok, source.description)
    params = source.params("encoder")
    check_encoder_params(params, abstract_encoder_params(cfg), source.description,
                         tok.model_path)
    return Pretrained(cfg, params, tok, source.description)


def default_seq_len(run_cfg: ml_collections.ConfigDict, max_positions: int) -> int:
    """A pretraining run's data.seq_len; a fine-tuning run's data.max_seq_len (0: its
    encoder's max positions, at most 512, as fine-tuning does)."""
    if run_cfg.get("mode") == "finetune":
        return int(run_cfg.data.max_seq_len) or min(max_positions, 512)
    return int(run_cfg.data.seq_len)


def prepared_set(workdir: paths.Path, run_cfg: ml_collections.ConfigDict,
                 tok: tokenizer_lib.Tokenizer) -> paths.Path:
    """The directory of the blocks a pretraining run trained on: its data.prepared, or
    the set it prepared in its data cache (both in the one format of data/shards.py)."""
    d = run_cfg.data
    if d.get("prepared"):
        return paths.Path(d.prepared)
    cache_dir = paths.Path(d.cache_dir or workdir / layout.DATA_DIR)
    prepared = [p.parent for p in sorted(cache_dir.glob(f"*/{layout.MANIFEST_FILE}"))
                if json.loads(paths.read_text(p)).get("seq_len") == d.seq_len]
    try:  # the fingerprint the run prepared its data under (its corpus may have moved)
        fingerprint = packing.data_fingerprint(
            run_data.source_fingerprints(run_cfg),
            tok.model_path, d.seq_len, d.validation_fraction)
        chosen = [p for p in prepared if p.name == fingerprint]
    except Exception:  # noqa: BLE001 - any failure means "cannot tell"; handled below
        chosen = []
    if not chosen and len(prepared) == 1:
        chosen = prepared
    if not chosen:
        raise CheckpointError(
            f"config.source: cannot find the validation blocks of {workdir} in {cache_dir} "
            f"({len(prepared)} prepared data sets of length {d.seq_len}); set "
            "config.source to a corpus instead")
    return chosen[0]


def validation_blocks(workdir: paths.Path, run_cfg: ml_collections.ConfigDict,
                      tok: tokenizer_lib.Tokenizer) -> tuple[int, Iterable[np.ndarray]]:
    """(L, the pretraining run's validation blocks in eval order: all sources, each read
    only as far as the analysis goes)."""
    data = shards.load(prepared_set(workdir, run_cfg, tok))
    return data.seq_len, itertools.chain.from_iterable(data.valid[n] for n in sorted(data.valid))


def corpus(workdir: paths.Path, run_cfg: ml_collections.ConfigDict,
           tok: tokenizer_lib.Tokenizer) -> dict:
    """What a pretraining run was trained on: {"fingerprint", "sources": {name: counts}}
    from its prepared set's manifest (counts: documents, tokens, train_blocks,
    valid_blocks, and what the readers cleaned)."""
    manifest = shards.read_manifest(prepared_set(workdir, run_cfg, tok))
    return {"fingerprint": manifest["fingerprint"], "sources": {
        name: {"documents": sum(entry[split]["documents"] for split in shards.SPLITS),
               "tokens": sum(entry[split]["tokens"] for split in shards.SPLITS),
               **{f"{split}_blocks": entry[split]["blocks"] for split in shards.SPLITS},
               "read": entry.get("read", {})}
        for name, entry in manifest["sources"].items()}}


def finished_steps(workdir: paths.Path) -> list[int]:
    """The steps of the run's finished checkpoints, ascending."""
    return checkpoint_lib.finished_steps(workdir / layout.CHECKPOINTS)
