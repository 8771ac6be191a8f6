"""The benchmarks: each script measures one thing and, where it says so, records it
(maelm_jax/infra/records.py) under benchmarks/results/, from which tables.py generates the tables
of README.md and docs/.

Run a script as `python benchmarks/<name>.py`; the scripts import each other as modules of
this package (`from benchmarks import harness`), which the project's install provides
(requirements.txt installs it, editable). A script defines its absl flags in its
`define_flags()`, called only when it runs as a script, so that any of them can be imported
beside another (by a test, or by a script that runs one's code) without two definitions of
one flag.
"""

import pathlib

# The repository: the scripts find main.py, configs/ and the records from here, so they run
# from any directory.
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
