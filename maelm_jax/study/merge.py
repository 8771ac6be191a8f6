"""One study from parts run apart: `merge(config, workdir)`.

A study's models need not be trained on one machine, or in one sitting: run the study
with --config.models (and --config.scratch) naming a share of them, on as many machines
or sessions as suit, then merge the parts into one report:

    python main.py --config=configs/study/merge.py --workdir=runs/study \
        --config.inputs=runs/part_a,runs/part_b

An input is a study's workdir, any directory holding its study.json (the small files
benchmarks/gpu_study.sh brings back), or the study.json itself: study.json alone holds
everything the table and plots show. Parts merge only when they are parts of one study:
the same settings apart from which models they take (config.shared_settings), the same
tokenizer (its SHA-256), the same prepared data (its fingerprint: the corpora's content,
the tokenizer, the blocks), the same GLUE tasks and files, and the same rank-analysis
settings; each model and the control in one part only. A mismatch is one line naming
both parts and what differs, and nothing is written. The workdir gets what a study's
does (study.json, study.md, the plots, rank/ with the parts' analyses side by side);
study.md says which machine ran which models.
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections
from absl import logging

from maelm_jax.analysis import measures
from maelm_jax.analysis import report as rank_report
from maelm_jax.config import schema
from maelm_jax.infra import errors, paths
from maelm_jax.study import config as study_config
from maelm_jax.study import report
from maelm_jax.workdirs import guard as workdir_lib
from maelm_jax.workdirs import layout

# The rank analysis's settings (rank.json), which every part's analysis must share.
_RANK_SETTINGS = ("tau", "center", "mask_ratio", "seed", "bootstrap", "source")


class MergeError(errors.UserError):
    """Inputs that are not parts of one study; the message names them and what differs."""


def _read(value: str) -> tuple[paths.Path, dict]:
    """An input's study.json path and contents; one line when it is not a study's."""
    given = paths.resolve(value, "config.inputs")
    file = given if given.name == layout.STUDY_JSON_FILE else given / layout.STUDY_JSON_FILE
    if not file.is_file():
        raise MergeError(f"config.inputs: {value} holds no {layout.STUDY_JSON_FILE}; give a "
                         "study's workdir, or a directory or file of its study.json")
    try:
        result = json.loads(paths.read_text(file))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MergeError(f"config.inputs: {file} cannot be read as JSON ({e})") from None
    keys = {"models", "controls", "pretraining", "glue", "parts"}
    if not isinstance(result, dict) or not keys <= set(result):
        raise MergeError(f"config.inputs: {file} is not a study's {layout.STUDY_JSON_FILE}")
    if "identity" not in result:
        raise MergeError(
            f"config.inputs: {file} records no identity (a study written before parts could "
            "be merged, or stopped before its tokenizer): run that study's command again, "
            "which reuses every finished part and records it")
    return file, result


def _first_difference(a: Any, b: Any, where: str) -> tuple[str, Any, Any] | None:
    """The first dotted field at which a and b differ, with both values; None if equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = _first_difference(a.get(key), b.get(key), f"{where}.{key}")
            if found:
                return found
        return None
    return None if a == b else (where, a, b)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_one_study(first: tuple[paths.Path, dict], other: tuple[paths.Path, dict]) -> None:
    """Raises MergeError unless the two inputs are parts of one study."""
    (file_a, a), (file_b, b) = first, other
    both = f"config.inputs: {file_a} and {file_b} are not parts of one study"
    ia, ib = a["identity"], b["identity"]
    found = _first_difference(ia["settings"], ib["settings"], "config")
    if found:
        field, va, vb = found
        raise MergeError(f"{both}: {field} is {_short(va)} in one and {_short(vb)} in the other")
    if ia["tokenizer_sha256"] != ib["tokenizer_sha256"]:
        raise MergeError(
            f"{both}: their tokenizers differ (SHA-256 {ia['tokenizer_sha256'][:12]}... and "
            f"{ib['tokenizer_sha256'][:12]}...); give every part the same file with "
            "--config.pretrain.tokenizer.model_path")
    if ia["data_fingerprint"] != ib["data_fingerprint"]:
        raise MergeError(
            f"{both}: their prepared data differ (fingerprints {ia['data_fingerprint']} and "
            f"{ib['data_fingerprint']}): the corpora's content is not the same")
    if sorted(ia["glue"]) != sorted(ib["glue"]):
        raise MergeError(f"{both}: they fine-tune on different GLUE tasks ({sorted(ia['glue'])} "
                         f"and {sorted(ib['glue'])}): their GLUE directories hold different tasks")
    for task in sorted(ia["glue"]):
        if ia["glue"][task] != ib["glue"][task]:
            raise MergeError(f"{both}: the files of GLUE task {task} differ")
    ra, rb = a["rank"], b["rank"]
    if ra.get("tau") is not None and rb.get("tau") is not None:
        found = _first_difference({k: ra.get(k) for k in _RANK_SETTINGS},
                                  {k: rb.get(k) for k in _RANK_SETTINGS}, "rank")
        if found:
            raise MergeError(f"{both}: their rank analyses differ in {found[0]}")


def _combined(inputs: list[tuple[paths.Path, dict]]) -> dict:
    """The merged study.json: each model and control from the part that holds it."""
    owner: dict[str, paths.Path] = {}
    for file, result in inputs:
        for name in result["models"] + result["controls"]:
            if name in owner:
                raise MergeError(f"config.inputs: {owner[name]} and {file} both hold {name}; "
                                 "merge each model, and the control, from one part")
            owner[name] = file
    first = inputs[0][1]
    analysed = [r["rank"] for _, r in inputs if r["rank"].get("tau") is not None]
    runs = [run for r in analysed for run in r["runs"]]
    # Paired differences again over every part's runs: parts read the same sequences
    # (the same data and rank settings) and draw the same bootstrap counts.
    rank = ({**{k: v for k, v in analysed[0].items() if k not in ("runs", "differences")},
             "runs": runs, "differences": measures.differences(runs)}
            if analysed else {"tau": None, "runs": []})
    merged = {
        "title": first["title"],
        "models": [n for _, r in inputs for n in r["models"]],
        "controls": [n for _, r in inputs for n in r["controls"]],
        "finished": all(r["finished"] for _, r in inputs),
        "parts_done": [p for _, r in inputs for p in r["parts_done"]],
        "parts_left": [p for _, r in inputs for p in r["parts_left"]],
        "pretraining": {n: r["pretraining"][n] for _, r in inputs for n in r["models"]},
        "rank": rank,
        "glue": {n: r["glue"][n] for _, r in inputs
                 for n in r["models"] + r["controls"] if n in r["glue"]},
        "glue_dir": first["glue_dir"],
        "seeds": first["seeds"],
        "pretrain_config": {n: c for _, r in inputs
                            for n, c in r.get("pretrain_config", {}).items()},
        "identity": first["identity"],
        "parts": [{**part, "study_json": str(file)} for file, r in inputs for part in r["parts"]],
    }
    return merged


def merge(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Merges the parts config.inputs names into workdir; returns the merged study.json."""
    schema.check(config, study_config.MERGE_FIELDS, study_config.merge_defaults(), MergeError)
    root = paths.resolve(workdir, "--workdir")
    workdir_lib.check_directory(root)
    inputs = [_read(value) for value in study_config.names(config.inputs)]
    for file, _ in inputs:
        if paths.same(file.parent, root):
            raise MergeError(f"--workdir {root} holds the input {file}, which the merge would "
                             "overwrite; merge into another directory")
    recorded = layout.mode(root) if root.is_dir() else None
    if recorded not in (None, "study_merge"):
        raise layout.WorkdirError(f"--workdir {root} holds a {recorded} run; merge into a new "
                                  "directory or one a merge wrote")
    for other in inputs[1:]:
        _check_one_study(inputs[0], other)
    merged = _combined(inputs)
    paths.make_dirs(root)
    layout.write_config(root, config)
    if merged["rank"]["runs"]:
        rank_report.write(root / layout.STUDY_RANK_DIR, merged["rank"])
    written = report.write(root, merged)
    logging.info("merged %d parts (%s) into %s", len(inputs),
                 ", ".join(merged["models"] + merged["controls"]),
                 ", ".join(str(p) for p in written))
    return merged
