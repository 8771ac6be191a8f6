r"""The laptop-scale study as docs/results.md gives it, run cold and recorded: what every
objective learns at that size and what it costs.

    python benchmarks/laptop_study.py --glue_dir=/data/glue --corpus=/data/wiki \
        [--config=configs/study/mini.py] [--workdir=runs/study] [-- --config.x=y]

Runs ``python main.py --config=<config> --workdir=<workdir> --config.glue_dir=<glue_dir>``
(pretraining on --corpus, a directory of --corpus_kind files, or on the built-in corpus
when it is empty) cold (cold_run.py: a process of its own, an empty compilation cache)
and records the study's study.json (maelm_jax/study/report.py: every model's [MASK]
loss and accuracy beside the unigram baseline, its ranks, its GLUE medians and per-seed
scores, its pretraining time and FLOPs; the control's scores) with the whole run's wall
seconds and peak memory, beside the jitted fp32 matmul's speed measured after it. The
workdir (a temporary one unless --workdir names a new directory, kept with its plots)
must be fresh: a resumed study's seconds would not be the study's. Paths in the record
are written as the docs write them (/data/<name>, runs/study), none of this machine's.
Arguments after ``--`` go to main.py (e.g. a shorter study for a test).

Each run writes its record (recording.py) to --record_dir (default benchmarks/results/; ""
writes none); docs/results.md's table is generated from the newest committed one
(`python benchmarks/tables.py`).
"""

from __future__ import annotations

import json
import pathlib
import shlex
import tempfile

from absl import app, flags

from benchmarks import cold_run, recording
from maelm_jax.infra import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("config", "configs/study/mini.py", "The study config main.py runs.")
    flags.DEFINE_string("glue_dir", "", "A GLUE directory (one folder per task); empty: the "
                        "study pretrains and analyses only.")
    flags.DEFINE_string("corpus", "", "The pretraining corpus, a directory of --corpus_kind "
                        "files; empty: the config's own (the built-in corpus).")
    flags.DEFINE_string("corpus_kind", "wikiextractor", "The reader of --corpus "
                        "(pretraining's data.sources.main.kind).")
    flags.DEFINE_string("workdir", "", "Where the study runs and stays (a new directory); "
                        "empty: a temporary one, removed after the record is written.")
    recording.define_flag("laptop_study")

DOCS_WORKDIR = "runs/study"


def _size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _data_flags(glue_dir: str, corpus: str, kind: str) -> tuple[list[str], dict, dict]:
    """main.py's data flags, the record's description of the data, and each path -> how
    the docs write it."""
    args, data, shown = [], {}, {}
    for name, given, flag in (("glue_dir", glue_dir, "--config.glue_dir"),
                              ("corpus", corpus, "--config.pretrain.data.sources.main.path")):
        if not given:
            continue
        path = pathlib.Path(given).expanduser().resolve()  # main.py runs from the repository
        if not path.is_dir():
            raise SystemExit(f"laptop_study.py: --{name}: {given} is not a directory")
        shown[str(path)] = f"/data/{path.name}"
        if name == "corpus":
            args.append(f"--config.pretrain.data.sources.main.kind={kind}")
            data["corpus"] = {"kind": kind, "name": path.name, "bytes": _size(path)}
        else:
            data["glue"] = {"name": path.name}
        args.append(f"{flag}={path}")
    return args, data, shown


def _shown(text: str, shown: dict) -> str:
    # Longest first: one path may hold another (a corpus inside the workdir).
    for path in sorted(shown, key=len, reverse=True):
        text = text.replace(path, shown[path])
    return text


def measure(config: str, glue_dir: str, corpus: str, kind: str, workdir: str,
            extra: list[str]) -> dict:
    """Runs the study cold; its figures and its study.json, in the docs' paths."""
    data_args, data, shown = _data_flags(glue_dir, corpus, kind)
    with tempfile.TemporaryDirectory() as scratch:
        root = pathlib.Path(workdir or pathlib.Path(scratch) / "study").expanduser().resolve()
        if root.exists():
            raise SystemExit(f"laptop_study.py: --workdir: {workdir} exists; a recorded study "
                             "starts in a new directory")
        shown[str(root)] = DOCS_WORKDIR
        args = [f"--config={config}", f"--workdir={root}", *data_args, *extra]
        timed = cold_run.run_main(args, pathlib.Path(scratch) / "jax", "laptop_study.py")
        study = json.loads(_shown((root / "study.json").read_text(), shown))
    if not study.get("finished"):
        raise SystemExit(f"laptop_study.py: the study stopped with {study['parts_left']} left")
    return {"command": _shown(shlex.join(["python", "main.py", *args]), shown), **timed,
            "data": data, "study": study}


def main(argv):
    figures = measure(FLAGS.config, FLAGS.glue_dir, FLAGS.corpus, FLAGS.corpus_kind,
                      FLAGS.workdir, argv[1:])
    s = figures["study"]
    print(f"{figures['command']}: {figures['seconds'] / 60:.1f} min, peak "
          f"{figures['peak_gb']:.2f} GB; models {', '.join(s['models'])}, "
          f"controls {', '.join(s['controls']) or 'none'}")
    recording.save("laptop_study", figures)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.forwarding_flags_parser)
