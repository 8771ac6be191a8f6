"""The laptop-scale study's plumbing on tiny models: files, resume, skipping, errors."""

import json
import pathlib
import re

import jax
import ml_collections
import numpy as np
import pytest

from maelm_jax.finetune import encoder as finetune_encoder
from maelm_jax.infra import errors
from maelm_jax.pretrain.objectives import recipes
from maelm_jax.study import config as study_config
from maelm_jax.study import run as study_run
from maelm_jax.study import sizing as sizing_lib
from maelm_jax.study import timing as timing_lib
from maelm_jax.workdirs import layout

from tiny_config import tiny_config

# End-to-end: left out of the fast inner loop (pytest -m "not slow").
pytestmark = pytest.mark.tier("slow")

MODELS = ("mlm", "3ml_cross")  # the cheapest pair that covers both decoder kinds' plumbing


def _write_glue(root):
    """A few-row RTE in the GLUE layout (index, sentence1, sentence2, label)."""
    rows = ["index\tsentence1\tsentence2\tlabel"]
    for i in range(12):
        label = "entailment" if i % 2 else "not_entailment"
        rows.append(f"{i}\tThe module returns a list of {i} items.\tIt returns items.\t{label}")
    (root / "RTE").mkdir(parents=True)
    for split in ("train", "dev"):
        (root / "RTE" / f"{split}.tsv").write_text("\n".join(rows) + "\n")


# Where a config file written for main.py finds this module and the shared helpers.
TEST_DIRS = [str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(__file__).parent)]


def _config(tokenizer_path, glue_dir=""):
    c = study_config.study_defaults()
    c.pretrain = tiny_config("maelm", tokenizer_path)
    c.pretrain.train.num_steps = c.pretrain.train.checkpoint_every = 4
    c.pretrain.train.eval_every = 4
    c.models = MODELS
    c.glue_dir = str(glue_dir)
    c.tasks = ("RTE", "MRPC")  # MRPC is absent from the fixture: skipped with a warning
    c.seeds = (1,)
    c.finetune.max_seq_len = 32
    c.finetune.num_epochs = 1
    c.finetune.batch_size = 4
    c.finetune.min_train_examples = 12  # the fixture's RTE has 12
    c.rank_tokens = 256
    return c


@pytest.fixture(scope="module")
def study(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("study")
    _write_glue(root / "glue")
    c = _config(tiny_tokenizer.model_path, root / "glue")
    return root / "out", c, study_run.run(c, str(root / "out"))


def test_every_model_is_pretrained_analysed_and_fine_tuned(study):
    out, _, result = study
    assert result["models"] == list(MODELS)
    for name in MODELS:
        p = result["pretraining"][name]
        assert p["step"] == 4 and p["seconds"] > 0 and 0 < p["eval_unigram_accuracy"] < 1
        assert set(result["glue"][name]) == {"RTE"}
        assert list(result["glue"][name]["RTE"]["per_seed"]) == ["1"]
    # 3ML is 80-10-10 at 40 %: [MASK] figures sit next to random and unchanged ones.
    assert "eval_mask_accuracy" in result["pretraining"]["3ml_cross"]
    assert [r["label"] for r in result["rank"]["runs"]] == list(MODELS)
    assert all(set(r["centred"]["last_layer"]) == {"with_mask", "without_mask", "mask_only"}
               for r in result["rank"]["runs"])
    assert result["pretraining"]["mlm"]["train_flops"] > 0
    assert result["pretraining"]["3ml_cross"]["train_flops"] > 0  # eq. (4)
    # The control: the same encoder from random weights, fine-tuned alike.
    assert result["controls"] == ["scratch"]
    assert list(result["glue"]["scratch"]["RTE"]["per_seed"]) == ["1"]
    scratch = json.loads((out / "finetune" / "scratch" / "RTE" / "config.json").read_text())
    assert scratch["init_from"] == str(out / "pretrain" / "mlm")
    assert scratch["init_weights"] == "random"
    [run] = (out / "finetune" / "scratch" / "RTE").glob("runs/*/seed_1/results.json")
    assert json.loads(run.read_text())["init_from"].startswith(
        "random weights in the architecture of pretraining checkpoint")
    # MLM and the control (one architecture) as one program; 3ML_cross (pre-LN) alone.
    assert json.loads(run.read_text())["seed_group"]["runs"] == ["mlm/seed_1", "scratch/seed_1"]
    assert [p.name for p in (out / "finetune" / "groups" / "RTE").iterdir()] == ["mlm_scratch"]
    [alone] = (out / "finetune" / "3ml_cross" / "RTE").glob("runs/*/seed_1/results.json")
    assert "seed_group" not in json.loads(alone.read_text())
    configs = result["pretrain_config"]
    # One tokenizer and corpus, one budget and seed.
    for name in MODELS:
        assert configs[name]["tokenizer"]["model_path"] == configs["mlm"]["tokenizer"][
            "model_path"]
        assert configs[name]["data"]["cache_dir"] == str(out / "data")
        assert configs[name]["train"] == configs["mlm"]["train"]


def test_every_part_holds_only_what_its_kind_writes(study):
    """layout.KINDS is the one list of what each kind of run writes: the study's workdir
    and every part of it (pretraining runs, the rank analysis, sweeps and their fine-tuning
    runs) hold nothing else."""
    out, _, _ = study
    parts = [(out, "study"), (out / "rank", "rank")]
    parts += [(d, "pretrain") for d in (out / "pretrain").iterdir()]
    for sweep in (out / "finetune").glob("*/*"):
        if sweep.parent.name == layout.STUDY_GROUPS_DIR:  # a task's programs
            parts += [(group, "finetune") for group in sweep.glob("*/seeds_*")]
            continue
        parts.append((sweep, "sweep"))
        parts += [(run, "finetune") for run in sweep.glob("runs/*/seed_*")]
    assert len(parts) > 2 + len(MODELS) + 2
    for directory, kind in parts:
        assert layout.unexpected_entries(directory, kind) == [], (directory, kind)
        if kind in ("pretrain", "finetune", "sweep"):  # those record their config
            assert layout.mode(directory) in (kind, "finetune"), directory  # sweeps: finetune
    # The check is real: an entry a kind does not write is named.
    (out / "rank" / "stray.txt").write_text("")
    assert layout.unexpected_entries(out / "rank", "rank") == ["stray.txt"]
    (out / "rank" / "stray.txt").unlink()


def test_tasks_too_small_or_absent_are_left_out(tiny_tokenizer, tmp_path, caplog):
    _write_glue(tmp_path / "glue")
    c = _config(tiny_tokenizer.model_path, tmp_path / "glue")
    assert study_run._glue_tasks(c) == ["RTE"]
    c.finetune.min_train_examples = 13
    with caplog.at_level("WARNING"):
        assert study_run._glue_tasks(c) == []
    assert ("RTE has 12 training examples in " in caplog.text
            and "fewer than config.finetune.min_train_examples=13, skipped" in caplog.text)
    assert "MRPC has no training data in" in caplog.text


def test_models_differ_only_in_what_defines_them(tiny_tokenizer):
    c = _config(tiny_tokenizer.model_path)
    configs = {n: study_config.model_config(c, n).to_dict() for n in recipes.MODELS}
    for name, cfg in configs.items():
        for section in ("tokenizer", "data", "train", "seed"):
            assert cfg[section] == configs["mlm"][section], (name, section)
        assert cfg["model"]["num_layers"] == configs["mlm"]["model"]["num_layers"]
    assert configs["mlm"]["objective"] == "mlm" and configs["maelm"]["objective"] == "maelm"
    for name in ("3ml_self", "3ml_cross"):
        m = configs[name]
        assert m["masking"]["mask_ratio"] == 0.4 and m["masking"]["mask_frac"] == 0.8
        assert m["model"]["decoder"]["d_model"] == m["model"]["d_model"] // 2
        assert m["model"]["decoder"]["num_layers"] == 2 and m["model"]["decoder"]["dropout"] == 0.1
    assert configs["3ml_cross"]["model"]["decoder"]["kind"] == "cross"
    assert configs["3ml_cross"]["model"]["decoder"]["pre_ln"]
    assert configs["maelm"]["masking"] == configs["mlm"]["masking"]


def test_the_report_and_plots_are_written(study):
    out, _, result = study
    for name in (layout.STUDY_JSON_FILE, layout.STUDY_MARKDOWN_FILE, layout.STUDY_LOSS_PLOT,
                 layout.RANK_LAYERS_PLOT, layout.STUDY_GLUE_PLOT):
        assert (out / name).is_file(), name
    table = (out / layout.STUDY_MARKDOWN_FILE).read_text()
    rows = [line for line in table.splitlines() if re.match(r"\| (MLM|MAE-LM|3ML_\w+) \|", line)]
    assert [r.split(" | ")[0] for r in rows] == ["| MLM", "| 3ML_cross"]
    assert "GLUE: dev medians over seeds [1] from " in table
    header = next(line for line in table.splitlines() if line.startswith("| model |"))
    assert "| centred rank (no [MASK]) | centred rank (with [MASK]) |" in header
    assert all(len(r.split(" | ")) == len(header.split(" | ")) for r in rows)
    assert any(line.startswith("| from scratch (control) |") for line in table.splitlines())
    assert "| RTE |" in table and "MRPC" not in table.split("\n\n")[2]
    assert json.loads((out / layout.STUDY_JSON_FILE).read_text())["glue"] == result["glue"]


def test_a_second_run_reuses_everything(study, caplog):
    out, c, result = study
    stamps = {p: p.stat().st_mtime for p in out.rglob("results.json")}
    caplog.set_level("INFO")
    again = study_run.run(c, str(out))
    assert again["glue"] == result["glue"] and again["rank"] == result["rank"]
    assert {p: p.stat().st_mtime for p in out.rglob("results.json")} == stamps
    assert caplog.text.count("is pretrained, skipping") == len(MODELS)
    assert "the rank analysis is done, skipping" in caplog.text


def test_without_glue_dir_it_pretrains_and_analyses_only(study, tmp_path):
    out, c, _ = study
    c = c.copy_and_resolve_references()
    c.glue_dir = ""
    c.models = ("mlm",)
    result = study_run.run(c, str(tmp_path))
    assert result["glue"] == {} and not (tmp_path / layout.STUDY_GLUE_PLOT).exists()
    assert "no glue_dir given" in (tmp_path / layout.STUDY_MARKDOWN_FILE).read_text()


@pytest.mark.parametrize("field, value, message", [
    ("models", ("mlm", "bert"), "config.models: expected names among"),
    ("seeds", (), "config.seeds: expected"),
    ("pretrain.model.dropout", 1.5, "config.pretrain.model.dropout: expected"),
])
def test_mistakes_are_named(tiny_tokenizer, tmp_path, field, value, message):
    c = _config(tiny_tokenizer.model_path)
    *path, leaf = field.split(".")
    node = c
    for part in path:
        node = node[part]
    node[leaf] = value
    with pytest.raises(errors.UserError, match="^" + re.escape(message)):
        study_run.run(c, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _wikiextractor(directory, documents):
    directory.mkdir(parents=True)
    (directory / "wiki_00").write_text("".join(
        f'<doc id="{i}" url="u" title="T{i}">\nT{i}\n{text}\n</doc>\n'
        for i, text in enumerate(documents)))


def test_the_gpu_preset_holds_its_sizes_and_every_model():
    from configs.study import gpu

    c = gpu.get_config()
    assert names_of(c.models) == ["mlm", "maelm", "3ml_self", "3ml_cross"] and c.scratch
    p = c.pretrain
    assert set(p.data.sources) == {"large", "wiki"}
    assert all(s.kind == "wikiextractor" for s in p.data.sources.values())
    assert (p.model.num_layers, p.model.d_model, p.model.num_heads, p.model.d_ff) == (
        6, 512, 8, 2048)
    assert (p.tokenizer.vocab_size, p.data.seq_len, p.train.batch_size) == (16384, 128, 256)
    assert {"SST-2", "CoLA", "MRPC", "STS-B", "RTE", "QNLI", "MNLI"} <= set(c.tasks)
    assert len(c.seeds) >= 3
    assert gpu.get_config("pretrain").model.d_model == 512
    # The probe's config is the study's MAE-LM, field for field.
    assert gpu.get_config("one_call_pretrain").to_dict() == study_config.model_config(
        gpu.get_config("one_call"), "maelm").to_dict()
    # The design's second version: MLM, MAE-LM and the control, batches of 512, a cap the
    # sizing decides under, one fine-tuning learning rate for all; 3ML_self in `seeds`.
    one = gpu.get_config("one_call")
    assert names_of(one.models) == ["mlm", "maelm"] and one.scratch
    assert (one.pretrain.train.batch_size, one.pretrain.train.num_steps) == (512, 8000)
    assert one.pretrain.train.warmup_steps / one.pretrain.train.num_steps == 0.1
    assert one.finetune.scratch_learning_rate in (0.0, one.finetune.learning_rate)
    assert names_of(gpu.get_config("seeds").models) == ["mlm", "maelm", "3ml_self"]
    # Every call of the one-call design analyses its ranks and packs its encoders; the
    # mechanism design pretrains MLM, MAE-LM and MAE-LM with [MASK] in the encoder (the
    # same config but masking.delta = 1), without fine-tuning.
    for preset in ("one_call", "seeds", "mechanism", "mechanism,tiny"):
        c = gpu.get_config(preset)
        study_config.validate(c)
        assert c.rank and c.return_encoders, preset
    mechanism = gpu.get_config("mechanism")
    assert names_of(mechanism.models) == ["mlm", "maelm", "enc_mask"]
    assert not mechanism.glue_dir and not mechanism.scratch
    enc_mask = study_config.model_config(mechanism, "enc_mask")
    maelm = study_config.model_config(mechanism, "maelm")
    assert enc_mask.masking.delta == 1.0 and maelm.masking.delta == 0.0
    enc_mask.masking.delta = 0.0
    assert enc_mask.to_dict() == maelm.to_dict()
    assert recipes.display_name("enc_mask") == "enc. w. [MASK]"
    with pytest.raises(ValueError, match="unknown config variant 'big'"):
        gpu.get_config("big")


def names_of(value):
    return study_config.names(value)


def _write_sst2_and_stsb(root, rows: int):
    """SST-2 and STS-B in the GLUE layout, `rows` training examples each."""
    from support import sst2_like

    (root / "SST-2").mkdir(parents=True)
    (root / "SST-2" / "train.tsv").write_text(sst2_like(root, rows, 0))
    (root / "SST-2" / "dev.tsv").write_text(sst2_like(root, 16, 1))
    rng = np.random.default_rng(0)
    lines = ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\t"
             "sentence2\tscore"]
    for i in range(rows):
        word = rng.choice(["good", "bad", "long"])
        lines.append(f"{i}\tg\tf\t2020\t{i}\ts\ts\tthe film was good\tthe film was {word}"
                     f"\t{rng.uniform(0, 5):.2f}")
    (root / "STS-B").mkdir()
    (root / "STS-B" / "train.tsv").write_text("\n".join(lines) + "\n")
    (root / "STS-B" / "dev.tsv").write_text("\n".join(lines[:17]) + "\n")


def test_one_gpu_call_in_miniature_sizes_itself_and_pools_with_a_seed_call(tmp_path):
    """gpu.py:one_call,tiny (two WikiExtractor corpora, MLM, MAE-LM and the control, the
    rank analysis, SST-2 and STS-B with every model and seed as one program) sizes its pretraining
    from step times measured at its start and predicts its wall time; a gpu.py:seeds,tiny
    call with another pretraining seed is of the same design, and the two pool into the
    claims' table (configs/study/pool.py through main.py)."""
    import subprocess
    import sys

    from configs.study import gpu

    from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env
    from support import made_up_documents

    documents = made_up_documents(300)
    _wikiextractor(tmp_path / "large", documents[::2])
    _wikiextractor(tmp_path / "wiki", documents[1::2])
    _write_sst2_and_stsb(tmp_path / "glue", 24)

    def call(preset, workdir, **changes):
        c = gpu.get_config(preset)
        c.pretrain.data.sources.large.path = str(tmp_path / "large")
        c.pretrain.data.sources.wiki.path = str(tmp_path / "wiki")
        c.glue_dir = str(tmp_path / "glue")
        c.update(seeds=(1, 2, 3), **changes)
        c.finetune.seeds_per_program = 3
        return study_run.run(c, str(tmp_path / workdir))

    first = call("one_call,tiny", "one")
    assert first["controls"] == ["scratch"] and set(first["glue"]["maelm"]) == {"SST-2", "STS-B"}
    sizing = first["sizing"]
    # The design's 6 steps at most; every model its planned steps.
    assert sizing["steps"] == {"mlm": 6, "maelm": 6}
    assert {m: p["step"] for m, p in first["pretraining"].items()} == sizing["steps"]
    assert set(sizing["timing"]["pretrain_step"]) == {"mlm", "maelm"}
    assert sizing["timing"]["finetune_step"] > 0
    # What each part adds besides its steps (its data, program, compiled steps, first step,
    # evaluation) is timed, as is the rank analysis; the two models' encoders and the
    # control's are one for fine-tuning: 9 runs, one program per head kind.
    timing = sizing["timing"]
    assert timing["finetune_part"] > 0 and timing["finetune_runs"] == 9
    assert timing["rank_model"] > 0 and min(timing["pretrain_part"].values()) > 0
    assert sizing["reserve_seconds"] >= 2 * timing["rank_model"]
    assert [(p["head"], p["runs"], p["tasks"]) for p in sizing["programs"]] == [
        ("2 classes", 9, ["SST-2"]), ("regression", 9, ["STS-B"])]
    predicted, took = sizing["predicted_seconds"]["total"], first["seconds"]
    assert 0.4 < took / predicted < 2.5, (took, sizing["predicted_seconds"])  # the model
    assert first["setup_seconds"] > 0 and set(first["part_seconds"]) == set(first["parts_done"])
    # The programs the sizing planned are the ones the parts built.
    built = []
    for group in sorted((tmp_path / "one" / "finetune" / "groups").glob("*/*/seeds_*")):
        roster = json.loads((group / "group.json").read_text())["runs"]
        built.append((group.parent.name, len(roster), sizing_lib.head_kind(group.parents[1].name)))
    assert sorted(built) == sorted(("_".join(p["models"]), p["runs"], p["head"])
                                   for p in sizing["programs"])
    assert (tmp_path / "one" / "sizing.json").is_file()
    # Every model and seed of a task as one program, one length.
    groups = tmp_path / "one" / "finetune" / "groups"
    for task in ("SST-2", "STS-B"):
        [group] = (groups / task).glob("*/seeds_1_2_3")
        assert group.parent.name == "mlm_maelm_scratch"
        assert not (group / "checkpoints").exists()
        roster = json.loads((group / "group.json").read_text())["runs"]
        assert len(roster) == 9 and {r["learning_rate"] for r in roster} == {1e-3}
    for name in ("mlm", "scratch"):
        [config] = (tmp_path / "one" / "finetune" / name / "SST-2").glob(
            "runs/*/seed_1/config.json")
        config = json.loads(config.read_text())
        assert config["data"]["one_bucket"] and config["train"]["resume_saves"] == "stop"
    # The fine-tuning program the sizing timed is the one the parts run (found again in
    # the compilation cache): the same encoder, rebuilt from the pretraining checkpoint.
    part = ml_collections.ConfigDict(json.loads(
        (tmp_path / "one" / "finetune" / "mlm" / "SST-2" / "runs").glob("*/seed_1/config.json")
        .__next__().read_text()))
    part_encoder, _, tok, _ = finetune_encoder.encoder_and_tokenizer(part)
    pretrained = study_config.model_config(gpu.get_config("one_call,tiny"), "mlm")
    assert timing_lib.finetune_encoder(pretrained, part, tok.vocab_size) == part_encoder
    # One learning rate for the models and the control.
    assert json.loads((tmp_path / "one" / "finetune" / "scratch" / "SST-2" / "config.json")
                      .read_text())["grid"]["learning_rate"] == [1e-3]
    assert [r["label"] for r in first["rank"]["runs"]] == ["mlm", "maelm"]
    # Every fine-tuned encoder's rank on the task's dev sequences, per model and seed.
    for m in ("mlm", "maelm", "scratch"):
        found = first["glue"][m]["SST-2"]["rank_per_seed"]
        assert set(found) == {"1", "2", "3"}
        last = found["1"]["last_layer"]["uncentred"]["without_mask"]
        assert 1 <= last["rank"] <= 32 and last["rank"] - 1 < last["continuous"] <= last["rank"]
    assert "| SST-2 | MAE-LM minus MLM | paired over 3 fine-tuning seeds |" in (
        tmp_path / "one" / "study.md").read_text()

    # Each encoder packed (bfloat16, with config and tokenizer) and unpacked into a workdir
    # that loads as the pretraining run's, within bfloat16's rounding.
    from maelm_jax import runs
    from maelm_jax.models import builder
    from maelm_jax.study import encoders

    packed = tmp_path / "one" / "encoders" / "maelm.npz"
    assert first["pretraining"]["maelm"]["encoder_file"] == str(packed)
    encoders.unpack(packed, tmp_path / "maelm_back")
    back = runs.load_pretrained(str(tmp_path / "maelm_back"), builder.Run())
    original = runs.load_pretrained(str(tmp_path / "one" / "pretrain" / "maelm"), builder.Run())
    assert back.encoder_cfg == original.encoder_cfg
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(original.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-6)
    with pytest.raises(encoders.EncoderFileError, match="not empty"):
        encoders.unpack(packed, tmp_path / "maelm_back")

    second = call("seeds,tiny", "two", models=("mlm", "maelm"), tasks=("SST-2",))
    second_config = gpu.get_config("seeds,tiny")
    assert second["pretrain_seed"] == second_config.pretrain.seed == 0
    assert "rank analysis" in second["parts_done"]  # every call a replicate of claim (c)
    assert [r["label"] for r in second["rank"]["runs"]] == ["mlm", "maelm"]
    records = tmp_path / "records"
    records.mkdir()
    for i, out in enumerate(("one", "two")):
        record = json.loads((tmp_path / out / "study.json").read_text())
        record["pretrain_seed"] = i  # as --config.pretrain.seed=1 would record the second
        for p in record["pretraining"].values():  # as if off the unigram plateau: (c) measured
            p["eval_mask_accuracy"] = 0.5
        (records / f"{out}.json").write_text(json.dumps(record))
    run = subprocess.run([sys.executable, "main.py", "--config=configs/study/pool.py",
                          f"--workdir={tmp_path / 'pool'}", f"--config.inputs={records}"],
                         cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
                         timeout=HANG_SECONDS)
    assert run.returncode == 0, run.stderr[-2000:]
    [design] = json.loads((tmp_path / "pool" / "pool.json").read_text())
    assert len(design["calls"]) == 2
    b = design["claims"]["b"]["difference"]
    assert b["over"] == "calls" and b["n"] == 2 and b["tasks"] == ["SST-2"]
    assert design["claims"]["a"]["models"]["mlm"]["GLUE average"]["over"] == "fine-tuning seeds"
    assert "| (a) |" in (tmp_path / "pool" / "pool.md").read_text()
    # Claim (c2) over the two calls' pretraining seeds: too few to decide.
    assert design["claims"]["c"]["c2"]["uncentred"]["status"] == (
        "not decidable (2 pretraining seeds of the 5 needed)")


class _Ticks:
    """A monotonic clock for preemption that advances one second each time it is read:
    the loops read it once per step and the study once per part, so a time limit of n
    seconds stops a study at the same place on any machine."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        self.now += 1.0
        return self.now


def test_a_study_in_slices_resumes_and_reuses_every_finished_part(study, tmp_path,
                                                                  monkeypatch, caplog):
    """The study under time limits that stop it inside the first model's pretraining,
    then between parts, then inside a fine-tuning sweep: each call writes the report of
    what is done (finished false, the parts left), the next continues, and the last one
    ends where the uninterrupted study did, redoing nothing that was finished."""
    from maelm_jax.training import preemption

    _, c, reference = study
    c = c.copy_and_resolve_references()
    c.reserve_seconds = 0
    out = tmp_path / "sliced"
    monkeypatch.setattr(preemption, "time", _Ticks())
    done, stamps = [], {}
    for limit in (3, 6, 5, 9, 1000):
        caplog.clear()
        caplog.set_level("INFO")
        with preemption.time_limit(limit):
            try:
                result = study_run.run(c, str(out))
            except preemption.TimeLimit:
                result = json.loads((out / layout.STUDY_JSON_FILE).read_text())
                assert not result["finished"] and result["parts_left"]
                assert "**Not finished**" in (out / layout.STUDY_MARKDOWN_FILE).read_text()
        # Parts done before stay done, and their runs are not redone.
        assert result["parts_done"][:len(done)] == done
        for path, stamp in stamps.items():
            assert path.stat().st_mtime == stamp, path
        for name in MODELS:
            if f"pretrain {name}" in done:
                assert f"study: {name} is pretrained, skipping" in caplog.text
        done = result["parts_done"]
        stamps = {p: p.stat().st_mtime for p in out.rglob("results.json")}
        if result["finished"]:
            break
    assert result["finished"] and not result["parts_left"]
    assert len(done) == 2 + 1 + 1  # two models, the rank analysis, RTE (every model at once)
    for name in MODELS:
        got, want = result["pretraining"][name], reference["pretraining"][name]
        assert got["step"] == want["step"] == 4
        np.testing.assert_allclose(got["eval_loss"], want["eval_loss"], rtol=1e-5)
    for name in (*MODELS, "scratch"):
        np.testing.assert_allclose(result["glue"][name]["RTE"]["median"],
                                   reference["glue"][name]["RTE"]["median"], atol=1e-6)


def test_main_exits_75_at_the_time_limit_with_the_report_so_far(tiny_tokenizer, tmp_path):
    """Through main.py, as a script runs it: too little time left to start pretraining
    (config.reserve_seconds) stops the study before its first part, with the report of
    nothing done and exit status 75; the log says the same command continues."""
    import subprocess
    import sys

    from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env

    config_file = tmp_path / "study.py"
    config_file.write_text(  # this file's tiny study, as a config file for main.py
        f"import sys\nsys.path[:0] = {TEST_DIRS!r}\n"
        "from test_study import _config\n\n\ndef get_config():\n"
        f"    return _config({tiny_tokenizer.model_path!r})\n")
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "main.py"), f"--config={config_file}",
         f"--workdir={tmp_path / 'out'}", "--time_limit_minutes=0.001"],
        env=subprocess_env(), capture_output=True, text=True, timeout=HANG_SECONDS,
        check=False)
    assert run.returncode == 75, run.stderr[-2000:]
    assert "time limit:" in run.stderr and "run the same command to continue" in run.stderr
    result = json.loads((tmp_path / "out" / layout.STUDY_JSON_FILE).read_text())
    assert result["finished"] is False and result["parts_done"] == []
    assert result["parts_left"][0] == "pretrain mlm"


def test_main_exits_143_when_preempted_with_the_report_so_far(tiny_tokenizer, tmp_path):
    """Through main.py: SIGTERM during the first model's pretraining saves its checkpoint
    at the step it was on and stops the study there (exit 143, the report so far, no
    next model). (That the same command then ends as the uninterrupted study is the
    sliced study's test above: a stop request raises the same exception.)"""
    import sys

    from conftest import REPO_ROOT, preempt_main

    _write_glue(tmp_path / "glue")
    config_file = tmp_path / "study.py"
    config_file.write_text(  # this file's tiny study, pretraining long enough to be stopped
        f"import sys\nsys.path[:0] = {TEST_DIRS!r}\n"
        "from test_study import _config\n\n\ndef get_config():\n"
        f"    c = _config({tiny_tokenizer.model_path!r}, {str(tmp_path / 'glue')!r})\n"
        "    c.pretrain.train.num_steps = 60\n    c.pretrain.train.log_every = 1\n"
        "    return c\n")
    cmd = [sys.executable, str(REPO_ROOT / "main.py"), f"--config={config_file}",
           f"--workdir={tmp_path / 'out'}"]
    first = tmp_path / "out" / "pretrain" / MODELS[0]
    step = preempt_main(cmd, first / "metrics.jsonl")
    assert (first / "checkpoints" / str(step)).is_dir() and step < 60
    result = json.loads((tmp_path / "out" / layout.STUDY_JSON_FILE).read_text())
    assert result["finished"] is False and result["parts_done"] == []
    assert not (tmp_path / "out" / "pretrain" / MODELS[1]).exists()


def test_parts_run_apart_merge_into_the_study_run_whole(study, tmp_path):
    """The fixture's study in two parts (MLM with the control, then 3ML_cross), each in a
    workdir of its own; of each only study.json is kept, as a GPU session brings it back.
    Merged, they give the study that ran whole: the same models, scores, ranks, table
    rows and plots."""
    import shutil

    from maelm_jax.study import merge

    whole_out, c, whole = study
    kept = []
    for name, models, scratch in (("a", ("mlm",), True), ("b", ("3ml_cross",), False)):
        part = c.copy_and_resolve_references()
        part.models, part.scratch = models, scratch
        study_run.run(part, str(tmp_path / name))
        (tmp_path / "back" / name).mkdir(parents=True)
        kept.append(tmp_path / "back" / name / layout.STUDY_JSON_FILE)
        shutil.copy(tmp_path / name / layout.STUDY_JSON_FILE, kept[-1])
        shutil.rmtree(tmp_path / name)  # nothing of the part's workdir is left
    m = study_config.merge_defaults()
    m.inputs = f"{kept[0].parent},{kept[1]}"  # a directory holding study.json, or the file
    out = tmp_path / "merged"
    merged = merge.merge(m, str(out))
    assert merged["models"] == whole["models"] and merged["controls"] == whole["controls"]
    assert merged["finished"] and not merged["parts_left"]
    for name in (*MODELS, "scratch"):
        np.testing.assert_allclose(merged["glue"][name]["RTE"]["median"],
                                   whole["glue"][name]["RTE"]["median"], atol=1e-6)
    for name in MODELS:
        got, want = merged["pretraining"][name], whole["pretraining"][name]
        np.testing.assert_allclose(got["eval_loss"], want["eval_loss"], rtol=1e-5)
        assert [s for s, _ in got["curves"]["train"]] == [s for s, _ in want["curves"]["train"]]
    assert [r["label"] for r in merged["rank"]["runs"]] == list(MODELS)
    for got, want in zip(merged["rank"]["runs"], whole["rank"]["runs"], strict=True):
        np.testing.assert_allclose(got["with_mask"], want["with_mask"], atol=1)
    assert [p["models"] + p["controls"] for p in merged["parts"]] == [
        ["mlm", "scratch"], ["3ml_cross"]]

    def rows(table):  # each row's model, ranks and scores (not its wall time)
        return [line.split(" | ")[:-3] for line in table.splitlines()
                if line.startswith("| ") and not line.startswith("| model")]

    table = (out / layout.STUDY_MARKDOWN_FILE).read_text()
    assert rows(table) == rows((whole_out / layout.STUDY_MARKDOWN_FILE).read_text())
    assert "Run on MLM, from scratch (control): " in table and "; 3ML_cross: " in table
    for name in (layout.STUDY_LOSS_PLOT, layout.RANK_LAYERS_PLOT, layout.STUDY_GLUE_PLOT):
        assert (out / name).stat().st_size > 1000, name
    assert layout.unexpected_entries(out, "study_merge") == []
    # Merging again into the same directory rewrites the same report.
    assert merge.merge(m, str(out))["glue"] == merged["glue"]
