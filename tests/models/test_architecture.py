"""The encoder's architecture record (models/encoder.py): a round trip through JSON, one-line
errors naming the field, and one EncoderConfig for pretraining and fine-tuning alike."""

import dataclasses
import json

import jax.numpy as jnp
import pytest

from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import encoder as finetune_encoder
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import layers
from maelm_jax.pretrain import setup as setup_lib

from tiny_config import tiny_config

pytestmark = pytest.mark.tier("integration")

RECORD = {"num_layers": 2, "d_model": 32, "num_heads": 4, "d_ff": 64, "pre_ln": False,
          "vocab_size": 100, "max_positions": 40, "rel_pos_buckets": 8,
          "rel_pos_max_distance": 16, "rel_pos_bucket_fn": "t5"}


def _encoder(rel_pos_buckets=32, bucket_fn="t5", pre_ln=False, dropout=0.0,
             dtype=jnp.float32):
    stack = layers.StackConfig(num_layers=3, d_model=48, num_heads=6, d_ff=96, pre_ln=pre_ln,
                               dropout=dropout, attention_dropout=dropout, dtype=dtype)
    return encoder_lib.EncoderConfig(stack=stack, vocab_size=300, max_positions=64,
                                     rel_pos_buckets=rel_pos_buckets, rel_pos_max_distance=96,
                                     rel_pos_bucket_fn=bucket_fn)


@pytest.mark.parametrize("cfg", [
    _encoder(),
    _encoder(rel_pos_buckets=0, pre_ln=True),
    _encoder(bucket_fn="maelm", dropout=0.1, dtype=jnp.bfloat16),
])
def test_the_record_round_trips_through_json(cfg):
    record = json.loads(json.dumps(encoder_lib.architecture(cfg)))
    assert list(record) == list(encoder_lib.ARCHITECTURE)
    assert encoder_lib.architecture(encoder_lib.from_architecture(record)) == record
    # The run's own fields come back from the arguments, not the record.
    assert encoder_lib.from_architecture(
        record, dtype=cfg.stack.dtype, dropout=cfg.stack.dropout,
        attention_dropout=cfg.stack.attention_dropout) == cfg


def test_a_record_written_before_a_field_existed_means_the_old_model():
    old = {k: v for k, v in RECORD.items() if k != "rel_pos_bucket_fn"}
    assert encoder_lib.from_architecture(old).rel_pos_bucket_fn == "t5"


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.pop("d_model"), "field 'd_model' is missing"),
    (lambda r: r.update(d_model="32"), "field 'd_model' must be an integer, got '32'"),
    (lambda r: r.update(num_layers=True), "field 'num_layers' must be an integer, got True"),
    (lambda r: r.update(pre_ln=1), "field 'pre_ln' must be true or false, got 1"),
    (lambda r: r.update(rel_pos_bucket_fn="T5"),
     "field 'rel_pos_bucket_fn' must be one of t5, maelm, got 'T5'"),
    (lambda r: r.update(activation="relu"), "unknown field 'activation'; expected only "),
])
def test_a_wrong_field_is_a_one_line_error_naming_it(edit, message):
    record = dict(RECORD)
    edit(record)
    with pytest.raises(encoder_lib.ArchitectureError) as e:
        encoder_lib.from_architecture(record, where="run/encoder.json")
    assert str(e.value).startswith(f"run/encoder.json: {message}")
    assert "\n" not in str(e.value)


def test_a_record_that_is_not_an_object_is_refused():
    with pytest.raises(encoder_lib.ArchitectureError,
                       match=r"^encoder.json: expected an object of the encoder's fields, got "
                             r"list$"):
        encoder_lib.from_architecture([1, 2], where="encoder.json")


def test_pretraining_and_finetuning_from_scratch_build_the_same_encoder(tiny_tokenizer):
    """The same model fields give equal EncoderConfigs (the dropouts and dtype, the run's
    own, are equal by default in both)."""
    pretrain = tiny_config("maelm", tiny_tokenizer.model_path)
    finetune = finetune_config.finetune_defaults()
    finetune.tokenizer_path = tiny_tokenizer.model_path
    finetune.model.max_positions = pretrain.data.seq_len
    # Away from both defaults, so that a field either side ignores shows.
    architecture = {"num_layers": 3, "d_model": 48, "num_heads": 6, "d_ff": 80, "pre_ln": True,
                    "rel_pos_buckets": 10, "rel_pos_max_distance": 20,
                    "rel_pos_bucket_fn": "maelm"}
    for model in (pretrain.model, finetune.model):
        model.update(architecture)
    pretrained = setup_lib.model_config(pretrain, tiny_tokenizer.vocab_size).encoder
    scratch = finetune_encoder.encoder_and_tokenizer(finetune)[0]
    assert scratch == pretrained
    record = encoder_lib.architecture(scratch)
    assert {k: record[k] for k in architecture} == architecture
    assert (record["vocab_size"], record["max_positions"]) == (tiny_tokenizer.vocab_size,
                                                               pretrain.data.seq_len)
    # Only the run's fields differ when the runs set them differently.
    finetune.model.dropout = 0.3
    tuned = finetune_encoder.encoder_and_tokenizer(finetune)[0]
    assert encoder_lib.architecture(tuned) == record
    assert tuned == dataclasses.replace(
        pretrained, stack=dataclasses.replace(pretrained.stack, dropout=0.3))
