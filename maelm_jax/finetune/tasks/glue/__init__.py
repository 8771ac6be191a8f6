"""The GLUE task kind in one folder: its protocol (task.py: GlueTask), the tasks and their
readers (examples.py: TSV files and TFDS), the benchmark's metrics and the papers' GLUE
average (metrics.py), and the server's submission files (outputs.py)."""

from maelm_jax.finetune.tasks.glue import examples, metrics, outputs, task

__all__ = ["examples", "metrics", "outputs", "task"]
