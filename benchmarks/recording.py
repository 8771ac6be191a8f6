"""Where a benchmark run writes its record: the --record_dir flag (default
benchmarks/results/, where the committed records are) and `save`, with the machine
(maelm_jax/infra/records.py)."""

from __future__ import annotations

import pathlib

from absl import flags

from benchmarks import REPO_ROOT
from maelm_jax.infra import cli, records

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def define_flag(benchmark: str) -> None:
    """--record_dir: where a run of `benchmark` writes its record."""
    flags.DEFINE_string("record_dir", str(RESULTS_DIR), "Where this run's record goes "
                        f"(<dir>/{benchmark}/<date>_<device>_<commit>.json; the tables in "
                        "README and docs/ are generated from the committed ones); '' for none.")
    cli.directory_flag("record_dir")


def save(benchmark: str, figures: dict, speed: tuple[str, float] | None = None
         ) -> pathlib.Path | None:
    """Writes `figures` as benchmark's record to --record_dir (none when it is empty) with
    the machine (`speed` as for records.machine) and prints where; returns the path."""
    if not flags.FLAGS.record_dir:
        return None
    path = records.write(benchmark, figures, pathlib.Path(flags.FLAGS.record_dir),
                         records.machine(speed))
    print(f"record: {path}")
    return path
