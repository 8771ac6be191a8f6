"""Merging a study's parts: what makes inputs parts of one study, and the one-line
refusals (on made-up study.json records; that parts run apart merge into the study run
whole is tests/study/test_study.py's)."""

import copy
import json
import re
import subprocess
import sys

import pytest

from maelm_jax.infra import errors
from maelm_jax.study import config as study_config
from maelm_jax.study import merge
from maelm_jax.workdirs import layout

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env

pytestmark = pytest.mark.tier("integration")


def _rank_run(name):
    ranks = {"with_mask": [3, 5, 6], "without_mask": [3, 4, 5], "mask_only": [1, 2, 2]}
    return {"path": f"/tmp/study/pretrain/{name}", "label": name, "kind": "pretrain",
            "d_model": 32, "num_layers": 2, "tokens": 256, "mask_tokens": 38,
            "layers": [0, 1, 2], **ranks,
            "last_layer": {k: v[-1] for k, v in ranks.items()},
            "centred": {**ranks, "last_layer": {k: v[-1] for k, v in ranks.items()}}}


def _part(models, controls=()):
    """A finished study's study.json holding `models` (and `controls`)."""
    config = study_config.study_defaults()
    config.models = tuple(models)
    names = [*models, *controls]
    return {
        "title": "Study", "models": list(models), "controls": list(controls),
        "finished": True, "parts_done": [f"pretrain {n}" for n in models], "parts_left": [],
        "pretraining": {n: {"workdir": f"/tmp/study/pretrain/{n}", "step": 4, "seconds": 60.0,
                            "train_flops": 1e12, "eval_loss": 4.0, "eval_mask_loss": 4.0,
                            "eval_mask_accuracy": 0.2, "eval_unigram_accuracy": 0.05,
                            "mfu": 0.31,
                            "curves": {"train": [[2, 5.0], [4, 4.5]], "eval": [[4, 4.0]]}}
                        for n in models},
        "rank": {"tau": 0.9, "center": True, "mask_ratio": 0.15, "seed": 0,
                 "source": {"kind": "validation"}, "source_description": "held-out blocks",
                 "runs": [_rank_run(n) for n in models]},
        "glue": {n: {"RTE": {"metric": "accuracy", "median": 55.0, "per_seed": {"1": 55.0},
                             "seconds": 30.0}} for n in names},
        "glue_dir": "/tmp/data/glue", "seeds": [1],
        "identity": {"settings": study_config.shared_settings(config),
                     "tokenizer_sha256": "ab" * 32, "data_fingerprint": "0123456789abcdef",
                     "glue": {"RTE": {"train.tsv": [10, "sha256:aa"],
                                      "dev.tsv": [5, "sha256:bb"]}}},
        "parts": [{"workdir": "/tmp/study", "models": list(models), "controls": list(controls),
                   "device": "1 x NVIDIA H100 80GB HBM3", "jax": "0.11.2"}],
    }


def _write(directory, record):
    directory.mkdir(parents=True)
    (directory / layout.STUDY_JSON_FILE).write_text(json.dumps(record))
    return directory


def _merge(tmp_path, *records, out="merged"):
    dirs = [_write(tmp_path / f"part{i}", r) for i, r in enumerate(records)]
    c = study_config.merge_defaults()
    c.inputs = ",".join(map(str, dirs))
    return merge.merge(c, str(tmp_path / out))


def test_parts_merge_into_one_report(tmp_path):
    merged = _merge(tmp_path, _part(["mlm"], ["scratch"]), _part(["maelm", "3ml_self"]))
    assert merged["models"] == ["mlm", "maelm", "3ml_self"]
    assert merged["controls"] == ["scratch"]
    assert [r["label"] for r in merged["rank"]["runs"]] == ["mlm", "maelm", "3ml_self"]
    out = tmp_path / "merged"
    table = (out / layout.STUDY_MARKDOWN_FILE).read_text()
    assert table.startswith("# Study\n")
    assert ("| MAE-LM | 4.00 | 20.0 | 5.0 | 5 | 6 | 5 | 6 | 55.0 | 55.0 | 1.0 min | 1e+12 "
            "| 31.0 % |") in table
    assert re.search(r"Run on MLM, from scratch \(control\): 1 x NVIDIA H100 80GB HBM3, jax "
                     r"0\.11\.2; MAE-LM, 3ML_self: ", table)
    rank_md = (out / layout.STUDY_RANK_DIR / layout.RANK_MARKDOWN_FILE).read_text()
    assert rank_md.count("### ") == 3
    assert layout.unexpected_entries(out, "study_merge") == []
    assert layout.mode(out) == "study_merge"


def test_an_unfinished_part_leaves_the_merge_unfinished(tmp_path):
    b = _part(["maelm"])
    b["finished"], b["parts_left"] = False, ["fine-tune maelm on RTE"]
    merged = _merge(tmp_path, _part(["mlm"]), b)
    assert not merged["finished"] and merged["parts_left"] == ["fine-tune maelm on RTE"]
    assert "**Not finished**" in (tmp_path / "merged" / layout.STUDY_MARKDOWN_FILE).read_text()


def _changed(record, path, value):
    out = copy.deepcopy(record)
    *parents, leaf = path
    node = out
    for key in parents:
        node = node[key]
    node[leaf] = value
    return out


@pytest.mark.parametrize("path, value, message", [
    (("identity", "settings", "seeds"), [1, 2],
     "config.seeds is [1, 2, 3, 4, 5] in one and [1, 2] in the other"),
    (("identity", "settings", "pretrain", "train", "num_steps"), 7,
     "config.pretrain.train.num_steps is "),
    (("identity", "tokenizer_sha256"), "cd" * 32,
     "their tokenizers differ (SHA-256 ababababab"),
    (("identity", "data_fingerprint"), "fedcba9876543210", "their prepared data differ"),
    (("identity", "glue"), {}, "they fine-tune on different GLUE tasks"),
    (("identity", "glue", "RTE", "dev.tsv"), [6, "sha256:cc"],
     "the files of GLUE task RTE differ"),
    (("rank", "tau"), 0.99, "their rank analyses differ in rank.tau"),
])
def test_inputs_of_two_studies_are_refused_naming_what_differs(tmp_path, path, value, message):
    with pytest.raises(errors.UserError, match=r"^config\.inputs: .*part0.* and .*part1.* are "
                       r"not parts of one study: " + re.escape(message)):
        _merge(tmp_path, _part(["mlm"]), _changed(_part(["maelm"]), path, value))
    assert not (tmp_path / "merged").exists()


def test_paths_and_the_models_taken_may_differ(tmp_path):
    b = _part(["maelm"])
    b["glue_dir"] = "/elsewhere/glue"
    b["pretraining"]["maelm"]["workdir"] = "/elsewhere/pretrain/maelm"
    assert _merge(tmp_path, _part(["mlm"]), b)["models"] == ["mlm", "maelm"]


def test_a_model_in_two_parts_is_refused(tmp_path):
    with pytest.raises(errors.UserError, match=r"^config\.inputs: .*part0.* and .*part1.* both "
                       r"hold scratch; merge each model, and the control, from one part"):
        _merge(tmp_path, _part(["mlm"], ["scratch"]), _part(["maelm"], ["scratch"]))
    assert not (tmp_path / "merged").exists()


def test_inputs_that_are_not_studies_are_named(tmp_path):
    old = _part(["mlm"])
    del old["identity"]
    with pytest.raises(errors.UserError, match=r"^config\.inputs: .*study\.json records no "
                       r"identity .*run that study's command again"):
        _merge(tmp_path, old)
    c = study_config.merge_defaults()
    c.inputs = str(tmp_path / "nowhere")
    with pytest.raises(errors.UserError, match=r"^config\.inputs: .*nowhere holds no study\.json"):
        merge.merge(c, str(tmp_path / "out"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / layout.STUDY_JSON_FILE).write_text("{")
    c.inputs = str(tmp_path / "bad" / layout.STUDY_JSON_FILE)
    with pytest.raises(errors.UserError, match=r"^config\.inputs: .*cannot be read as JSON"):
        merge.merge(c, str(tmp_path / "out"))
    c.inputs = ""
    with pytest.raises(errors.UserError, match=r"^config\.inputs: expected study workdirs"):
        merge.merge(c, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_workdir_is_never_an_input_or_another_run(tmp_path):
    part = _write(tmp_path / "part", _part(["mlm"]))
    before = (part / layout.STUDY_JSON_FILE).read_text()
    c = study_config.merge_defaults()
    c.inputs = str(part)
    with pytest.raises(errors.UserError, match=r"^--workdir .*part holds the input"):
        merge.merge(c, str(part))
    assert (part / layout.STUDY_JSON_FILE).read_text() == before
    run = tmp_path / "run"
    run.mkdir()
    (run / layout.CONFIG_FILE).write_text(json.dumps({"mode": "finetune"}))
    with pytest.raises(errors.UserError, match=r"^--workdir .*run holds a finetune run"):
        merge.merge(c, str(run))
    assert sorted(p.name for p in run.iterdir()) == [layout.CONFIG_FILE]


def test_main_merges_and_names_a_mistake_in_one_line(tmp_path):
    a = _write(tmp_path / "a", _part(["mlm"]))
    b = _write(tmp_path / "b", _part(["mlm"]))
    cmd = [sys.executable, str(REPO_ROOT / "main.py"), "--config=configs/study/merge.py",
           f"--workdir={tmp_path / 'out'}"]
    run = subprocess.run(cmd + [f"--config.inputs={a},{b}"], cwd=REPO_ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=HANG_SECONDS, check=False)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].endswith("both hold mlm; merge each model, and "
                                                       "the control, from one part")
    b.joinpath(layout.STUDY_JSON_FILE).write_text(json.dumps(_part(["maelm"])))
    run = subprocess.run(cmd + [f"--config.inputs={a},{b}"], cwd=REPO_ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=HANG_SECONDS, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((tmp_path / "out" / layout.STUDY_JSON_FILE).read_text())["models"] == [
        "mlm", "maelm"]
