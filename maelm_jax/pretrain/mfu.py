"""Model FLOPs utilisation: achieved TFLOP/s per device and the fraction of the device's
peak they are (Chowdhery et al., 2022, PaLM, Appendix B).

The FLOPs are the model's, not the hardware's: the 3ML Appendix D count of
maelm_jax/pretrain/flops.py rescaled to the usual convention of a backward pass costing twice the
forward (so forward + backward = 3 x forward, the "6 x parameters x tokens" of dense
layers), with no credit for rematerialised recomputation. Attention and the decoder are
counted, biases, LayerNorm and softmax are not (under 1 %).

Peaks are dense matmul FLOP/s per JAX device at the compute dtype: for TPUs from JAX's
table of chips (a v4 or v5p device is a whole megacore chip, a TPU7x device one of its two
cores), for GPUs from the vendors' datasheets. On TPU a float32 matmul runs at the default
precision as bfloat16 passes, so both dtypes share the bfloat16 peak; on NVIDIA GPUs XLA
runs float32 matmuls as TF32 on tensor cores by default, whose peak is half the bfloat16
one. A kind neither table knows gets no MFU (TFLOP/s are still logged) unless
config.train.peak_tflops_per_device names its peak. CPUs are not listed: benchmarks
measure a matmul's speed on them instead.
"""

from __future__ import annotations

import jax.numpy as jnp

from maelm_jax.infra import topology
from maelm_jax.models import layers
from maelm_jax.pretrain import setup as setup_lib

# Substring of jax.Device.device_kind -> (bfloat16, float32) dense peak TFLOP/s per GPU.
# Checked in order: more specific names first. TPUs come from JAX's own table of chips
# (maelm_jax/infra/topology.py chip_facts), which knows every generation and its kind's aliases.
PEAK_TFLOPS: tuple[tuple[str, tuple[float, float]], ...] = (
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
    kind is neither a TPU JAX knows nor in PEAK_TFLOPS."""
    if override > 0:
        return override
    tpu = topology.chip_facts(device_kind)
    if tpu is not None:  # float32 matmuls run as bfloat16 passes at the default precision
        return tpu.peak_bf16_tflops
    single_precision = layers.resolve_dtype(dtype) == jnp.float32
    for name, (half, single) in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return single if single_precision else half
    return None


class Utilisation:
    """TFLOP/s per device and MFU from steps/s, for the train logs: the program's model
    FLOPs (its Shape's, forward + backward = 3 x forward)."""

    def __init__(self, program: setup_lib.Program, num_devices: int, device_kind: str):
        config = program.config
        self.flops_per_step = program.model_flops
        self.num_devices = num_devices
        self.peak = peak_tflops(device_kind, config.model.dtype,
                                config.train.peak_tflops_per_device)

    def measure(self, steps_per_sec: float) -> dict[str, float]:
        tflops = self.flops_per_step * steps_per_sec / self.num_devices / 1e12
        out = {"tflops_per_device": tflops}
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out
