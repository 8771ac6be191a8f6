"""Memory per device of a pretraining config on a mesh, before booking the hardware.

    # Exact, for a TPU slice (compile-only TPU devices; pip install -r requirements-tpu-check.txt):
    python scripts/plan_memory.py --config=configs/pretrain/base.py --topology=v5e:8x8 \
        --config.train.batch_size=2048 --remat_policies=all --fit
    # A guide, on this machine's CPU compiler:
    python scripts/plan_memory.py --config=configs/pretrain/base.py \
        --config.mesh.shape='(16,1,1)' --config.train.batch_size=2048 \
        --config.train.grad_accum_steps=4 [--remat_policies=all]

--config and its --config.<field>=<value> overrides are main.py's. With --remat_policies
(a comma-separated list of model.remat_policy values, or "all") the step is compiled
once per policy.

Parameters and optimiser state come from `jax.eval_shape` and the sharding rules (exact).
With --topology the train step is compiled by XLA:TPU itself for that slice (libtpu's
compile-only devices, maelm_jax/infra/topology.py; `--num_slices` for a multislice job): the
arguments, temporaries and program per device are the TPU compiler's own figures, set
against the chip's HBM, and a step that does not fit is reported with what it needs
(the compiler refuses it as the pod would). `--fit` then halves the micro-batch
(doubling train.grad_accum_steps) until the step fits, for each policy. Model "auto"
choices are a TPU's (bfloat16, einsum attention). Without --topology the mesh is simulated
with host devices and the temporaries are the CPU compiler's estimate, which fuses and
rematerialises differently (on BERT-base it overestimated TPU activations by about half).
"""

import math
import re

import jax
from absl import app, flags

from maelm_jax.infra import cli, sharding, topology
from maelm_jax.models import stack as stack_lib
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib

FLAGS = flags.FLAGS
cli.define_config("configs/pretrain/base.py", "Pretraining config file[:variant], as for "
                  "main.py.", prefix=cli.program())
flags.DEFINE_integer("devices", 0, "Devices to plan for when config.mesh.shape has a -1 "
                     "(default: the product of its sizes; not with --topology).", lower_bound=0)
flags.DEFINE_string("topology", None, "A TPU slice to compile for, e.g. v5e:8x8, v4:2x2x4, "
                    "v6e:4x4 (see maelm_jax/infra/topology.py); needs libtpu.")
flags.DEFINE_integer("num_slices", 1, "Slices of --topology in a multislice job "
                     "(config.mesh.dcn_shape lays them out).", lower_bound=1)
flags.DEFINE_string("remat_policies", None, "Comma-separated model.remat_policy values to "
                    "compare, or 'all' (default: the config's).")
cli.choices_flag("remat_policies", stack_lib.REMAT_POLICIES, also=("all",))
flags.DEFINE_bool("fit", False, "With --topology: for each policy, the largest micro-batch "
                  "(train.grad_accum_steps) whose step fits the chip's HBM.")
flags.DEFINE_bool("no_compile", False, "Only parameters and optimiser state (no XLA "
                  "compilation).")

# XLA:TPU refusing a program: "... the total memory required for HLO temporaries (22.18G)
# exceeds available HBM (15.75G)" (and similar wordings).
_OUT_OF_HBM = re.compile(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT])\).*?HBM \(([\d.]+)([KMGT])\)")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def gib(n: float) -> str:
    return f"{n / 2**30:8.2f} GiB"


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


def _policies() -> list[str]:
    if FLAGS.remat_policies == "all":
        return list(stack_lib.REMAT_POLICIES)
    if FLAGS.remat_policies:
        return [x.strip() for x in FLAGS.remat_policies.split(",") if x.strip()]
    return [FLAGS.config.model.remat_policy]


def _devices(c) -> list:
    """The devices to plan on: a TPU slice's compile-only devices, or host devices."""
    if FLAGS.topology:
        if FLAGS.devices:
            cli.fail("--devices: not with --topology (the slice decides)", cli.program())
        try:
            return topology.devices(FLAGS.topology, FLAGS.num_slices)
        except topology.TopologyError as e:
            cli.fail(str(e), cli.program())
    sizes = [int(s) for s in c.mesh.shape]
    devices = FLAGS.devices or math.prod(s for s in sizes if s > 0)
    if -1 in sizes and not FLAGS.devices:
        cli.fail("config.mesh.shape has a -1; give --devices=<the number of devices to plan "
                 "for>", cli.program())
    # Simulated host devices (only the CPU backend reads this): set before JAX's first use.
    jax.config.update("jax_num_cpu_devices", devices)
    if len(jax.devices()) < devices:
        cli.fail(f"{devices} devices needed, {len(jax.devices())} present", cli.program())
    return jax.devices()[:devices]


def compiled_bytes(c, vocab: int, mesh) -> tuple[dict | None, int | None]:
    """({arguments, temporaries, program, total} bytes per device of the compiled train
    step, None), or (None, the bytes the TPU compiler said it needed) when it does not fit."""
    try:
        mem = setup_lib.build(c, vocab, mesh).compile_train_step().memory_analysis()
    except Exception as e:  # XLA reports an oversized program as a runtime error
        found = _OUT_OF_HBM.search(str(e).replace("\n", " "))
        if not found:
            raise
        return None, int(float(found.group(1)) * _UNITS[found.group(2)])
    figures = {"arguments": mem.argument_size_in_bytes,
               "temporaries": mem.temp_size_in_bytes,
               "program": mem.generated_code_size_in_bytes}
    figures["total"] = peak_bytes(mem)
    return figures, None


def peak_bytes(mem) -> int:
    """A compiled program's peak memory per device: the compiler's own figure (its buffers'
    live ranges overlap), else arguments + temporaries + program + the outputs that do not
    alias the donated arguments."""
    peak = getattr(mem, "peak_memory_in_bytes", 0)
    return peak or (mem.argument_size_in_bytes + mem.temp_size_in_bytes
                    + mem.generated_code_size_in_bytes + mem.output_size_in_bytes
                    - mem.alias_size_in_bytes)


def main(argv):
    del argv  # cli.tool_flags_parser refuses stray arguments
    c = FLAGS.config
    if FLAGS.fit and not FLAGS.topology:
        cli.fail("--fit: needs --topology (only the TPU compiler's figures are exact)",
                 cli.program())
    try:
        pretrain_config.validate(c)
    except pretrain_config.ConfigError as e:
        cli.fail(str(e), cli.program())
    policies = _policies()
    devices = _devices(c)
    if FLAGS.topology:
        setup_lib.resolve_auto(c, "tpu")
    try:
        mesh = sharding.make_mesh(c.mesh.shape, devices, c.mesh.dcn_shape)
        sharding.check_batch(mesh, c.train.batch_size, c.train.grad_accum_steps)
    except sharding.MeshError as e:
        cli.fail(str(e), cli.program())
    vocab = c.tokenizer.vocab_size
    program = setup_lib.build(c, vocab, mesh)
    counts = program.counts
    print(f"{c.objective}, {program.num_params / 1e6:.1f}M parameters, vocab {vocab}, "
          f"L={c.data.seq_len}, batch {c.train.batch_size} (accumulation "
          f"{c.train.grad_accum_steps}), compute {c.model.dtype}, "
          f"scan_layers={c.model.scan_layers}")
    where = (f"{FLAGS.topology} x {FLAGS.num_slices} slices ({devices[0].device_kind})"
             if FLAGS.topology else "host devices")
    print(f"mesh {dict(mesh.shape)} = {mesh.size} devices on {where}; encoder length "
          f"{counts.n_enc}, {counts.k} predicted per sequence")
    params = per_device_bytes(program.state.abstract.params)
    opt = per_device_bytes(program.state.abstract.opt_state)
    print(f"  parameters (float32)      {gib(params)} per device")
    print(f"  optimiser state           {gib(opt)} per device")
    if FLAGS.no_compile:
        return
    chip = topology.chip_facts(devices[0].device_kind) if FLAGS.topology else None
    if chip:
        print(f"  HBM per device            {gib(chip.hbm_bytes)}")
    dp = sharding.data_parallel_size(mesh)
    configured_accum = c.train.grad_accum_steps
    for policy in policies:
        c.model.remat_policy = policy
        accum = configured_accum
        while True:
            c.train.grad_accum_steps = accum
            micro = c.train.batch_size // accum // dp
            figures, needed = compiled_bytes(c, vocab, mesh)
            shown = policy if policy != "auto" else (
                f"auto ({setup_lib.encoder_config(c, vocab).stack.remat_policy})")
            head = f"  remat_policy={shown}, {micro} sequences per device per micro-batch:"
            if figures is None:
                print(f"{head} does not fit: the TPU compiler needs {gib(needed).strip()} "
                      "of temporaries")
            elif FLAGS.topology:
                print(f"{head} fits: peak {gib(figures['total']).strip()} per device "
                      f"(state {gib(figures['arguments']).strip()}, activations and "
                      f"temporaries {gib(figures['temporaries']).strip()}, program "
                      f"{gib(figures['program']).strip()})")
            else:
                print(f"  remat_policy={shown}:")
                print(f"    activations + temporaries {gib(figures['temporaries'])} per device "
                      "(compiled step)")
                print(f"    total                     {gib(params + opt + figures['temporaries'])} "
                      f"per device (arguments {gib(figures['arguments'])}, outputs aliased "
                      "with them)")
            halved = c.train.batch_size // (2 * accum)  # the next micro-batch, over all devices
            if (not FLAGS.fit or figures is not None or c.train.batch_size % (2 * accum)
                    or halved % dp or halved < dp):
                break
            accum *= 2
        if FLAGS.fit and figures is not None and accum != configured_accum:
            print(f"    -> --config.train.grad_accum_steps={accum}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.tool_flags_parser)
