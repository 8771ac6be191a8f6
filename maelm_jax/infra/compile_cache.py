"""JAX's persistent compilation cache, on by default: a machine compiles a program once.

On a GPU most of a first compile is XLA's GEMM autotuning (each matmul of the program
timed against its candidate kernels). With the cache, every later run of the same program
on the same kind of machine (a second run of a config, a resumed run, the other seeds and
settings of a sweep that share shapes) loads the compiled program in seconds; XLA's
per-fusion autotuning results are kept beside it (JAX's default
``jax_persistent_cache_enable_xla_caches``), so even a new program reuses the GEMM choices
of its shapes. Programs that compile in under a second are not kept (JAX's
``jax_persistent_cache_min_compile_time_secs``).

Where: ``--compilation_cache_dir``, else ``$JAX_COMPILATION_CACHE_DIR``, else ``jax/`` in
the user cache (`maelm_jax.infra.user_cache`: ``~/.cache/maelm_jax/jax``). A bucket path works
too (JAX reads and writes it through etils.epath). ``--nocompilation_cache`` runs without
it. Entries are keyed by the program, the JAX and XLA versions, the compile options and the
device kind, so one directory can serve several machines and versions; delete it to reclaim
the space.
"""

from __future__ import annotations

import jax

from maelm_jax.infra import environment, user_cache

ENV = "JAX_COMPILATION_CACHE_DIR"


def directory(override: str = "") -> str:
    """Where the cache is: `override`, else $JAX_COMPILATION_CACHE_DIR, else the user
    cache's jax/."""
    return override or environment.text(ENV) or str(user_cache.directory("jax"))


def enable(override: str = "") -> str:
    """Turns the cache on (before the first compile); returns its directory."""
    path = directory(override)
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def disable() -> None:
    """No persistent cache, whatever $JAX_COMPILATION_CACHE_DIR says."""
    jax.config.update("jax_enable_compilation_cache", False)


def first_step_message() -> str:
    """How the first step's program was obtained, for the log line that times it."""
    if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir:
        return ("compiled (or loaded from the compilation cache in "
                f"{jax.config.jax_compilation_cache_dir}) and ran the first step")
    return "compiled (no compilation cache) and ran the first step"
