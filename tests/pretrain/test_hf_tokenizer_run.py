"""A pretraining run with a Hugging Face tokenizer.json (BERT's layout: [PAD] 0, [UNK] 3,
[CLS] 4, [SEP] 5, [MASK] 6, built locally): the packer, the masker (3ML's random tokens
too), the model, the closing fill-mask examples and the checks of a prepared set take the
special ids from the tokenizer, and an export ships it as tokenizer.json."""

import json

import hf_tokenizers
import numpy as np
import pytest

from maelm_jax.data import builtin_corpus, run_data, shards
from maelm_jax.export import config as export_config
from maelm_jax.export import run as export_run
from maelm_jax.fill_mask import run as fill_mask_run
from maelm_jax.infra import paths
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.pretrain.objectives import recipes
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.workdirs import layout

from tiny_config import tiny_config

pytestmark = pytest.mark.tier("integration")


def test_a_run_with_a_bert_tokenizer_uses_its_special_ids(tmp_path):
    documents = list(builtin_corpus.iter_documents())
    (tmp_path / "bert").mkdir()
    path = hf_tokenizers.bert_like(documents, tmp_path / "bert" / "tokenizer.json")
    tok = tokenizer_lib.load_tokenizer(str(path))
    special = tok.special
    assert special == tokenizer_lib.SpecialIds(pad=0, unk=3, bos=4, eos=5, mask=6)
    # 3ML_self: [MASK], random and kept tokens, and a decoder that fills in [MASK].
    c = recipes.MODELS["3ml_self"].apply(tiny_config("maelm", str(path)))
    c.tokenizer.vocab_size = tok.vocab_size
    c.train.num_steps = c.train.checkpoint_every = c.train.eval_every = 4
    c.train.fill_mask_examples = 2
    workdir = tmp_path / "run"
    metrics = pretrain_train.train_and_evaluate(c, str(workdir))
    assert np.isfinite(metrics["loss"])
    # The blocks were cut with [CLS] first and [SEP] after each document, and the set
    # records the tokenizer by its file and its special ids.
    (prepared,) = (workdir / layout.DATA_DIR).iterdir()
    manifest = shards.read_manifest(paths.Path(prepared))
    assert manifest["tokenizer"] == layout.HF_TOKENIZER_FILE
    assert manifest["special_ids"] == special.to_json()
    blocks = np.asarray(shards.load(paths.Path(prepared),
                                    run_data.source_weights(c)).train["main"][:])
    assert np.all(blocks[:, 0] == special.bos) and np.any(blocks[:, 1:] == special.eos)
    assert not np.isin(blocks, [special.pad, special.mask]).any()
    # Fill-mask marks pieces with the tokenizer's own [MASK], word starts by WordPiece's.
    examples = fill_mask_run.after_pretraining(str(workdir))  # main.py's, after the run
    assert examples.count("[MASK] 1") == 2
    masker = fill_mask_run.FillMasker.from_workdir(str(workdir))
    ids, masked = masker.encode_text("the [MASK] sat on the mat.")
    assert ids[0] == special.bos and ids[-1] == special.eos and ids[masked[0]] == special.mask
    assert masker.predict(ids, masked).top_ids.shape == (1, 5)
    # A prepared set and a run that name different tokenizers do not agree.
    other = hf_tokenizers.roberta_like(documents, tmp_path / "roberta.json")
    c.data.prepared, c.tokenizer.model_path = str(prepared), str(other)
    with pytest.raises(tokenizer_lib.TokenizerError, match=r"^config.tokenizer.model_path: "
                       r".*roberta\.json is not the tokenizer .* was prepared with"):
        run_data.shards_tokenizer(c, paths.Path(tmp_path / "other"))
    # The export ships the tokenizer.json, in the run's special ids.
    e = export_config.export_defaults()
    e.init_from = str(workdir)
    export_run.run(e, str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"],
            config["mask_token_id"]) == (0, 4, 5, 6)
    assert (tmp_path / "hf" / layout.HF_TOKENIZER_FILE).is_file()
    assert not (tmp_path / "hf" / layout.TOKENIZER_FILE).exists()
