"""A model to start from, resolved and read once: `read(init_from, field)` -> Source.

init_from names a pretraining or fine-tuning workdir of ours (its newest finished
checkpoint), one of its ``checkpoints/<step>`` directories, or a local Hugging Face
RoBERTa/BERT directory (sources/huggingface.py). Its config.json is read here, once: the
checks (an unfinished fine-tuning run refused, a pretraining run stopped early warned of),
the tokenizer, the architecture and the parameters are all derived from the Source.

Parameters are read partially (only ``params["encoder"]`` when that is all that is
wanted: the decoder, the LM head and the optimiser state stay on disk) as numpy arrays,
whatever devices and sharding wrote them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import numpy as np
from absl import logging

from maelm_jax.infra import errors, paths
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.models import layer_layout
from maelm_jax.sources import huggingface
from maelm_jax.training import budget as budget_lib
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.workdirs import layout

PRETRAINING, FINETUNING, HUGGING_FACE = "pretraining", "fine-tuning", "huggingface"


class CheckpointError(errors.UserError):
    """A run that cannot be read back (config, tokenizer, checkpoint or data), or a
    checkpoint that cannot initialise the encoder; the message says why."""


@dataclasses.dataclass(frozen=True)
class Source:
    """A model a run starts from, as read once.

    kind: PRETRAINING or FINETUNING (a workdir of ours) or HUGGING_FACE. path: the workdir
    or the Hugging Face directory. step_dir: our checkpoint's step directory (None for
    Hugging Face). config: the run's config.json, or the Hugging Face config.json.
    field: the setting that named it, for error messages."""

    kind: str
    path: paths.Path
    step_dir: paths.Path | None
    config: dict
    field: str = "config.init_from"

    @property
    def step(self) -> int | None:
        """The checkpoint's step (None: a Hugging Face model)."""
        return None if self.step_dir is None else int(self.step_dir.name)

    @property
    def description(self) -> str:
        """E.g. "pretraining checkpoint <dir>/checkpoints/300"."""
        if self.kind == HUGGING_FACE:
            return f"Hugging Face {self.config.get('model_type')} model {self.path}"
        return f"{self.kind} checkpoint {self.step_dir}"

    @property
    def layer_norm_eps(self) -> float:
        """The epsilon the source's LayerNorms were trained with (an architecture field no
        parameter's shape shows)."""
        if self.kind == HUGGING_FACE:
            try:
                return huggingface.architecture(self.config, self.field)["layer_norm_eps"]
            except huggingface.HuggingFaceError as e:
                raise CheckpointError(str(e)) from None
        arch = (read_json(self.path / layout.ENCODER_FILE, self.field)
                if self.kind == FINETUNING else self.config.get("model", {}))
        return float(arch.get("layer_norm_eps", encoder_lib.ADDED["layer_norm_eps"]))

    def params(self, part: str | None = None, stacked: bool = False,
               unmapped: list[str] | None = None) -> Any:
        """The parameters (or only params[part]) as numpy arrays, the layers per layer or
        `stacked` (models/layer_layout.py). `unmapped`, a list, gets the names of a Hugging
        Face checkpoint's tensors that our model has no place for (a pooler, a head)."""
        if self.kind != HUGGING_FACE:
            return restore_params(self.step_dir, part, self.field, stacked)
        try:
            tree, left_out = huggingface.params(self.path, self.config)
        except huggingface.HuggingFaceError as e:
            raise CheckpointError(str(e)) from None
        if unmapped is not None:
            unmapped.extend(left_out)
        if part is not None and part not in tree:
            raise CheckpointError(f"{self.field}: {self.path} holds no {part!r}")
        return layer_layout.to_layout(tree[part] if part else tree, stacked)


def read(init_from: str, field: str = "config.init_from") -> Source:
    """The Source `init_from` names (see the module's docstring), or a CheckpointError."""
    path = paths.resolve(init_from, field)
    if path.name == layout.STATE_ITEM:
        path = path.parent
    if not path.exists():
        raise CheckpointError(f"{field}: {init_from} does not exist")
    if huggingface.is_model_dir(path):
        return Source(HUGGING_FACE, path, None, read_json(path / huggingface.CONFIG_FILE, field),
                      field)
    if path.name.isdigit() and path.parent.name == layout.CHECKPOINTS:
        workdir = path.parent.parent
        config = read_json(workdir / layout.CONFIG_FILE, field)
        _check_finished(workdir, config, init_from, field)
        return Source(_kind(config), workdir, path, config, field)
    if (path / layout.CONFIG_FILE).is_file() and (path / layout.CHECKPOINTS).is_dir():
        config = read_json(path / layout.CONFIG_FILE, field)
        _check_finished(path, config, init_from, field)
        steps = [step for step in checkpoint_lib.finished_steps(path / layout.CHECKPOINTS)
                 if (path / layout.CHECKPOINTS / str(step) / layout.STATE_ITEM).is_dir()]
        if not steps:
            raise CheckpointError(f"{field}: {path}/{layout.CHECKPOINTS} holds no "
                                  f"finished checkpoint")
        _warn_if_stopped_early(path, config, max(steps))
        return Source(_kind(config), path, path / layout.CHECKPOINTS / str(max(steps)), config,
                      field)
    raise CheckpointError(f"{field}: {init_from} is neither a workdir (config.json and "
                          f"checkpoints/), a <workdir>/checkpoints/<step> directory nor a "
                          f"Hugging Face model directory (config.json and "
                          f"{huggingface.SAFETENSORS} or {huggingface.TORCH_BIN})")


def _kind(config: dict) -> str:
    return FINETUNING if config.get("mode") == "finetune" else PRETRAINING


def _check_finished(workdir: paths.Path, config: dict, init_from: str, field: str) -> None:
    """Refuses an unfinished fine-tuning run: its checkpoints/ holds resume states (the
    whole train state), not yet the parameters it selects."""
    if config.get("mode") == "finetune" and not (workdir / layout.RESULTS_FILE).exists():
        raise CheckpointError(f"{field}: {init_from} is an unfinished fine-tuning "
                              f"run (no {layout.RESULTS_FILE}); run its command again to "
                              "finish it first")


def _warn_if_stopped_early(workdir: paths.Path, config: dict, step: int) -> None:
    """Warns when a pretraining workdir's latest checkpoint is not its last step (a run
    stopped or still going): taking it is allowed, but rarely what a whole workdir meant."""
    if config.get("mode", "pretrain") != "pretrain":
        return
    plan = budget_lib.read(workdir)
    end = plan.end if plan else config.get("train", {}).get("num_steps")
    if isinstance(end, int) and step < end:
        logging.warning("%s is a pretraining run that has not finished: its latest checkpoint "
                        "is step %d of %d, and that is the one used (name %s/%s/%d to say "
                        "so, or run its command again to finish it)", workdir, step, end,
                        workdir, layout.CHECKPOINTS, step)


def read_json(path: paths.Path, field: str = "config.init_from") -> dict:
    if not path.is_file():
        raise CheckpointError(f"{field}: {path} is missing; it describes the encoder")
    try:
        value = json.loads(paths.read_text(path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{field}: {path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{field}: {path} is not a JSON object")
    return value


def _tree_metadata(state_dir: paths.Path, field: str) -> Any:
    try:
        return checkpoint_lib.saved_tree(state_dir)
    except Exception as e:  # orbax raises many types for a directory it cannot read
        raise CheckpointError(f"{field}: {state_dir} is not an orbax checkpoint "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                              ) from None


def restore_params(step_dir: paths.Path, part: str | None = None,
                   field: str = "config.init_from", stacked: bool = False) -> Any:
    """The checkpoint's params (or only params[part]) as numpy arrays, without the optimiser
    state, with the layers per layer or `stacked` (models/layer_layout.py) whichever way
    they were saved. `field` is the setting that named the checkpoint, for error messages."""
    import orbax.checkpoint as ocp

    # Absolute (orbax reads nothing from a relative path), a bucket's URI unchanged.
    step_dir = paths.resolve(step_dir, field)
    state_dir = step_dir / layout.STATE_ITEM
    if not state_dir.is_dir():
        raise CheckpointError(f"{field}: {step_dir} has no '{layout.STATE_ITEM}' item; it is "
                              f"not a maelm_jax checkpoint")
    def damaged(e: Exception) -> CheckpointError:
        return CheckpointError(f"{field}: {step_dir} cannot be restored ("
                               f"{checkpoint_lib.failure_reason(e)}); it may be damaged: name "
                               f"an older <workdir>/checkpoints/<step>")

    # Digests first: a damaged metadata file must read as damage, not as another kind of
    # checkpoint.
    try:
        checkpoint_lib.check_digests(step_dir)
    except Exception as e:
        raise damaged(e) from None
    tree = _tree_metadata(state_dir, field)
    params = tree.get("params") if isinstance(tree, dict) else None
    wanted = params.get(part) if isinstance(params, dict) and part else params
    if not isinstance(wanted, dict):
        raise CheckpointError(f"{field}: {step_dir} holds no params{f'[{part!r}]' if part else ''}"
                              f"; it is not a pretraining or fine-tuning checkpoint")
    shapes = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), wanted)
    abstract = {"params": {part: shapes} if part else shapes}
    # Numpy, not jax arrays: independent of the devices and sharding it was saved with.
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract)
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            state_dir,
            args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args,
                                        partial_restore=True),
        )
    except Exception as e:  # orbax and tensorstore raise many types for damaged files
        raise damaged(e) from None
    return layer_layout.to_layout(restored["params"][part] if part else restored["params"],
                                  stacked)
