"""Training: optimiser, train state and steps, checkpoints, metrics, the loop."""
