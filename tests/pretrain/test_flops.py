"""Tests for the 3ML Appendix D FLOPs formulas: hand-computed cases and the paper's eqs."""

import jax
import pytest

from maelm_jax.infra import sharding
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import flops
from maelm_jax.pretrain import setup as setup_lib

from tiny_config import TINY_VOCAB, tiny_config

pytestmark = pytest.mark.tier("unit")

# --- building blocks, by hand --------------------------------------------------------------

def test_msa_by_hand():
    # n=2, d=3: 8*2*9 + 4*4*3 = 144 + 48.
    assert flops.msa(2, 3) == 192


def test_mlp_by_hand_and_paper_form():
    # n=2, d=3, d_ff=12: two dense layers of 2*3*12 multiply-adds, 2 FLOPs each.
    assert flops.mlp(2, 3, 12) == 288
    # The paper's 16 n d^2 is the d_ff = 4 d case.
    for n, d in ((2, 3), (128, 768), (512, 1024)):
        assert flops.mlp(n, d, 4 * d) == 16 * n * d * d


def test_block_by_hand_and_paper_form():
    assert flops.block(2, 3, 12) == 192 + 288
    for n, d in ((2, 3), (512, 768)):
        assert flops.block(n, d, 4 * d) == 24 * n * d * d + 4 * n * n * d


def test_prediction_by_hand():
    # k=1, d_in=d=3, |V|=5: 2*1*(9 + 15).
    assert flops.prediction(1, 3, 3, 5) == 48
    # 3ML head: d_de=2 -> d_en=4 -> |V|=6 at k=1: 2*(8 + 24).
    assert flops.prediction(1, 2, 4, 6) == 64


def test_mlm_step_by_hand():
    # One layer at n=2, d=3, d_ff=12 (480), head at k=1 (48); x2 forward+backward, x batch.
    assert flops.mlm_step_flops(1, 1, 2, 3, 12, 1, 5) == 2 * (480 + 48)
    assert flops.mlm_step_flops(2, 1, 2, 3, 12, 1, 5) == 4 * (480 + 48)


def test_maelm_step_by_hand():
    # L=4, k=1 removed -> n_enc=3; d_en=4 (d_ff 16), d_de=2 (d_ff 8), |V|=6, 1+1 layers.
    projection = 2 * 3 * 4 * 2                      # 48
    encoder = 24 * 3 * 16 + 4 * 9 * 4               # block(3, 4, 16) = 1296
    decoder = 24 * 4 * 4 + 4 * 16 * 2               # block(4, 2, 8) = 512
    head = 2 * 1 * (2 * 4 + 4 * 6)                  # 64
    assert projection + encoder + decoder + head == 1920
    assert flops.maelm_step_flops(1, 1, 1, 4, 3, 4, 16, 2, 8, 1, 6) == 2 * 1920
    # Equal widths: no projection term.
    assert (flops.maelm_step_flops(1, 1, 1, 4, 3, 4, 16, 4, 16, 1, 6)
            == 2 * (1296 + flops.block(4, 4, 16) + flops.prediction(1, 4, 4, 6)))


# --- the paper's equations --------------------------------------------------------------------

def _paper_blk(n, d):
    return 24 * n * d * d + 4 * n * n * d


def test_roberta_equation_2():
    # RoBERTa-base shapes: b=2048, l=12, n=512, d=768, |V|=50265; k = n r = 77 predicted.
    b, l, n, d, vocab, nr = 2048, 12, 512, 768, 50265, 77  # noqa: E741 (the paper's names)
    eq2 = 2 * b * (l * _paper_blk(n, d) + 2 * nr * (d * d + d * vocab))
    assert flops.mlm_step_flops(b, l, n, d, 4 * d, nr, vocab) == eq2

    config = pretrain_config.pretrain_defaults()
    config.objective = "mlm"
    config.train.batch_size = b
    assert pretrain_config.mask_counts(config).k == nr
    assert setup_lib.step_flops(config, vocab) == eq2


def test_3ml_self_equation_3():
    # 3ML_self: 40 % masking, 80-10-10, a 2-layer half-width decoder behind a projection.
    config = pretrain_config.pretrain_defaults()
    config.masking.mask_ratio = 0.4
    config.masking.mask_frac = 0.8
    config.masking.random_frac = 0.1
    config.model.decoder.num_layers = 2
    config.model.decoder.d_model = 384
    config.model.decoder.num_heads = 6
    config.model.decoder.d_ff = 4 * 384
    config.train.batch_size = 256
    vocab = 32768
    counts = pretrain_config.mask_counts(config)
    # n_en = (1 - 0.8 r) n = 348.16 in the paper; our counts are exact ints.
    assert (counts.k, counts.k_mask, counts.n_enc) == (205, 164, 348)
    b, n, n_en, d_en, d_de, nr = 256, 512, 348, 768, 384, 205
    eq3 = 2 * b * (2 * n_en * d_en * d_de + 12 * _paper_blk(n_en, d_en)
                   + 2 * _paper_blk(n, d_de) + 2 * nr * (d_de * d_en + d_en * vocab))
    assert setup_lib.step_flops(config, vocab) == eq3


def test_maelm_default_is_cheaper_encoder_plus_decoder():
    # MAE-LM base: the encoder at n_enc = 512 - 77 = 435 plus 4 full-width decoder layers.
    config = pretrain_config.pretrain_defaults()
    config.train.batch_size = 1
    vocab = 32768
    expected = 2 * (12 * _paper_blk(435, 768) + 4 * _paper_blk(512, 768)
                    + 2 * 77 * (768 * 768 + 768 * vocab))
    assert setup_lib.step_flops(config, vocab) == expected


# --- reductions ---------------------------------------------------------------------------------

def test_maelm_without_decoder_or_removal_is_mlm():
    # 0 decoder layers, equal widths and nothing removed (n_enc = L): exactly MLM.
    args = {"batch_size": 3, "seq_len": 64, "num_predicted": 10, "vocab_size": 1000}
    mlm = flops.mlm_step_flops(num_layers=2, d_model=32, d_ff=128, **args)
    maelm = flops.maelm_step_flops(encoder_layers=2, decoder_layers=0, n_enc=64, d_en=32,
                                   d_ff_en=128, d_de=32, d_ff_de=128, **args)
    assert maelm == mlm


def test_step_flops_maelm_delta_one_reduces_to_mlm():
    # The MAE-LM paper's delta ablation with delta = 1 keeps every [MASK] in the encoder.
    config = pretrain_config.pretrain_defaults()
    config.data.seq_len = 128
    config.train.batch_size = 8
    config.masking.delta = 1.0
    config.model.decoder.num_layers = 0
    assert pretrain_config.mask_counts(config).n_enc == 128
    mlm = config.copy_and_resolve_references()
    mlm.objective = "mlm"
    assert setup_lib.step_flops(config, 5000) == setup_lib.step_flops(mlm, 5000)


def test_step_flops_rejects_unknown_objective():
    config = pretrain_config.pretrain_defaults()
    config.objective = "electra"
    with pytest.raises(pretrain_config.ConfigError, match="objective"):
        setup_lib.step_flops(config, 1000)


# --- 3ML_cross, eq. (4) ----------------------------------------------------------------------

def test_mca_and_cross_block_by_hand_and_paper_form():
    # n_en=3, n_de=2, d=4: 4*3*16 + 4*2*16 + 4*3*2*4 = 192 + 128 + 96.
    assert flops.mca(3, 2, 4) == 416
    for n_en, n_de, d in ((3, 2, 4), (348, 164, 384)):
        paper = 4 * n_en * d * d + 28 * n_de * d * d + 4 * n_en * n_de * d + 4 * n_de * n_de * d
        assert flops.cross_block(n_en, n_de, d, 4 * d) == paper
    # Without self-attention the phi_MSA(n_de) term drops.
    assert flops.cross_block(3, 2, 4, 16, self_attention=False) == \
        flops.cross_block(3, 2, 4, 16) - flops.msa(2, 4)


def test_3ml_cross_equation_4():
    # 3ML_cross-base shapes: 40 % of 512 = 205 predicted, 164 [MASK]s removed, 41 predicted
    # from the encoder; a 2-layer 384-wide decoder behind a projection.
    config = pretrain_config.pretrain_defaults()
    config.masking.mask_ratio, config.masking.mask_frac, config.masking.random_frac = 0.4, 0.8, 0.1
    config.model.decoder.update(kind="cross", num_layers=2, d_model=384, num_heads=6, d_ff=1536)
    config.train.batch_size = 2
    vocab = 50265
    counts = pretrain_config.mask_counts(config)
    n_en, n_de, k, d_en, d_de = counts.n_enc, 512 - counts.n_enc, counts.k, 768, 384
    assert (n_en, n_de, k) == (348, 164, 205)
    paper_cblk = (4 * n_en * d_de ** 2 + 28 * n_de * d_de ** 2 + 4 * n_en * n_de * d_de
                  + 4 * n_de ** 2 * d_de)
    eq4 = 2 * 2 * (2 * n_en * d_en * d_de + 12 * _paper_blk(n_en, d_en) + 2 * paper_cblk
                   + 2 * (k - n_de) * (d_en * d_en + d_en * vocab)   # encoder-side head
                   + 2 * n_de * (d_de * d_en + d_en * vocab))        # decoder-side head
    # Ours has one more d_en x d_en map on the decoder side (see cross_step_flops).
    assert setup_lib.step_flops(config, vocab) == eq4 + 2 * 2 * 2 * n_de * d_en * d_en
    # Equal widths: no projection and no extra map.
    config.model.decoder.update(d_model=768, num_heads=12, d_ff=3072)
    assert setup_lib.step_flops(config, vocab) == 2 * 2 * (
        12 * _paper_blk(n_en, 768) + 2 * flops.cross_block(n_en, n_de, 768, 3072)
        + 2 * k * (768 * 768 + 768 * vocab))


# Every TPU kind JAX reports, under each of its names: one device's bf16 peak, which a
# float32 matmul shares (bfloat16 passes). v4 and v5p devices are megacore chips.
TPU_PEAKS = {
    "TPU v2": 23.0, "TPU v3": 70.0, "TPU v4": 275.0,
    "TPU v5 lite": 197.0, "TPU v5e": 197.0,  # v5e, not v5p's 459 by substring
    "TPU v5": 459.0, "TPU v5p": 459.0,
    "TPU v6 lite": 920.0, "TPU v6e": 920.0,
    "TPU7x": 1155.0,  # one of a chip's two cores: each is a device
}


@pytest.mark.parametrize("kind", sorted(TPU_PEAKS))
def test_tpu_peaks_come_from_jax_for_every_kind(kind):
    from maelm_jax.pretrain import mfu

    assert mfu.peak_tflops(kind, "bfloat16") == TPU_PEAKS[kind]
    assert mfu.peak_tflops(kind, "float32") == TPU_PEAKS[kind]


def test_peak_tflops_by_device_kind_dtype_and_override():
    from maelm_jax.pretrain import mfu

    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert mfu.peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert mfu.peak_tflops("NVIDIA A100-SXM4-40GB", "float32") == 156.0  # TF32
    assert mfu.peak_tflops("TPU v9 imaginary", "bfloat16") is None
    assert mfu.peak_tflops("cpu", "float32") is None
    assert mfu.peak_tflops("cpu", "float32", override=0.2) == 0.2


def test_utilisation_is_model_flops_times_steps_per_second_over_devices():
    from maelm_jax.pretrain import mfu

    c = tiny_config("maelm")
    c.train.peak_tflops_per_device = 2.0

    def program(config):
        return setup_lib.build(config, TINY_VOCAB, sharding.make_mesh((1, 1, 1),
                                                                      jax.devices()[:1]))

    util = mfu.Utilisation(program(c), num_devices=4, device_kind="cpu")
    model_flops = setup_lib.step_flops(c, TINY_VOCAB) * 3 // 2  # 3 x forward, not the paper's 2
    assert util.flops_per_step == model_flops
    out = util.measure(steps_per_sec=10.0)
    assert out["tflops_per_device"] == pytest.approx(model_flops * 10 / 4 / 1e12)
    assert out["mfu"] == pytest.approx(out["tflops_per_device"] / 2.0)
    c.train.peak_tflops_per_device = 0.0
    assert "mfu" not in mfu.Utilisation(program(c), 4, "cpu").measure(10.0)
