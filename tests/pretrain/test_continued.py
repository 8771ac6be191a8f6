"""Continued pretraining (train.init_from): an MLM run continued as MAE-LM at twice its
length loads the encoder and the LM head, starts the decoder, copies the position table
over the new positions, records where it started (and its export's model card says so),
and resumes exactly; shapes that cannot be reconciled are one line naming the parameter."""

import json
import logging

import jax
import numpy as np
import pytest

from maelm_jax.export import config as export_config
from maelm_jax.export import run as export_run
from maelm_jax.pretrain import continued
from maelm_jax.pretrain import train as pretrain_train

from tiny_config import tiny_config, tiny_model

pytestmark = pytest.mark.tier("integration")


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory, tiny_tokenizer):
    """A 4-step tiny MLM pretraining at length 32: config.json + checkpoints/4."""
    c = tiny_config("mlm", tiny_tokenizer.model_path)
    c.train.num_steps = c.train.checkpoint_every = c.train.eval_every = 4
    workdir = tmp_path_factory.mktemp("mlm")
    pretrain_train.train_and_evaluate(c, str(workdir))
    return workdir


def _continued(tokenizer_path, init_from, num_steps):
    """MAE-LM at length 64 from `init_from`, reading on where its data stopped, at a
    constant rate (a run stopped early then has the same schedule as a whole one)."""
    c = tiny_config("maelm", tokenizer_path)
    c.data.seq_len = 64
    c.train.init_from, c.train.continue_data = str(init_from), True
    c.train.num_steps, c.train.checkpoint_every, c.train.eval_every = num_steps, 2, 4
    c.train.lr_schedule = "constant"
    return c


def _losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split") == "train"}


def test_an_mlm_run_continues_as_maelm_at_a_longer_length_and_resumes_exactly(
        mlm_run, tiny_tokenizer, tmp_path, caplog):
    whole = tmp_path / "whole"
    with caplog.at_level(logging.INFO):
        pretrain_train.train_and_evaluate(
            _continued(tiny_tokenizer.model_path, mlm_run, 4), str(whole))
    summary = [r.getMessage() for r in caplog.records if "started from" in r.getMessage()]
    assert len(summary) == 1, summary
    assert (f"started from pretraining checkpoint {mlm_run}/checkpoints/4: loaded" in summary[0]
            and "(encoder, lm_head), new" in summary[0] and "(decoder), dropped 0" in summary[0]
            and "['encoder']['position_embeddings']['embedding'] 32 -> 64 rows" in summary[0])
    record = json.loads((whole / "init_from.json").read_text())
    assert record["init_from"] == f"{mlm_run}/checkpoints/4" and record["step"] == 4
    assert record["kind"] == "pretraining" and record["data_offset"] == 4
    assert all(n.startswith("['decoder']") for n in record["new"]) and record["new"]
    assert record["dropped"] == [] and len(record["extended"]) == 1
    recorded = json.loads((whole / "config.json").read_text())
    assert recorded["train"]["init_from"] == str(mlm_run)

    # Stopped after 2 steps and started again: the steps an uninterrupted run takes (the
    # source is not read again: its parameters are in the checkpoint, the data offset in
    # init_from.json).
    stopped = tmp_path / "stopped"
    pretrain_train.train_and_evaluate(
        _continued(tiny_tokenizer.model_path, mlm_run, 2), str(stopped))
    moved = mlm_run.with_name(mlm_run.name + "_moved")  # nor need it be where it was
    mlm_run.rename(moved)
    try:
        pretrain_train.train_and_evaluate(
            _continued(tiny_tokenizer.model_path, mlm_run, 4), str(stopped))
    finally:
        moved.rename(mlm_run)
    assert _losses(stopped) == _losses(whole) and sorted(_losses(whole)) == [1, 2, 3, 4]
    assert json.loads((stopped / "init_from.json").read_text()) == record

    # Exported, the model card says where it started; transformers loads it.
    c = export_config.export_defaults()
    c.init_from = str(whole)
    export_run.run(c, str(tmp_path / "hf"))
    assert (f"| started from | pretraining checkpoint {mlm_run}/checkpoints/4 |"
            in (tmp_path / "hf" / "README.md").read_text())
    transformers = pytest.importorskip("transformers", reason="loading the export needs "
                                       "transformers (pip install -r requirements-hf.txt)")
    model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf",
                                                              trust_remote_code=True)
    assert model.config.max_position_embeddings == 64 and model.config.objective == "maelm"


@pytest.mark.parametrize("change, named", [
    ({"d_model": 64, "d_ff": 128}, r"parameter \['encoder'\]\['ln_embed'\]\['bias'\] has shape "
     r"\(32,\), this run's model needs \(64,\)"),
    ({"num_layers": 3}, r"parameter \['encoder'\]\['stack'\]\['layer_2'\]\S+ is only in this "
     r"run's model \(another depth\)"),
    ({"num_heads": 4}, r"parameter \['encoder'\]\['relative_bias'\]\['rel_embedding'\] has "
     r"shape \(8, 2\), this run's model needs \(8, 4\)"),
])
def test_shapes_that_cannot_be_reconciled_are_one_line(mlm_run, tiny_tokenizer, change, named,
                                                       tmp_path):
    c = tiny_config("maelm", tiny_tokenizer.model_path)
    for name, value in change.items():
        c.model[name] = value
    c.train.init_from = str(mlm_run)
    _, _, params = tiny_model(c)
    with pytest.raises(continued.ContinuedError, match=named):
        continued.load(continued.read_source(c, tmp_path), params, stacked=False)


def test_a_hugging_face_model_has_no_data_to_continue(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    c = tiny_config("maelm")
    c.train.init_from, c.train.continue_data = str(tmp_path / "hf"), True
    with pytest.raises(continued.ContinuedError, match=r"^config.train.continue_data: .* is a "
                       r"huggingface model, not a pretraining run"):
        continued.read_source(c, tmp_path)


def test_a_scanned_run_loads_the_same_parameters(mlm_run, tiny_tokenizer, tmp_path):
    """model.scan_layers: the source's layers are read stacked, the same values."""
    from maelm_jax.models import layer_layout

    c = tiny_config("maelm", tiny_tokenizer.model_path)
    c.train.init_from = str(mlm_run)
    source = continued.read_source(c, tmp_path)
    per_layer = continued.load(source, tiny_model(c)[2], stacked=False)
    c.model.scan_layers = True
    stacked = continued.load(source, tiny_model(c)[2], stacked=True)
    assert len(stacked.loaded) < len(per_layer.loaded)  # a leaf per weight, not per layer
    want = layer_layout.to_stacked(per_layer.params["encoder"])
    got = stacked.params["encoder"]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_source_that_does_not_fit_leaves_the_workdir_as_it_was(mlm_run, tiny_tokenizer,
                                                                 tmp_path):
    c = tiny_config("maelm", tiny_tokenizer.model_path)
    c.model.d_model, c.model.d_ff = 64, 128
    c.train.init_from = str(mlm_run)
    with pytest.raises(continued.ContinuedError, match=r"^config.train.init_from: .* has "
                       r"shape \(32,\), this run's model needs \(64,\)"):
        pretrain_train.train_and_evaluate(c, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
