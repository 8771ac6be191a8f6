"""The models' named choices and the Pallas kernel's options, as plain data.

Config files and their validation (maelm_jax/pretrain/config.py, the objectives' field tables)
check these names without importing Flax or the Pallas kernel; the model modules read the
same tuples, so each choice is declared once, here. Nothing below imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

# Compute dtypes (parameters, optimiser state, softmax, LayerNorm statistics and the loss
# stay float32). "auto": bfloat16 on GPUs and TPUs, whose matrix units run it several
# times faster than float32, and float32 on CPUs, where bfloat16 is emulated and slower
# (layers.resolve_dtype).
DTYPES = ("auto", "float32", "bfloat16", "float16")

# How attention is computed. "einsum": our own two einsums and a float32 softmax, the
# reference. "xla" / "cudnn": jax.nn.dot_product_attention with that implementation (cuDNN's
# fused kernel needs a GPU and bfloat16 or float16); with attention dropout in training
# they fall back to the einsum path, which materialises the probabilities. "pallas": our
# flash-attention kernel (models/flash_attention.py) with the bias, the key mask and
# dropout inside, bits drawn from the layer's "dropout" stream as every other dropout (a
# GPU kernel; Pallas' interpreter on a CPU, for tests). "auto", on GPUs at half precision:
# "pallas" when the model has attention dropout and heads the kernel tiles, else "cudnn"
# (with attention dropout the kernel's forward and backward beat the einsum path's at
# BERT-base shapes, docs/performance.md, and cuDNN's fused call cannot drop); "einsum"
# elsewhere (on CPU and TPU XLA compiles both alike). The attention diagnostics, which read
# the probabilities, always take the einsum path.
ATTENTION_IMPLS = ("auto", "einsum", "xla", "cudnn", "pallas")
# How a fine-tuning head reads the encoder (finetune/heads.py): its first token's state or
# the mean over real tokens.
POOLINGS = ("first", "mean")

# What a layer keeps for the backward pass, the rest being recomputed (stack.py maps each
# name to its jax.checkpoint policy). "none": no rematerialisation, everything is kept.
# "full": only the layer's input, the whole layer is recomputed (least memory, about one
# more forward). "dots": the matmul outputs (recomputes the cheap element-wise work:
# LayerNorm, GELU, softmax, dropout). "dots_no_batch": only the matmuls against weights
# (recomputes attention's score and weighted-sum matmuls too), MaxText's usual choice for
# large models. "dots_attention": those matmuls and the attention kernel's output and row
# statistics (named in models/flash_attention.py), so the backward recomputes only
# element-wise work (LayerNorm, GELU, dropout, bias adds) and never the attention forward:
# about 280 MB a BERT-base layer at 32 x 512 in bfloat16 where "none" keeps 897 MB
# (benchmarks/program_cost.py prints it). "auto": "dots_attention" where the attention
# kernel is the Pallas one (GPUs and TPUs with attention dropout), else "none" (the cuDNN
# and einsum paths' outputs are not named, and recomputing them would run the attention
# twice).
REMAT_POLICIES = ("auto", "none", "full", "dots", "dots_no_batch", "dots_attention")

# How a relative position bias table starts: "normal" is N(0, 0.02) like every other
# weight (both papers); "local" is a locality prior (relative_position.local_bias_init).
REL_POS_INITS = ("normal", "local")
# Relative-position bucketing by name: T5's (the papers cite Raffel et al.) or the official
# MAE-LM code's (relative_position.BUCKET_FNS).
BUCKET_FNS = ("t5", "maelm")

# The MAE-LM decoder's kinds (models/decoder.py): "self" (MAE-LM, 3ML_self) over all L
# positions; "cross" (3ML_cross), "causal_cross" and "cross_only" (MAE-LM Table 2) read
# only the removed [MASK]s and attend to the encoder.
DECODER_KINDS = ("self", "cross", "causal_cross", "cross_only")

# The learning-rate schedule's shape after its warmup (config.train.lr_schedule of
# pretraining): training/optimizer.py computes each, its index in the schedule's data.
LR_SCHEDULES = ("linear", "cosine", "wsd", "constant", "inv_sqrt")
# The experiment trackers a pretraining run may write to besides metrics.jsonl
# (config.train.trackers, comma-separated; training/metrics.py: TRACKERS).
TRACKERS = ("tensorboard", "wandb")


def profile_window(spec: str) -> tuple[int, int] | None:
    """config.train.profile_steps ("START,COUNT"; "" for none) as (start, count)
    (training/profiler.py); ValueError for anything else."""
    if not spec.strip():
        return None
    start, count = (int(part) for part in spec.split(","))
    if start < 1 or count < 1:
        raise ValueError(spec)
    return start, count


def valid_profile_window(spec: Any) -> bool:
    """Whether `spec` is "" or "START,COUNT" with START >= 1 and COUNT >= 1."""
    try:
        return isinstance(spec, str) and (profile_window(spec) or True)
    except ValueError:
        return False

# ------------------------------------------------------------------ the Pallas kernel's

# The masked-LM output layer's dot: float32, or the compute dtype with float32 accumulation.
OUTPUT_DTYPES = ("float32", "compute")
# How a bias shared by the batch gets its gradient (models/flash_attention.py): summed
# inside the dK/dV kernel ("batch"), per row summed by XLA ("rows"), or by a kernel of its
# own that sums rows in registers ("kernel": no read-modify-write in the dK/dV loop).
BIAS_GRADS = ("batch", "rows", "kernel")
# Elements that share one 32-bit hash of the dropout bits.
HASH_ELEMENTS = (1, 2, 4)
_TILE = re.compile(r"^(\d+)x(\d+):(\d+):(\d+)$")


class OptionsError(ValueError):
    """Kernel options that cannot work; the message names the option."""


def _power_of_two(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class Tile:
    """One kernel's launch: its tile (queries x keys) and Triton's warps and pipeline stages.

    Written "block_qxblock_k:num_warps:num_stages", e.g. "128x64:4:3".
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            size = getattr(self, name)
            if not (_power_of_two(size) and size >= 16):
                raise OptionsError(f"{name} must be a power of two >= 16 (Triton's dot), "
                                   f"got {size}")
        if not (_power_of_two(self.num_warps) and self.num_warps <= 16):
            raise OptionsError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise OptionsError(f"num_stages must be in [1, 8], got {self.num_stages}")

    @classmethod
    def parse(cls, text: str) -> Tile:
        match = _TILE.match(text) if isinstance(text, str) else None
        if not match:
            raise OptionsError(f"expected 'block_qxblock_k:warps:stages' such as '64x64:4:2', "
                               f"got {text!r}")
        return cls(*map(int, match.groups()))

    def __str__(self) -> str:
        return f"{self.block_q}x{self.block_k}:{self.num_warps}:{self.num_stages}"


# The TPU's vector registers: 8 sublanes x 128 lanes of 32 bits.
LANES = 128
_TPU_TILE = re.compile(r"^(\d+)x(\d+)$")


@dataclasses.dataclass(frozen=True)
class TpuTile:
    """One TPU kernel's tile: queries x keys, each a multiple of 128 (the lane width: the
    row statistics are transposed to lanes, the bias row is gathered 128 lanes at a time).
    Written "block_qxblock_k", e.g. "128x256"."""

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            size = getattr(self, name)
            if not (isinstance(size, int) and size >= LANES and size % LANES == 0):
                raise OptionsError(f"{name} must be a multiple of {LANES} (the TPU's lanes), "
                                   f"got {size}")

    @classmethod
    def parse(cls, text: str) -> TpuTile:
        match = _TPU_TILE.match(text) if isinstance(text, str) else None
        if not match:
            raise OptionsError(f"expected 'block_qxblock_k' such as '128x128', got {text!r}")
        return cls(*map(int, match.groups()))

    def __str__(self) -> str:
        return f"{self.block_q}x{self.block_k}"


_TILES = {"forward": Tile, "dkv": Tile, "dq": Tile, "tpu_forward": TpuTile,
          "tpu_dkv": TpuTile, "tpu_dq": TpuTile}


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the three kernels run: each one's Tile, the bias-gradient scheme and the dropout
    bits per hash. Every choice computes the same function (up to float rounding, and the
    dropout bits' pattern for hash_elements); they differ in speed only, so the defaults are
    for the GPU measurement to choose (benchmarks/gpu_suite.py sweeps them)."""

    forward: Tile = Tile()
    dkv: Tile = Tile()  # block_k: the program's key block; block_q: the queries it streams
    dq: Tile = Tile()  # block_q: the program's query block; block_k: the keys it streams
    bias_grad: str = "batch"  # one of BIAS_GRADS
    # "batch": programs per (key block, head) over the batch. 8: the GPU sweep's choice
    # (benchmarks/gpu_suite.py, docs/performance.md), faster than fewer groups and as fast
    # as "rows", which writes a float32 partial sum per row for XLA to add.
    bias_grad_groups: int = 8
    hash_elements: int = 1  # one of HASH_ELEMENTS
    # The TPU kernels' tiles (models/flash_attention_tpu.py; dkv: block_k its key block,
    # block_q the queries it streams; dq and forward: block_q theirs, block_k streamed)
    # and the VMEM they may use (a chip's scoped default is 16 MiB on v4/v5e, 32 on v6e).
    tpu_forward: TpuTile = TpuTile()
    tpu_dkv: TpuTile = TpuTile()
    tpu_dq: TpuTile = TpuTile()
    tpu_vmem_limit_mb: int = 16

    def __post_init__(self):
        if self.bias_grad not in BIAS_GRADS:
            raise OptionsError(f"bias_grad must be one of {', '.join(BIAS_GRADS)}, got "
                               f"{self.bias_grad!r}")
        if not (isinstance(self.bias_grad_groups, int) and self.bias_grad_groups >= 1):
            raise OptionsError(f"bias_grad_groups must be an int >= 1, got "
                               f"{self.bias_grad_groups!r}")
        if self.hash_elements not in HASH_ELEMENTS:
            raise OptionsError(f"hash_elements must be one of "
                               f"{', '.join(map(str, HASH_ELEMENTS))}, got {self.hash_elements!r}")

        if not (isinstance(self.tpu_vmem_limit_mb, int) and 1 <= self.tpu_vmem_limit_mb <= 128):
            raise OptionsError(f"tpu_vmem_limit_mb must be an int in [1, 128], got "
                               f"{self.tpu_vmem_limit_mb!r}")

    @property
    def tpu_query_multiple(self) -> int:
        """What the TPU kernels pad the number of queries to a multiple of."""
        return math.lcm(self.tpu_forward.block_q, self.tpu_dkv.block_q, self.tpu_dq.block_q)

    @property
    def tpu_key_multiple(self) -> int:
        """What the TPU kernels pad the number of keys to a multiple of."""
        return math.lcm(self.tpu_forward.block_k, self.tpu_dkv.block_k, self.tpu_dq.block_k)

    def tpu_vmem_bytes(self, n: int, m: int, head_dim: int, itemsize: int = 2) -> dict[str, int]:
        """Each TPU kernel's VMEM estimate (bytes) for n queries and m keys (padded) of
        head_dim: its blocks double-buffered (the pipeline's) plus its [block_q, block_k]
        float32 temporaries (scores, probabilities, dropout, bias: a handful each)."""
        n = -(-n // self.tpu_query_multiple) * self.tpu_query_multiple
        m = -(-m // self.tpu_key_multiple) * self.tpu_key_multiple
        words = 4
        def tile_temps(t: TpuTile) -> int:
            return 8 * t.block_q * t.block_k * words

        f, d, q = self.tpu_forward, self.tpu_dkv, self.tpu_dq
        # per program: q and o [bq, D], k and v [m, D], a bias tile [bq, m] (at most
        # float32), positions [bq, 128] and [8, m], the mask [8, m], statistics [1, bq]
        forward = 2 * ((2 * f.block_q + 2 * m) * head_dim * itemsize + f.block_q * m * words
                       + f.block_q * LANES * words + 2 * 8 * m * words
                       + 2 * 8 * f.block_q * words) + tile_temps(f)
        dkv = 2 * ((2 * n + 4 * d.block_k) * head_dim * itemsize
                   + 2 * n * d.block_k * words + n * LANES * words + 2 * 8 * d.block_k * words
                   + 3 * 8 * n * words) + tile_temps(d)
        dq = 2 * ((3 * q.block_q + 2 * m) * head_dim * itemsize + q.block_q * m * words
                  + q.block_q * LANES * words + 2 * 8 * m * words
                  + 3 * 8 * q.block_q * words) + tile_temps(q)
        return {"tpu_forward": forward, "tpu_dkv": dkv, "tpu_dq": dq}

    def check_tpu_vmem(self, n: int, m: int, head_dim: int, where: str = "options") -> None:
        """An OptionsError naming the kernel whose estimate exceeds tpu_vmem_limit_mb."""
        limit = self.tpu_vmem_limit_mb * 2 ** 20
        for name, used in self.tpu_vmem_bytes(n, m, head_dim).items():
            if used > limit:
                raise OptionsError(
                    f"{where}.{name}: the TPU kernel needs about {used / 2 ** 20:.1f} MiB of "
                    f"VMEM for {n} queries, {m} keys and heads of {head_dim}, over "
                    f"{where}.tpu_vmem_limit_mb={self.tpu_vmem_limit_mb}: use smaller tiles "
                    f"(now {getattr(self, name)}), shorter sequences or a higher limit")

    @property
    def query_multiple(self) -> int:
        """What the number of queries must be a multiple of."""
        return math.lcm(self.forward.block_q, self.dkv.block_q, self.dq.block_q)

    @property
    def key_multiple(self) -> int:
        """What the number of keys must be a multiple of."""
        return math.lcm(self.forward.block_k, self.dkv.block_k, self.dq.block_k)

    @property
    def length_multiple(self) -> int:
        """What a self-attention length must be a multiple of."""
        return math.lcm(self.query_multiple, self.key_multiple)

    def fitted(self, length: int) -> KernelOptions:
        """These options for a self-attention of `length`, padded no further than a tile
        needs: every block shrunk to the power of two (>= 16, <= the configured block)
        whose multiple nearest above `length` is smallest, the largest such block on ties.
        MAE-LM's 109 kept tokens of 128 pad to 112 (blocks of 16) instead of 128; 3ML's
        87 to 96 (32); BERT-base's 435 to 448 (64, as configured)."""
        largest = max(self.length_multiple, 16)
        candidates = [b for b in (2 ** i for i in range(4, largest.bit_length()))
                      if b <= largest]
        block = min(candidates, key=lambda b: (-(-length // b) * b, -b))
        shrink = lambda t: dataclasses.replace(  # noqa: E731
            t, block_q=min(t.block_q, block), block_k=min(t.block_k, block))
        return dataclasses.replace(self, forward=shrink(self.forward), dkv=shrink(self.dkv),
                                   dq=shrink(self.dq))

    def fields(self) -> dict[str, Any]:
        """The options as config fields (model.pallas.*): tiles as strings."""
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), (Tile, TpuTile))
                         else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], where: str = "options") -> KernelOptions:
        """The options of config fields as `fields` writes them; an OptionsError names the
        field (`where`.<name>) and what is expected."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise OptionsError(f"{where}.{unknown[0]}: unknown option; expected "
                               f"{', '.join(sorted(known))}")
        values = {}
        for name, value in fields.items():
            try:
                values[name] = _TILES[name].parse(value) if name in _TILES else value
            except OptionsError as e:
                raise OptionsError(f"{where}.{name}: {e}") from None
        try:
            return cls(**values)
        except OptionsError as e:
            name = str(e).split(" ", 1)[0]
            raise OptionsError(f"{where}.{name}: {str(e).split(' ', 1)[1]}") from None
