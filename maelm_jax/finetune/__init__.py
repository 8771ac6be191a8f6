"""Fine-tuning a pretrained encoder on GLUE and SQuAD: `train.run` (one run) and
`sweep.run_sweep` (a grid of settings x seeds; `seed_group.run` trains several seeds of a
setting as one program).

Modules: config (defaults, validation), tasks (the task protocol, tasks/base.py, and its
kinds by name: tasks/glue.py, tasks/squad.py), glue / squad (reading the benchmarks), data
(RoBERTa-style encoding, static-shape batches), heads (the task models), loading (the
checkpoint a run leaves; the encoder it starts from is read by maelm_jax/runs.py),
metrics / squad_metrics (the benchmarks' definitions), squad_postprocess (spans to answer
text), submission (GLUE test files), train, seed_group, sweep.
"""
