"""MAE-LM (and 3ML_self, 3ML_cross): [MASK]s never enter the encoder; a shallow decoder,
dropped after pretraining, predicts them (the model: maelm_jax/models/maelm.py).

Its config fields are the decoder's (``model.decoder.*``: its size, kind, dropout and the
official code's options) and MAE-LM Table 2's ``model.misaligned_positions``.
"""

from __future__ import annotations

import dataclasses

import ml_collections
from absl import logging

from maelm_jax.config import options, schema
from maelm_jax.pretrain import flops
from maelm_jax.pretrain.objectives import base
from maelm_jax.text import masking


class MaeLm(base.Objective):
    name = "maelm"
    removes_masks = True

    def defaults(self) -> ml_collections.ConfigDict:
        c = ml_collections.ConfigDict()
        c.model = ml_collections.ConfigDict()
        # MAE-LM Table 2 "misaligned position encoding": the encoder reads its kept tokens
        # at positions 0..n_enc-1 instead of their original ones.
        c.model.misaligned_positions = False
        d = c.model.decoder = ml_collections.ConfigDict()
        d.num_layers = 4
        d.d_model = 768  # a projection bridges a different encoder width
        d.num_heads = 12
        d.d_ff = 3072
        d.pre_ln = False
        # "self": MAE-LM / 3ML_self (full length, self-attention); "cross": 3ML_cross (only
        # the removed [MASK]s, self-attention among them and cross-attention to the
        # encoder); "causal_cross" / "cross_only": the same with causal / no self-attention
        # among the [MASK]s (MAE-LM Table 2's BART-like and cross-attention-only decoders).
        d.kind = "self"
        # MAE-LM Table 2 "enc. w. [MASK], dec. resets [MASK]": with masking.delta > 0, the
        # self decoder reads the [MASK] embedding (not the encoder's output) at the
        # encoder's [MASK]s.
        d.reset_masks = False
        d.dropout = 0.0  # MAE-LM's decoder has none; 3ML uses 0.1 on the whole model
        d.attention_dropout = 0.0
        # Options of the official code, off in the paper: a T5 relative position bias of the
        # decoder's own (0 = off), and the encoder's position table shared with the decoder
        # (equal widths only). See docs/plateau.md.
        d.rel_pos_buckets = 0
        d.rel_pos_max_distance = 128
        d.rel_pos_init = "normal"
        d.share_positions = False
        return c

    def fields(self) -> dict[str, schema.Field]:
        return {
            **schema.stack_fields("model.decoder"),
            "model.decoder.pre_ln": schema.boolean(),
            "model.decoder.rel_pos_buckets": schema.integer(0),
            "model.decoder.rel_pos_max_distance": schema.integer(1),
            "model.decoder.rel_pos_init": schema.choice(*options.REL_POS_INITS),
            "model.decoder.share_positions": schema.boolean(),
            "model.decoder.kind": schema.choice(*options.DECODER_KINDS),
            "model.decoder.reset_masks": schema.boolean(),
            "model.misaligned_positions": schema.boolean(),
            "model.decoder.dropout": schema.rate(),
            "model.decoder.attention_dropout": schema.rate(),
        }

    def validate(self, config: ml_collections.ConfigDict, require: base.Require) -> None:
        m, d = config.model, config.model.decoder
        schema.stack_rules(d, "model.decoder", m.attention_impl, require)
        require(not d.share_positions or d.d_model == m.d_model,
                "model.decoder.share_positions",
                f"False when model.decoder.d_model ({d.d_model}) differs from model.d_model",
                d.share_positions)
        require(not d.reset_masks or d.kind == "self", "model.decoder.reset_masks",
                f"False with model.decoder.kind={d.kind!r} (only the self decoder reads the "
                "encoder's [MASK] positions)", d.reset_masks)
        if d.reset_masks and config.masking.delta == 0:
            logging.warning(
                "config.model.decoder.reset_masks has no effect with config.masking.delta=0: "
                "no [MASK] stays in the encoder; set masking.delta > 0 (Table 2 uses 1.0)")

    def attention_stacks(self, config):
        return [config.model.decoder]

    def model_config(self, config, encoder):
        from maelm_jax.models import decoder as decoder_lib
        from maelm_jax.models import layers
        from maelm_jax.models import maelm as model_lib

        m, d = config.model, config.model.decoder
        stack = encoder.stack
        dec_stack = layers.StackConfig(
            num_layers=d.num_layers,
            d_model=d.d_model,
            num_heads=d.num_heads,
            d_ff=d.d_ff,
            dropout=d.dropout,
            attention_dropout=d.attention_dropout,
            pre_ln=d.pre_ln,
            dtype=stack.dtype,
            attention_impl=stack.attention_impl,
            pallas=stack.pallas,
            scan_layers=stack.scan_layers,
            remat_policy=stack.remat_policy,
            layer_norm_eps=stack.layer_norm_eps,
        )
        decoder = decoder_lib.DecoderConfig(
            stack=dec_stack,
            seq_len=config.data.seq_len,
            kind=d.kind,
            rel_pos_buckets=d.rel_pos_buckets,
            rel_pos_max_distance=d.rel_pos_max_distance,
            rel_pos_init=d.rel_pos_init,
            rel_pos_bucket_fn=m.rel_pos_bucket_fn,
            share_positions=d.share_positions,
            reset_masks=d.reset_masks,
        )
        return model_lib.MaeLmConfig(encoder=encoder, decoder=decoder,
                                     misaligned_positions=m.misaligned_positions)

    def model(self, model_cfg):
        from maelm_jax.models import maelm as model_lib

        return model_lib.MaeLmModel(model_cfg)

    def step_flops(self, config: ml_collections.ConfigDict, counts: masking.MaskCounts,
                   vocab_size: int) -> int:
        m, dec = config.model, config.model.decoder
        if dec.kind == "self":
            return flops.maelm_step_flops(config.train.batch_size, m.num_layers,
                                          dec.num_layers, counts.seq_len, counts.n_enc,
                                          m.d_model, m.d_ff, dec.d_model, dec.d_ff, counts.k,
                                          vocab_size)
        return flops.cross_step_flops(config.train.batch_size, m.num_layers, dec.num_layers,
                                      counts.n_enc, counts.seq_len - counts.n_enc, m.d_model,
                                      m.d_ff, dec.d_model, dec.d_ff, counts.k, vocab_size,
                                      self_attention=dec.kind != "cross_only")

    def for_length(self, model_cfg, params, length: int):
        """The decoder is built for `length` and reads the first `length` rows of its own
        position table: the self decoder spans the whole sequence (pretraining always
        fills all L positions; a shorter text must not add phantom [MASK] positions)."""
        model_cfg = dataclasses.replace(
            model_cfg, decoder=dataclasses.replace(model_cfg.decoder, seq_len=length))
        if not model_cfg.decoder.share_positions:
            decoder = dict(params["decoder"])
            table = decoder["position_embeddings"]["embedding"]
            decoder["position_embeddings"] = {"embedding": table[:length]}
            params = {**params, "decoder": decoder}
        return model_cfg, params
