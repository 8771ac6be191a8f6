"""Every environment variable the project reads, read here, with one-line errors.

Cluster launchers (Slurm, Open MPI, Cloud TPU's GKE), container and CI wrappers set or
pass on variables the project reads to find its job's shape and its caches. A wrapper
often passes a variable that is unset on its side as set but empty: that is read as
unset, which is what the launcher means. A value that is not what the variable holds
(`SLURM_NTASKS=four`) stops the run with one line naming the variable and what it
should hold, instead of Python's `invalid literal for int()` and a traceback.

VARIABLES lists each one with what it is for; tests/test_environment.py reads each.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from maelm_jax.infra import errors

# name -> what it holds (who reads it).
VARIABLES: dict[str, str] = {
    "SLURM_NTASKS": "the tasks of a Slurm job",  # distributed.py
    "OMPI_COMM_WORLD_SIZE": "the processes of an Open MPI job",  # distributed.py
    "TPU_WORKER_HOSTNAMES": "a GKE TPU slice's hosts, comma-separated",  # distributed.py
    "MAELM_JAX_CACHE": "the project's per-user cache directory",  # user_cache.py
    "XDG_CACHE_HOME": "the user's cache directory, ours under it",  # user_cache.py
    "JAX_COMPILATION_CACHE_DIR": "where compiled programs are kept",  # compile_cache.py
    # What a copy of the tree without git history is of (records.py: the benchmarks' records
    # and the study's).
    "MAELM_JAX_COMMIT": "a commit's hash",
}


class EnvironmentVariableError(errors.UserError):
    """An environment variable whose value is not what it should hold."""


def _raw(name: str, env: Mapping[str, str] | None) -> str | None:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a variable the project reads (environment.VARIABLES)")
    value = (os.environ if env is None else env).get(name)
    return None if value is None or not value.strip() else value.strip()


def text(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, or None when it is unset or empty."""
    return _raw(name, env)


def integer(name: str, default: int, minimum: int = 0,
            env: Mapping[str, str] | None = None) -> int:
    """The variable as an integer of at least `minimum`; `default` when unset or empty."""
    value = _raw(name, env)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise EnvironmentVariableError(
            f"environment variable {name}: expected an integer >= {minimum} "
            f"({VARIABLES[name]}), got {value!r}; unset it or set a number")
    return number


def names(name: str, env: Mapping[str, str] | None = None) -> list[str]:
    """The variable's comma-separated names, without empty ones ([] when unset)."""
    value = _raw(name, env)
    return [] if value is None else [part.strip() for part in value.split(",") if part.strip()]
