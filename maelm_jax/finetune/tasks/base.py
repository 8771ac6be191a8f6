"""What a fine-tuning task kind is: the one interface GLUE, SQuAD and any new kind implement.

A kind is one class. Its class methods are what the config needs before any data is
read; an instance is the task of one run, its splits read and encoded:

* which `config.task` values it serves (`task_names`, `serves`, `describe`);
* its own config fields: defaults (`add_defaults`, e.g. SQuAD's ``config.squad.*``), their
  types and ranges (`fields`) and the rules between fields (`validate`);
* its papers' search spaces (`paper_grid`, for configs/finetune/*.py);
* what the rank analysis reads of a fine-tuning run (`dev_sequences`) and what a Hugging
  Face export of one is (`export_head`);
* for a run (`__init__(config, tokenizer, max_len)`): the encoded splits (`train`, `eval`),
  the model (`model`: the encoder under "encoder" plus a head under "head"), the loss as
  sums (`loss_sums`), what the eval step returns (`eval_outputs`), the dev metrics in
  percent (`score`) and its primary one (`primary_metric`), and the predictions files
  (`write_outputs`).

The training loop (finetune/train.py) sees only the instance side. Kinds are registered by
name in maelm_jax/finetune/tasks/__init__.py; a new one is a module and a registry line.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import ml_collections
import numpy as np

from maelm_jax.config import schema
from maelm_jax.infra import errors, paths
from maelm_jax.text import tokenizer as tokenizer_lib

if TYPE_CHECKING:  # a kind's config side is read by config files: plain data, no Flax
    import flax.linen as nn
    import jax

    from maelm_jax.models import encoder as encoder_lib

# (rows [B], outputs {name: [B, ...]}) per eval batch; rows of -1 are filler.
BatchOutputs = list[tuple[np.ndarray, dict]]
# run_eval(sequences, targets): the eval step over every sequence, in eval batches.
RunEval = Callable[[Sequence[np.ndarray], dict], BatchOutputs]


class FinetuneConfigError(errors.UserError):
    """A fine-tuning config mistake; the message names the field and what is expected."""


# require(cond, field, expected, got): FinetuneConfigError("config.<field>: expected ...").
require = schema.requirer(FinetuneConfigError)


@dataclasses.dataclass
class Split:
    """Encoded sequences plus per-example targets ({name: [N, ...]})."""

    sequences: list[np.ndarray]
    targets: dict
    index: list[str] | None = None  # GLUE rows' keys, for submission files

    def __len__(self) -> int:
        return len(self.sequences)


@dataclasses.dataclass(frozen=True)
class ExportHead:
    """How a fine-tuned run's model is exported (maelm_jax/export): the PyTorch class
    (export/remote/modeling_maelm.py), the fields it adds to config.json, the PyTorch name
    of the run's "head" parameters ("classifier" or "qa_outputs", models/torch_names.py) and
    the task's name for the model card."""

    architecture: str
    fields: dict
    head: str
    task: str


class Task(abc.ABC):
    """One kind of fine-tuning task; subclasses set `kind` and implement the abstract
    methods. Instances are built by `tasks.make_task` from a validated config."""

    kind: ClassVar[str]  # the registry's name for the kind ("glue", "squad")

    # ------------------------------------------------------------------ the config side

    @classmethod
    @abc.abstractmethod
    def task_names(cls) -> tuple[str, ...]:
        """The config.task values the kind serves (canonical spellings)."""

    @classmethod
    def serves(cls, task: str) -> bool:
        """Whether config.task = `task` is this kind's (a kind may accept other
        spellings of its names)."""
        return task in cls.task_names()

    @classmethod
    def describe(cls) -> str:
        """The kind's tasks in words, for the error naming the known config.task values."""
        return ", ".join(cls.task_names())

    @classmethod  # noqa: B027 (optional: a kind may have none)
    def add_defaults(cls, c: ml_collections.ConfigDict) -> None:
        """Adds the kind's own fields (with their defaults) to finetune_defaults(); every
        config has them, whatever its task, so a run's config.json reads back as it was."""

    @classmethod
    def fields(cls) -> dict[str, schema.Field]:
        """The types and ranges of the fields `add_defaults` adds (maelm_jax/config/schema.py)."""
        return {}

    @classmethod  # noqa: B027 (optional: a kind may have none)
    def validate(cls, c: ml_collections.ConfigDict) -> None:
        """Rules between fields when config.task is this kind's (`require` raises the
        one-line error); the fields' own types and ranges are already checked."""

    @classmethod
    def paper_grid(cls, task: str, size: str, paper: str) -> dict:
        """A paper's search space: {"num_epochs": (...), "learning_rate": (...),
        "batch_size": (...), "warmup_ratio": (...)} for the encoder size ("base" or
        "large") and recipe (finetune/config.py PAPERS)."""
        raise FinetuneConfigError(f"config.task: {task} has no paper grid; set config.grid.* "
                                  f"and config.train.* directly")

    @classmethod
    def dev_sequences(cls, run_cfg: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
                      seq_len: int) -> list[np.ndarray]:
        """A fine-tuning run's dev sequences, encoded as the run encoded them (for the rank
        analysis, analysis/inputs.py). By default: the run's first eval split, read by the
        kind itself."""
        return list(cls(run_cfg, tok, seq_len).eval_splits()[0].sequences)

    @classmethod
    def export_head(cls, run_cfg: ml_collections.ConfigDict) -> ExportHead | None:
        """The Hugging Face model a fine-tuned run of this kind exports as; None: the export
        has no PyTorch head for it."""
        return None

    # ------------------------------------------------------------------------ a run's task

    train: Split  # the training examples (or features), encoded
    eval: dict[str, Split]  # the dev split(s) by name

    @abc.abstractmethod
    def __init__(self, config: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
                 max_len: int):
        """Reads and encodes the task's splits (sequences of at most max_len tokens)."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The task's display name (results.json "task", log lines)."""

    @property
    @abc.abstractmethod
    def primary_metric(self) -> str:
        """The key of `score`'s result that runs and evaluations are compared by (higher is
        better)."""

    def eval_splits(self) -> list[Split]:
        return list(self.eval.values())

    @abc.abstractmethod
    def model(self, encoder_cfg: encoder_lib.EncoderConfig) -> nn.Module:
        """The Flax module: __call__(tokens [B, n], key_mask [B, n], deterministic) ->
        outputs; parameters {"encoder": ..., "head": ...} (finetune/heads.py has the
        encoder + head modules)."""

    @abc.abstractmethod
    def loss_sums(self, outputs: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
        """(loss summed over the batch's real rows, their count); batch as
        data.Batch.arrays() (tokens, key_mask, weights [B], and the split's targets); the
        step divides once."""

    @abc.abstractmethod
    def eval_outputs(self, outputs: Any) -> dict:
        """What the eval step returns per row ({name: [B, ...]}), from the model's outputs."""

    @abc.abstractmethod
    def score(self, run_eval: RunEval) -> dict:
        """The dev metrics (percentages, as the benchmarks report them); run_eval(sequences,
        targets) runs the eval step over them."""

    def write_outputs(self, workdir: paths.Path, run_eval: RunEval) -> list[str]:
        """Writes the predictions files under workdir (with the selected parameters) and
        returns their paths; none by default."""
        return []
