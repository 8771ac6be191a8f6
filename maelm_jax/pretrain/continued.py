"""Continued pretraining: a run's first parameters from another model (train.init_from).

The source is a pretraining or fine-tuning workdir of ours (its newest finished
checkpoint), one of its ``checkpoints/<step>``, or a local Hugging Face RoBERTa/BERT
directory (sources/). Each parameter of this run's model that the source holds under the
same name with the same shape is loaded; the others are initialised as the config says
(an MLM run continued as MAE-LM keeps the encoder, its embeddings and the LM head, and
starts the decoder); what the source holds and this model lacks is dropped. A model of
another width, depth, head count or vocabulary is an error naming the first parameter
that differs. The optimiser, the step and the schedule start afresh; the data from its
start, unless train.continue_data reads on from where the source's run stopped.

Position tables (the encoder's, a decoder's) are the one shape allowed to differ: a
longer data.seq_len than the source's extends them by copying the source's rows over the
new ones in turn (row i takes row i mod n), as Longformer made 4,096 positions from
RoBERTa's 512: every new position starts as a trained one, with the local structure
(neighbouring rows alike) that attention learnt, where a random row would start as noise
and an interpolation would stretch every learnt distance. A shorter length keeps the first
rows. The relative position bias is per bucket, whatever the length.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np

from maelm_jax.infra import paths
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.sources import source as source_lib
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.workdirs import layout

FIELD = "config.train.init_from"
_POSITIONS = "['position_embeddings']['embedding']"
_LAYER = re.compile(r"\['layer_\d+'\]")


@dataclasses.dataclass(frozen=True)
class Loaded:
    """The source's parameters laid onto this run's model.

    params: this model's parameter structure, a numpy array at each leaf loaded and None
    at each new one. loaded, new, dropped: parameter names (jax key paths; a Hugging Face
    checkpoint's tensors without a place here by their own names, among the dropped).
    extended: (name, the source's rows, this run's) of each position table resized."""

    params: Any
    loaded: list[str]
    new: list[str]
    dropped: list[str]
    extended: list[tuple[str, int, int]]

    def summary(self, source: source_lib.Source) -> str:
        """The one log line: what was loaded, what is new, what was dropped."""
        def parts(names: list[str]) -> str:
            # By top-level module: ['encoder']... of ours, pooler of roberta.pooler.dense.bias
            groups = sorted({n.split("']")[0].lstrip("['") if n.startswith("[") else
                             n.removeprefix("roberta.").removeprefix("bert.").split(".")[0]
                             for n in names})
            return f"{len(names)} ({', '.join(groups)})" if names else "0"

        line = (f"started from {source.description}: loaded {parts(self.loaded)}, new "
                f"{parts(self.new)}, dropped {parts(self.dropped)} parameter arrays")
        for name, rows, now in self.extended:
            line += (f"; {name} {rows} -> {now} rows "
                     f"({'copied over the new rows' if now > rows else 'the first kept'})")
        return line

    def record(self, source: source_lib.Source, data_offset: int) -> dict:
        """What the workdir's init_from.json holds: where the run started from."""
        return {"init_from": str(source.path if source.step_dir is None else source.step_dir),
                "kind": source.kind, "step": source.step, "description": source.description,
                "data_offset": data_offset, "loaded": self.loaded, "new": self.new,
                "dropped": self.dropped,
                "extended": [{"parameter": n, "from": a, "to": b} for n, a, b in self.extended]}


class ContinuedError(pretrain_config.ConfigError):
    """A source that cannot start this run's model; the message names the parameter."""


def read_source(config: ml_collections.ConfigDict,
                workdir: paths.Path) -> source_lib.Source | None:
    """The source config.train.init_from names, its config read once; a ConfigError for
    one that cannot be read or cannot continue the data. None without init_from, and for
    a continued run resumed in `workdir` (a checkpoint and its init_from.json): its
    checkpoints hold what was loaded, and the source may since have moved."""
    t = config.train
    if not t.init_from or _resumed(workdir):
        return None
    try:
        source = source_lib.read(t.init_from, FIELD)
    except source_lib.CheckpointError as e:
        raise ContinuedError(str(e)) from None
    if t.continue_data and source.kind != source_lib.PRETRAINING:
        raise ContinuedError(f"config.train.continue_data: {t.init_from} is a {source.kind} "
                             "model, not a pretraining run whose data could be continued; "
                             "set it to False")
    try:
        theirs = source.layer_norm_eps
    except source_lib.CheckpointError as e:
        raise ContinuedError(str(e)) from None
    if theirs != float(config.model.layer_norm_eps):
        # Not a shape, so no parameter would say it: the same weights would compute
        # another function (BERT's 1e-12 against our default 1e-5).
        raise ContinuedError(f"config.model.layer_norm_eps: {source.description} was "
                             f"trained with LayerNorm epsilon {theirs:g}, this run has "
                             f"{float(config.model.layer_norm_eps):g}; set "
                             f"--config.model.layer_norm_eps={theirs:g}")
    return source


def data_offset(config: ml_collections.ConfigDict, source: source_lib.Source | None,
                workdir: paths.Path) -> int:
    """The batches of the data stream skipped before this run's first step: the source's
    step with train.continue_data (a resumed run's, as its init_from.json recorded it),
    else 0."""
    if source is None:
        if not (config.train.init_from and _resumed(workdir)):
            return 0
        return int(json.loads(paths.read_text(workdir / layout.INIT_FROM_FILE))["data_offset"])
    return int(source.step) if config.train.continue_data else 0


def _resumed(workdir: paths.Path) -> bool:
    """Whether `workdir` holds a continued run that has saved a checkpoint."""
    return ((workdir / layout.INIT_FROM_FILE).is_file()
            and bool(checkpoint_lib.finished_steps(workdir / layout.CHECKPOINTS)))


def load(source: source_lib.Source, abstract: Any, stacked: bool) -> Loaded:
    """The source's parameters matched to `abstract` (this run's parameters' shapes, in
    the layout `stacked` says); a ContinuedError for shapes that cannot be reconciled."""
    unmapped: list[str] = []  # a Hugging Face checkpoint's tensors without a place here
    try:
        given = source.params(stacked=stacked, unmapped=unmapped)
    except source_lib.CheckpointError as e:
        raise ContinuedError(str(e).replace("config.init_from", FIELD)) from None
    ours = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(abstract)}
    theirs = {jax.tree_util.keystr(k): np.asarray(v)
              for k, v in jax.tree_util.tree_leaves_with_path(given)}
    _check_depth(ours, theirs, source)
    loaded, new, extended, values = [], [], [], {}
    for name, want in ours.items():
        if name not in theirs:
            new.append(name)
            continue
        value = theirs[name]
        if tuple(value.shape) != tuple(want.shape):
            if not (name.endswith(_POSITIONS) and value.shape[1:] == tuple(want.shape[1:])):
                raise ContinuedError(
                    f"{FIELD}: {source.description}: parameter {name} has shape "
                    f"{tuple(value.shape)}, this run's model needs {tuple(want.shape)} "
                    "(another width, depth, head count or vocabulary)")
            extended.append((name, value.shape[0], want.shape[0]))
            value = _resized(value, want.shape[0])
        values[name] = value.astype(want.dtype)
        loaded.append(name)
    dropped = sorted(set(theirs) - set(ours)) + sorted(unmapped)
    params = jax.tree_util.tree_map_with_path(
        lambda k, _: values.get(jax.tree_util.keystr(k)), abstract)
    return Loaded(params, loaded, new, dropped, extended)


def _check_depth(ours: Mapping[str, Any], theirs: Mapping[str, Any],
                 source: source_lib.Source) -> None:
    """A stack both models have (the encoder's) with another number of layers is refused,
    not half loaded: its first layer parameter only one side has is named."""
    def stacks(names):
        return {_LAYER.split(n)[0] for n in names if _LAYER.search(n)}

    shared = stacks(ours) & stacks(theirs)
    for name in sorted(set(ours) ^ set(theirs)):
        if _LAYER.search(name) and _LAYER.split(name)[0] in shared:
            side = "this run's model" if name in ours else "the source"
            raise ContinuedError(f"{FIELD}: {source.description}: parameter {name} is only "
                                 f"in {side} (another depth)")


def _resized(table: np.ndarray, rows: int) -> np.ndarray:
    """table [n, D] as [rows, D]: its rows copied in turn over longer, the first if shorter."""
    return np.tile(table, (math.ceil(rows / table.shape[0]), 1))[:rows]


def initial_state(state: Any, loaded: Loaded) -> Any:
    """`state` (a fresh train state, sharded) with the loaded parameters in place of the
    initial ones, each laid out as the initial one is; the optimiser's moments are zeros
    whatever the parameters, so they stay as they are."""
    def put(value, fresh):
        if value is None:
            return fresh
        return jax.make_array_from_callback(value.shape, fresh.sharding, lambda i: value[i])

    return state.replace(params=jax.tree.map(put, loaded.params, state.params,
                                             is_leaf=lambda x: x is None))
