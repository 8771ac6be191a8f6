"""Hyperparameter sweeps as the papers report them: every setting of the grid is run with
every seed, then the seeds are aggregated by one of two rules (`grid.aggregate`):

* "median_then_best" (MAE-LM, Appendix D: "the medians of downstream task fine-tuning
  results under the same set of five different random seeds"): each setting's median
  over its seeds; the figure is the best setting's median.
* "best_then_median" (3ML, Appendix B: "select the best values from each running and
  finally choose the median of these five values"): each seed's best score over the
  settings; the figure is the median of those bests. It is never below the first rule's.

Runs go to ``<workdir>/runs/<setting>/seed_<s>/`` (each a complete fine-tuning workdir);
a run whose results.json and config.json match is reused (inputs.FINE_TUNING's
harmless fields aside) and an unfinished one continues
from its last resume checkpoint (train.py), so an interrupted sweep resumes. With
``grid.seeds_per_program`` = K > 1 the seeds of a setting train K at a time as one program
(seed_group.py; the group's own workdir is ``runs/<setting>/seeds_<a>_<b>.../``), each
still writing its own config.json and results.json to ``seed_<s>/``. The summary
is ``<workdir>/sweep.json`` and the table ``<workdir>/sweep.md``.

`run_models` runs the sweeps of several models on one task (the study's: one setting each,
the same seeds) with every model's runs of a seed group in one program (seed_group.py):
each run starts from its own model's encoder at its own learning rate, runs of a seed draw
the same batches and dropout, and each model's sweep is then summarised as `run_sweep`
summarises it, from its finished runs.

`run_sweep` is main.py's entry when ``config.sweep`` is set; `train.run` is the single run.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import ml_collections
import numpy as np
from absl import logging

from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import encoder, inputs, seed_group, train
from maelm_jax.infra import distributed, markdown, paths
from maelm_jax.training import lifecycle
from maelm_jax.workdirs import guard as workdir_lib
from maelm_jax.workdirs import layout

GRID_FIELDS = ("learning_rate", "batch_size", "num_epochs", "warmup_ratio")
_SHORT = {"learning_rate": "lr", "batch_size": "bs", "num_epochs": "ep", "warmup_ratio": "wu"}


def settings(config: ml_collections.ConfigDict) -> list[dict]:
    """Every combination of the grid's values, in a fixed order."""
    values = [tuple(config.grid[f]) for f in GRID_FIELDS]
    return [dict(zip(GRID_FIELDS, combo, strict=False)) for combo in itertools.product(*values)]


def setting_name(setting: dict) -> str:
    return "_".join(f"{_SHORT[k]}{setting[k]:g}" for k in GRID_FIELDS)


def run_config(config: ml_collections.ConfigDict, setting: dict,
               seed: int) -> ml_collections.ConfigDict:
    """The single run of one setting and seed (no checkpoint, no test predictions)."""
    c = config.copy_and_resolve_references()
    c.sweep = False
    c.seed = seed
    for name, value in setting.items():
        c.train[name] = type(c.train[name])(value)
    c.save_checkpoint = False
    c.predict_test = False
    return c


def _finished(run_dir: paths.Path, c: ml_collections.ConfigDict) -> dict | None:
    """The earlier results of this run, if any: finished with this config but for
    fine-tuning's harmless fields (inputs.FINE_TUNING). A run recorded before a config
    field existed counts as run with that field at its default."""
    results, saved = run_dir / layout.RESULTS_FILE, run_dir / layout.CONFIG_FILE
    if not (results.is_file() and saved.is_file()):
        return None
    if lifecycle.changes(inputs.FINE_TUNING, c, json.loads(paths.read_text(saved))):
        return None
    return json.loads(paths.read_text(results))


def _run_group(config: ml_collections.ConfigDict, setting: dict, seeds: tuple[int, ...],
               setting_dir: paths.Path, allow_config_change: bool) -> list[dict]:
    """The results of `setting` with each of `seeds`, in order: reused where every one is
    finished; else run, alone (one seed) or as one program (seed_group.py)."""
    configs = [run_config(config, setting, seed) for seed in seeds]
    run_dirs = [setting_dir / f"seed_{seed}" for seed in seeds]
    finished = [distributed.leader_says_ok(_finished(d, c) is not None)
                for d, c in zip(run_dirs, configs, strict=True)]
    if all(finished):
        for run_dir in run_dirs:
            logging.info("sweep: reusing %s", run_dir)
        return [json.loads(paths.read_text(d / layout.RESULTS_FILE)) for d in run_dirs]
    if len(seeds) == 1:
        return [train.run(configs[0], str(run_dirs[0]), allow_config_change)]
    # A group's runs depend on one another (seed_group.py): all of them run again.
    return seed_group.run(configs[0], seeds, str(setting_dir / seed_group.group_name(seeds)),
                          [str(d) for d in run_dirs], allow_config_change)


def _architecture(config: ml_collections.ConfigDict) -> str:
    """What decides whether runs can share a program: the encoder's config (its
    architecture, dtype, dropout and kernel), read without its weights."""
    return repr(encoder.encoder_and_tokenizer(config, weights=False)[0])


def run_models(sweeps: dict[str, ml_collections.ConfigDict], workdirs: dict[str, str],
               group_root: str, allow_config_change: bool = False,
               measure: seed_group.Measure | None = None) -> dict[str, dict]:
    """Each model's sweep (`sweeps[name]`, one setting; `workdirs[name]`, as run_sweep's
    workdir) with the runs of every model whose encoder shares an architecture trained
    together: one program per seed group (grid.seeds_per_program of the first sweep) in
    <group_root>/<models>/seeds_<a>_<b>..., each run keyed "<name>/seed_<s>". Finished
    runs are reused; a group with an unfinished run runs again whole (its runs depend on
    one another). `measure`: what each group measures of its runs' encoders at its end
    (seed_group.run_members). Returns each model's run_sweep summary."""
    names = list(sweeps)
    prepared = {n: finetune_config.validated(sweeps[n], workdirs[n]) for n in names}
    plans = {}
    for n, (c, workdir) in prepared.items():
        grid = settings(c)
        if len(grid) != 1:
            raise finetune_config.FinetuneConfigError(
                f"config.grid: the sweep of {n} has {len(grid)} settings; models are trained "
                f"together with one setting each")
        plans[n] = (c, grid[0], workdir / layout.SWEEP_RUNS_DIR / setting_name(grid[0]))
    seeds = [tuple(plans[n][0].grid.seeds) for n in names]
    if len(set(seeds)) != 1:
        raise finetune_config.FinetuneConfigError(
            f"config.grid.seeds: the models' sweeps train with other seeds ({seeds}); models "
            f"are trained together with the same ones")
    size = plans[names[0]][0].grid.seeds_per_program
    chunks = [seeds[0][i:i + size] for i in range(0, len(seeds[0]), size)]
    kinds: dict[str, list[str]] = {}
    for n in names:
        kinds.setdefault(_architecture(plans[n][0]), []).append(n)
    root = paths.resolve(group_root, "group directory")
    for together in kinds.values():
        for chunk in chunks:
            members = [seed_group.Member(f"{n}/seed_{s}", run_config(plans[n][0], plans[n][1], s),
                                         str(plans[n][2] / f"seed_{s}"))
                       for n in together for s in chunk]
            finished = [distributed.leader_says_ok(
                _finished(paths.Path(m.workdir), m.config) is not None) for m in members]
            if all(finished):
                continue
            if len(members) == 1:
                train.run(members[0].config, members[0].workdir, allow_config_change)
                continue
            seed_group.run_members(
                members, str(root / "_".join(together) / seed_group.group_name(chunk)),
                allow_config_change, measure)
    return {n: run_sweep(sweeps[n], workdirs[n], allow_config_change) for n in names}


def _median(values: list[float]) -> float:
    return float(np.median(values))


def run_sweep(config: ml_collections.ConfigDict, workdir: str,
              allow_config_change: bool = False) -> dict:
    """Runs grid x seeds; returns the summary (also in sweep.json and sweep.md). A run of
    the grid recorded with a changed config is refused as a single run's would be
    (train.run), unless `allow_config_change` (then it runs again)."""
    config, workdir = finetune_config.validated(config, workdir)
    workdir_lib.check_directory(workdir)
    mode = layout.mode(workdir)
    if mode not in (None, "finetune"):
        raise finetune_config.FinetuneConfigError(
            f"--workdir {workdir} holds a {mode} run; sweep into another directory")
    # Several processes run the sweep as one job (each run is multi-process); process 0
    # alone writes its files, and decides which runs are finished. It writes once every
    # process has read the workdir's record above, so that all judged the same record.
    distributed.barrier("sweep workdir checked")
    if distributed.is_leader():
        paths.make_dirs(workdir)
        layout.write_config(workdir, config)
    distributed.barrier("sweep workdir")
    grid, seeds = settings(config), tuple(config.grid.seeds)
    logging.info("sweep: %d settings x %d seeds = %d runs", len(grid), len(seeds),
                 len(grid) * len(seeds))
    size = config.grid.seeds_per_program
    groups = [seeds[i:i + size] for i in range(0, len(seeds), size)]
    rows = []
    for setting in grid:
        name = setting_name(setting)
        per_seed = []
        for group in groups:
            per_seed += _run_group(config, setting, group, workdir / layout.SWEEP_RUNS_DIR / name,
                                  allow_config_change)
        primary = per_seed[0]["primary_metric"]
        metric_names = [k for k in per_seed[0]["dev"] if k not in ("step", "epoch")]
        rows.append({
            "setting": name,
            "hyperparameters": setting,
            "median": {k: _median([r["dev"][k] for r in per_seed]) for k in metric_names},
            "per_seed": {str(s): r["dev"][primary] for s, r in zip(seeds, per_seed, strict=False)},
            "wall_seconds": sum(r["wall_seconds"] for r in per_seed),
            # A seed group's runs: their encoders' ranks on the dev set (seed_group.py).
            **({"rank_per_seed": {str(s): r["rank"] for s, r in
                                  zip(seeds, per_seed, strict=False)}}
               if all("rank" in r for r in per_seed) else {}),
        })
    primary = per_seed[0]["primary_metric"]
    summary = {
        "task": per_seed[0]["task"],
        "primary_metric": primary,
        "select": config.train.select,
        "seeds": list(seeds),
        "aggregate": config.grid.aggregate,
        **aggregate(rows, [str(s) for s in seeds], primary, config.grid.aggregate),
        "settings": rows,
    }
    if distributed.is_leader():
        paths.write_text(workdir / layout.SWEEP_SUMMARY_FILE, json.dumps(summary, indent=2))
        paths.write_text(workdir / layout.SWEEP_TABLE_FILE, markdown_table(summary))
    logging.info("sweep: %s %s = %.2f (best setting %s)", config.grid.aggregate, primary,
                 summary["score"], summary["best_setting"])
    return summary


def aggregate(rows: list[dict], seeds: list[str], primary: str, rule: str) -> dict:
    """The sweep's figure by `rule` (finetune_config.AGGREGATES), from rows holding each
    setting's "median" metrics and "per_seed" primary scores. Returns "score" (the figure),
    "best_setting" and "best_median" (the setting with the best median, or under
    best_then_median the one most seeds chose, and its medians) and, for
    best_then_median, "best_per_seed": {seed: {"setting", "score"}}."""
    if rule == "median_then_best":
        best = max(rows, key=lambda r: r["median"][primary])
        return {"score": best["median"][primary], "best_setting": best["setting"],
                "best_median": best["median"]}
    if rule != "best_then_median":
        raise ValueError(f"unknown aggregation rule {rule!r}")
    per_seed = {}
    for seed in seeds:
        best = max(rows, key=lambda r: r["per_seed"][seed])
        per_seed[seed] = {"setting": best["setting"], "score": best["per_seed"][seed]}
    chosen = [per_seed[s]["setting"] for s in seeds]
    # Ties go to the first setting in grid order.
    mode = max((r for r in rows if r["setting"] in chosen),
               key=lambda r: chosen.count(r["setting"]))
    return {"score": _median([p["score"] for p in per_seed.values()]),
            "best_setting": mode["setting"], "best_median": mode["median"],
            "best_per_seed": per_seed}


def _shown_metrics(summary: dict) -> list[str]:
    names = list(summary["settings"][0]["median"])
    # SQuAD's per-subset and threshold entries stay in sweep.json.
    shown = [k for k in names if not k.startswith(("HasAns", "NoAns")) and "thresh" not in k]
    primary = summary["primary_metric"]
    return [primary] + [k for k in shown if k != primary]


def markdown_table(summary: dict) -> str:
    """One row per setting: hyperparameters, medians over seeds, each seed's score."""
    metrics = _shown_metrics(summary)
    seeds = [str(s) for s in summary["seeds"]]
    primary = summary["primary_metric"]
    header = (["setting", "lr", "batch", "epochs", "warmup"]
              + [f"median {m}" for m in metrics] + [f"seed {s}" for s in seeds])
    if summary["aggregate"] == "best_then_median":
        rule = (f"the median over {len(seeds)} seeds of each seed's best setting (3ML): "
                f"**{summary['score']:.2f}**; per seed: " + ", ".join(
                    f"{s}: {p['setting']} {p['score']:.2f}"
                    for s, p in summary["best_per_seed"].items()))
    else:
        rule = (f"the best setting's median over {len(seeds)} seeds (MAE-LM): "
                f"**{summary['score']:.2f}**")
    lines = [
        f"# {summary['task']} sweep: {len(seeds)} seeds per setting",
        "",
        (f"Primary metric: {primary} (dev, {summary['select']} evaluation of each run). "
         f"Figure: {rule}. Best setting: **{summary['best_setting']}**."),
        "",
    ]
    rows = []
    for row in summary["settings"]:
        h = row["hyperparameters"]
        name = row["setting"]
        if name == summary["best_setting"]:
            name = f"**{name}**"
        cells: list[Any] = [name, f"{h['learning_rate']:g}", h["batch_size"], h["num_epochs"],
                            f"{h['warmup_ratio']:g}"]
        cells += [f"{row['median'][m]:.2f}" for m in metrics]
        cells += [f"{row['per_seed'][s]:.2f}" for s in seeds]
        rows.append(cells)
    return "\n".join(lines + markdown.table(header, rows)) + "\n"
