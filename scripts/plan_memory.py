"""Memory per device of a pretraining config on a mesh, before booking the hardware.

    python scripts/plan_memory.py --config=configs/pretrain/base.py \
        --config.mesh.shape='(16,1,1)' --config.train.batch_size=2048 \
        --config.train.grad_accum_steps=4 [--remat_policies=all] \
        [--config.model.scan_layers=true]

--config and its --config.<field>=<value> overrides are main.py's. With --remat_policies
(a comma-separated list of model.remat_policy values, or "all") the step is compiled
once per policy and the activations column shows what each saves.

Parameters and optimiser state come from `jax.eval_shape` and the sharding rules (exact);
activations and temporaries come from XLA's memory analysis of the compiled train step
(built by training.setup.build, as the training loop builds it). On a CPU-only machine
the mesh is simulated with as many host devices as it needs, so the temporaries are the
CPU compiler's estimate: accelerator compilers fuse and rematerialise differently, so
treat that column as a guide (typically within a small factor), and the parameter and
optimiser columns as exact.
"""

import math

import jax
from absl import app, flags

from maelm_jax import cli, sharding
from maelm_jax import config as config_lib
from maelm_jax.models import stack as stack_lib
from maelm_jax.training import setup as setup_lib

FLAGS = flags.FLAGS
cli.define_config("configs/pretrain/base.py", "Pretraining config file[:variant], as for "
                  "main.py.", prefix=cli.program())
flags.DEFINE_integer("devices", 0, "Devices to plan for when config.mesh.shape has a -1 "
                     "(default: the product of its sizes).")
flags.DEFINE_string("remat_policies", None, "Comma-separated model.remat_policy values to "
                    "compare, or 'all' (default: the config's).")
flags.DEFINE_bool("no_compile", False, "Only parameters and optimiser state (no XLA "
                  "compilation).")


def gib(n: float) -> str:
    return f"{n / 2**30:8.2f} GiB"


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


def main(argv):
    del argv  # cli.tool_flags_parser refuses stray arguments
    c = FLAGS.config
    try:
        config_lib.validate(c)
    except config_lib.ConfigError as e:
        cli.fail(str(e), cli.program())
    sizes = [int(s) for s in c.mesh.shape]
    devices = FLAGS.devices or math.prod(s for s in sizes if s > 0)
    if -1 in sizes and not FLAGS.devices:
        cli.fail("config.mesh.shape has a -1; give --devices=<the number of devices to plan "
                 "for>", cli.program())
    # Simulated host devices (only the CPU backend reads this): set before JAX's first use.
    jax.config.update("jax_num_cpu_devices", devices)
    if FLAGS.remat_policies == "all":
        policies = list(stack_lib.REMAT_POLICIES)
    elif FLAGS.remat_policies:
        policies = [x.strip() for x in FLAGS.remat_policies.split(",") if x.strip()]
        unknown = sorted(set(policies) - set(stack_lib.REMAT_POLICIES))
        if unknown:
            cli.fail(f"--remat_policies: unknown {', '.join(unknown)}; expected 'all' or "
                     f"some of {', '.join(stack_lib.REMAT_POLICIES)}", cli.program())
    else:
        policies = [c.model.remat_policy]
    if len(jax.devices()) < devices:
        cli.fail(f"{devices} devices needed, {len(jax.devices())} present", cli.program())

    mesh = sharding.make_mesh(sizes, jax.devices()[:devices])
    sharding.check_batch(mesh, c.train.batch_size, c.train.grad_accum_steps)
    vocab = c.tokenizer.vocab_size
    trainer = setup_lib.build(c, vocab, mesh)
    counts = trainer.counts
    print(f"{c.objective}, {trainer.num_params / 1e6:.1f}M parameters, vocab {vocab}, "
          f"L={c.data.seq_len}, batch {c.train.batch_size} (accumulation "
          f"{c.train.grad_accum_steps}), compute {c.model.dtype}, "
          f"scan_layers={c.model.scan_layers}")
    print(f"mesh {dict(mesh.shape)} = {mesh.size} devices; encoder length {counts.n_enc}, "
          f"{counts.k} predicted per sequence")
    params = per_device_bytes(trainer.state.abstract.params)
    opt = per_device_bytes(trainer.state.abstract.opt_state)
    print(f"  parameters (float32)      {gib(params)} per device")
    print(f"  optimiser state           {gib(opt)} per device")
    if FLAGS.no_compile:
        return
    for policy in policies:
        c.model.remat_policy = policy
        mem = setup_lib.build(c, vocab, mesh).compile_train_step().memory_analysis()
        temp = mem.temp_size_in_bytes
        print(f"  remat_policy={policy}:")
        print(f"    activations + temporaries {gib(temp)} per device (compiled step)")
        print(f"    total                     {gib(params + opt + temp)} per device "
              f"(arguments {gib(mem.argument_size_in_bytes)}, outputs aliased with them)")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.tool_flags_parser)
