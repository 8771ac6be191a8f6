"""What both trainers share (pretraining, maelm_jax/pretrain/; fine-tuning,
maelm_jax/finetune/): the one step loop (engine.py), the run lifecycle (lifecycle.py),
checkpoints, preemption, metrics, the optimiser, a state's layout on a mesh and the jitted
steps. It imports no mode's config."""
