"""A study model's pretrained encoder in one small file, and back into a workdir: how a GPU
call brings back what it trained, so fine-tuning and every analysis can be redone on a CPU.

`pack(workdir, file)` writes one uncompressed .npz holding the pretraining run's
config.json, its tokenizer file and the encoder's parameters of its newest checkpoint in
bfloat16 (stored as their 16 bits: numpy has no bfloat16 of its own). At the one-call
design's 6 x 256 encoder with 8,192 pieces that is about 14 MB, within the 16 MiB a lent
machine returns per file; no optimiser state, no decoder.

`unpack(file, workdir)` writes a pretraining workdir that every mode starting from one
takes (fine-tuning's init_from, the rank analysis's runs, the export): config.json,
tokenizer.model and checkpoints/<step> with the encoder's parameters in float32 (bfloat16
values, widened). Its prepared data are not in it: analyse it on a corpus source
(docs/analysis.md), not on its validation blocks.
"""

from __future__ import annotations

import io
import json
from typing import Any

import jax
import ml_dtypes
import numpy as np

from maelm_jax.infra import errors, paths
from maelm_jax.sources import source as source_lib
from maelm_jax.workdirs import layout

_CONFIG, _TOKENIZER, _STEP = "__config__", "__tokenizer__", "__step__"
_HF_TOKENIZER = "__hf_tokenizer__"  # set when the tokenizer is a Hugging Face tokenizer.json
_PREFIX = "encoder/"  # parameter arrays: encoder/<path joined by "/">


class EncoderFileError(errors.UserError):
    """A file that is not a packed encoder, or a workdir it cannot be unpacked into."""


def _flatten(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in
                _flatten(sub, f"{prefix}{key}/").items()}
    return {prefix.rstrip("/"): np.asarray(tree)}


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def pack(workdir: paths.Path, out: paths.Path) -> paths.Path:
    """The newest checkpoint's encoder of the pretraining run in `workdir`, with its config
    and tokenizer, as one .npz at `out`."""
    from maelm_jax import runs

    source = source_lib.read(str(workdir))
    tok = runs.find_tokenizer(source, "")
    params = source.params("encoder")
    arrays = {_PREFIX + name: np.asarray(value, np.float32).astype(ml_dtypes.bfloat16)
              .view(np.uint16) for name, value in _flatten(jax.device_get(params)).items()}
    arrays[_CONFIG] = np.frombuffer(json.dumps(source.config).encode(), np.uint8)
    arrays[_TOKENIZER] = np.frombuffer(paths.Path(tok.model_path).read_bytes(), np.uint8)
    if str(tok.model_path).endswith(".json"):
        arrays[_HF_TOKENIZER] = np.asarray(True)
    arrays[_STEP] = np.asarray(source.step, np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    paths.make_dirs(out.parent)
    out.write_bytes(buffer.getvalue())
    return out


def unpack(file: paths.Path, workdir: paths.Path) -> paths.Path:
    """The packed encoder `file` as a pretraining workdir at `workdir` (a new directory);
    returns its checkpoint's step directory."""
    import orbax.checkpoint as ocp

    try:
        with np.load(io.BytesIO(file.read_bytes()), allow_pickle=False) as data:
            found = {name: data[name] for name in data.files}
    except (OSError, ValueError) as e:
        raise EncoderFileError(f"{file}: not a packed encoder ({e})") from None
    if not {_CONFIG, _TOKENIZER, _STEP} <= set(found):
        raise EncoderFileError(f"{file}: not a packed encoder (no config, tokenizer or step)")
    if workdir.exists() and any(workdir.iterdir()):
        raise EncoderFileError(f"{workdir}: not empty; unpack an encoder into a new directory")
    config = json.loads(found[_CONFIG].tobytes().decode())
    params = _unflatten({name[len(_PREFIX):]: value.view(ml_dtypes.bfloat16).astype(np.float32)
                         for name, value in found.items() if name.startswith(_PREFIX)})
    step_dir = workdir / layout.CHECKPOINTS / str(int(found[_STEP]))
    paths.make_dirs(step_dir)
    paths.write_text(workdir / layout.CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    name = layout.HF_TOKENIZER_FILE if _HF_TOKENIZER in found else layout.TOKENIZER_FILE
    (workdir / name).write_bytes(found[_TOKENIZER].tobytes())
    ocp.PyTreeCheckpointer().save(paths.resolve(str(step_dir / layout.STATE_ITEM), "workdir"),
                                  {"params": {"encoder": params}})
    return step_dir
