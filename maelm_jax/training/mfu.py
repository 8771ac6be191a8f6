"""Model FLOPs utilisation: achieved TFLOP/s per device and the fraction of the device's
peak they are (Chowdhery et al., 2022, PaLM, Appendix B).

The FLOPs are the model's, not the hardware's: the 3ML Appendix D count of
maelm_jax/flops.py rescaled to the usual convention of a backward pass costing twice the
forward (so forward + backward = 3 x forward, the "6 x parameters x tokens" of dense
layers), with no credit for rematerialised recomputation. Attention and the decoder are
counted, biases, LayerNorm and softmax are not (under 1 %).

Peaks are dense matmul FLOP/s per JAX device at the compute dtype, from the vendors'
datasheets. On TPU a float32 matmul runs at the default precision as bfloat16 passes, so
both dtypes share the bfloat16 peak; on NVIDIA GPUs XLA runs float32 matmuls as TF32 on
tensor cores by default, whose peak is half the bfloat16 one. A kind not in the table
gets no MFU (TFLOP/s are still logged) unless config.train.peak_tflops_per_device names
its peak. CPUs are not listed: benchmarks measure a matmul's speed on them instead.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections

from maelm_jax.models import layers
from maelm_jax.training import setup as setup_lib

# Substring of jax.Device.device_kind -> (bfloat16, float32) dense peak TFLOP/s per device.
# Checked in order: more specific names first. TPU v2 and v3 expose each core as a device.
PEAK_TFLOPS: tuple[tuple[str, tuple[float, float]], ...] = (
    ("TPU v2", (22.5, 22.5)),
    ("TPU v3", (61.5, 61.5)),
    ("TPU v4", (275.0, 275.0)),
    ("TPU v5 lite", (197.0, 197.0)),  # v5e
    ("TPU v5", (459.0, 459.0)),  # v5p
    ("TPU v6 lite", (918.0, 918.0)),  # v6e (Trillium)
    ("H100 PCIe", (756.0, 378.0)),
    ("H100", (989.0, 494.0)),  # SXM
    ("H200", (989.0, 494.0)),
    ("A100", (312.0, 156.0)),
    ("L4", (121.0, 60.0)),
    ("A10", (125.0, 62.5)),  # A10 and A10G
)


def peak_tflops(device_kind: str, dtype: str, override: float = 0.0) -> float | None:
    """The peak dense TFLOP/s of one device of `device_kind` at compute `dtype`
    ("bfloat16" and "float16" count as bfloat16), `override` if positive, None if the
    kind is not in PEAK_TFLOPS."""
    if override > 0:
        return override
    single_precision = layers.resolve_dtype(dtype) == jnp.float32
    for name, (half, single) in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return single if single_precision else half
    return None


def model_flops(paper_flops: int) -> int:
    """FLOPs counted forward + backward = 3 x forward from the papers' 2 x forward."""
    return paper_flops * 3 // 2


def model_flops_per_step(config: ml_collections.ConfigDict, vocab_size: int) -> int:
    """Model FLOPs of one optimiser step: the objective's count (training/setup.py
    step_flops: forward + backward = 2 x forward) rescaled to forward + backward = 3 x
    forward."""
    return model_flops(setup_lib.step_flops(config, vocab_size))


class Utilisation:
    """TFLOP/s per device and MFU from steps/s, for the train logs."""

    def __init__(self, config: ml_collections.ConfigDict, vocab_size: int, num_devices: int,
                 device_kind: str):
        self.flops_per_step = model_flops_per_step(config, vocab_size)
        self.num_devices = num_devices
        self.peak = peak_tflops(device_kind, config.model.dtype,
                                config.train.peak_tflops_per_device)

    def measure(self, steps_per_sec: float) -> dict[str, float]:
        tflops = self.flops_per_step * steps_per_sec / self.num_devices / 1e12
        out = {"tflops_per_device": tflops}
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out
