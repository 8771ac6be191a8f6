"""The per-user cache: what a machine keeps between runs so that it does work once.

``$MAELM_JAX_CACHE`` if set, else ``$XDG_CACHE_HOME/maelm_jax``, else
``~/.cache/maelm_jax``. It holds only what can be computed again (file digests, compiled
programs): deleting it costs time, never results.
"""

from __future__ import annotations

import os
import pathlib

from maelm_jax.infra import environment

ENV = "MAELM_JAX_CACHE"


def directory(*parts: str) -> pathlib.Path:
    """The cache directory (or a subdirectory of it), not created here."""
    root = environment.text(ENV) or os.path.join(
        environment.text("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "maelm_jax")
    return pathlib.Path(root, *parts)
