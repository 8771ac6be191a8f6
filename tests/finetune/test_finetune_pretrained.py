"""From a tiny pretraining run: loading only the encoder, refusing what does not fit,
SST-2 well above the majority class, and a fine-tuned workdir as the next init_from."""

import json
import logging
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs.finetune import glue as glue_config
from maelm_jax import runs
from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import encoder as finetune_encoder
from maelm_jax.finetune import train
from maelm_jax.models import builder
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.text import tokenizer as tokenizer_lib

from conftest import require_shared_data
from tiny_config import tiny_config

# What a fine-tuning run sets on the encoder it reads back (models/builder.py).
WITH_DROPOUT = builder.Run(dropout=0.1, attention_dropout=0.1)

pytestmark = pytest.mark.tier("integration")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tiny_tokenizer):
    """A 10-step tiny MAE-LM pretraining: config.json + checkpoints/10."""
    c = tiny_config("maelm", tiny_tokenizer.model_path)
    c.data.seq_len = 64  # the encoder's positions: fine-tuning sequences of up to 64 tokens
    c.train.num_steps = c.train.checkpoint_every = c.train.eval_every = 10
    c.train.log_every = 5
    workdir = tmp_path_factory.mktemp("pretrain")
    pretrain_train.train_and_evaluate(c, str(workdir))
    return workdir


def _leaves(tree):
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_loads_only_the_encoder_from_a_workdir_or_one_checkpoint(pretrained, caplog):
    with caplog.at_level(logging.WARNING):
        p = runs.load_pretrained(str(pretrained), WITH_DROPOUT)
    # A good checkpoint loads without a warning (orbax's Checkpointer warned that the step's
    # metadata file is not inside the item, on every good checkpoint).
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert p.description == f"pretraining checkpoint {pretrained}/checkpoints/10"
    assert p.encoder_cfg.vocab_size == p.tokenizer.vocab_size
    assert (p.encoder_cfg.stack.num_layers, p.encoder_cfg.stack.d_model) == (2, 32)
    full = ocp.PyTreeCheckpointer().restore(pretrained / "checkpoints" / "10" / "state")
    assert set(full["params"]) >= {"encoder", "decoder"}  # the decoder is left behind
    want, got = _leaves(full["params"]["encoder"]), _leaves(p.params)
    assert want.keys() == got.keys()
    assert all(np.array_equal(want[k], got[k]) for k in want)
    step = runs.load_pretrained(str(pretrained / "checkpoints" / "10"), WITH_DROPOUT)
    assert step.description == p.description



@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_a_pretraining_run_that_has_not_finished_is_used_with_a_warning(pretrained, tmp_path,
                                                                        caplog):
    stopped = _copy_run(pretrained, tmp_path, lambda c: c["train"].update(num_steps=20))
    with caplog.at_level(logging.WARNING):
        p = runs.load_pretrained(str(stopped), WITH_DROPOUT)
    assert p.description.endswith("checkpoints/10")
    assert f"{stopped} is a pretraining run that has not finished: its latest checkpoint is " \
           "step 10 of 20" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # named: meant
        runs.load_pretrained(str(stopped / "checkpoints" / "10"), WITH_DROPOUT)
    assert "has not finished" not in caplog.text


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_random_weights_keep_the_architecture_and_tokenizer_of_init_from(pretrained):
    """init_weights="random": the from-scratch control of a pretraining run."""
    c = glue_config.get_config("sst2")
    c.init_from, c.data.data_dir = str(pretrained), "glue"
    loaded = finetune_encoder.encoder_and_tokenizer(c)
    c.init_weights = "random"
    finetune_config.validate(c)
    cfg, params, tok, description = finetune_encoder.encoder_and_tokenizer(c)
    assert params is None  # fresh weights from the seed, as with no init_from
    assert cfg == loaded[0] and tok.model_path == loaded[2].model_path
    assert description == f"random weights in the architecture of {loaded[3]}"
    c.init_from = ""
    c.tokenizer_path = tok.model_path
    with pytest.raises(finetune_config.FinetuneConfigError,
                       match=r"^config.init_from: expected a workdir to take the architecture "
                             r"and tokenizer from \(init_weights='random'\), got nothing$"):
        finetune_config.validate(c)


def _copy_run(pretrained, tmp_path, edit):
    """A workdir whose config.json is edited, pointing at the same checkpoints."""
    run = tmp_path / "run"
    run.mkdir()
    config = json.loads((pretrained / "config.json").read_text())
    edit(config)
    (run / "config.json").write_text(json.dumps(config))
    (run / "checkpoints").symlink_to(pretrained / "checkpoints")
    return run


def test_refuses_another_vocabulary(pretrained, tmp_path):
    documents = ["the quick brown fox jumps over the lazy dog.\nA Wizard's job is to vex chumps."]
    other = tokenizer_lib.train_tokenizer(documents, str(tmp_path / "other.model"), 300)
    with pytest.raises(runs.CheckpointError, match=r"vocabulary of 512 pieces but the "
                                                      r"tokenizer .*other.model has 300"):
        runs.load_pretrained(str(pretrained), WITH_DROPOUT, other.model_path)


def test_refuses_other_widths_and_depths(pretrained, tmp_path):
    wide = _copy_run(pretrained, tmp_path, lambda c: c["model"].update(d_model=64))
    with pytest.raises(runs.CheckpointError,
                       match=r"parameter \['ln_embed'\]\['bias'\] has shape \(32,\), the "
                             r"encoder in its config needs \(64,\)"):
        runs.load_pretrained(str(wide), WITH_DROPOUT)
    shutil.rmtree(wide)
    deep = _copy_run(pretrained, tmp_path, lambda c: c["model"].update(num_layers=3))
    with pytest.raises(runs.CheckpointError, match=r"missing \['stack'\]\['layer_2'\]"):
        runs.load_pretrained(str(deep), WITH_DROPOUT)


def test_refuses_what_is_not_a_pretraining_checkpoint(pretrained, tmp_path):
    with pytest.raises(runs.CheckpointError, match=r"config.init_from: .* does not exist"):
        runs.load_pretrained(str(tmp_path / "nowhere"), WITH_DROPOUT)
    with pytest.raises(runs.CheckpointError, match="neither a workdir"):
        runs.load_pretrained(str(tmp_path), WITH_DROPOUT)
    # An orbax checkpoint of something else: no params["encoder"].
    other = tmp_path / "other"
    manager = ocp.CheckpointManager(other / "checkpoints", item_names=("state",))
    manager.save(3, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": {"dense": np.zeros(3, np.float32)}})))
    manager.wait_until_finished()
    manager.close()
    shutil.copyfile(pretrained / "config.json", other / "config.json")
    with pytest.raises(runs.CheckpointError, match=r"holds no params\['encoder'\]; it is not "
                                                      r"a pretraining or fine-tuning checkpoint"):
        runs.load_pretrained(str(other), WITH_DROPOUT)
    # A state item orbax cannot read: damage where the step's digests say so, else not a
    # checkpoint (those written before digests existed have none).
    unreadable = tmp_path / "unreadable"
    shutil.copytree(pretrained, unreadable)
    state = unreadable / "checkpoints" / "10" / "state"
    shutil.rmtree(state)
    state.mkdir()
    with pytest.raises(runs.CheckpointError, match=r"10 cannot be restored \(.*_METADATA is "
                                                      r"missing\); it may be damaged"):
        runs.load_pretrained(str(unreadable), WITH_DROPOUT)
    (state.parent / "digests.json").unlink()
    with pytest.raises(runs.CheckpointError, match=r"config.init_from: .*10/state is not an "
                                                      r"orbax checkpoint \("):
        runs.load_pretrained(str(unreadable), WITH_DROPOUT)
    # A config.json that is not a pretraining config.
    broken = _copy_run(pretrained, tmp_path, lambda c: c.update(model="tiny"))
    with pytest.raises(runs.CheckpointError, match="is not a pretraining config"):
        runs.load_pretrained(str(broken), WITH_DROPOUT)


def _finetuning_run(pretrained, tmp_path, record):
    """A finished fine-tuning workdir with this encoder.json over the pretraining
    checkpoints (they hold params["encoder"] as a fine-tuning checkpoint does)."""
    run = tmp_path / "finetuned"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"mode": "finetune"}))
    (run / "results.json").write_text("{}")
    (run / "encoder.json").write_text(json.dumps(record))
    (run / "checkpoints").symlink_to(pretrained / "checkpoints")
    return run


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_records_written_before_a_field_existed_still_load(pretrained, tmp_path,
                                                           tiny_tokenizer):
    # A pretraining config.json from before the encoder's later fields.
    later = ("rel_pos_bucket_fn", "rel_pos_init", "activation_dropout", "attention_impl",
             "scan_layers", "remat_policy", "misaligned_positions")
    old_run = _copy_run(pretrained, tmp_path,
                        lambda c: [c["model"].pop(k) for k in later])
    p = runs.load_pretrained(str(old_run), WITH_DROPOUT)
    assert p.encoder_cfg.rel_pos_bucket_fn == "t5"
    # A fine-tuning run's encoder.json as the first release wrote it.
    record = encoder_lib.architecture(p.encoder_cfg)
    del record["rel_pos_bucket_fn"]
    run = _finetuning_run(pretrained, tmp_path, record)
    old = runs.load_pretrained(str(run), WITH_DROPOUT, tiny_tokenizer.model_path)
    assert old.description.startswith("fine-tuning checkpoint")
    assert old.encoder_cfg == p.encoder_cfg


def test_a_wrong_encoder_json_field_is_named(pretrained, tmp_path, tiny_tokenizer):
    with open(pretrained / "config.json") as f:
        model = json.load(f)["model"]
    record = {**encoder_lib.model_architecture(model, vocab_size=tiny_tokenizer.vocab_size,
                                               max_positions=64), "d_model": "32"}
    run = _finetuning_run(pretrained, tmp_path, record)
    with pytest.raises(runs.CheckpointError,
                       match=rf"^config.init_from: {run}/encoder.json: field 'd_model' must "
                             rf"be an integer, got '32'$"):
        runs.load_pretrained(str(run), WITH_DROPOUT, tiny_tokenizer.model_path)


def _sst2_config(init_from, data_dir):
    c = glue_config.get_config("sst2")
    c.init_from = init_from
    c.data.data_dir = data_dir
    c.data.max_seq_len = 64
    c.data.buckets = (32, 64)
    c.data.max_train_examples = 2000  # of 67K: a quick test
    c.model.dropout = c.model.attention_dropout = 0.0
    c.train.batch_size, c.train.eval_batch_size = 16, 128
    c.train.num_epochs, c.train.learning_rate, c.train.log_every = 3, 1e-3, 25
    c.mesh.shape = (1, 1, 1)  # one device: faster than 8 simulated ones on a small CPU
    return c


@pytest.fixture(scope="module")
def sst2_run(pretrained, tmp_path_factory):
    c = _sst2_config(str(pretrained), str(require_shared_data("glue")))
    workdir = tmp_path_factory.mktemp("sst2")
    return workdir, train.run(c, str(workdir))


def test_sst2_from_the_tiny_checkpoint_beats_the_majority_class(sst2_run):
    workdir, results = sst2_run
    accuracy = results["dev"]["accuracy"]
    # The 512-piece tokenizer, trained on Python docstrings, spells most sentiment words
    # letter by letter: a bag-of-pieces logistic regression on the same 2000 examples gets
    # about 66 %. This run gets about 64 %.
    print(f"SST-2 dev accuracy after a 10-step tiny pretraining and 3 epochs on 2000 "
          f"examples: {accuracy:.1f} % (majority class: 50.9 %)")
    assert accuracy > 58.0
    assert results["init_from"].startswith("pretraining checkpoint")
    lines = (workdir / "predictions" / "SST-2.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 1 + 1821
    assert {line.split("\t")[1] for line in lines[1:]} <= {"0", "1"}


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_a_finetuned_workdir_initialises_the_next_task(sst2_run, tmp_path):
    """RoBERTa's MNLI -> RTE: the encoder from a fine-tuning run, a new head."""
    workdir, _ = sst2_run
    p = runs.load_pretrained(str(workdir), WITH_DROPOUT)
    assert p.description.startswith("fine-tuning checkpoint")
    saved = ocp.PyTreeCheckpointer().restore(next((workdir / "checkpoints").iterdir()) / "state")
    want = _leaves(saved["params"]["encoder"])
    assert all(np.array_equal(want[k], v) for k, v in _leaves(p.params).items())
    c = glue_config.get_config("rte")
    c.init_from = str(workdir)
    c.data.data_dir = str(require_shared_data("glue"))  # 40 rows: the format, not the task
    c.data.max_seq_len, c.data.buckets = 64, (64,)
    c.train.batch_size = c.train.eval_batch_size = 8
    c.mesh.shape = (2, 1, 1)  # data parallel over 2 of the simulated devices
    c.fast_compile = True  # 5 steps: compiling dominates
    c.train.num_epochs, c.train.log_every = 1, 1
    results = train.run(c, str(tmp_path / "rte"))
    assert results["init_from"].startswith("fine-tuning checkpoint")
    assert results["num_steps"] == 5 and 0.0 <= results["dev"]["accuracy"] <= 100.0
    assert (tmp_path / "rte" / "predictions" / "RTE.tsv").is_file()
