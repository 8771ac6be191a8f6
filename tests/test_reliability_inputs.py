"""Reliability, round 2: inputs and faults a new user meets. Relative paths from another
directory, a mistyped config file, a file as workdir, an unreadable config.json, a damaged
checkpoint, out-of-range fields, a multi-megabyte single-line corpus, and switching the
corpus from the command line; each a one-line error with the workdir left as it was, or a
warning and a recovery."""

import json
import logging
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from configs.finetune import glue as glue_config
from maelm_jax import runs
from maelm_jax.config import schema
from maelm_jax.data import packing, run_data, sources
from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import train as finetune_train
from maelm_jax.infra import errors
from maelm_jax.models import builder
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.training import checkpoint

from conftest import REPO_ROOT, subprocess_env
from support import (
    expect_user_error,
    plain_corpus,
    snapshot,
    sst2_like,
    tiny_pretraining,
    train_metrics,
)
from tiny_config import tiny_config

# What a fine-tuning run sets on the encoder it reads back (models/builder.py).
WITH_DROPOUT = builder.Run(dropout=0.1, attention_dropout=0.1)

pytestmark = pytest.mark.tier("unit")


def _one_line_error(result, *fragments):
    """main.py failed with exit status 1 and exactly one stderr line holding fragments."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _main(args, cwd):
    return subprocess.run([sys.executable, str(REPO_ROOT / "main.py"), *args], cwd=cwd,
                          env=subprocess_env(), capture_output=True, text=True)


# ---------------------------------------------------------------- relative paths

@pytest.mark.tier("integration")  # seconds: a run
def test_relative_paths_from_another_directory(tmp_path, tiny_tokenizer, monkeypatch):
    """The README's fine-tuning command on the README's quickstart: workdir, corpus,
    tokenizer, cache, init_from and data_dir all relative to the current directory."""
    (tmp_path / "text").mkdir()
    shutil.copy(plain_corpus(tmp_path), tmp_path / "text" / "corpus.txt")
    shutil.copy(tiny_tokenizer.model_path, tmp_path / "tok.model")
    monkeypatch.chdir(tmp_path)
    c = tiny_config("maelm", "tok.model")
    c.data.sources.main.kind = "text"
    c.data.sources.main.path = "text/*.txt"
    c.data.cache_dir = "cache"
    c.train.num_steps = c.train.checkpoint_every = 2
    pretrain_train.train_and_evaluate(c, "runs/pre")
    recorded = json.loads((tmp_path / "runs" / "pre" / "config.json").read_text())
    assert recorded["tokenizer"]["model_path"] == str(tmp_path / "tok.model")
    assert recorded["data"]["sources"]["main"]["path"] == str(tmp_path / "text" / "*.txt")
    assert recorded["data"]["cache_dir"] == str(tmp_path / "cache")
    assert (tmp_path / "cache").is_dir()
    assert (tmp_path / "runs" / "pre" / "checkpoints" / "2").is_dir()
    # Resuming from the same directory with the same relative config is the same run.
    c.train.num_steps = 3
    pretrain_train.train_and_evaluate(c, "runs/pre")
    assert 3 in train_metrics(tmp_path / "runs" / "pre")

    (tmp_path / "glue" / "SST-2").mkdir(parents=True)
    (tmp_path / "glue" / "SST-2" / "train.tsv").write_text(sst2_like(None, 32, 0))
    (tmp_path / "glue" / "SST-2" / "dev.tsv").write_text(sst2_like(None, 16, 1))
    f = glue_config.get_config("sst2")
    f.init_from = "runs/pre"  # the relative path orbax could not read
    f.data.data_dir = "glue"
    f.data.max_seq_len, f.data.buckets = 32, (32,)
    f.train.batch_size, f.train.eval_batch_size, f.train.num_epochs = 16, 16, 1
    f.mesh.shape, f.fast_compile, f.predict_test = (1, 1, 1), True, False
    results = finetune_train.run(f, "runs/sst2")
    assert results["num_steps"] == 2
    assert (tmp_path / "runs" / "sst2" / "results.json").is_file()
    # One checkpoint directory, relative, as init_from.
    p = runs.load_pretrained("runs/pre/checkpoints/3", WITH_DROPOUT)
    assert p.description.endswith("runs/pre/checkpoints/3")


@pytest.mark.tier("integration")  # seconds: a run
def test_cli_switches_the_corpus_and_lists_a_sources_fields(tmp_path, tiny_tokenizer):
    """`--config.data.sources.main.kind=text --config.data.sources.main.path=...` on the
    default (builtin) source, from another directory with relative paths."""
    (tmp_path / "corpus.txt").write_text(plain_corpus(tmp_path).read_text())
    shutil.copy(tiny_tokenizer.model_path, tmp_path / "tok.model")
    base = ["--config=" + str(REPO_ROOT / "tests" / "tiny_config.py"), "--workdir=run",
            "--config.tokenizer.model_path=tok.model", "--config.data.sources.main.kind=text"]
    typo = _main(base + ["--config.data.sources.main.paht=corpus.txt"], tmp_path)
    _one_line_error(typo, "data.sources.main.paht: unknown field for a 'text' source",
                    "expected fields: doc_separator, kind, path, weight")
    assert not (tmp_path / "run").exists()
    result = _main(base + ["--config.data.sources.main.path=corpus.txt",
                           "--config.train.num_steps=1", "--config.train.eval_batches=1"],
                   tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["data"]["sources"]["main"] == {
        "kind": "text", "path": str(tmp_path / "corpus.txt"), "weight": 1.0}


# ------------------------------------------------- files that are not what they should be

def test_mistyped_config_file_or_section_is_one_line(tmp_path):
    result = _main(["--config=configs/nope.py", "--workdir=w"], tmp_path)
    _one_line_error(result, "--config: configs/nope.py does not exist")
    tiny = "--config=" + str(REPO_ROOT / "tests" / "tiny_config.py")
    result = _main([tiny, "--workdir=w", "--config.data.sources.extra.kind=text"], tmp_path)
    _one_line_error(result, "--config.data.sources.extra.kind: config.data.sources has no "
                            "field 'extra'; a new section (such as another source) needs a "
                            "config file")
    result = _main([tiny, "--workdir=w", "--config.modle.dropout=0.2"], tmp_path)
    _one_line_error(result, "config has no field 'modle'; did you mean config.mode?")
    assert not (tmp_path / "w").exists()


def test_workdir_that_is_a_file_is_refused(tmp_path, tiny_tokenizer):
    not_a_dir = tmp_path / "notes.txt"
    not_a_dir.write_text("not a directory")
    c = tiny_pretraining(tmp_path, tiny_tokenizer)
    expect_user_error(c, not_a_dir, "notes.txt exists and is not a directory")
    expect_user_error(c, not_a_dir / "run", "notes.txt exists and is not a directory")
    assert not_a_dir.read_text() == "not a directory"


def test_workdir_with_unreadable_config_json_is_refused(tmp_path, tiny_tokenizer):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"model": {"d_model": 32,')  # cut short by a full disk
    c = tiny_pretraining(tmp_path, tiny_tokenizer)
    expect_user_error(c, run, r"config.json is not valid JSON \(line 1 column 26: .*\); "
                               r".*repair it, or use another --workdir")
    f = glue_config.get_config("sst2")
    f.tokenizer_path, f.data.data_dir = tiny_tokenizer.model_path, str(tmp_path)
    before = snapshot(run)
    with pytest.raises(errors.UserError, match="config.json is not valid JSON"):
        finetune_train.run(f, str(run))
    assert snapshot(run) == before


# ---------------------------------------------------------------- damaged checkpoints

def _damage(step_dir):
    """Overwrites the first half of the step's largest file with zeros, as a bad disk or an
    interrupted copy would. Returns that file."""
    largest = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)
    largest.write_bytes(bytes(data))
    return largest


def _steps(checkpoints):
    return sorted((p for p in checkpoints.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


@pytest.mark.tier("integration")  # seconds: a run
def test_damaged_checkpoint_warns_and_resumes_from_the_previous_step(
        tmp_path, tiny_tokenizer, caplog):
    run = tmp_path / "run"
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=4, checkpoint_every=2)
    pretrain_train.train_and_evaluate(c, str(run))
    newest = _steps(run / "checkpoints")[-1]
    assert newest.name == "4"
    largest = _damage(newest)
    damaged_bytes = largest.read_bytes()
    c.train.num_steps = 6
    with caplog.at_level(logging.WARNING):
        pretrain_train.train_and_evaluate(c, str(run))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"checkpoint {run}/checkpoints/4 cannot be restored: " in w for w in warnings)
    assert any("resuming from step 2" in w and "4.damaged" in w for w in warnings), warnings
    # Kept for inspection, byte for byte; the run went on from step 2 and saved 4 again.
    kept = run / "checkpoints" / "4.damaged" / largest.relative_to(newest)
    assert kept.read_bytes() == damaged_bytes
    assert checkpoint.Checkpointer(run / "checkpoints", 3).latest_step() == 6
    assert (run / "checkpoints" / "4").is_dir()
    assert sorted(train_metrics(run)) == [1, 2, 3, 4, 5, 6]


def test_no_intact_checkpoint_is_one_line_and_touches_nothing(tmp_path, tiny_tokenizer):
    run = tmp_path / "run"
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=2, checkpoint_every=2)
    pretrain_train.train_and_evaluate(c, str(run))
    for step_dir in _steps(run / "checkpoints"):
        _damage(step_dir)
    c.train.num_steps = 4
    expect_user_error(c, run, r"no checkpoint in .*checkpoints can be restored \(steps "
                               r"2, 1; the newest: .*\); if they are damaged, move them out")
    # Fine-tuning from one of them says so too.
    with pytest.raises(errors.UserError, match=r"checkpoints/2 cannot be restored \(.*\); it "
                                               r"may be damaged") as info:
        runs.load_pretrained(str(run / "checkpoints" / "2"), WITH_DROPOUT)
    assert "\n" not in str(info.value)


def test_a_checkpoint_of_another_model_is_named_not_called_damaged(tmp_path, tiny_tokenizer):
    """--allow_config_change with another architecture: the checkpoints are intact, so the
    error names the first parameter that differs and moves nothing aside."""
    run = tmp_path / "run"
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=2, checkpoint_every=2)
    pretrain_train.train_and_evaluate(c, str(run))
    c.model.num_layers += 1
    before = snapshot(run)
    with pytest.raises(errors.UserError, match=r"checkpoints/2 holds another model than this "
                                               r"config builds \(params\['encoder'\]\['stack'\]"
                                               r"\['layer_2'\].* is not in the checkpoint\); "
                                               r"continue the run with the config it was "
                                               r"written with"):
        pretrain_train.train_and_evaluate(c, str(run), allow_config_change=True)
    assert snapshot(run) == before


def test_a_models_parameters_are_compared_in_one_layer_layout():
    def layer(width):
        return {"mlp": {"kernel": jax.ShapeDtypeStruct((4, width), np.float32)}}

    per_layer = {"params": {"encoder": {"stack": {"layer_0": layer(8), "layer_1": layer(8)}}}}
    stacked = {"params": {"encoder": {"stack": {"scan": {"layer": {"mlp": {
        "kernel": jax.ShapeDtypeStruct((2, 4, 8), np.float32)}}}}}}}
    state = types.SimpleNamespace
    assert checkpoint.model_mismatch(stacked, state(params=per_layer["params"])) is None
    assert checkpoint.model_mismatch(per_layer, state(params=stacked["params"])) is None
    wider = {"encoder": {"stack": {"layer_0": layer(16), "layer_1": layer(16)}}}
    assert checkpoint.model_mismatch(stacked, state(params=wider)) == (
        "params['encoder']['stack']['layer_0']['mlp']['kernel'] is (4, 8) there, (4, 16) here")
    assert checkpoint.model_mismatch({"opt": {}}, state(params=wider)) is None


# ---------------------------------------------------------------- values out of range

@pytest.mark.parametrize("field, value, message", [
    ("model.dropout", 1.5, r"config.model.dropout: expected a number in \[0, 1\), got 1.5"),
    ("model.attention_dropout", -0.1, r"config.model.attention_dropout: expected a number in"),
    ("model.activation_dropout", 1.0, r"config.model.activation_dropout: expected"),
    ("train.adam_b2", 1.0, r"config.train.adam_b2: expected a number in \[0, 1\), got 1.0"),
    ("train.weight_decay", -0.01, r"config.train.weight_decay: expected a number >= 0"),
    ("train.clip_norm", -1.0, r"config.train.clip_norm: expected a number >= 0"),
    ("train.learning_rate", float("nan"), r"config.train.learning_rate: expected a number > 0"),
    ("train.log_every", 0, r"config.train.log_every: expected an int >= 1, got 0"),
    ("train.keep_checkpoints", 0, r"config.train.keep_checkpoints: expected an int >= 1"),
    ("data.prefetch", -1, r"config.data.prefetch: expected an int >= 0"),
    ("mesh.shape", (0, 1, 1), r"config.mesh.shape: expected a tuple of mesh axis sizes"),
    ("seed", -3, r"config.seed: expected an int >= 0"),
])
def test_out_of_range_pretraining_fields(tmp_path, tiny_tokenizer, field, value, message):
    c = tiny_pretraining(tmp_path, tiny_tokenizer)
    group, _, name = field.rpartition(".")
    (c[group] if group else c)[name] = value
    expect_user_error(c, tmp_path / "run", message)


@pytest.mark.parametrize("field, value, message", [
    ("model.dropout", 1.0, r"config.model.dropout: expected a number in \[0, 1\), got 1.0"),
    ("train.warmup_ratio", 1.0, r"config.train.warmup_ratio: expected a number in \[0, 1\)"),
    ("train.adam_eps", 0.0, r"config.train.adam_eps: expected a number > 0"),
    ("squad.n_best", 0, r"config.squad.n_best: expected an int >= 1"),
    ("data.buckets", (4, 64), r"config.data.buckets: expected increasing lengths >= 8"),
    ("grid.learning_rate", (1e-5, -1.0), r"config.grid.learning_rate: expected a tuple of "
                                         r"numbers > 0"),
    ("train.num_epochs", 0, r"config.train.num_epochs: expected an int >= 1, got 0"),
])
def test_out_of_range_finetuning_fields(tmp_path, tiny_tokenizer, field, value, message):
    c = glue_config.get_config("sst2")
    c.tokenizer_path, c.data.data_dir = tiny_tokenizer.model_path, str(tmp_path)
    group, _, name = field.rpartition(".")
    c[group][name] = value
    with pytest.raises(errors.UserError, match=message) as info:
        finetune_train.run(c, str(tmp_path / "ft"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "ft").exists()


def test_mistyped_field_is_named_with_a_suggestion(tmp_path, tiny_tokenizer):
    c = tiny_pretraining(tmp_path, tiny_tokenizer)
    c.masking.mask_ration = 0.2
    expect_user_error(c, tmp_path / "run", r"config.masking.mask_ration: unknown field; did "
                                            r"you mean config.masking.mask_ratio\?")
    # A field in the wrong section: every section that has it.
    del c.masking.mask_ration
    c.masking.num_steps = 3
    expect_user_error(c, tmp_path / "run", r"config.masking.num_steps: unknown field; did you "
                                            r"mean config.train.num_steps\?")
    # Nothing close: the section's fields are listed.
    del c.masking.num_steps
    c.train.epochs = 3
    expect_user_error(c, tmp_path / "run", r"config.train.epochs: unknown field; train has "
                                            r"adam_b1, adam_b2, .*, batch_size, .*, weight_decay")


def test_warmup_longer_than_training_warns(caplog):
    c = tiny_config()
    c.train.warmup_steps, c.train.num_steps = 50, 20
    with caplog.at_level(logging.WARNING):
        pretrain_config.validate(c)
    assert "config.train.warmup_steps=50 exceeds config.train.num_steps=20" in caplog.text


@pytest.mark.parametrize("defaults, fields", [
    (pretrain_config.pretrain_defaults, pretrain_config.fields()),
    (finetune_config.finetune_defaults, finetune_config.FIELDS),
])
def test_every_field_has_a_declared_type_and_range(defaults, fields):
    """A new config field must be declared in the table, and the defaults must pass it."""
    flat = schema._flatten(defaults())
    undeclared = [name for name in flat
                  if name not in fields and not name.startswith("data.sources.")]
    assert not undeclared, f"declare these in FIELDS (or an objective's fields()): {undeclared}"
    schema.check(defaults(), fields, defaults(), ValueError)


# ---------------------------------------------------------------- pathological documents

def _single_line_file(path, megabytes, seed=0):
    """A minified-looking text: words and numbers, no sentence punctuation, one line."""
    rng = np.random.default_rng(seed)
    words = np.array(["river", "stone", "alpha", "omega", "delta", "sky", "wood", "field"])
    picks = rng.integers(0, len(words), megabytes * 150_000)
    numbers = rng.integers(0, 1000, len(picks))
    text = " ".join(f"{w}{n}" for w, n in zip(words[picks], numbers, strict=True))
    text = text[: megabytes * 1_000_000]
    path.write_text(text + "\n")
    return path


def test_multi_megabyte_single_line_is_split_and_bounded(tmp_path, caplog):
    line = _single_line_file(tmp_path / "minified.txt", 3)
    c = tiny_config()
    c.data.sources.main.kind = "text"
    c.data.sources.main.path = f"{plain_corpus(tmp_path)},{line}"  # normal text, then the line
    with caplog.at_level(logging.WARNING):
        tok = run_data.setup_tokenizer(c, tmp_path)
        data = run_data.build_blocks(c, tmp_path, tok)
    assert ("data.sources.main: 1 line(s) longer than 4096 characters split at whitespace; "
            "1 document(s) longer than 1000000 characters cut into parts of at most 20000"
            ) in caplog.text
    assert data.train["main"].shape[0] > 1000
    # The tokenizer learnt from the pieces (SentencePiece would have skipped the whole line).
    assert len(tok.encode(["river123 stone456"])[0]) < 8

    documents = list(sources.iter_documents({"kind": "text", "path": str(line)}))
    assert len(documents) > 150  # 3 MB in parts of at most 20K characters
    assert all(len(d) <= sources.DOCUMENT_PART_CHARS for d in documents)
    assert max(len(x) for d in documents for x in d.split("\n")) <= sources.MAX_LINE_CHARS
    # Only whitespace changed: the same words in the same order.
    assert " ".join(" ".join(documents).split()) == " ".join(line.read_text().split())


def test_line_and_document_bounds_fit_the_tokenizer_trainer():
    assert 4 * sources.MAX_LINE_CHARS <= tokenizer_lib._MAX_SENTENCE_BYTES
    assert sources.split_line("aaaa bbbb cccc", 9) == ["aaaa bbbb", "cccc"]
    assert sources.split_line("abcdefghij", 4) == ["abcd", "efgh", "ij"]  # no whitespace


def test_tokenizer_training_skips_and_counts_overlong_lines(tmp_path, caplog):
    """Text given straight to train_tokenizer: the 3 MB line costs nothing and is named."""
    line = _single_line_file(tmp_path / "minified.txt", 3).read_text()
    documents = [f"document {i} is about rivers and stones." for i in range(300)] + [line]
    with caplog.at_level(logging.WARNING):
        tokenizer_lib.train_tokenizer(documents, str(tmp_path / "t.model"), 300)
    assert "skipped 1 line(s) longer than 16384 bytes" in caplog.text


def test_packing_a_huge_document_in_one_call():
    """Blocks of a 2M-token document, in one call (a quadratic packer would not finish)."""
    packer = packing.BlockPacker(32, tokenizer_lib.SENTENCEPIECE_IDS)
    ids = list(range(5, 2_000_005))
    blocks = packer.add(ids)
    assert len(blocks) == (len(ids) + 1) // 31 and blocks[1][1:3] == [36, 37]


def test_modes_that_record_no_config_refuse_another_modes_workdir(tmp_path):
    """Mode prepare and the rank analysis write no config.json of their own, so they ask
    the workdir: one that holds a pretraining run's record is refused in one line, and
    nothing is written into it."""
    from maelm_jax.workdirs import guard as workdir_lib
    from maelm_jax.workdirs import layout

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"objective": "maelm"}')
    before = sorted(p.name for p in run.iterdir())
    for kind, noun in (("prepare", "prepare"), ("rank", "analyse"),
                       ("study_pool", "pool the calls")):
        with pytest.raises(layout.WorkdirError,
                           match=rf"^--workdir {run} holds a pretrain run; {noun} into "
                                 "another directory$"):
            workdir_lib.claim(run, kind, noun)
    assert sorted(p.name for p in run.iterdir()) == before
    workdir_lib.claim(tmp_path / "new", "prepare", "prepare")  # a new one is fine
    assert not (tmp_path / "new").exists()


def test_the_study_refuses_another_modes_workdir_before_writing(tmp_path):
    """The study records its config.json first; pointed at a pretraining run's workdir it
    is refused before that, and the run's record stays."""
    from maelm_jax.study import config as study_config
    from maelm_jax.study import run as study_run
    from maelm_jax.workdirs import layout

    from tiny_config import tiny_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"objective": "maelm"}')
    c = study_config.study_defaults()
    c.pretrain = tiny_config("maelm")
    with pytest.raises(layout.WorkdirError, match="holds a pretrain run; run the study into"):
        study_run.run(c, str(run))
    assert (run / "config.json").read_text() == '{"objective": "maelm"}'
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_a_resume_on_other_data_is_refused_unless_allowed(tmp_path, tiny_tokenizer,
                                                          monkeypatch, caplog):
    """The same source path with more documents between a stop and a resume: the run
    recorded the data it trains on (data.json), and its checkpoints do not continue on
    another block stream and evaluation set unless --allow_config_change says so."""
    from support import plain_documents, preempt_at

    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=3)
    run = tmp_path / "run"
    preempt_at(monkeypatch, c, run, 1)
    recorded = json.loads((run / "data.json").read_text())
    assert recorded["sources"]["main"]["train"]["documents"] > 0
    (tmp_path / "corpus.txt").write_text(plain_documents(260))
    before = snapshot(run)
    with pytest.raises(errors.UserError, match=r"holds a run trained on other data \(source "
                       r"main: \d+ training documents then, \d+ now \(fingerprint \w+ then, "
                       r"\w+ now\)\); .*--allow_config_change") as refused:
        pretrain_train.train_and_evaluate(c, str(run))
    assert "\n" not in str(refused.value)
    assert snapshot(run) == before  # the other data's blocks are not left in data/
    with caplog.at_level(logging.WARNING):
        pretrain_train.train_and_evaluate(c, str(run), allow_config_change=True)
    assert "continuing" in caplog.text and "on other data" in caplog.text
    assert json.loads((run / "data.json").read_text())["fingerprint"] != recorded["fingerprint"]
