"""A config small enough that a step takes milliseconds on a CPU.

Used by tests in-process (`tiny_config()`) and as a config file for main.py
(`--config=tests/tiny_config.py[:mlm]`).
"""

from maelm_jax.pretrain import config as pretrain_config

TINY_VOCAB = 512


def get_config(arg: str | None = None):
    return tiny_config(arg or "maelm")


def tiny_config(objective: str = "maelm", tokenizer_path: str = ""):
    """A model small enough that a step takes milliseconds on a CPU."""
    c = pretrain_config.pretrain_defaults()
    c.objective = objective
    c.tokenizer.model_path = tokenizer_path
    c.tokenizer.vocab_size = TINY_VOCAB
    c.data.seq_len = 32
    c.data.validation_fraction = 0.05
    c.model.num_layers = 2
    c.model.d_model = 32
    c.model.num_heads = 2
    c.model.d_ff = 64
    c.model.rel_pos_buckets = 8
    c.model.rel_pos_max_distance = 16
    c.model.decoder.num_layers = 1
    c.model.decoder.d_model = 32
    c.model.decoder.num_heads = 2
    c.model.decoder.d_ff = 64
    c.train.batch_size = 8
    c.train.num_steps = 20
    c.train.learning_rate = 1e-3
    c.train.warmup_steps = 2
    c.train.log_every = 1
    c.train.eval_every = 10
    c.train.eval_batches = 2
    c.train.checkpoint_every = 10
    return c


def tiny_model(c, batch_size: int = 2, seed: int = 0):
    """(model, a masked batch of random tokens, initialised params) for a pretraining config."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from maelm_jax.pretrain import config as pretrain_config
    from maelm_jax.pretrain import setup as setup_lib
    from maelm_jax.text import masking, tokenizer

    counts = pretrain_config.mask_counts(c)
    model = setup_lib.model(c, TINY_VOCAB)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(
        tokenizer.NUM_SPECIAL, TINY_VOCAB, (batch_size, c.data.seq_len)), jnp.int32)
    batch = masking.apply_mask(jax.random.PRNGKey(seed), tokens, counts, TINY_VOCAB,
                               tokenizer.SENTENCEPIECE_IDS)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch)["params"])
    return model, batch, params
