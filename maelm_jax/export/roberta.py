"""An export in transformers' own RoBERTa classes (``config.classes = "roberta"``): for
an encoder that is a plain RoBERTa, config.json of model_type ``roberta`` and the weights
under RobertaModel's names, so that the Auto classes load it without trust_remote_code.

Plain means what RoBERTa computes: post-LN blocks (``model.pre_ln=False``) and learned
absolute positions alone (``model.rel_pos_buckets=0``); the exact GELU, LayerNorm's 1e-5
and the tied masked-LM head are ours already. A pretraining run with objective ``mlm``
is a RobertaForMaskedLM (its LM head is RoBERTa's: dense, GELU, LayerNorm, the tied
table and a bias); any other run exports its encoder as a RobertaModel (MAE-LM's head
reads the decoder, which RoBERTa has not; a fine-tuned head is not RoBERTa's).

RoBERTa numbers positions from ``pad_token_id + 1`` (its padding offset), so our position
table of L rows becomes rows ``pad + 1 ..`` of one of ``L + pad + 1`` rows, the rows
before it zero (never read: only padding has those ids); the one token-type row is zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from maelm_jax.export.config import ExportError
from maelm_jax.sources import huggingface

MODEL_TYPE = "roberta"
_POSITIONS = "encoder.position_embeddings.weight"


def is_masked_lm(ours: dict[str, Any]) -> bool:
    """Whether the export of config.json `ours` (our classes') is a RobertaForMaskedLM."""
    return ours["architectures"] == ["MaelmForMaskedLM"] and ours["objective"] == "mlm"


def hf_config(ours: dict[str, Any]) -> dict[str, Any]:
    """config.json of RobertaForMaskedLM or RobertaModel for the export whose config.json in
    our classes is `ours` (export/run.py's); ExportError unless its encoder is plain."""
    for field, plain in (("pre_ln", False), ("rel_pos_buckets", 0)):
        if ours[field] != plain:
            raise ExportError(f"config.classes: 'roberta' needs a plain RoBERTa encoder "
                              f"(model.pre_ln=False, model.rel_pos_buckets=0); the run has "
                              f"model.{field}={ours[field]!r}; export it with "
                              "classes='maelm'")
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "hidden_dropout_prob", "attention_probs_dropout_prob",
            "layer_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "torch_dtype")
    return {
        "architectures": ["RobertaForMaskedLM" if is_masked_lm(ours) else "RobertaModel"],
        "model_type": MODEL_TYPE, **{k: ours[k] for k in keep}, "hidden_act": "gelu",
        "max_position_embeddings": ours["max_position_embeddings"] + ours["pad_token_id"] + 1,
        "type_vocab_size": 1, "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    }


def state_dict(state: dict[str, np.ndarray], pad: int,
               masked_lm: bool) -> dict[str, np.ndarray]:
    """RobertaForMaskedLM's (or RobertaModel's: the encoder alone, without the "roberta."
    prefix) state dict of the export's `state` (torch_names.state_dict's; `pad`: the
    tokenizer's pad id, RoBERTa's padding offset)."""
    out = {}
    for name, value in state.items():
        if not masked_lm and not name.startswith("encoder."):
            continue  # a decoder, or a fine-tuned head: not RobertaModel's
        if name == _POSITIONS:
            table = np.zeros((value.shape[0] + pad + 1, value.shape[1]), np.float32)
            table[pad + 1:] = value
            out["roberta.embeddings.position_embeddings.weight"] = table
            out["roberta.embeddings.token_type_embeddings.weight"] = np.zeros(
                (1, value.shape[1]), np.float32)
            continue
        # The one table of names the import of RoBERTa checkpoints reads the other way.
        theirs = huggingface.roberta_name(name)
        if theirs is None:  # a plain encoder and an MLM head hold nothing else
            raise ValueError(f"{name} has no RoBERTa counterpart")
        out[theirs] = value
    if masked_lm:  # the tied projection, stored as transformers saves it
        out["lm_head.decoder.weight"] = out["roberta.embeddings.word_embeddings.weight"]
        out["lm_head.decoder.bias"] = out["lm_head.bias"]
        return out
    return {name.removeprefix("roberta."): value for name, value in out.items()
            if name.startswith("roberta.")}
