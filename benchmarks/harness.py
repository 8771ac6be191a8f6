"""What the benchmarks share: the objectives derived from one config, their compiled train
steps, rotated timing, the trace of a step's ops, and flags with one-line errors.

Not a benchmark itself: the scripts that time train steps import it. Each of them takes
--config as main.py does (a pretraining config file[:variant] and --config.<field>=<value>
overrides), defaulting to its own file in configs/benchmark/.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from absl import flags

from benchmarks import REPO_ROOT, recording
from maelm_jax.infra import cli, host_memory, sharding, timer
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.pretrain.objectives import recipes
from maelm_jax.text import tokenizer
from maelm_jax.training import profiler

# The benchmarks' default config files.
CONFIGS = REPO_ROOT / "configs" / "benchmark"
FLAGS = flags.FLAGS
# The models the benchmarks offer (the papers' four, then any other registered objective),
# as the flags are defined; objective_config takes any model recipes.get knows.
OBJECTIVES = recipes.names()


def objective_config(config: ml_collections.ConfigDict,
                     objective: str) -> ml_collections.ConfigDict:
    """The validated config that `objective` (a model of pretrain/objectives/recipes.py) is timed
    with: the recipe applied to `config`, so every objective shares its encoder.

    mlm: the config's masking (by default 15 %, all [MASK]); maelm: MAE-LM with the
    config's masking and decoder; 3ml_self, 3ml_cross: 3ML Table 4's changes (40 % masked,
    80-10-10, a 2-layer half-width decoder with the encoder's dropout; 3ml_cross's is a
    cross decoder and both stacks are pre-LN).

    Raises pretrain_config.ConfigError (one line) for a config that does not validate.
    """
    c = recipes.get(objective).apply(config)
    pretrain_config.validate(c)
    return c


def objective_configs(config: ml_collections.ConfigDict,
                      objectives: Sequence[str]) -> dict[str, ml_collections.ConfigDict]:
    """`objective_config` of each objective; a config that does not validate exits with
    its one-line message before anything is compiled."""
    try:
        return {objective: objective_config(config, objective) for objective in objectives}
    except pretrain_config.ConfigError as e:
        cli.fail(str(e), cli.program())


# How the records' FLOPs ("flops", "gflop") count a step: the model's, forward + backward
# = 3 x forward. Records without the field (before 2026-12) hold 3ML Appendix D's count,
# forward + backward = 2 x forward: tables.py rescales them.
FLOPS_COUNT = "3 x forward"


class Bench(timer.Samples):
    """One objective's compiled train step, its state and its model FLOPs per step.

    Built by `training.setup.build`, as the training loop builds it: state and step
    sharded over a mesh (here one device, whatever config.mesh says), the state donated,
    traced under the rules.
    """

    def __init__(self, config: ml_collections.ConfigDict, tokens: np.ndarray):
        super().__init__()
        vocab_size = config.tokenizer.vocab_size
        program = setup_lib.build(config, vocab_size,
                                  sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
        self.counts = program.counts
        # Model FLOPs (forward + backward = 3 x forward), as the train logs count them; 3ML
        # Appendix D's count (backward = forward) only where the papers' ratios are
        # reproduced (speedup_table.py): the ratios are the same in either.
        self.flops = program.model_flops
        stack = setup_lib.encoder_config(config, vocab_size, program.shape).stack
        self.attention_impl, self.remat_policy = stack.attention_impl, stack.remat_policy
        self.num_params = program.num_params
        self.state, self.schedule = program.init(), program.schedule
        self.tokens = jax.device_put(tokens, sharding.batch_sharding(program.mesh))
        start = time.perf_counter()
        self.step = program.compile_train_step()
        self.compile_seconds = time.perf_counter() - start

    def step_once(self):
        self.state, metrics = self.step(self.state, self.tokens, self.schedule)
        return self.state, metrics


def random_tokens(config: ml_collections.ConfigDict) -> np.ndarray:
    """[batch, L] int32 ids from the ordinary vocabulary (ids below NUM_SPECIAL are special)."""
    rng = np.random.default_rng(0)
    return rng.integers(tokenizer.NUM_SPECIAL, config.tokenizer.vocab_size,
                        (config.train.batch_size, config.data.seq_len)).astype(np.int32)


# The per-op sum of a trace: the library's (training/profiler.py), which a run's
# train.profile_steps window prints too.
trace_op_seconds = profiler.op_seconds


def device_line() -> str:
    """jax's version, backend and device kind, for the first line of a benchmark."""
    return (f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} x "
            f"{jax.devices()[0].device_kind})")


def six_nt_tflops(num_params: int, tokens_per_step: int, seconds: float) -> float:
    """Model TFLOP/s by the 6 N T convention (N parameters, T tokens per step)."""
    return 6 * num_params * tokens_per_step / seconds / 1e12


# --- flags ---------------------------------------------------------------------------------


def define_config(file_name: str) -> None:
    """--config (file.py[:variant], with --config.<field>=<value> overrides, as main.py's),
    defaulting to configs/benchmark/<file_name>."""
    cli.define_config(
        str(CONFIGS / file_name),
        f"Pretraining config file[:variant] with the sizes to time (default: "
        f"configs/benchmark/{file_name}).", prefix=cli.program())


def define_timing_flags(steps: int, benchmark: str | None = None) -> None:
    """--steps, --warmup and --repeats: how step_time.py and peer_hf.py time each side;
    with a `benchmark` name, --record_dir: where the run's record goes (recording.py)."""
    flags.DEFINE_integer("steps", steps, "Timed steps per measurement.", lower_bound=1)
    flags.DEFINE_integer("warmup", 1, "Untimed steps after compiling.", lower_bound=0)
    flags.DEFINE_integer("repeats", 5, "Measurements per objective or side, alternated; the "
                         "median is reported.", lower_bound=1)
    if benchmark:
        recording.define_flag(benchmark)
    define_host_memory_flag()


def sizes(config: ml_collections.ConfigDict) -> dict:
    """What a record says of the model and batch a benchmark timed."""
    m = config.model
    return {"num_layers": m.num_layers, "d_model": m.d_model, "num_heads": m.num_heads,
            "d_ff": m.d_ff, "decoder_layers": m.decoder.num_layers,
            "decoder_d_model": m.decoder.d_model, "seq_len": config.data.seq_len,
            "batch_size": config.train.batch_size, "vocab_size": config.tokenizer.vocab_size,
            "dropout": m.dropout, "attention_dropout": m.attention_dropout,
            "prng_impl": config.train.prng_impl}


def define_objectives_flag(default: list[str], help_text: str) -> None:
    """--objectives: some of OBJECTIVES, checked (mlm always runs)."""
    flags.DEFINE_list("objectives", default, help_text)
    cli.choices_flag("objectives", recipes.names())


def define_host_memory_flag() -> None:
    """--keep_host_memory, applied by start_host_memory."""
    flags.DEFINE_bool("keep_host_memory", True, "Tune glibc's malloc to reuse XLA's per-step "
                      "scratch memory, as main.py does (maelm_jax/infra/host_memory.py); "
                      "applies to the peer in the same process too.")


def start_host_memory() -> bool:
    """Applies --keep_host_memory; call first in main(), before JAX's backend starts."""
    return FLAGS.keep_host_memory and host_memory.keep_freed_memory()

