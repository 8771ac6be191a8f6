"""Pretraining, shaped like fine-tuning: `train.train_and_evaluate` (the run: its
lifecycle policy and its engine.Run), config (defaults, validation and mask counts: plain
data), objectives/ (MLM, MAE-LM, 3ML behind one interface, the registry and the papers'
recipes), setup (the program built once from a config), steps (its state and its train
and eval steps), flops (the papers' training FLOPs) and mfu (utilisation in the logs).
What both trainers share (the step loop, checkpoints, the lifecycle, optimiser, state
layout, the jitted steps) is maelm_jax/training/.
"""
