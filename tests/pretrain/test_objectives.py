"""The objective registry and the papers' recipes: an objective defined here, in one class
and one registration, trains, evaluates, checkpoints and fills masks through the same
engine as the built-in ones; the recipes are the one definition the configs, the study
and the benchmarks use; the built-in models keep the parameter trees their checkpoints
were written with."""

import dataclasses
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from benchmarks import harness
from maelm_jax.config import schema, variants
from maelm_jax.infra import sharding
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import layers
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import flops, objectives
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.pretrain import steps as pretrain_steps
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.pretrain.objectives import base, recipes
from maelm_jax.study import config as study_config
from maelm_jax.text import masking, tokenizer
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.workdirs import layout

from conftest import REPO_ROOT
from support import preempt_at
from tiny_config import TINY_VOCAB, tiny_config

SP = tokenizer.SENTENCEPIECE_IDS
pytestmark = pytest.mark.tier("unit")

GOLDEN = pathlib.Path(__file__).parents[1] / "golden" / "param_trees.json"


# ------------------------------------------------------------------ a toy objective

class ToyModel(nn.Module):
    """The encoder reads the corrupted sequence (as MLM's); an untied dense layer predicts
    (with a bias or not: the toy's own config field)."""

    encoder_cfg: encoder_lib.EncoderConfig
    head_bias: bool = True

    @nn.compact
    def __call__(self, batch: masking.MaskedBatch, deterministic: bool = True):
        positions = jnp.arange(batch.inputs.shape[1], dtype=jnp.int32)[None]
        hidden = encoder_lib.Encoder(self.encoder_cfg, name="encoder")(
            batch.inputs, positions, deterministic=deterministic)
        predicted = masking.gather_tokens(hidden, batch.pred_index)
        head = nn.Dense(self.encoder_cfg.vocab_size, name="head", use_bias=self.head_bias,
                        kernel_init=layers.normal_init(("embed", "vocab")),
                        bias_init=layers.zeros_init(("vocab",)))
        return head(predicted).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    encoder: encoder_lib.EncoderConfig
    head_bias: bool  # read by the model
    z_weight: float  # read by the loss


class Toy(base.Objective):
    """Everything an objective can own: fields of its own (toy.head_bias, read by its
    model; toy.z_weight, read by its loss), its own corruption (one contiguous span of k
    [MASK]s per sequence) and an extra loss sum (a z-loss, log(sum exp(logits))^2, PaLM's,
    added to the loss with the weight toy.z_weight)."""

    name = "toy"
    removes_masks = False

    def __init__(self):
        self.corrupted = []  # the token shapes `corrupt` was traced with

    def defaults(self):
        return ml_collections.ConfigDict({"toy": {"head_bias": True, "z_weight": 1e-3}})

    def fields(self):
        return {"toy.head_bias": schema.boolean(), "toy.z_weight": schema.number(0.0)}

    def corrupt(self, model_cfg, key, tokens, counts, vocab_size):
        self.corrupted.append(tokens.shape)
        B, L = tokens.shape
        start = jax.random.randint(key, (B, 1), 0, L - counts.k + 1)
        pred_index = (start + jnp.arange(counts.k)[None]).astype(jnp.int32)  # [B, k] sorted
        rows = jnp.arange(B)[:, None]
        targets = jnp.take_along_axis(tokens, pred_index, axis=1)
        return masking.MaskedBatch(
            inputs=tokens.at[rows, pred_index].set(SP.mask),
            enc_index=jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
            pred_index=pred_index, targets=targets,
            weights=(targets != SP.pad).astype(jnp.float32),
            category=jnp.full((B, counts.k), masking.MASKED, jnp.int32))

    def loss_sums(self, model_cfg, logits, batch, per_category=False):
        sums = super().loss_sums(model_cfg, logits, batch, per_category)
        z = jax.nn.logsumexp(logits, axis=-1) ** 2 * batch.weights  # [B, k]
        sums["loss_sum"] = sums["loss_sum"] + model_cfg.z_weight * jnp.sum(z)
        sums["aux_sum"] = jnp.sum(z)
        if per_category:
            one_hot = jax.nn.one_hot(batch.category, len(masking.CATEGORY_NAMES))
            sums["category_aux_sum"] = jnp.einsum("bk,bkc->c", z, one_hot)
        return sums

    def model_config(self, config, encoder):
        return ToyConfig(encoder, config.toy.head_bias, config.toy.z_weight)

    def model(self, model_cfg):
        return ToyModel(model_cfg.encoder, model_cfg.head_bias)

    def step_flops(self, config, counts, vocab_size):
        m = config.model
        per_sequence = (m.num_layers * flops.block(counts.seq_len, m.d_model, m.d_ff)
                        + 2 * counts.k * m.d_model * vocab_size)
        return 2 * config.train.batch_size * per_sequence

    def validate(self, config, require):
        require(config.masking.mask_frac == 1.0, "masking.mask_frac",
                "1.0 for objective toy (it predicts [MASK]s only)", config.masking.mask_frac)


@pytest.fixture
def toy():
    objective = Toy()
    objectives.register(objective)
    yield objective
    objectives.unregister("toy")


def _toy_config(tmp_path, tok):
    c = tiny_config("toy", tok.model_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i} tells of rivers, stones and the sea. " * 4
                                  for i in range(120)))
    c.data.sources.main.kind = "text"
    c.data.sources.main.path = str(corpus)
    c.train.num_steps = 8
    c.train.checkpoint_every = c.train.eval_every = 4
    return c


def test_a_registered_objective_brings_its_fields_and_rules(toy, tiny_tokenizer):
    c = tiny_config("toy", tiny_tokenizer.model_path)
    assert c.toy.head_bias is True  # its default, in every pretraining config
    pretrain_config.validate(c)
    head = lambda c: jax.eval_shape(  # noqa: E731
        setup_lib.model(c, TINY_VOCAB).init, jax.random.PRNGKey(0),
        pretrain_steps._dummy_batch(pretrain_config.mask_counts(c)))["params"]["head"]
    assert set(head(c)) == {"kernel", "bias"}
    assert pretrain_config.mask_counts(c).n_enc == c.data.seq_len  # its encoder keeps [MASK]s
    assert setup_lib.step_flops(c, TINY_VOCAB) == Toy().step_flops(
        c, pretrain_config.mask_counts(c), TINY_VOCAB)
    c.toy.head_bias = False
    assert set(head(c)) == {"kernel"}
    # Its loss reads its own field too: the z-loss weight changes the train step's loss by
    # the weight times the z-loss the step reports.
    losses = {}
    for weight in (0.0, 0.5):
        c.toy.z_weight = weight
        program = setup_lib.build(c, TINY_VOCAB)
        tokens = np.random.default_rng(0).integers(
            5, TINY_VOCAB, (c.train.batch_size, c.data.seq_len), dtype=np.int32)
        with sharding.activate(program.mesh, program.rules):
            _, m = program.train_step(program.init(), sharding.global_batch(tokens, program.mesh))
        losses[weight] = (float(m["loss"]), float(m["aux"]))
    assert losses[0.5][0] - losses[0.0][0] == pytest.approx(0.5 * losses[0.0][1], rel=1e-3)
    c.toy = ml_collections.ConfigDict({"head_bias": "no", "z_weight": 0.0})  # as recorded
    with pytest.raises(pretrain_config.ConfigError, match=r"^config\.toy\.head_bias: expected True "
                       r"or False, got 'no'$"):
        pretrain_config.validate(c)
    c.toy = ml_collections.ConfigDict({"head_bias": False, "z_weight": 0.0})
    c.masking.mask_frac = 0.8
    with pytest.raises(pretrain_config.ConfigError, match=r"config\.masking\.mask_frac: expected "
                       r"1\.0 for objective toy") as info:
        pretrain_config.validate(c)
    assert "\n" not in str(info.value)
    # The other objectives' configs carry its field too (one config switches objective by
    # one field), and lose it with the objective.
    assert tiny_config("mlm").toy.head_bias is True
    objectives.unregister("toy")
    assert "toy" not in pretrain_config.pretrain_defaults()
    objectives.register(toy)


def test_an_objective_may_not_redefine_a_field(toy):
    clash = Toy()
    clash.name = "clash"
    clash.defaults = lambda: ml_collections.ConfigDict({"toy": {"head_bias": False}})
    with pytest.raises(ValueError, match="toy.head_bias defaults to False"):
        objectives.register(clash)
    assert objectives.names() == ("maelm", "mlm", "toy")


def test_an_unknown_objective_names_the_registered_ones(toy):
    c = tiny_config("electra")
    with pytest.raises(pretrain_config.ConfigError, match="config.objective"):
        pretrain_config.validate(c)
    with pytest.raises(pretrain_config.ConfigError, match="expected one of maelm, mlm, toy"):
        setup_lib.step_flops(c, TINY_VOCAB)


def _metrics(workdir, split):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["split"] == split}


@pytest.mark.tier("integration")  # seconds: a run
def test_a_toy_objective_trains_resumes_evaluates_and_fills_masks(
        toy, tmp_path, tiny_tokenizer, monkeypatch):
    from maelm_jax.fill_mask import run as fill_mask_run

    c = _toy_config(tmp_path, tiny_tokenizer)
    whole = tmp_path / "whole"
    metrics = pretrain_train.train_and_evaluate(c, str(whole))
    # Its corruption is the train step's (traced for the shapes of the loss sums, then for
    # the step) and the eval step's.
    assert toy.corrupted == [(c.train.batch_size, c.data.seq_len)] * 3
    # Its extra sum is reported per predicted token, in training and evaluation.
    train = _metrics(whole, "train")
    assert sorted(train) == list(range(1, 9))
    assert all(np.isfinite(r["loss"]) and r["aux"] > 0 for r in train.values())
    assert train[8]["loss"] < train[1]["loss"]
    assert np.isfinite(metrics["loss"]) and metrics["aux"] > 0
    assert metrics["mask_aux"] == pytest.approx(metrics["aux"])  # all its spans are [MASK]s
    assert _metrics(whole, "eval")[8]["aux"] == metrics["aux"]

    # Stopped at step 4 (its checkpoint) and started again: the same run, step for step.
    resumed = tmp_path / "resumed"
    preempt_at(monkeypatch, c, resumed, 4)
    pretrain_train.train_and_evaluate(c, str(resumed))
    assert sorted(_metrics(resumed, "train")) == list(range(1, 9))
    for step in range(1, 9):
        for key in ("loss", "aux", "accuracy"):
            assert _metrics(resumed, "train")[step][key] == train[step][key], (step, key)
    assert _metrics(resumed, "eval")[8] == _metrics(whole, "eval")[8]

    # Its parameters, checkpointed: the encoder (what fine-tuning keeps) and its own head.
    ckpt = checkpoint_lib.Checkpointer(whole / "checkpoints", 3)
    assert ckpt.latest_step() == 8
    ckpt.close()
    masker = fill_mask_run.FillMasker.from_workdir(str(whole))
    assert set(masker.params) == {"encoder", "head"}
    ids, masked = masker.encode_text("the <mask> of rivers")
    filled = masker.predict(ids, masked, top_k=3)
    assert filled.top_ids.shape == (1, 3)
    assert np.all(np.diff(filled.top_probs[0]) <= 0)


@pytest.mark.tier("integration")  # seconds: a run
def test_a_toy_objective_is_studied_and_benchmarked(toy, tmp_path, tiny_tokenizer):
    """A registered objective is a model of the study and of the benchmarks by its name,
    with no recipe of its own."""
    from maelm_jax.study import run as study_run

    assert recipes.names() == (*recipes.MODELS, "toy")
    study = study_config.study_defaults()
    study.pretrain = tiny_config("maelm", tiny_tokenizer.model_path)
    study.pretrain.train.num_steps = study.pretrain.train.checkpoint_every = 2
    study.pretrain.train.eval_every = 2
    study.models = ("toy",)
    study.rank_tokens = 256
    result = study_run.run(study, str(tmp_path / "study"))
    assert result["models"] == ["toy"] and result["pretraining"]["toy"]["step"] == 2
    assert "| toy |" in (tmp_path / "study" / layout.STUDY_MARKDOWN_FILE).read_text()

    config = tiny_config("maelm")
    timed = harness.objective_configs(config, ["mlm", "toy"])
    assert timed["toy"].objective == "toy" and timed["toy"].model == timed["mlm"].model
    tokens = harness.random_tokens(timed["toy"])
    bench = harness.Bench(timed["toy"], tokens)
    bench.run(2)
    # The model FLOPs (forward + backward = 3 x forward) of the objective's own count.
    assert len(bench.wall) == 2 and bench.flops == setup_lib.step_flops(timed["toy"],
                                                                        TINY_VOCAB) * 3 // 2


def test_unregistering_leaves_the_built_in_objectives(toy):
    with pytest.raises(ValueError, match="already registered"):
        objectives.register(Toy())
    with pytest.raises(ValueError, match="built in"):
        objectives.unregister("mlm")
    assert objectives.names()[:2] == ("maelm", "mlm")
    assert "toy" in pretrain_config.pretrain_defaults()


# ------------------------------------------------------------------ the recipes

def test_every_recipe_validates_and_changes_only_what_defines_it():
    base_config = pretrain_config.pretrain_defaults()
    for recipe in (*recipes.MODELS.values(), *recipes.TABLE2.values()):
        c = recipe.apply(base_config)
        pretrain_config.validate(c)
        for section in ("tokenizer", "data", "train", "seed", "mesh"):
            assert c[section] == base_config[section], (recipe.name, section)
        assert (c.model.num_layers, c.model.d_model) == (12, 768)
    assert base_config.objective == "maelm"  # apply copies
    three_ml = recipes.MODELS["3ml_cross"].apply(base_config)
    assert (three_ml.model.decoder.num_layers, three_ml.model.decoder.d_model,
            three_ml.model.decoder.num_heads, three_ml.model.decoder.d_ff) == (2, 384, 6, 1536)
    assert three_ml.model.pre_ln and three_ml.model.decoder.pre_ln
    assert three_ml.model.decoder.dropout == base_config.model.dropout


def test_a_recipe_refuses_a_field_the_config_lacks():
    bad = recipes.Recipe("bad", "bad", {"model.decoder.colour": "red"})
    with pytest.raises(KeyError, match="sets unknown config field 'model.decoder.colour'"):
        bad.apply(pretrain_config.pretrain_defaults())


def test_configs_study_and_benchmarks_build_the_same_models():
    """3ML Table 4's config, the study's models and the benchmarks' objectives agree with
    the recipes on what defines each model."""
    pretrain = pretrain_config.pretrain_defaults()
    study = study_config.study_defaults()
    for name, recipe in recipes.MODELS.items():
        expected = recipe.apply(pretrain)
        timed = harness.objective_config(pretrain, name)
        studied = study_config.model_config(study, name)
        for got in (timed, studied):
            assert got.objective == expected.objective
            assert got.masking == expected.masking
            assert got.model == expected.model, name
    for model, name in (("self", "3ml_self"), ("cross", "3ml_cross"), ("mlm", "mlm")):
        table4 = variants.load(f"{REPO_ROOT}/configs/pretrain/3ml.py:{model}_base")
        assert table4.objective == recipes.MODELS[name].changes["objective"]
        if model != "mlm":
            assert (table4.model.decoder.num_layers, table4.model.decoder.d_model) == (2, 384)
    cross = variants.load(f"{REPO_ROOT}/configs/pretrain/3ml.py:cross_base")
    assert cross.model.pre_ln and cross.model.decoder.pre_ln and cross.model.decoder.kind == "cross"
    table2 = variants.load(f"{REPO_ROOT}/configs/pretrain/base.py:dec_uni_cross")
    assert table2.model.decoder.kind == "causal_cross"


# ------------------------------------------------------------------ checkpoints still restore

def _golden_variants():
    for objective in ("mlm", "maelm"):
        for scan in (False, True):
            c = tiny_config(objective)
            c.model.scan_layers = scan
            yield f"{objective}{'_scan' if scan else ''}", c
    c = tiny_config("maelm")
    c.model.decoder.update(kind="cross", d_model=16, num_heads=1, d_ff=32, num_layers=2)
    yield "maelm_cross_half", c
    c = tiny_config("maelm")
    c.model.decoder.update(rel_pos_buckets=8, share_positions=True)
    yield "maelm_decoder_options", c


def test_parameter_trees_are_those_checkpoints_were_written_with():
    """Every parameter's path and shape, as recorded from the models before the objectives
    had modules of their own: orbax restores by path and shape, so equal trees mean old
    checkpoints restore."""
    golden = json.loads(GOLDEN.read_text())
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    for name, c in _golden_variants():
        pretrain_config.validate(c)
        counts = pretrain_config.mask_counts(c)
        batch = masking.MaskedBatch(i32(1, counts.seq_len), i32(1, counts.n_enc),
                                    i32(1, counts.k), i32(1, counts.k),
                                    jax.ShapeDtypeStruct((1, counts.k), jnp.float32))
        shapes = jax.eval_shape(setup_lib.model(c, TINY_VOCAB).init, jax.random.PRNGKey(0),
                                batch)["params"]
        tree = {jax.tree_util.keystr(path): list(getattr(leaf, "value", leaf).shape)
                for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]}
        assert tree == golden[name], name
