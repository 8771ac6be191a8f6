"""The sections both trainers share (maelm_jax/config/sections.py) are declared once: each
shared field has the same default (bar the recipe values a kind must give), the same check
and the same one-line error in pretraining, fine-tuning and the analysis."""

import ml_collections
import pytest

from maelm_jax.analysis import config as rank_config
from maelm_jax.config import sections as config_sections
from maelm_jax.finetune import config as finetune_config
from maelm_jax.pretrain import config as pretrain_config

pytestmark = pytest.mark.tier("unit")

KINDS = {
    "pretrain": (pretrain_config.pretrain_defaults, pretrain_config.fields,
                 pretrain_config.validate, pretrain_config.ConfigError),
    "finetune": (finetune_config.finetune_defaults, finetune_config.fields,
                 finetune_config.validate, finetune_config.FinetuneConfigError),
}
SECTIONS = (("model", config_sections.ENCODER), ("train", config_sections.TRAIN),
            ("", config_sections.MESH))


def _get(config, dotted):
    for part in dotted.split("."):
        config = config[part]
    return config


def _valid_finetune():
    c = finetune_config.finetune_defaults()
    c.tokenizer_path = "spm.model"
    return c


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_trainer_takes_every_shared_field_from_its_section(kind):
    defaults, fields, _, _ = KINDS[kind]
    config, table = defaults(), fields()
    for prefix, section in SECTIONS:
        for name, field in section.fields(prefix).items():
            assert table[name] is field, name  # the same declaration, not a copy
            own = section.entries[name.removeprefix(f"{prefix}.") if prefix else name][0]
            if own is not config_sections.OWN_DEFAULT:
                assert _get(config, name) == own, name
    # The analysis's mesh is the trainers' too.
    assert all(rank_config.FIELDS[name] is field
               for name, field in config_sections.MESH.fields().items())
    assert rank_config.rank_defaults().mesh.to_dict() == defaults().mesh.to_dict()


def test_the_recipes_differ_only_where_a_kind_gives_its_own_default():
    pre, fine = pretrain_config.pretrain_defaults(), finetune_config.finetune_defaults()
    differ = {name for name in config_sections.TRAIN.fields("train")
              if _get(pre, name) != _get(fine, name)}
    own = {f"train.{name}" for name, (default, _) in config_sections.TRAIN.entries.items()
           if default is config_sections.OWN_DEFAULT}
    assert differ and differ <= own  # e.g. the peak learning rate, the clipping
    assert (pre.train.learning_rate, fine.train.learning_rate) == (5e-4, 2e-5)  # Tables 4, 5
    assert pre.model.to_dict()["pallas"] == fine.model.to_dict()["pallas"]


@pytest.mark.parametrize("field, value, expected", [
    ("model.dropout", 1.5, "config.model.dropout: expected a number in [0, 1), got 1.5"),
    ("train.adam_b2", 1.0, "config.train.adam_b2: expected a number in [0, 1), got 1.0"),
    ("mesh.shape", (0, 1, 1), "config.mesh.shape: expected a tuple of mesh axis sizes"),
    ("model.rel_pos_bucket_fn", "alibi", "config.model.rel_pos_bucket_fn: expected one of"),
])
def test_a_bad_shared_field_is_refused_alike_by_both_trainers(field, value, expected):
    messages = []
    for kind, (defaults, _, validate, error) in sorted(KINDS.items()):
        c = _valid_finetune() if kind == "finetune" else defaults()
        parent, leaf = field.rsplit(".", 1)
        _get(c, parent)[leaf] = value
        with pytest.raises(error) as e:
            validate(c)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and messages[0].startswith(expected), messages


def test_a_section_refuses_a_missing_recipe_value_and_an_unknown_field():
    with pytest.raises(ValueError, match="train.learning_rate: the config kind must give"):
        config_sections.TRAIN.add_to(ml_collections.ConfigDict(), "train", batch_size=8,
                                     clip_norm=0.0, log_every=1)
    with pytest.raises(ValueError, match="learning_rat: not a field of this section"):
        config_sections.TRAIN.add_to(ml_collections.ConfigDict(), "train", learning_rat=1.0)
    c = ml_collections.ConfigDict()
    config_sections.ENCODER.add_to(c, "model", pallas__hash_elements=2, d_model=64)
    assert c.model.pallas.hash_elements == 2 and c.model.d_model == 64
    assert set(config_sections.ENCODER.fields("model")) == set(_names(c.to_dict()))


def _names(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _names(value, f"{prefix}{key}.")
        else:
            yield prefix + key
