"""Mode "export": a trained run as a directory Hugging Face transformers loads.

    python main.py --config=configs/export.py --workdir=<output dir> \
        --config.init_from=<pretraining or fine-tuning workdir, or a checkpoint>

writes, into ``--workdir``:

* ``config.json``: the architecture (remote/configuration_maelm.py's fields) with
  ``auto_map``, so that the Auto classes load it with ``trust_remote_code=True``;
* ``configuration_maelm.py``, ``modeling_maelm.py``, ``tokenization_maelm.py``: the
  model's PyTorch code (maelm_jax/export/remote/, copied as they are);
* ``model.safetensors``: every parameter of the run (encoder, and the decoder and LM head
  of a pretraining run or the head of a fine-tuning run), float32, written with
  safetensors' numpy API (exporting needs no PyTorch);
* ``tokenizer.json``: the fast tokenizer (export/fast_tokenizer.py; AutoTokenizer loads
  it as a PreTrainedTokenizerFast, with offset mappings), ``tokenizer_config.json``,
  ``special_tokens_map.json``, and for a SentencePiece tokenizer ``tokenizer.model`` (the
  slow tokenizer, remote/tokenization_maelm.py, giving the same ids);
* ``README.md``, the model card; ``training_config.json``, the run's own config.json.

The export is written to a temporary directory beside ``--workdir`` and renamed into
place at the end, so a failed export leaves nothing; a ``--workdir`` that holds anything
but an earlier export is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shlex
import shutil
import sys
import tempfile
from typing import Any

import ml_collections
import numpy as np

from maelm_jax import run_configs, runs
from maelm_jax.export import card, fast_tokenizer, roberta
from maelm_jax.export import config as export_config
from maelm_jax.export.config import ExportError
from maelm_jax.infra import paths
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import torch_names
from maelm_jax.sources import source as source_lib
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.training import metrics as metrics_lib
from maelm_jax.workdirs import layout

REMOTE_DIR = pathlib.Path(__file__).parent / "remote"
REMOTE_FILES = ("configuration_maelm.py", "modeling_maelm.py", "tokenization_maelm.py")
MODEL_TYPE = "maelm_jax"  # remote/configuration_maelm.py's MaelmConfig.model_type
AUTO_MAP = {
    "AutoConfig": "configuration_maelm.MaelmConfig",
    "AutoModel": "modeling_maelm.MaelmModel",
    "AutoModelForMaskedLM": "modeling_maelm.MaelmForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_maelm.MaelmForSequenceClassification",
    "AutoModelForQuestionAnswering": "modeling_maelm.MaelmForQuestionAnswering",
}
WEIGHTS_FILE = "model.safetensors"
HF_TOKENIZER_FILE = "tokenizer.json"  # the fast tokenizer, every export
SLOW_TOKENIZER_FILE = "tokenizer.model"  # the SentencePiece model, when the run has one
# Objectives whose models the PyTorch code reproduces (the decoder kinds of maelm included).
OBJECTIVES = ("mlm", "maelm")


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Exports config.init_from into workdir; returns what was written ({"files": ...})."""
    config = export_config.validate(config)
    out = paths.resolve(workdir, "--workdir")
    _check_output(out)
    try:
        exported = _read_run(config.init_from)
    except runs.CheckpointError as e:
        raise ExportError(str(e)) from None
    files = _files(exported, config.classes)
    _publish(files, out)
    return {"workdir": str(out), "files": sorted(files), "hf_config": exported["hf_config"]}


def _check_output(out: paths.Path) -> None:
    """Refuses an output that is a file, or a directory holding anything but an export."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--workdir: {out} is a file; give a new or empty directory")
    entries = [p for p in out.iterdir() if p.name != layout.LOCK_FILE] if out.exists() else []
    if not entries:  # new, or empty but for the hold of this export (workdirs/lock.py)
        return
    config = out / "config.json"
    try:
        earlier = json.loads(paths.read_text(config)).get("model_type") in (
            MODEL_TYPE, roberta.MODEL_TYPE)
    except (OSError, ValueError, AttributeError):
        earlier = False
    if not earlier:
        found = sorted(p.name for p in entries)[0]
        raise ExportError(f"--workdir: {out} holds other files (e.g. {found}); give a new or "
                          "empty directory, or an earlier export to replace")


def _read_run(init_from: str) -> dict[str, Any]:
    """What the export is made of: the run's config, parameters, tokenizer and records."""
    source = source_lib.read(init_from)
    if source.step_dir is None:
        raise ExportError(f"config.init_from: {init_from} is a Hugging Face model already; "
                          "export a run of ours (one that continued it, say)")
    run_dir, step_dir, recorded = source.path, source.step_dir, source.config
    run_cfg = run_configs.run_config(recorded)
    tok = runs.find_tokenizer(source, "")
    step = int(step_dir.name)
    params = runs.restore_params(step_dir)
    if run_cfg.get("mode", "pretrain") == "finetune":
        hf_config, head, facts = _finetuned(run_dir, run_cfg, params, tok)
    else:
        hf_config, head, facts = _pretrained(run_dir, run_cfg, tok, step)
    vocab = np.shape(params["encoder"]["word_embeddings"]["embedding"])[0]
    if vocab != tok.vocab_size:
        raise ExportError(f"config.init_from: {step_dir} has a vocabulary of {vocab} pieces "
                          f"but the run's tokenizer {tok.model_path} has {tok.vocab_size}")
    facts["tokenizer"] = ("SentencePiece" if tok.kind == "sentencepiece"
                          else "Hugging Face tokenizer.json")
    return {"run_dir": run_dir, "step": step, "recorded": recorded, "run_cfg": run_cfg,
            "tokenizer": tok, "hf_config": hf_config,
            "state": torch_names.state_dict(params, head), "facts": facts}


def _encoder_fields(arch: dict[str, Any], model: ml_collections.ConfigDict) -> dict[str, Any]:
    """The encoder's part of config.json: its architecture record and the run's dropout."""
    return {
        "vocab_size": arch["vocab_size"],
        "hidden_size": arch["d_model"],
        "num_hidden_layers": arch["num_layers"],
        "num_attention_heads": arch["num_heads"],
        "intermediate_size": arch["d_ff"],
        "max_position_embeddings": arch["max_positions"],
        "pre_ln": arch["pre_ln"],
        "rel_pos_buckets": arch["rel_pos_buckets"],
        "rel_pos_max_distance": arch["rel_pos_max_distance"],
        "rel_pos_bucket_fn": arch["rel_pos_bucket_fn"],
        "layer_norm_eps": arch["layer_norm_eps"],
        "hidden_dropout_prob": float(model.dropout),
        "attention_probs_dropout_prob": float(model.attention_dropout),
        "activation_dropout": float(model.get("activation_dropout", 0.0)),
    }


def _base_config(architectures: list[str], fields: dict[str, Any],
                 special: tokenizer_lib.SpecialIds = tokenizer_lib.SENTENCEPIECE_IDS
                 ) -> dict[str, Any]:
    """config.json's fields every export has; `special`: the run's tokenizer's ids."""
    return {"architectures": architectures, "model_type": MODEL_TYPE, "auto_map": AUTO_MAP,
            "torch_dtype": "float32",
            "pad_token_id": special.pad, "bos_token_id": special.bos,
            "eos_token_id": special.eos, "mask_token_id": special.mask, **fields}


def pretraining_config(run_cfg: ml_collections.ConfigDict, vocab_size: int,
                       special: tokenizer_lib.SpecialIds = tokenizer_lib.SENTENCEPIECE_IDS
                       ) -> dict:
    """config.json of a pretraining run (MaelmForMaskedLM, with its decoder if it has one)
    whose tokenizer has `vocab_size` ids and the `special` ids."""
    m = run_cfg.model
    if run_cfg.objective not in OBJECTIVES:
        raise ExportError(f"config.init_from: the run was pretrained with objective "
                          f"{run_cfg.objective!r}; export knows {', '.join(OBJECTIVES)}")
    arch = encoder_lib.model_architecture(m, vocab_size=vocab_size,
                                          max_positions=int(run_cfg.data.seq_len))
    decoder = None
    if run_cfg.objective == "maelm":  # as pretrain/objectives/maelm.py builds it
        d = m.decoder
        decoder = {"kind": d.kind, "num_layers": d.num_layers, "hidden_size": d.d_model,
                   "num_attention_heads": d.num_heads, "intermediate_size": d.d_ff,
                   "pre_ln": d.pre_ln, "max_position_embeddings": int(run_cfg.data.seq_len),
                   "rel_pos_buckets": d.rel_pos_buckets,
                   "rel_pos_max_distance": d.rel_pos_max_distance,
                   "share_positions": d.share_positions, "dropout": float(d.dropout),
                   "attention_dropout": float(d.attention_dropout),
                   "activation_dropout": 0.0}
    return _base_config(["MaelmForMaskedLM"], {
        **_encoder_fields(arch, m), "objective": run_cfg.objective,
        "misaligned_positions": bool(m.misaligned_positions), "pretraining_decoder": decoder},
        special)


def _pretrained(run_dir: paths.Path, run_cfg: ml_collections.ConfigDict,
                tok: tokenizer_lib.Tokenizer, step: int):
    """config.json, head name and model-card facts of a pretraining run."""
    facts = {"kind": "pretraining", "objective": card.objective_name(run_cfg),
             "step": step,
             "tokens_seen": step * int(run_cfg.train.batch_size) * int(run_cfg.data.seq_len),
             "metrics": _last_eval(run_dir, step), "corpus": _corpus(run_dir, run_cfg, tok),
             "max_length": int(run_cfg.data.seq_len), "init_from": _started_from(run_dir)}
    return pretraining_config(run_cfg, tok.vocab_size, tok.special), None, facts


def _started_from(run_dir: paths.Path) -> str:
    """Where a continued pretraining run started from (its init_from.json), else ""."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads(paths.read_text(run_dir / layout.INIT_FROM_FILE))["description"]
    return ""


def finetuning_config(arch: dict[str, Any], run_cfg: ml_collections.ConfigDict,
                      special: tokenizer_lib.SpecialIds = tokenizer_lib.SENTENCEPIECE_IDS
                      ) -> tuple[dict, str, str]:
    """(config.json, the head's PyTorch name, the task's name) of a fine-tuning run whose
    encoder has the architecture record `arch` (and whose tokenizer the `special` ids); the
    task's kind (finetune/tasks) says which PyTorch model it is."""
    from maelm_jax.finetune import tasks

    try:
        kind = tasks.kind_for(run_cfg.task)
    except tasks.FinetuneConfigError as e:
        raise ExportError(f"config.init_from: the run's {e}") from None
    exported = kind.export_head(run_cfg)
    if exported is None:
        raise ExportError(f"config.init_from: a fine-tuned {kind.kind} task "
                          f"({run_cfg.task}) has no Hugging Face head to export")
    fields = {**_encoder_fields(arch, run_cfg.model), "objective": "mlm",
              "classifier_dropout": float(run_cfg.model.classifier_dropout),
              "pooling": run_cfg.model.pooling, **exported.fields}
    return (_base_config([exported.architecture], fields, special), exported.head,
            exported.task)


def _finetuned(run_dir: paths.Path, run_cfg: ml_collections.ConfigDict, params: Any,
               tok: tokenizer_lib.Tokenizer):
    """config.json, head name and model-card facts of a fine-tuning run."""
    path = run_dir / layout.ENCODER_FILE
    try:
        encoder_cfg = encoder_lib.from_architecture(runs.read_json(path),
                                                    where=f"config.init_from: {path}")
    except encoder_lib.ArchitectureError as e:
        raise ExportError(str(e)) from None
    arch = encoder_lib.architecture(encoder_cfg)
    hf_config, head, task = finetuning_config(arch, run_cfg, tok.special)
    if head == "classifier":
        outputs = np.shape(params["head"]["out"]["kernel"])[-1]
        if outputs != len(hf_config["id2label"]):
            raise ExportError(f"config.init_from: {run_dir}'s head has {outputs} outputs; "
                              f"{task} has {len(hf_config['id2label'])}")
    results_path = run_dir / layout.RESULTS_FILE
    results = json.loads(paths.read_text(results_path)) if results_path.is_file() else {}
    facts = {"kind": "fine-tuning", "task": task, "step": None,
             "metrics": results.get("dev", {}), "init_from": results.get("init_from", ""),
             "max_length": runs.default_seq_len(run_cfg, arch["max_positions"])}
    return hf_config, head, facts


def _last_eval(run_dir: paths.Path, step: int) -> dict:
    evals = [row for row in metrics_lib.read(run_dir, "eval") if row.get("step", 0) <= step]
    return {k: v for k, v in evals[-1].items() if k != "split"} if evals else {}


def _corpus(run_dir: paths.Path, run_cfg: ml_collections.ConfigDict,
            tok: tokenizer_lib.Tokenizer) -> dict | None:
    """The prepared data's record, or None when it is no longer where the run left it."""
    with contextlib.suppress(Exception):  # a moved corpus: the card says it is unknown
        return runs.corpus(run_dir, run_cfg, tok)
    return None


def _tokenizer_files(tok: tokenizer_lib.Tokenizer, max_length: int,
                     stock: bool = False) -> dict[str, bytes]:
    """tokenizer.json (the fast tokenizer: export/fast_tokenizer.py), tokenizer_config.json
    and special_tokens_map.json, and for a SentencePiece model its tokenizer.model (the slow
    tokenizer, remote/tokenization_maelm.py) unless the export is `stock` (transformers'
    classes alone: the fast tokenizer as a plain PreTrainedTokenizerFast)."""
    ids = tok.special
    piece = {role: tok.id_to_piece(getattr(ids, role))
             for role in ("bos", "eos", "unk", "pad", "mask")}
    # RoBERTa's roles: <s> begins (and classifies), </s> ends and separates a pair (BERT's
    # [CLS] and [SEP] alike).
    specials = {"bos_token": piece["bos"], "eos_token": piece["eos"], "sep_token": piece["eos"],
                "cls_token": piece["bos"], "unk_token": piece["unk"], "pad_token": piece["pad"],
                "mask_token": piece["mask"]}
    files = {HF_TOKENIZER_FILE: fast_tokenizer.tokenizer_json(tok)}
    if tok.kind == "sentencepiece" and not stock:
        files[SLOW_TOKENIZER_FILE] = paths.Path(tok.model_path).read_bytes()
        loader = {"tokenizer_class": "MaelmTokenizer",
                  "auto_map": {"AutoTokenizer": ["tokenization_maelm.MaelmTokenizer",
                                                 "tokenization_maelm.MaelmTokenizerFast"]}}
    else:  # a Hugging Face tokenizer has no slow class of ours; a stock export no code
        loader = {"tokenizer_class": "PreTrainedTokenizerFast"}
    tokenizer_config = {
        **loader, "model_max_length": max_length, "padding_side": "right",
        "truncation_side": "right", "clean_up_tokenization_spaces": False, **specials}
    return {**files, "tokenizer_config.json": _json(tokenizer_config),
            "special_tokens_map.json": _json(specials)}


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode("utf-8")


def _files(exported: dict[str, Any], classes: str) -> dict[str, bytes | np.ndarray]:
    """File name -> content (the weights as their state dict, written last), in our
    PyTorch classes or (`classes` "roberta") transformers' RoBERTa ones."""
    command = " ".join(shlex.quote(a) for a in [os.path.basename(sys.argv[0]), *sys.argv[1:]])
    ours, state, stock = exported["hf_config"], exported["state"], classes == "roberta"
    files: dict[str, Any] = ({} if stock else
                             {name: (REMOTE_DIR / name).read_bytes() for name in REMOTE_FILES})
    files.update(_tokenizer_files(exported["tokenizer"], exported["facts"]["max_length"],
                                  stock))
    files["training_config.json"] = _json(exported["recorded"])
    files["README.md"] = card.model_card(ours, exported["facts"], exported["run_dir"], command,
                                         stock).encode("utf-8")
    if stock:
        masked_lm = roberta.is_masked_lm(ours)
        ours, state = (roberta.hf_config(ours),
                       roberta.state_dict(state, ours["pad_token_id"], masked_lm))
    files["config.json"] = _json(ours)
    files[WEIGHTS_FILE] = state
    return files


def _write(files: dict[str, Any], directory: pathlib.Path) -> None:
    from safetensors.numpy import save_file

    for name, content in files.items():
        if name == WEIGHTS_FILE:
            save_file(content, str(directory / name), metadata={"format": "pt"})
        else:
            (directory / name).write_bytes(content)


def _publish(files: dict[str, Any], out: paths.Path) -> None:
    """Writes the files to a temporary directory and puts it in out's place; in a bucket,
    uploads them with config.json last (an export without it is not one)."""
    local = paths.is_local(out)
    parent = pathlib.Path(out).parent if local else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=parent))
    try:
        _write(files, tmp)
        paths.as_created_in_place(tmp)  # not mkdtemp's 0700: the team loads the export
        if not local:
            for file in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
                paths.upload(file, out / file.name)
            return
        target = pathlib.Path(out)
        old = None
        if (target / layout.LOCK_FILE).exists():
            # The hold moves with its file (a flock is the file's, not its name's), so the
            # published directory is still held until this export ends.
            os.replace(target / layout.LOCK_FILE, tmp / layout.LOCK_FILE)
        if target.exists():
            old = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.replace(target, old / "export")
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
