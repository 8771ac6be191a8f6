"""No module of maelm_jax imports a module that imports it, directly or through others,
and no package (a subpackage taken whole, or a top-level module) imports one that imports
it: each mode's entry point is picked by main.py, so no module needs its caller. Each layer
imports only the layers below it, config files import no model code, and the library
imports nothing of the benchmarks built on it."""

import ast
import pathlib
import subprocess
import sys

import pytest

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env

pytestmark = pytest.mark.tier("unit")


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports anywhere in its source (at the top or
    inside a function: a lazy import is still a dependency). `from a.b import c` counts
    as importing a.b.c when that is a module, else a.b."""
    paths = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` steps up
                    parent = package_parts[: len(package_parts) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    imported.add(name if name in paths else base)
        graph[module] = {name for name in imported if name in paths and name != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list [a, b, ..., a] of modules each importing the next, or None (depth-first)."""
    done, path = set(), []

    def visit(module):
        path.append(module)
        for dependency in sorted(graph[module]):
            if dependency in path:
                return path[path.index(dependency):] + [dependency]
            if dependency not in done:
                cycle = visit(dependency)
                if cycle:
                    return cycle
        done.add(path.pop())
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_no_module_imports_one_that_imports_it():
    graph = import_graph(REPO_ROOT, "maelm_jax")
    assert "maelm_jax.finetune.train" in graph["maelm_jax.finetune.sweep"]  # the graph is real
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_finds_a_lazy_relative_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a  # lazy\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    # A name that is not a module is imported from its package.
    (pkg / "sub" / "b.py").write_text("from . import VALUE\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.b"] == {"pkg.sub"} and find_cycle(graph) is None


def package_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The module graph with each subpackage of `package` taken as one node (its modules'
    imports together); top-level modules stay nodes of their own."""
    def node(module: str) -> str:
        parts = module.split(".")
        child = ".".join(parts[:2])
        return child if any(m.startswith(child + ".") for m in graph) else module

    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        out.setdefault(node(module), set()).update(node(d) for d in deps)
    return {n: deps - {n} for n, deps in out.items()}


def test_no_package_imports_one_that_imports_it():
    graph = package_graph(import_graph(REPO_ROOT, "maelm_jax"), "maelm_jax")
    assert "maelm_jax.runs" in graph["maelm_jax.finetune"]  # packages are nodes
    cycle = find_cycle(graph)
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


def test_the_package_check_finds_a_cycle_between_packages(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from pkg import top\n")
    (pkg / "sub" / "b.py").write_text("")
    (pkg / "top.py").write_text("from pkg.sub import b\n")
    modules = import_graph(tmp_path, "pkg")
    assert find_cycle(modules) is None  # no module cycle...
    packages = package_graph(modules, "pkg")
    assert find_cycle(packages) in (["pkg.sub", "pkg.top", "pkg.sub"],
                                    ["pkg.top", "pkg.sub", "pkg.top"])  # ...but packages


# The layers, lowest first: a module may import its own layer's and lower ones', never a
# higher one's. The root holds folders by layer: the infrastructure (infra/) under the
# text (tokenizer, masking), the config language (plain data: schema, the models' named
# choices, the shared sections, variants) and the workdir's layout; the models on them.
# The engine both trainers share (training/) knows no mode's config; the models a run may
# start from (sources/: our checkpoints, Hugging Face directories) are read on it.
# Pretraining's objectives sit on the models and under the config that names them (and
# merges their fields); pretraining's run, program and steps above its config (setup.py
# counts a config's FLOPs for MFU: the config itself is plain data), beside reading its
# runs back (runs.py). Fine-tuning and the other applications (analysis, fill-mask, the
# study, the export) sit on both; main.py, outside the package, calls them.
LAYERS = (
    ("maelm_jax.infra",),
    ("maelm_jax.text", "maelm_jax.config", "maelm_jax.workdirs"),
    ("maelm_jax.models",),
    ("maelm_jax.data",),
    ("maelm_jax.training",),
    ("maelm_jax.sources",),
    ("maelm_jax.pretrain.objectives", "maelm_jax.pretrain.flops"),
    ("maelm_jax.pretrain.config",),
    ("maelm_jax.pretrain", "maelm_jax.runs"),
    ("maelm_jax.finetune", "maelm_jax.analysis", "maelm_jax.fill_mask", "maelm_jax.study",
     "maelm_jax.run_configs", "maelm_jax.export"),
)


def _layer(module: str) -> int | None:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None  # the shared utilities below them all (paths, schema, tokenizer, ...)


def _level(module: str) -> int:
    level = _layer(module)
    return -1 if level is None else level


def test_no_module_imports_from_a_higher_layer():
    graph = import_graph(REPO_ROOT, "maelm_jax")
    upward = sorted((module, dependency) for module, deps in graph.items()
                    for dependency in deps if _level(module) < _level(dependency))
    assert not upward, f"imports from a higher layer: {upward}"
    # The check is real: fine-tuning imports pretraining (its runs read back), pretraining's
    # steps its objectives, fine-tuning's program the shared engine, an objective the models.
    assert any(_level(d) == 8 for d in graph["maelm_jax.finetune.encoder"])
    assert any(_level(d) == 6 for d in graph["maelm_jax.pretrain.steps"])
    assert any(_level(d) == 4 for d in graph["maelm_jax.finetune.setup"])
    assert any(_level(d) == 2 for d in graph["maelm_jax.pretrain.objectives.maelm"])
    assert any(_level(d) == 0 for d in graph["maelm_jax.text.tokenizer"])


def test_every_module_is_in_a_named_layer():
    """The package root holds folders by layer (and the two modules that read runs back,
    above the trainers): no module sits outside the layers this test names."""
    graph = import_graph(REPO_ROOT, "maelm_jax")
    assert "maelm_jax.infra.paths" in graph
    assert sorted(m for m in graph if m != "maelm_jax" and _layer(m) is None) == []


def test_the_library_imports_no_benchmark():
    """maelm_jax is what the benchmarks measure and record with (maelm_jax/infra/records.py):
    none of its modules imports benchmarks/, lazily or not."""
    offenders = []
    for path in sorted((REPO_ROOT / "maelm_jax").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(REPO_ROOT)}: {name}" for name in names
                          if name == "benchmarks" or name.startswith("benchmarks.")]
    assert offenders == []
    graph = import_graph(REPO_ROOT, "maelm_jax")
    assert "maelm_jax.infra.records" in graph["maelm_jax.study.run"]  # the study records alike


def test_the_benchmarks_import_each_other_without_a_cycle():
    graph = import_graph(REPO_ROOT, "benchmarks")
    assert "benchmarks.harness" in graph["benchmarks.step_time"]  # the graph is real
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# What a config file may not import: model code, Flax, the Pallas kernel. Config files are
# plain data (maelm_jax/pretrain/config.py, finetune/config.py with every task kind's config
# side, ...), read before anything is built and by tools that never build a model.
HEAVY = ("flax", "maelm_jax.models.", "maelm_jax.training", "maelm_jax.pretrain.setup",
         "maelm_jax.pretrain.steps", "maelm_jax.pretrain.train", "jax.experimental.pallas")
LIGHT_MODULES: set[str] = set()  # exceptions under a heavy prefix (none now)


def test_config_files_import_no_model_code():
    files = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "configs").rglob("*.py")
                   if p.name != "__init__.py")
    assert {"configs/pretrain/base.py", "configs/study/mini.py", "configs/finetune/glue.py",
            "configs/finetune/squad.py", "configs/export.py", "configs/fill_mask.py",
            "configs/analysis/rank.py"} <= set(files)
    script = "\n".join([
        "import importlib.util, sys",
        "import maelm_jax.pretrain.config, maelm_jax.pretrain.objectives",
        "import maelm_jax.pretrain.objectives.recipes",
        *(f"spec = importlib.util.spec_from_file_location('c{i}', {f!r})\n"
          "spec.loader.exec_module(importlib.util.module_from_spec(spec))"
          for i, f in enumerate(files)),
        f"heavy = sorted(m for m in sys.modules if m.startswith({HEAVY!r}) "
        f"and m not in {LIGHT_MODULES!r})",
        "print(heavy)",
    ])
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT,
                            env=subprocess_env(), capture_output=True, text=True, check=False,
                            timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", result.stdout
