"""The model card (README.md) of an export: what the model is, what it was trained on and
how far, its last evaluation, how it was made and how to load it."""

from __future__ import annotations

import json
from typing import Any

import ml_collections

from maelm_jax.infra import markdown, paths

_DECODERS = {"self": "MAE-LM / 3ML_self: a self decoder over the whole sequence",
             "cross": "3ML_cross: a cross-attention decoder over the [MASK] positions",
             "causal_cross": "MAE-LM Table 2: causal self-attention + cross-attention decoder",
             "cross_only": "MAE-LM Table 2: cross-attention-only decoder"}


def objective_name(run_cfg: ml_collections.ConfigDict) -> str:
    """The pretraining objective in words."""
    if run_cfg.objective == "mlm":
        return (f"MLM (RoBERTa-style: the encoder reads [MASK]), "
                f"{run_cfg.masking.mask_ratio:.0%} of positions predicted")
    return (f"[MASK] tokens left out of the encoder ({_DECODERS[run_cfg.model.decoder.kind]}"
            f"), {run_cfg.masking.mask_ratio:.0%} of positions predicted")


def _loading(stock: bool) -> list[str]:
    """How to load the export: transformers' own RoBERTa classes, or ours from the code
    shipped beside the weights."""
    if stock:
        intro = ("The encoder is a plain RoBERTa (post-LN, learned absolute positions), "
                 "written in transformers' own RoBERTa classes: no code ships with it.")
        remote = ""
    else:
        intro = ("The modelling code ships in this directory (stock transformers classes "
                 "have no T5 relative position bias in an encoder, no pre-LN final LayerNorm "
                 "and no MAE-LM decoder), so loading needs `trust_remote_code=True`:")
        remote = ", trust_remote_code=True"
    return [intro, "", "```python",
            "from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer, pipeline",
            f"tokenizer = AutoTokenizer.from_pretrained(path{remote})",
            f"encoder = AutoModel.from_pretrained(path{remote})",
            "hidden = encoder(**tokenizer(\"A text.\", return_tensors=\"pt\")).last_hidden_state",
            "fill = pipeline(\"fill-mask\", model=AutoModelForMaskedLM.from_pretrained(",
            f"    path{remote}), tokenizer=tokenizer)",
            "```", "",
            "The tokenizer is a fast one (`tokenizer.json`), with offset mappings for "
            "transformers' question-answering and token-classification scripts.", ""]


def _table(rows: list[tuple[str, Any]]) -> str:
    """A key-value table: no column names (a blank header), a row per (key, value)."""
    return "\n".join(markdown.table([markdown.BLANK] * 2, rows))


def model_card(hf_config: dict, facts: dict, run_dir: paths.Path, command: str,
               stock: bool = False) -> str:
    """The README.md text; `hf_config` is the export's config.json in our classes, `stock`
    says it was written in transformers' RoBERTa classes (export/roberta.py)."""
    c = hf_config
    arch = [("layers", c["num_hidden_layers"]), ("hidden size", c["hidden_size"]),
            ("heads", c["num_attention_heads"]), ("FFN size", c["intermediate_size"]),
            ("LayerNorm", "pre-LN" if c["pre_ln"] else "post-LN"),
            ("positions", c["max_position_embeddings"]),
            ("relative position bias", (f"{c['rel_pos_buckets']} buckets "
                                        f"({c['rel_pos_bucket_fn']}), max distance "
                                        f"{c['rel_pos_max_distance']}")
             if c["rel_pos_buckets"] else "none"),
            ("vocabulary", f"{c['vocab_size']} {facts['tokenizer']} pieces")]
    head = c["architectures"][0] if not stock else (
        "RobertaForMaskedLM" if c["architectures"] == ["MaelmForMaskedLM"]
        and c["objective"] == "mlm" else "RobertaModel")
    lines = [f"# A maelm_jax {facts['kind']} export", "",
             f"Exported from `{run_dir}` by maelm_jax. Main class: `{head}`.", ""]
    if facts["kind"] == "pretraining":
        corpus = facts["corpus"]
        sources = ("unknown (the run's prepared data was not found)" if corpus is None else
                   ", ".join(f"{name}: {s.get('tokens', '?')} tokens, "
                             f"{s.get('train_blocks', '?')} training blocks"
                             for name, s in corpus["sources"].items()))
        lines += ["## Training", "", _table([
            ("objective", facts["objective"]),
            ("started from", facts.get("init_from") or "random initialisation"),
            ("steps", facts["step"]),
            ("tokens seen", f"{facts['tokens_seen']:,}"),
            ("corpus fingerprint", corpus["fingerprint"] if corpus else "unknown"),
            ("corpus", sources),
        ]), ""]
    else:
        lines += ["## Fine-tuning", "", _table([
            ("task", facts["task"]), ("started from", facts["init_from"] or "—"),
            ("labels", ", ".join(c.get("id2label", {}).values()) or "start / end logits"),
        ]), ""]
    lines += ["## Last evaluation", "",
              "```json", json.dumps(facts["metrics"], indent=2, sort_keys=True), "```", "",
              "## Architecture", "", _table(arch), "",
              "## Load it", "", *_loading(stock),
              "`AutoModelForSequenceClassification` and `AutoModelForQuestionAnswering` load "
              "the encoder with a new head" + ("." if stock else " (or this run's head, if it "
                                               "was fine-tuned for that)."), "",
              "## How it was made", "", "```", command, "```", "",
              "The run's own config is `training_config.json`.", ""]
    return "\n".join(lines)
