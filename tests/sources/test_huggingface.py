"""A Hugging Face RoBERTa or BERT directory read as our encoder: on the same token ids our
encoder's hidden states and masked-LM logits are transformers' (float32, within 1e-4),
the export's PyTorch model given the imported weights computes them too (import ->
export -> PyTorch), and a model this import cannot map is one line naming the field.

Tiny random models are built here with transformers and saved with save_pretrained (the
files a hub download holds), as safetensors and as pytorch_model.bin. Needs PyTorch and
transformers (requirements-hf.txt).
"""

import json

import ml_collections
import numpy as np
import pytest

from maelm_jax import runs
from maelm_jax.export import run as export_run
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import mlm, torch_names
from maelm_jax.sources import source as source_lib
from maelm_jax.text import masking

pytestmark = pytest.mark.tier("slow")

torch = pytest.importorskip("torch", reason="the import's tests need PyTorch "
                            "(pip install -r requirements-hf.txt)")
transformers = pytest.importorskip("transformers", reason="the import's tests need "
                                   "transformers (pip install -r requirements-hf.txt)")

from maelm_jax.export.remote import configuration_maelm, modeling_maelm  # noqa: E402

TOLERANCE = 1e-4
VOCAB = 64
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=64)
IDS = [5, 17, 9, 40, 33, 8, 61, 12, 3]  # no padding id of either model


def _save(kind: str, directory, safetensors: bool, **changes):
    """A tiny random masked-LM model of `kind` saved into `directory`; returns it."""
    torch.manual_seed(0)
    if kind == "roberta":  # RoBERTa's shape: one token type, 2 + 16 positions
        config = transformers.RobertaConfig(**SIZES, max_position_embeddings=18,
                                            type_vocab_size=1, layer_norm_eps=1e-5, **changes)
        model = transformers.RobertaForMaskedLM(config)
    else:  # BERT's: two token types, its own LayerNorm epsilon (1e-12), imported as such
        config = transformers.BertConfig(**SIZES, max_position_embeddings=16, **changes)
        model = transformers.BertForMaskedLM(config)
    with torch.no_grad():  # LayerNorms and biases off their initial ones and zeros
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=safetensors)
    return model.eval()


@pytest.mark.parametrize("kind,safetensors", [("roberta", True), ("bert", False)])
def test_an_imported_encoder_computes_what_transformers_does(kind, safetensors, tmp_path):
    hf = _save(kind, tmp_path / kind, safetensors)
    source = source_lib.read(str(tmp_path / kind))
    assert source.kind == source_lib.HUGGING_FACE and source.step is None
    arch, _ = runs.architecture(source, VOCAB)
    assert arch["max_positions"] == 16 and arch["rel_pos_buckets"] == 0 and not arch["pre_ln"]
    assert arch["layer_norm_eps"] == (1e-5 if kind == "roberta" else 1e-12)
    cfg = encoder_lib.from_architecture(arch)
    params = source.params()
    ids = np.asarray([IDS], np.int32)
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(ids.astype(np.int64)), output_hidden_states=True)
    hidden = encoder_lib.Encoder(cfg).apply({"params": params["encoder"]}, ids,
                                            np.arange(len(IDS), dtype=np.int32)[None])
    np.testing.assert_allclose(np.asarray(hidden), out.hidden_states[-1].numpy(),
                               atol=TOLERANCE, rtol=TOLERANCE)
    # The LM head, tied to the word embeddings, at every position.
    positions = np.arange(len(IDS), dtype=np.int32)[None]
    batch = masking.MaskedBatch(inputs=ids, enc_index=positions, pred_index=positions,
                                targets=ids, weights=np.ones(ids.shape, np.float32))
    logits = mlm.MlmModel(mlm.MlmConfig(encoder=cfg)).apply({"params": params}, batch)
    np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), atol=TOLERANCE,
                               rtol=TOLERANCE)

    # Round trip: the export's PyTorch model, given the imported weights by the export's
    # names, computes transformers' outputs.
    quiet = ml_collections.ConfigDict({"dropout": 0.0, "attention_dropout": 0.0})
    hf_config = export_run._base_config(["MaelmForMaskedLM"], {
        **export_run._encoder_fields(arch, quiet), "objective": "mlm",
        "misaligned_positions": False, "pretraining_decoder": None})
    exported = modeling_maelm.MaelmForMaskedLM(
        configuration_maelm.MaelmConfig.from_dict(hf_config))
    exported.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in
                              torch_names.state_dict(params).items()}, strict=True)
    with torch.no_grad():
        again = exported.eval()(input_ids=torch.from_numpy(ids.astype(np.int64)))
    np.testing.assert_allclose(again.logits.numpy(), out.logits.numpy(), atol=TOLERANCE,
                               rtol=TOLERANCE)


def test_a_bare_encoder_imports_without_its_head(tmp_path):
    torch.manual_seed(0)
    config = transformers.RobertaConfig(**SIZES, max_position_embeddings=18, type_vocab_size=1)
    transformers.RobertaModel(config).save_pretrained(tmp_path / "bare")
    params = source_lib.read(str(tmp_path / "bare")).params()
    assert sorted(params) == ["encoder"]
    assert params["encoder"]["position_embeddings"]["embedding"].shape == (16, 32)


def test_a_model_it_cannot_map_is_one_line(tmp_path):
    _save("bert", tmp_path / "relu", True, hidden_act="relu")
    with pytest.raises(runs.CheckpointError, match=r"hidden_act 'relu' has no counterpart"):
        runs.architecture(source_lib.read(str(tmp_path / "relu")), VOCAB)
    _save("roberta", tmp_path / "other", True)
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(runs.CheckpointError, match=r"model_type 'gpt2' is not one this import"):
        source_lib.read(str(tmp_path / "other")).params()


def test_a_hugging_face_model_fine_tunes_in_the_glue_harness(tmp_path):
    """A local RoBERTa directory (its weights, config.json and its own byte-level BPE
    tokenizer.json, RoBERTa's special ids) as fine-tuning's init_from: its encoder and
    tokenizer, a new head, the harness unchanged (RTE's reference rows: the format, not
    the task)."""
    import hf_tokenizers

    from configs.finetune import glue as glue_config
    from maelm_jax.data import builtin_corpus
    from maelm_jax.finetune import train
    from maelm_jax.models import builder
    from maelm_jax.text import tokenizer as tokenizer_lib

    from conftest import require_shared_data

    glue = require_shared_data("glue")
    model_dir = tmp_path / "roberta"
    model_dir.mkdir()
    tok = tokenizer_lib.load_tokenizer(str(hf_tokenizers.roberta_like(
        builtin_corpus.iter_documents(), model_dir / "tokenizer.json")))
    torch.manual_seed(0)
    config = transformers.RobertaConfig(**{**SIZES, "vocab_size": tok.vocab_size},
                                        max_position_embeddings=66, type_vocab_size=1)
    transformers.RobertaForMaskedLM(config).save_pretrained(model_dir)
    p = runs.load_pretrained(str(model_dir), builder.Run())
    assert p.encoder_cfg.max_positions == 64 and p.encoder_cfg.rel_pos_buckets == 0
    assert p.tokenizer.special == tok.special and tok.special.pad == 1  # RoBERTa's own ids
    c = glue_config.get_config("rte")
    c.init_from = str(model_dir)
    c.data.data_dir = str(glue)
    c.data.max_seq_len, c.data.buckets = 64, (64,)
    c.train.batch_size = c.train.eval_batch_size = 8
    c.mesh.shape = (1, 1, 1)
    c.fast_compile = True  # 5 steps: compiling dominates
    c.train.num_epochs, c.train.log_every = 1, 1
    results = train.run(c, str(tmp_path / "rte"))
    assert results["init_from"] == f"Hugging Face roberta model {model_dir}"
    assert results["num_steps"] == 5 and 0.0 <= results["dev"]["accuracy"] <= 100.0
    # Without a tokenizer.json the tokenizer to use is asked for.
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(runs.CheckpointError, match=r"has no tokenizer.json; set "
                       r"config.tokenizer_path"):
        runs.load_pretrained(str(model_dir), builder.Run())


def test_a_hugging_face_model_continues_pretraining(tmp_path, caplog):
    """train.init_from a RoBERTa directory, with its tokenizer.json: the encoder and the LM
    head loaded, its 16 positions copied over the run's 32, the pooler dropped."""
    import logging

    import hf_tokenizers

    from maelm_jax.data import builtin_corpus
    from maelm_jax.pretrain import continued
    from maelm_jax.pretrain import train as pretrain_train
    from maelm_jax.text import tokenizer as tokenizer_lib

    from tiny_config import tiny_config

    model_dir = tmp_path / "roberta"
    model_dir.mkdir()
    path = hf_tokenizers.roberta_like(builtin_corpus.iter_documents(),
                                      model_dir / "tokenizer.json")
    tok = tokenizer_lib.load_tokenizer(str(path))
    torch.manual_seed(0)
    config = transformers.RobertaConfig(**{**SIZES, "vocab_size": tok.vocab_size},
                                        max_position_embeddings=18, type_vocab_size=1)
    model = transformers.RobertaForMaskedLM(config)
    model.roberta.pooler = transformers.models.roberta.modeling_roberta.RobertaPooler(config)
    model.save_pretrained(model_dir)
    c = tiny_config("mlm", str(path))
    c.model.rel_pos_buckets = 0  # RoBERTa has none
    c.tokenizer.vocab_size = tok.vocab_size
    c.train.init_from = str(model_dir)
    c.train.num_steps = c.train.checkpoint_every = c.train.eval_every = 2
    c.train.fill_mask_examples = 0
    # transformers' RobertaConfig says 1e-12 unless told: the run must say it too.
    with pytest.raises(continued.ContinuedError, match=r"^config.model.layer_norm_eps: "
                       r"Hugging Face roberta model .* trained with LayerNorm epsilon 1e-12, "
                       r"this run has 1e-05; set --config.model.layer_norm_eps=1e-12$"):
        pretrain_train.train_and_evaluate(c, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    c.model.layer_norm_eps = 1e-12
    with caplog.at_level(logging.INFO):
        pretrain_train.train_and_evaluate(c, str(tmp_path / "run"))
    (summary,) = [r.getMessage() for r in caplog.records if "started from" in r.getMessage()]
    assert (f"started from Hugging Face roberta model {model_dir}: loaded 41 (encoder, "
            "lm_head), new 0, dropped 2 (pooler) parameter arrays; ['encoder']"
            "['position_embeddings']['embedding'] 16 -> 32 rows" in summary), summary
