"""A local Hugging Face RoBERTa or BERT directory read as one of our encoders (and its
masked-LM head): the architecture record its config.json describes and its weights
(``model.safetensors``, sharded or not, or ``pytorch_model.bin``) as our Flax tree.

The weights are renamed onto the export's PyTorch names (export/remote/modeling_maelm.py)
and read back through the one mapping the export writes with (models/torch_names.py).
Both models are post-LN Transformers with learned absolute positions, the exact GELU and
no relative bias; what differs is folded in here:

* RoBERTa numbers its positions from ``pad_token_id + 1`` (2), so its table of 514 rows
  holds our 512 positions from row 2 on;
* the token-type table's first row is added to every position row: every input here is
  one segment of type 0 (RoBERTa has one type; a BERT pair's second segment reads type 0
  too, as RoBERTa's do);
* the tied output projection (``lm_head.decoder`` / ``cls.predictions.decoder``) is the
  word-embedding table, as ours; BERT's pooler and next-sentence head are dropped;
* LayerNorm's epsilon is ours (1e-5; RoBERTa's, and BERT's 1e-12 differs by less than
  the float32 rounding at a trained model's activations).

No network: the directory is read as it is (``save_pretrained``'s or a hub download's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from maelm_jax.infra import errors, paths
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import torch_names
from maelm_jax.training import state as state_lib

CONFIG_FILE = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
# The model types mapped, and the row of their position table that our position 0 is.
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
MODEL_TYPES = (*ROBERTA_TYPES, "bert")

# Our PyTorch names (the export's, models/torch_names.py) and RobertaForMaskedLM's, module
# by module (each holds a weight and a bias; {i} a layer): the import reads this table one
# way, the export in transformers' own classes (export/roberta.py) the other. BertModel's
# encoder is RoBERTa's under "bert."; BERT's masked-LM head has names of its own.
MODULES = (
    ("encoder.word_embeddings", "roberta.embeddings.word_embeddings"),
    ("encoder.ln_embed", "roberta.embeddings.LayerNorm"),
    *((f"encoder.stack.layers.{{i}}.attention.{p}",
       f"roberta.encoder.layer.{{i}}.attention.self.{p}") for p in ("query", "key", "value")),
    ("encoder.stack.layers.{i}.attention.out", "roberta.encoder.layer.{i}.attention.output.dense"),
    ("encoder.stack.layers.{i}.ln_attention",
     "roberta.encoder.layer.{i}.attention.output.LayerNorm"),
    ("encoder.stack.layers.{i}.mlp.wi", "roberta.encoder.layer.{i}.intermediate.dense"),
    ("encoder.stack.layers.{i}.mlp.wo", "roberta.encoder.layer.{i}.output.dense"),
    ("encoder.stack.layers.{i}.ln_mlp", "roberta.encoder.layer.{i}.output.LayerNorm"),
    ("lm_head.dense", "lm_head.dense"),
    ("lm_head.ln", "lm_head.layer_norm"),
    ("lm_head", "lm_head"),  # the output bias
)
_BERT_HEAD = (("lm_head.dense", "cls.predictions.transform.dense"),
              ("lm_head.ln", "cls.predictions.transform.LayerNorm"), ("lm_head", "cls.predictions"))
# Read into the position table, or the same as a parameter kept (the tied projection).
_FOLDED = re.compile(r"embeddings\.(position_embeddings|token_type_embeddings)\.weight|"
                     r"embeddings\.position_ids|(lm_head|cls\.predictions)\.decoder\.(weight|bias)")


def _renamed(name: str, pairs) -> str | None:
    """`name` (module and weight or bias) under the other side's name of `pairs`
    ((from, to) module templates), or None."""
    for source, target in pairs:
        pattern = re.escape(source).replace(re.escape("{i}"), r"(?P<i>\d+)")
        match = re.fullmatch(pattern + r"\.(?P<leaf>weight|bias)", name)
        if match:
            return f"{target.format(i=match.groupdict().get('i'))}.{match['leaf']}"
    return None


def roberta_name(ours: str) -> str | None:
    """RobertaForMaskedLM's name of one of the export's PyTorch names (None: RoBERTa has
    no such parameter; the position table is the caller's, it differs in shape)."""
    return _renamed(ours, MODULES)


def our_name(theirs: str) -> str | None:
    """The export's PyTorch name of a RoBERTa or BERT checkpoint's (RobertaModel's and
    BertModel's without the model prefix, *ForMaskedLM's with it), or None."""
    bare = re.sub(r"^(roberta|bert)\.", "", theirs)
    full = bare if bare.startswith(("lm_head.", "cls.")) else f"roberta.{bare}"
    return _renamed(full, [(b, a) for a, b in MODULES + _BERT_HEAD])


class HuggingFaceError(errors.UserError):
    """A Hugging Face directory that cannot be read as one of our encoders."""


def is_model_dir(path: paths.Path) -> bool:
    """Whether `path` looks like a Hugging Face model directory (config.json with a
    model_type, and weights), not a workdir of ours."""
    config = path / CONFIG_FILE
    if not config.is_file() or not any((path / f).is_file()
                                       for f in (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN)):
        return False
    try:
        return "model_type" in json.loads(paths.read_text(config))
    except (OSError, ValueError, TypeError):
        return False


def architecture(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Our architecture record (models/encoder.py) of the encoder a Hugging Face
    config.json describes; an HuggingFaceError for a model this import does not map."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise HuggingFaceError(f"{where}: model_type {kind!r} is not one this import maps; "
                           f"expected one of {', '.join(MODEL_TYPES)}")
    checks = {"hidden_act": ("gelu",), "position_embedding_type": ("absolute", None),
              "is_decoder": (False, None), "add_cross_attention": (False, None)}
    for name, allowed in checks.items():
        if config.get(name) not in allowed:
            raise HuggingFaceError(f"{where}: {name} {config.get(name)!r} has no counterpart in "
                               f"our encoder (expected {allowed[0]!r})")
    try:
        return encoder_lib.checked({
            "num_layers": int(config["num_hidden_layers"]), "d_model": int(config["hidden_size"]),
            "num_heads": int(config["num_attention_heads"]),
            "d_ff": int(config["intermediate_size"]), "pre_ln": False,
            "vocab_size": int(config["vocab_size"]),
            "max_positions": int(config["max_position_embeddings"]) - _first_position(config),
            "rel_pos_buckets": 0, "rel_pos_max_distance": 128, "rel_pos_bucket_fn": "t5",
            # transformers' default for both (a RoBERTa checkpoint states its 1e-5).
            "layer_norm_eps": float(config.get("layer_norm_eps", 1e-12))},
            where)
    except KeyError as e:
        raise HuggingFaceError(f"{where}: field {e.args[0]!r} is missing") from None


def _first_position(config: Mapping[str, Any]) -> int:
    """The row of the position table our position 0 reads: RoBERTa's padding offset."""
    return int(config.get("pad_token_id", 1)) + 1 if config["model_type"] in ROBERTA_TYPES else 0


def read_state(directory: paths.Path) -> dict[str, np.ndarray]:
    """The directory's weights, Hugging Face names -> float32 numpy arrays."""
    if (directory / SAFETENSORS).is_file() or (directory / SAFETENSORS_INDEX).is_file():
        from safetensors.numpy import load_file

        files = [SAFETENSORS]
        if not (directory / SAFETENSORS).is_file():  # shards named by their index
            index = json.loads(paths.read_text(directory / SAFETENSORS_INDEX))
            files = sorted(set(index["weight_map"].values()))
        state = {}
        for name in files:
            state.update(load_file(str(directory / name)))
        return {k: np.asarray(v, np.float32) for k, v in state.items()}
    try:
        import torch
    except ImportError:
        raise HuggingFaceError(f"config.init_from: {directory} holds {TORCH_BIN} only, which needs "
                           "PyTorch to read (pip install -r requirements-hf.txt), or convert "
                           f"it to {SAFETENSORS}") from None
    state = torch.load(str(directory / TORCH_BIN), map_location="cpu", weights_only=True)
    return {k: v.float().numpy() for k, v in state.items()}


def params(directory: paths.Path, config: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """({"encoder": ..., "lm_head": ...} as our Flax tree in the per-layer layout (numpy
    float32; the LM head only where the checkpoint has one), the Hugging Face names left
    out: a pooler, a next-sentence or classification head)."""
    where = f"config.init_from: {directory}/{CONFIG_FILE}"
    arch = architecture(config, where)
    state, dropped = {}, []
    for name, value in read_state(directory).items():
        modern = name.replace(".gamma", ".weight").replace(".beta", ".bias")  # old BERTs
        bare = re.sub(r"^(roberta|bert)\.", "", modern)
        ours = our_name(modern)
        if _FOLDED.fullmatch(bare):
            state[bare] = value
        elif ours is not None:
            state[ours] = value
        else:
            dropped.append(name)
    positions = state.get("embeddings.position_embeddings.weight")
    if positions is None:
        raise HuggingFaceError(f"config.init_from: {directory} has no position embeddings; it is "
                           "not a RoBERTa or BERT encoder's checkpoint")
    first = _first_position(config)
    table = positions[first:first + arch["max_positions"]]
    if "embeddings.token_type_embeddings.weight" in state:  # every input is of type 0
        table = table + state["embeddings.token_type_embeddings.weight"][0]
    state["encoder.position_embeddings.weight"] = table
    d = arch["d_model"]
    template = {"encoder": _encoder_shapes(arch),  # and the LM head of models/heads.py
                "lm_head": {"dense": {"kernel": _shape(d, d), "bias": _shape(d)},
                            "ln": {"scale": _shape(d), "bias": _shape(d)},
                            "bias": _shape(arch["vocab_size"])}}
    try:
        tree, missing = torch_names.from_state_dict(state, template)
    except ValueError as e:
        raise HuggingFaceError(f"config.init_from: {directory}: {e} (its config.json "
                           "describes another model)") from None
    encoder_missing = [m for m in missing if m.startswith("encoder.")]
    if encoder_missing:
        raise HuggingFaceError(f"config.init_from: {directory} lacks the encoder's "
                           f"{encoder_missing[0]} (Hugging Face names mapped onto ours)")
    if any(m.startswith("lm_head.") for m in missing):
        tree.pop("lm_head", None)  # a bare RobertaModel/BertModel: the encoder alone
    return tree, dropped


def _shape(*dims: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(dims, np.float32)


def _encoder_shapes(arch: dict[str, Any]) -> Any:
    """The encoder's parameter shapes (per layer), without allocating them."""
    cfg = encoder_lib.from_architecture(arch)
    tokens = jax.numpy.zeros((1, 8), jax.numpy.int32)
    return state_lib.abstract_params(
        lambda: encoder_lib.Encoder(cfg).init(jax.random.PRNGKey(0), tokens, tokens)["params"])
