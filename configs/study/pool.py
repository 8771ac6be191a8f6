"""The calls of a study design pooled, and what they show of the papers' claims
(maelm_jax/study/pool.py):

    python main.py --config=configs/study/pool.py --workdir=runs/pool \
        [--config.inputs=benchmarks/results/study] [--config.readme=README.md]

By default the records committed under benchmarks/results/study/; --config.readme=README.md
rewrites the README's table from them (a test fails when it is out of date).
"""

from maelm_jax import variants
from maelm_jax.study import pool


def get_config(arg: str | None = None):
    variants.require_none(arg)
    return pool.pool_defaults()
