"""Fine-tuning a pretrained encoder on GLUE and SQuAD: `train.run` (one run) and
`sweep.run_sweep` (a grid of settings x seeds; `seed_group.run` trains several seeds of a
setting as one program).

Modules: config (defaults, validation), tasks (the task protocol, tasks/base.py, and its
kinds by name, each a folder: tasks/glue/, tasks/squad/ with the kind's protocol, examples,
metrics and outputs), data (RoBERTa-style encoding, static-shape batches), heads (the task
models), loading (the checkpoint a run leaves; the encoder it starts from is read by
maelm_jax/runs.py), train, seed_group, sweep.
"""
