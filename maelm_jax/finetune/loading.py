"""The checkpoints of a fine-tuning workdir, all under checkpoints/ (the one place every
kind of run keeps them): until the run finishes, its resume states (train/Checkpointer's
steps, a `meta` record beside the arrays); once it has, the final checkpoint alone: the
selected parameters, with the encoder's architecture and the tokenizer beside them, so
the workdir can be another run's init_from (MNLI -> RTE, MRPC, STS-B, as RoBERTa does).
Reading any run back, this one included, is maelm_jax/runs.py's.

A run finishes in an order that a crash at any point leaves resumable: the final
checkpoint is written beside the resume states, then results.json, then the resume
states go (`drop_resume`). Continuing an unfinished run first removes a final checkpoint
that a crashed finish left (`drop_final`): it holds no train state to resume from.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from maelm_jax.infra import distributed, paths
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.workdirs import layout


def save_finetuned(workdir: paths.Path, step: int, params: Any,
                   encoder_cfg: encoder_lib.EncoderConfig,
                   tokenizer: tokenizer_lib.Tokenizer) -> paths.Path:
    """Writes checkpoints/<step>/state ({"params": {"encoder", "head"}}), encoder.json and
    the tokenizer's file (tokenizer.model or tokenizer.json), so the workdir can be another
    run's init_from. `workdir` is absolute (or a bucket's URI). Every process of a job
    calls it with the same host `params`: orbax's save is collective (process 0 writes
    the arrays), and process 0 alone writes the other two files. A resume state saved at
    `step` gives way to it (the others stay until results.json is written)."""
    import orbax.checkpoint as ocp

    with distributed.as_one("fine-tuning checkpoint"):
        if distributed.is_leader():
            paths.remove(workdir / layout.CHECKPOINTS / str(step))
    if distributed.is_leader():
        record = encoder_lib.architecture(encoder_cfg)
        paths.write_text(workdir / layout.ENCODER_FILE, json.dumps(record, indent=2))
        own = workdir / layout.TOKENIZER_FILES[tokenizer.kind]
        if not paths.same(tokenizer.model_path, own):
            paths.Path(tokenizer.model_path).copy(own, overwrite=True)
    manager = ocp.CheckpointManager(
        workdir / layout.CHECKPOINTS,
        options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                             enable_async_checkpointing=False),
        item_names=(layout.STATE_ITEM,),
    )
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "step": np.int32(step)})), force=True)
    manager.wait_until_finished()
    manager.close()
    return workdir / layout.CHECKPOINTS / str(step)


def _is_final(step_dir: paths.Path) -> bool:
    return step_dir.name.isdigit() and not (step_dir / layout.META_ITEM).exists()


def drop_final(workdir: paths.Path) -> None:
    """Before an unfinished run continues: removes a final checkpoint that a finish cut
    short left among the resume states (process 0)."""
    directory = workdir / layout.CHECKPOINTS
    if directory.is_dir():
        for step_dir in directory.iterdir():
            if _is_final(step_dir):
                paths.remove(step_dir)


def drop_resume(workdir: paths.Path, final_step: int | None) -> None:
    """Once results.json is written: removes everything under checkpoints/ but the final
    checkpoint at `final_step` (resume states, steps set aside as damaged, unfinished
    saves); all of checkpoints/ when the run keeps none (process 0)."""
    directory = workdir / layout.CHECKPOINTS
    if final_step is None or not directory.is_dir():
        paths.remove(directory)
        return
    for entry in directory.iterdir():
        if entry.name != str(final_step):
            paths.remove(entry)
