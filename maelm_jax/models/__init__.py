"""Flax models: Transformer layers, the encoder, the MAE-LM decoder, heads, objectives."""
