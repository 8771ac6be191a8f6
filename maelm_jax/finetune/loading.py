"""The checkpoint a fine-tuning run leaves: its selected parameters, with the encoder's
architecture and the tokenizer beside them, so the workdir can be another run's init_from
(MNLI -> RTE, MRPC, STS-B, as RoBERTa does). Reading any run back, this one included, is
maelm_jax/runs.py's.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from maelm_jax import distributed, layout, paths
from maelm_jax import tokenizer as tokenizer_lib
from maelm_jax.models import encoder as encoder_lib


def save_finetuned(workdir: paths.Path, step: int, params: Any,
                   encoder_cfg: encoder_lib.EncoderConfig,
                   tokenizer: tokenizer_lib.Tokenizer) -> paths.Path:
    """Writes checkpoints/<step>/state ({"params": {"encoder", "head"}}), encoder.json and
    tokenizer.model, so the workdir can be another run's init_from. `workdir` is
    absolute (or a bucket's URI). Every process of a job calls it with the same host
    `params`: orbax's save is collective (process 0 writes the arrays), and process 0
    alone writes the other two files."""
    import orbax.checkpoint as ocp

    if distributed.is_leader():
        record = encoder_lib.architecture(encoder_cfg)
        paths.write_text(workdir / layout.ENCODER_FILE, json.dumps(record, indent=2))
        if not paths.same(tokenizer.model_path, workdir / layout.TOKENIZER_FILE):
            paths.Path(tokenizer.model_path).copy(workdir / layout.TOKENIZER_FILE, overwrite=True)
    manager = ocp.CheckpointManager(
        workdir / layout.CHECKPOINTS,
        options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                             enable_async_checkpointing=False),
        item_names=(layout.STATE_ITEM,),
    )
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "step": np.int32(step)})), force=True)
    manager.wait_until_finished()
    manager.close()
    return workdir / layout.CHECKPOINTS / str(step)


def clear_finetuned(workdir: paths.Path) -> None:
    """Removes an earlier fine-tuning run's checkpoints from workdir (never a pretraining
    run's: train.py refuses such a workdir first)."""
    paths.remove(workdir / layout.CHECKPOINTS)
