"""maelm_jax: pretrain text encoders the MAE-LM / 3ML way (and the MLM baseline) in JAX/Flax."""
