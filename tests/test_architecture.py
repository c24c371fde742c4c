"""The package's shape: its import graph has no cycle and follows the layers, no module is
over 600 lines (every module under harts/, none excepted), only `harts.config.env` reads the
environment, and the suite's hypothesis strategies live in tests/strategies.py.

The graph is built from the source (every `import harts...` / `from harts... import ...`
of every module under harts/, those inside functions included), not from what a run
happens to import.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1] / "harts"
MAX_LINES = 600
ENV_MODULE = "harts.config.env"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


SOURCES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in SOURCES.items()}


def _resolve(name: str) -> str | None:
    """The harts module a dotted name refers to: itself, or the module it is an attribute of."""
    while name and name not in SOURCES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(harts modules `module` imports, top-level external packages it imports)."""
    internal: set[str] = set()
    external: set[str] = set()
    is_package = SOURCES[module].name == "__init__.py"
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "harts" or alias.name.startswith("harts."):
                    internal.add(_resolve(alias.name))
                else:
                    external.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "harts" or target.startswith("harts."):
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    internal.add(full if full in SOURCES else _resolve(target))
            else:
                external.add(target.split(".")[0])
    internal.discard(None)
    internal.discard(module)
    return internal, external


IMPORTS = {m: _imports(m) for m in SOURCES}


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(SOURCES)
    for m, (internal, _) in IMPORTS.items():
        g.add_edges_from((m, t) for t in internal)
    return g


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_sees_imports_inside_functions():
    # an op family's registry imports its GPU paths lazily, inside functions
    assert "harts.exec.ops.kda.fla" in IMPORTS["harts.exec.ops.kda.paths"][0]
    assert "torch" in IMPORTS["harts.exec.backend"][1]


def test_no_import_cycle():
    g = _graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, f"import cycles among: {cycles}"


@pytest.mark.parametrize("layer, forbidden", [
    ("tree", {"plan", "sim", "exec", "distributed", "models", "verify", "rl", "train", "cli"}),
    ("config", {"plan", "sim", "exec", "distributed", "models", "verify", "rl", "train", "cli"}),
    ("plan", {"exec", "distributed", "models", "verify", "rl", "train", "cli"}),
    ("sim", {"exec", "distributed", "models", "verify", "rl", "train", "cli"}),
    ("exec", {"distributed", "models", "verify", "rl", "train", "cli"}),
    ("distributed", {"verify", "rl", "train", "cli"}),
    # harts.models (checkpoints in and out) sits above exec, beside verify
    ("models", {"verify", "train", "cli"}),
    ("verify", {"models", "train", "cli"}),
    ("rl", {"verify", "experiments", "train", "cli"}),
    # harts.bench (the benchmarks behind `harts bench`) sits above exec and sim, beside verify
    ("bench", {"distributed", "models", "verify", "rl", "track", "experiments", "train", "cli"}),
    # harts.train (one way to train: a TrainConfig in one process or distributed) sits
    # above exec, distributed and models; the command line is its one user
    ("train", {"verify", "rl", "bench", "experiments", "cli"}),
    # harts.integrations (verl's engine, TRL's trainer) sits on exec, distributed (verl's
    # data-parallel engine shards with it), models and tree; its modules import their
    # framework, so nothing below imports them (next test)
    ("integrations", {"verify", "rl", "train", "bench", "experiments", "cli"}),
])
def test_layers_import_only_downwards(layer, forbidden):
    bad = sorted((m, t) for m, (internal, _) in IMPORTS.items() if _layer(m) == layer
                 for t in internal if _layer(t) in forbidden)
    assert not bad, f"harts.{layer} imports against the layer direction: {bad}"


def test_only_the_cli_and_the_experiments_import_the_benchmarks():
    assert "harts.bench.step" in IMPORTS["harts.cli.bench"][0]  # the scan sees the CLI's import
    bad = sorted((m, t) for m, (internal, _) in IMPORTS.items()
                 if _layer(m) not in ("bench", "cli", "experiments")
                 for t in internal if _layer(t) == "bench")
    assert not bad, f"harts.bench imported outside the CLI and the experiments: {bad}"


def test_nothing_imports_the_framework_integrations():
    assert "harts.integrations.hf" in IMPORTS["harts.integrations.trl"][0]  # the scan sees them
    bad = sorted((m, t) for m, (internal, _) in IMPORTS.items() if _layer(m) != "integrations"
                 for t in internal if _layer(t) == "integrations")
    assert not bad, f"harts.integrations imported from outside: {bad}"


@pytest.mark.parametrize("layer", ["exec", "distributed"])
def test_execution_never_imports_the_simulator(layer):
    # the step structure the executors need (schedules, stages, StepWork) lives in harts.plan
    bad = sorted((m, t) for m, (internal, _) in IMPORTS.items() if _layer(m) == layer
                 for t in internal if _layer(t) == "sim")
    assert not bad, f"harts.{layer} imports the simulator: {bad}"


@pytest.mark.parametrize("layer", ["tree", "config", "plan", "sim"])
def test_lower_layers_never_reach_torch(layer):
    # torch imported by the module itself or by any harts module it reaches
    g = _graph()
    bad = []
    for m in SOURCES:
        if _layer(m) != layer:
            continue
        for reached in {m} | nx.descendants(g, m):
            if "torch" in IMPORTS[reached][1]:
                bad.append((m, reached))
    assert not bad, f"harts.{layer} reaches torch: {sorted(bad)}"


# harts.rl's credit assignment and allocation are numpy only (the loop's modules use exec)
RL_NUMPY = ("harts.rl", "harts.rl.signatures", "harts.rl.rtmc", "harts.rl.trace", "harts.rl.trace_predictor")


@pytest.mark.parametrize("module", RL_NUMPY)
def test_rl_numpy_modules_never_reach_torch(module):
    g = _graph()
    bad = sorted(r for r in {module} | nx.descendants(g, module) if "torch" in IMPORTS[r][1])
    assert not bad, f"{module} reaches torch through {bad}"


def test_rl_numpy_modules_import_without_torch():
    import subprocess
    import sys

    code = ("import sys; import " + ", ".join(RL_NUMPY) +
            "; loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'));"
            " print(loaded); raise SystemExit(1 if loaded else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, timeout=120)
    assert run.returncode == 0, f"importing {RL_NUMPY} loaded torch: {run.stdout} {run.stderr}"


def test_no_module_over_600_lines():
    # a module a newcomer reads in one sitting; a longer one splits into cohesive modules
    assert len(SOURCES) > 100  # every module under harts/
    long = {m: n for m, p in SOURCES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _composites(tree: ast.AST) -> list[int]:
    """Lines of the functions decorated `@st.composite` / `@composite`."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            for d in node.decorator_list if getattr(d, "attr", getattr(d, "id", None)) == "composite"]


def test_hypothesis_strategies_live_in_tests_strategies():
    tests = Path(__file__).resolve().parent
    assert _composites(ast.parse("@st.composite\ndef a(draw):\n    pass\n@composite\ndef b(draw):\n    pass\n")) \
        == [2, 5]
    assert _composites(ast.parse((tests / "strategies.py").read_text()))
    elsewhere = {str(p.relative_to(tests)): lines for p in sorted(tests.rglob("*.py")) if p.name != "strategies.py"
                 and (lines := _composites(ast.parse(p.read_text())))}
    assert not elsewhere, f"hypothesis strategies outside tests/strategies.py: {elsewhere}"


def _environment_reads(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in ("environ", "getenv"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv", "putenv", "unsetenv") for a in node.names):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_scan_finds_environment_reads():
    assert _environment_reads(ast.parse("import os\nx = os.environ.get('A')\ny = os.getenv('B')\n")) == [2, 3]
    assert _environment_reads(ast.parse("from os import environ\nz = environ['C']\n")) == [1, 2]
    assert _environment_reads(TREES[ENV_MODULE])


def test_only_the_configuration_module_reads_the_environment():
    bad = {m: lines for m, tree in TREES.items() if m != ENV_MODULE and (lines := _environment_reads(tree))}
    assert not bad, f"environment reads outside {ENV_MODULE}: {bad}"


def test_no_test_folder_is_one_pytest_skips():
    """pytest does not recurse into folders named like build outputs or environments (its
    default `norecursedirs`); a test folder so named is silently never run."""
    import fnmatch

    skipped = ("*.egg", "_darcs", "build", "CVS", "dist", "node_modules", "venv", "{arch}")
    tests = Path(__file__).resolve().parent
    # (hidden folders, caches among them, hold no tests)
    hidden = [str(d.relative_to(tests)) for d in tests.rglob("*") if d.is_dir() and not d.name.startswith(".")
              and any(fnmatch.fnmatch(d.name, pat) for pat in skipped)]
    assert not hidden, hidden


RESULT_PATH = re.compile(r"benchmarks/results/[A-Za-z0-9_.*<>/-]*")


def _cited_result_paths() -> dict[str, set[str]]:
    """Every `benchmarks/results/...` path cited in harts/, docs/, README.md and the
    benchmarks' scripts, with the files citing it (`<topic>`-style templates skipped)."""
    repo = ROOT.parent
    files = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".json", ".md") and p.is_file()]
    files += sorted((repo / "docs").glob("*.md")) + [repo / "README.md"]
    files += sorted((repo / "benchmarks").glob("*.py")) + sorted((repo / "benchmarks" / "gpu").glob("*.py"))
    cited: dict[str, set[str]] = {}
    for f in files:
        for m in RESULT_PATH.finditer(f.read_text()):
            path = m.group(0).rstrip(".,")
            if "<" not in path:
                cited.setdefault(path, set()).add(str(f.relative_to(repo)))
    return cited


def test_every_cited_result_file_exists():
    repo = ROOT.parent
    cited = _cited_result_paths()
    assert len(cited) > 20  # the scan sees the citations
    missing = {path: sorted(where) for path, where in cited.items()
               if not (list(repo.glob(path)) if "*" in path else (repo / path).exists())}
    assert not missing, missing


# ---- the command line's modules ------------------------------------------------------------------


def _command_modules() -> set[str]:
    """The modules of harts.cli that register subcommands (a top-level `register`)."""
    return {m for m, tree in TREES.items() if m.startswith("harts.cli.") and any(
        isinstance(node, ast.FunctionDef) and node.name == "register" for node in tree.body)}


def test_command_modules_do_not_import_each_other():
    """A subcommand's module imports no other subcommand's module: what two commands share
    lives in the shared modules (common, data, model_source), so a command can change or go
    without touching another."""
    commands = _command_modules()
    assert {"harts.cli.train", "harts.cli.verify", "harts.cli.tree", "harts.cli.run"} <= commands
    bad = sorted((m, t) for m in commands for t in IMPORTS[m][0] if t in commands)
    assert not bad, f"command modules importing other command modules: {bad}"


# ---- one construction site per trainer kind ----------------------------------------------------------

# each trainer class and the one module that constructs it outside the tests: the factories
# (harts.exec.factory.make_trainer, harts.distributed.runner.distributed_trainer), which
# harts.train.build_trainer, the verifiers, the RL API and the benchmarks call
TRAINER_FACTORIES = {
    "ExpandedTrainer": "harts/exec/factory.py",
    "TreeTrainer": "harts/exec/factory.py",
    "PlanTrainer": "harts/exec/factory.py",
    "PrefixMergedTrainer": "harts/exec/factory.py",
    "DistPlanTrainer": "harts/distributed/runner.py",
    "PipelineTrainer": "harts/distributed/runner.py",
}
# benchmarks/gpu/revisions.py times other git revisions of harts too: it calls the trainer
# classes every revision has
_OLD_API = {"benchmarks/gpu/revisions.py"}


def _constructions(tree: ast.AST) -> list[tuple[str, int]]:
    """(trainer class, line) of every `XTrainer(...)` and `(XTrainer if c else YTrainer)(...)` call."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            targets = (func.body, func.orelse) if isinstance(func, ast.IfExp) else (func,)
            for t in targets:
                name = getattr(t, "id", getattr(t, "attr", None))
                if name in TRAINER_FACTORIES:
                    out.append((name, node.lineno))
    return out


def _trainer_constructions() -> dict[str, list[str]]:
    """The trainer constructions in harts/, benchmarks/ and scripts/ by class, as "path:line"."""
    repo = ROOT.parent
    found: dict[str, list[str]] = {name: [] for name in TRAINER_FACTORIES}
    for d in ("harts", "benchmarks", "scripts"):
        for path in sorted((repo / d).rglob("*.py")):
            rel = str(path.relative_to(repo))
            if rel in _OLD_API:
                continue
            tree = TREES[_module_name(path)] if d == "harts" else ast.parse(path.read_text())
            for name, line in _constructions(tree):
                found[name].append(f"{rel}:{line}")
    return found


def test_the_scan_finds_trainer_constructions():
    tree = ast.parse("t = TreeTrainer(net)\nu = (TreeTrainer if x else ExpandedTrainer)(net)\n"
                     "v = harts.exec.window.PlanTrainer(net, plan)\nclass T(TreeTrainer):\n    pass\n")
    assert sorted(_constructions(tree)) == [("ExpandedTrainer", 2), ("PlanTrainer", 3), ("TreeTrainer", 1),
                                            ("TreeTrainer", 2)]
    assert _trainer_constructions()["TreeTrainer"]  # the factory's


def test_each_trainer_kind_has_one_construction_site():
    """Every trainer is built through its factory: one construction site per class outside
    the tests (a new caller goes through make_trainer / distributed_trainer / build_trainer)."""
    found = _trainer_constructions()
    bad = {name: sites for name, sites in found.items()
           if len(sites) != 1 or not sites[0].startswith(TRAINER_FACTORIES[name] + ":")}
    assert not bad, f"trainers constructed outside their factory: {bad}"
