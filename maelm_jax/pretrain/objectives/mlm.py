"""MLM, the RoBERTa-style baseline: the encoder reads the whole corrupted sequence,
[MASK]s included, and the LM head sits on the encoder at the k predicted positions (the
model: maelm_jax/models/mlm.py). It has no config fields of its own."""

from __future__ import annotations

import ml_collections

from maelm_jax.pretrain import flops
from maelm_jax.pretrain.objectives import base
from maelm_jax.text import masking


class Mlm(base.Objective):
    name = "mlm"
    removes_masks = False

    def model_config(self, config, encoder):
        from maelm_jax.models import mlm as model_lib

        return model_lib.MlmConfig(encoder=encoder)

    def model(self, model_cfg):
        from maelm_jax.models import mlm as model_lib

        return model_lib.MlmModel(model_cfg)

    def step_flops(self, config: ml_collections.ConfigDict, counts: masking.MaskCounts,
                   vocab_size: int) -> int:
        m = config.model
        return flops.mlm_step_flops(config.train.batch_size, m.num_layers, counts.seq_len,
                                    m.d_model, m.d_ff, counts.k, vocab_size)

    def validate(self, config, require) -> None:
        require(not config.model.misaligned_positions, "model.misaligned_positions",
                "False for objective mlm (its encoder reads every position; nothing to "
                "misalign)", config.model.misaligned_positions)
