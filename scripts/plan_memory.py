"""Memory per device of a pretraining config on a mesh, before booking the hardware.

    python scripts/plan_memory.py --config=configs/pretrain/base.py --mesh=16,1,1 \
        --batch_size=2048 --grad_accum_steps=4 [--remat_policies=all --scan_layers]

With --remat_policies (a comma-separated list of model.remat_policy values, or "all") the
step is compiled once per policy and the activations column shows what each saves.

Parameters and optimiser state come from `jax.eval_shape` and the sharding rules (exact);
activations and temporaries come from XLA's memory analysis of the compiled train step.
On a CPU-only machine the mesh is simulated with as many host devices as it needs, so the
temporaries are the CPU compiler's estimate: accelerator compilers fuse and rematerialise
differently, so treat that column as a guide (typically within a small factor), and the
parameter and optimiser columns as exact.
"""

import argparse
import math
import os
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/pretrain/base.py",
                   help="config file, optionally with :variant (e.g. base.py:mlm)")
    p.add_argument("--mesh", default="8,1,1", help="data,fsdp,tensor sizes")
    p.add_argument("--batch_size", type=int, default=None, help="global batch (default: config)")
    p.add_argument("--grad_accum_steps", type=int, default=None)
    p.add_argument("--seq_len", type=int, default=None)
    p.add_argument("--dtype", default=None, help="compute dtype, e.g. bfloat16")
    p.add_argument("--remat_policies", default=None,
                   help="comma-separated model.remat_policy values to compare, or 'all' "
                        "(default: the config's)")
    p.add_argument("--scan_layers", action="store_true", help="set model.scan_layers")
    p.add_argument("--no_compile", action="store_true",
                   help="only parameters and optimiser state (no XLA compilation)")
    return p.parse_args(argv)


def gib(n: float) -> str:
    return f"{n / 2**30:8.2f} GiB"


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


def main(argv):
    args = parse_args(argv)
    mesh_shape = tuple(int(x) for x in args.mesh.split(","))
    devices = math.prod(s for s in mesh_shape if s > 0)
    # Simulated devices must be requested before JAX initialises its CPU backend.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={devices}")
    import importlib.util

    import jax
    import numpy as np

    from maelm_jax import config as config_lib
    from maelm_jax import sharding
    from maelm_jax.models import layers
    from maelm_jax.models import pretrain as pretrain_lib
    from maelm_jax.training import optimizer, steps

    path, _, variant = args.config.partition(":")
    spec = importlib.util.spec_from_file_location("plan_config", REPO_ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(variant or None)
    if args.batch_size:
        c.train.batch_size = args.batch_size
    if args.grad_accum_steps:
        c.train.grad_accum_steps = args.grad_accum_steps
    if args.seq_len:
        c.data.seq_len = args.seq_len
    if args.dtype:
        c.model.dtype = args.dtype
    if args.scan_layers:
        c.model.scan_layers = True
    c.mesh.shape = mesh_shape
    config_lib.validate(c)
    if args.remat_policies == "all":
        policies = list(layers.REMAT_POLICIES)
    elif args.remat_policies:
        policies = [x.strip() for x in args.remat_policies.split(",") if x.strip()]
        unknown = sorted(set(policies) - set(layers.REMAT_POLICIES))
        if unknown:
            sys.exit(f"plan_memory.py: --remat_policies: unknown {', '.join(unknown)}; "
                     f"expected 'all' or some of {', '.join(layers.REMAT_POLICIES)}")
    else:
        policies = [c.model.remat_policy]

    mesh = sharding.make_mesh(c.mesh.shape, jax.devices()[:devices])
    sharding.check_batch(mesh, c.train.batch_size, c.train.grad_accum_steps)
    rules = sharding.rules_from_config(c.sharding_rules)
    counts = config_lib.mask_counts(c)
    vocab = c.tokenizer.vocab_size
    model = pretrain_lib.PretrainModel(config_lib.model_config(c, vocab))
    tx, schedule = optimizer.make_optimizer(c.train)
    setup = steps.state_setup(model, tx, c.seed, counts, mesh, rules)
    n_params = sum(x.size for x in jax.tree.leaves(setup.abstract.params))

    print(f"{args.config}: {c.objective}, {n_params / 1e6:.1f}M parameters, vocab {vocab}, "
          f"L={c.data.seq_len}, batch {c.train.batch_size} (accumulation "
          f"{c.train.grad_accum_steps}), compute {c.model.dtype}, "
          f"scan_layers={c.model.scan_layers}")
    print(f"mesh {dict(mesh.shape)} = {mesh.size} devices; encoder length {counts.n_enc}, "
          f"{counts.k} predicted per sequence")
    params = per_device_bytes(setup.abstract.params)
    opt = per_device_bytes(setup.abstract.opt_state)
    print(f"  parameters (float32)      {gib(params)} per device")
    print(f"  optimiser state           {gib(opt)} per device")
    if args.no_compile:
        return
    batch = jax.ShapeDtypeStruct((c.train.batch_size, c.data.seq_len), np.int32,
                                 sharding=sharding.batch_sharding(mesh))
    for policy in policies:
        c.model.remat_policy = policy
        model = pretrain_lib.PretrainModel(config_lib.model_config(c, vocab))
        train_step = steps.jit_train_step(
            steps.make_train_step(model, tx, schedule, counts, vocab, c.train.grad_accum_steps),
            setup,
            mesh,
        )
        with sharding.activate(mesh, rules):
            compiled = train_step.lower(setup.abstract, batch).compile()
        mem = compiled.memory_analysis()
        temp = mem.temp_size_in_bytes
        print(f"  remat_policy={policy}:")
        print(f"    activations + temporaries {gib(temp)} per device (compiled step)")
        print(f"    total                     {gib(params + opt + temp)} per device "
              f"(arguments {gib(mem.argument_size_in_bytes)}, outputs aliased with them)")


if __name__ == "__main__":
    main(sys.argv[1:])
