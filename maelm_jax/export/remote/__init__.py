"""The files an export ships beside its weights, for transformers' `trust_remote_code=True`.

They import only torch, transformers and sentencepiece (never maelm_jax or JAX), relative
imports among themselves only, so that they run wherever they are copied.
"""
