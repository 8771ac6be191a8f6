"""Fine-tuning a pretrained encoder on GLUE and SQuAD: `train.run` (one run) and
`sweep.run_sweep` (a grid of settings x seeds).

Modules: config (defaults, validation), glue / squad (reading the benchmarks), data
(RoBERTa-style encoding, static-shape batches), heads (the task models), loading (the
encoder from a checkpoint), metrics / squad_metrics (the benchmarks' definitions),
squad_postprocess (spans to answer text), submission (GLUE test files), train, sweep.
"""
