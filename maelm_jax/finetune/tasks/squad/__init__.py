"""The SQuAD task kind in one folder: its protocol (task.py: SquadTask), the examples and
their windowed features (examples.py: the official JSON and TFDS), the official v1.1 and
v2.0 evaluations (metrics.py), and logits to answer text (outputs.py)."""

from maelm_jax.finetune.tasks.squad import examples, metrics, outputs, task

__all__ = ["examples", "metrics", "outputs", "task"]
