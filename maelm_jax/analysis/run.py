"""The effective-rank analysis, top to bottom: `analyse(config, workdir)`.

config -> for each run in config.runs: its encoder and tokenizer (the loader fine-tuning
uses) -> held-out sequences, masked and not (inputs.py) -> Gram matrices of every layer
summed on the mesh (rank.py) -> rank_tau per layer on the host -> rank.json, rank.md and
the plots in workdir (report.py). Nothing is written into the analysed runs' workdirs.
"""

from __future__ import annotations

import hashlib
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from maelm_jax import run_configs, runs
from maelm_jax.analysis import bootstrap, inputs, measures, rank, report
from maelm_jax.analysis import config as rank_config
from maelm_jax.infra import distributed, errors, paths, sharding
from maelm_jax.models import builder
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.training import state as state_lib
from maelm_jax.workdirs import guard as workdir_lib
from maelm_jax.workdirs import layout


def _as_runs_error(error: errors.UserError) -> rank_config.RankConfigError:
    """The loader names its own field (config.init_from); here the path came from runs."""
    return rank_config.RankConfigError(str(error).replace("config.init_from", "config.runs", 1))


def _resolve(path: str) -> tuple[paths.Path, paths.Path]:
    try:
        return runs.resolve_checkpoint(path)
    except errors.UserError as e:
        raise _as_runs_error(e) from None


def _labels(run_paths: list[str]) -> list[str]:
    """Short names for tables and legends: the workdir's name (with @<step> for a
    checkpoint), made unique by its parent when two runs share it."""
    def name(path: paths.Path, parents: int) -> str:
        if path.parent.name == layout.CHECKPOINTS:
            return f"{name(path.parent.parent, parents)}@{path.name}"
        return "/".join(path.parts[-1 - parents:])

    for parents in range(8):
        labels = [name(paths.Path(p), parents) for p in run_paths]
        if len(set(labels)) == len(labels):
            return labels
    return list(run_paths)


def _source_description(source: ml_collections.ConfigDict) -> str:
    kind = source.kind
    if kind == "validation":
        return "each run's own held-out data (validation blocks; a fine-tuning run's dev set)"
    fields = ", ".join(f"{k}={source[k]}" for k in sorted(source.keys()) if k != "kind")
    return f"{kind} ({fields})" if fields else kind


def gram_sums(encoder_cfg: encoder_lib.EncoderConfig, params, batches: list[dict], mesh,
              rules: tuple = sharding.DEFAULT_RULES,
              groups: int = 1) -> dict[str, dict[str, np.ndarray]]:
    """Every statistic's moments (rank.moments) over `batches` (inputs.py), summed on the
    mesh per group of consecutive batches (bootstrap.group_of): "gram" [G, layers + 1, d,
    d], "sum" [G, layers + 1, d], "count" [G], G = min(groups, batches). The encoder's
    parameters are sharded by their logical axes, each batch split over data x fsdp, the
    sums replicated (and donated from step to step); a group's sums go to the host when it
    ends, so memory holds G groups whatever the number of tokens. One compilation: every
    batch has the same shape."""
    param_shardings = state_lib.build(runs.encoder_init(encoder_cfg), mesh, rules).shardings
    replicated = sharding.replicated(mesh)
    step = jax.jit(rank.make_gram_step(encoder_cfg),
                   in_shardings=(param_shardings, replicated, sharding.batch_sharding(mesh)),
                   out_shardings=replicated, donate_argnums=1)
    params = jax.device_put(params, param_shardings)
    stack = encoder_cfg.stack
    done, grams = [], None
    with sharding.activate(mesh, rules):
        for i, batch in enumerate(batches):
            group = bootstrap.group_of(i, len(batches), groups)
            if i == 0 or group != bootstrap.group_of(i - 1, len(batches), groups):
                if grams is not None:
                    done.append(jax.tree.map(np.asarray, jax.device_get(grams)))
                grams = jax.device_put(rank.zero_grams(stack.num_layers, stack.d_model),
                                       replicated)  # fresh: each step donates them
            grams = step(params, grams, {k: sharding.global_batch_from_full(v, mesh)
                                         for k, v in batch.items()})
    done.append(jax.tree.map(np.asarray, jax.device_get(grams)))
    return jax.tree.map(lambda *parts: np.stack(parts), *done)


def _inputs_digest(batches: list[dict]) -> str:
    """The SHA-256 of the analysed tokens and their masking: runs with equal digests were
    read on the same sequences, so their bootstrap replicates pair."""
    digest = hashlib.sha256()
    for batch in batches:
        for name in ("masked", "counted"):
            digest.update(np.ascontiguousarray(batch[name]).tobytes())
    return digest.hexdigest()


def _analyse_run(config: ml_collections.ConfigDict, path: str, label: str, mesh,
                 rules) -> dict:
    run_workdir, step_dir = _resolve(path)
    try:
        pretrained = runs.load_pretrained(path, builder.Run(dtype=config.dtype))
    except errors.UserError as e:
        raise _as_runs_error(e) from None
    run_cfg = run_configs.recorded_config(run_workdir)
    enc = pretrained.encoder_cfg
    d, num_layers = enc.stack.d_model, enc.stack.num_layers
    seq_len = config.seq_len or runs.default_seq_len(run_cfg, enc.max_positions)
    if seq_len > enc.max_positions:
        raise rank_config.RankConfigError(
            f"config.seq_len: {seq_len} is longer than the {enc.max_positions} positions of "
            f"{path}")
    num_tokens = config.num_tokens or rank_config.DEFAULT_TOKENS_PER_DIM * d
    rows = inputs.sequences(config, run_workdir, run_cfg, pretrained.tokenizer, seq_len,
                            num_tokens)
    batches, n, n_mask = inputs.make_batches(rows, seq_len, config.batch_size, num_tokens,
                                             config.mask_ratio, config.seed,
                                             special=pretrained.tokenizer.special)
    if n == 0:
        raise rank_config.RankConfigError(f"config.source: no text to read for {path}")
    if n < num_tokens:
        logging.warning("%s: the source holds %d tokens, fewer than the %d asked for", label,
                        n, num_tokens)
    if n < 10 * d:
        logging.warning("%s: n = %d tokens is not many times d = %d; rank_tau is bounded by "
                        "n and noisy (the paper has n ~ 6500 d)", label, n, d)
    logging.info("%s: %s, d=%d, %d layers; %d tokens (%d [MASK]) in %d batches of %dx%d",
                 label, pretrained.description, d, num_layers, n, n_mask, len(batches),
                 config.batch_size, seq_len)

    start = time.perf_counter()
    grouped = gram_sums(enc, pretrained.params, batches, mesh, rules, config.bootstrap_groups)
    found = measures.run_measures(grouped, config.tau, config.center,
                                  config.bootstrap_replicates, config.seed)
    stats = found["statistics"]
    ranks = {name: stats["uncentred"][name]["rank"] for name in rank.STATS}
    last = {name: stats["uncentred"][name]["continuous"][-1] for name in rank.STATS}
    logging.info("%s: continuous rank_%g of the last layer %.1f without [MASK], %.1f with, "
                 "%.1f of the [MASK] rows (%.1fs)", label, config.tau, last["without_mask"],
                 last["with_mask"], last["mask_only"], time.perf_counter() - start)
    centred = {}
    if config.center:
        centred = {name: stats["centred"][name]["rank"] for name in rank.STATS}
        centred["last_layer"] = {name: values[-1] for name, values in centred.items()}
    kind = "fine-tuning" if run_cfg.get("mode") == "finetune" else "pretraining"
    return {
        "label": label,
        "path": str(path),
        "checkpoint": str(step_dir),
        "kind": kind,
        "objective": run_cfg.get("objective", "") if kind == "pretraining" else "",
        "task": run_cfg.get("task", "") if kind == "fine-tuning" else "",
        "d_model": d,
        "num_layers": num_layers,
        "seq_len": seq_len,
        "tokens": n,
        "mask_tokens": n_mask,
        "layers": list(range(num_layers + 1)),
        **ranks,
        "last_layer": {name: values[-1] for name, values in ranks.items()},
        **({"centred": centred} if centred else {}),
        "inputs_sha256": _inputs_digest(batches),
        **found,
    }


def analyse(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs the analysis config.runs asks for; writes the outputs into workdir and returns
    the report (what rank.json holds)."""
    rank_config.validate(config)
    config = rank_config.resolve_paths(config)
    out_dir = paths.resolve(workdir, "--workdir")
    workdir_lib.claim(out_dir, "rank", "analyse")
    # Fixed sizes: the first devices.
    mesh = sharding.fixed_mesh(config.mesh.shape, config.mesh.dcn_shape)
    rules = sharding.rules_from_config(config.sharding_rules)
    dp = sharding.data_parallel_size(mesh)
    if config.batch_size % dp:
        raise rank_config.RankConfigError(
            f"config.batch_size: {config.batch_size} sequences do not split over the "
            f"data-parallel size {dp} (mesh data x fsdp)")
    run_paths = rank_config.runs(config)
    for path in run_paths:  # every run is checked before the first one is analysed
        _resolve(path)
    results = [_analyse_run(config, path, label, mesh, rules)
               for path, label in zip(run_paths, _labels(run_paths), strict=False)]
    out = {
        "tau": config.tau,
        "center": config.center,
        "mask_ratio": config.mask_ratio,
        "seed": config.seed,
        "bootstrap": {"groups": config.bootstrap_groups,
                      "replicates": config.bootstrap_replicates, "level": bootstrap.LEVEL},
        "source": config.source.to_dict(),
        "source_description": _source_description(config.source),
        "runs": results,
        "differences": measures.differences(results),
    }
    if distributed.is_leader():
        written = report.write(out_dir, out)
        logging.info("wrote %s", ", ".join(str(p) for p in written))
    return out
