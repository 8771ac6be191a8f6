"""Fine-tuning takes the attention kernel from its config, as pretraining does: the Pallas
kernel (interpreted on a CPU) fine-tunes to the einsum reference's numbers without dropout,
and an encoder whose heads the kernel cannot tile is one line naming the field."""

import json

import numpy as np
import pytest

from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import encoder as finetune_encoder
from maelm_jax.finetune import train
from maelm_jax.models import builder, flash_attention

from support import tiny_finetuning

pytestmark = pytest.mark.tier("integration")

NO_DROPOUT = {"model.dropout": 0.0, "model.attention_dropout": 0.0,
              "model.classifier_dropout": 0.0, "train.num_epochs": 1, "train.log_every": 1}


def _train_losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


def test_pallas_fine_tunes_as_the_einsum_reference(sst2_settings, tmp_path,  # noqa: F811
                                                   monkeypatch):
    traced = []  # the kernel is traced once per compiled program that uses it
    real = flash_attention.attention

    def spy(*args, **kwargs):
        traced.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_attention, "attention", spy)
    results = {}
    for impl in ("einsum", "pallas"):
        c = tiny_finetuning(sst2_settings, **NO_DROPOUT, **{"model.attention_impl": impl})
        results[impl] = train.run(c, str(tmp_path / impl))
        assert bool(traced) == (impl == "pallas"), impl
    reference, pallas = (_train_losses(tmp_path / i) for i in ("einsum", "pallas"))
    assert len(reference) == 6
    np.testing.assert_allclose(pallas, reference, rtol=1e-4, atol=1e-5)
    assert results["pallas"]["dev"]["accuracy"] == pytest.approx(
        results["einsum"]["dev"]["accuracy"], abs=1e-6)


def test_heads_the_kernel_cannot_tile_are_named(sst2_settings, tmp_path):  # noqa: F811
    """At config time, as pretraining does, for an encoder from scratch; by the builder
    (models/builder.py) for one read from a run, whose heads only its record says."""
    c = tiny_finetuning(sst2_settings, **{"model.num_heads": 4, "model.attention_impl": "pallas"})
    with pytest.raises(finetune_config.FinetuneConfigError,
                       match=r"^config\.model\.num_heads: expected heads of a power-of-two "
                             r"size >= 16 .*got 4$"):
        finetune_config.validate(c)
    with pytest.raises(finetune_config.FinetuneConfigError,
                       match=r"config\.model\.num_heads: .*got 4") as info:
        train.run(c, str(tmp_path / "run"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()
    arch = finetune_encoder.scratch_architecture(c, 64)
    with pytest.raises(builder.BuildError, match=r"^config\.model\.attention_impl: expected "
                                                 r"'einsum' or 'auto' for heads of 8 "):
        builder.encoder(arch, finetune_encoder.run_settings(c))
