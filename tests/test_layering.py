"""The package's layering, checked from the source (ast, nothing is imported or executed).

Each top-level folder is a layer, lowest first (docs/design.md "Layout"):

    rollout/models (+ rollout.fileio, config_loader, run_dir)   the foundation: model definitions and loaders
    mtp_heads/     heads, losses, the distillation core, the co-trainer and its refresh policies
    rollout/       engines -> workers and the monitor -> the runtime facade -> integrations
    trainers/      policy training: the async GRPO loop, tasks, run checkpoints
    experiments/   the CLI, its jobs and studies

rollout/models is the one documented place a lower folder reaches into: mtp_heads imports it
and the file/config helpers beside it, nothing else of rollout. LAYERS below puts every module in
one layer (finer inside rollout/). Every import is walked: top level, lazy inside functions,
under `if TYPE_CHECKING:`, and `importlib.import_module("...")` with a literal name. The rules:

1. no import cycle between modules;
2. mtp_heads imports only itself and the foundation: no engine, runtime, trainer or experiment;
3. no library module (rollout, mtp_heads, trainers) imports experiments;
4. no private name (`_x`) is imported from another module;
5. every module has a layer and imports only from its own layer or lower ones, and the layers
   follow the folders (a folder's layers are contiguous, in the order above);
6. an experiments entry point (a module with `main`) imports no other entry point, except where
   one job composes another (COMPOSES); what they share lives in experiments.common.

Each rule is also run on a synthetic tree with one planted violation, to show it can fail.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("rollout", "mtp_heads", "trainers")
SCANNED = (*LIBRARY, "experiments")
FOUNDATION = ("rollout.models", "rollout.fileio", "rollout.config_loader", "rollout.run_dir")
# (folder, layer, module prefixes), lowest first; the longest matching prefix decides. A new module
# outside these prefixes fails rule 5 until it is placed here.
LAYERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("rollout/models", "models, loaders and file/config helpers", FOUNDATION),
    ("mtp_heads", "heads, losses, distillation, the co-trainer", ("mtp_heads",)),
    ("rollout", "engines", ("rollout.types", "rollout.verify", "rollout.torch_engine", "rollout.engine",
                            "rollout.vllm")),
    ("rollout", "workers and the monitor", ("rollout.workers", "rollout.monitor")),
    ("rollout", "runtime", ("rollout.accelerator", "rollout.worker_pool", "rollout.cotrainer_client",
                            "rollout.published_weights", "rollout.ray_guard")),
    ("rollout", "integrations into other trainers", ("rollout.integrations",)),
    ("trainers", "policy training: the GRPO loop, tasks, run checkpoints", ("trainers",)),
    ("experiments", "experiments and the CLI", ("experiments",)),
)
FOLDERS = ("rollout/models", "mtp_heads", "rollout", "trainers", "experiments")
PACKAGE_LAYERS = {"rollout": 5, "mtp_heads": 1, "trainers": 6, "experiments": 7}   # the __init__ modules
HEADS_MAY_IMPORT = ("mtp_heads", *FOUNDATION)
# experiments entry points that run another job: (importer, imported)
COMPOSES = {
    ("experiments.common", "experiments.async_rl"),             # run_cell: a study's RL run
    ("experiments.entropy_ablation", "experiments.pretrain_heads"),   # each objective's heads
    ("experiments.bench_decode", "experiments.bench_vllm"),     # bench-decode --against vllm
    # a result's measurement script: a task-only store through the builder's own code
    ("experiments.results.heads_rg_smollm2.build_rg_store", "experiments.build_head_data"),
}


@dataclass(frozen=True)
class Edge:
    src: str          # importing module
    dst: str          # imported module (internal)
    names: tuple[str, ...]   # names taken with `from dst import ...` ("" entries for plain imports)
    file: str
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_modules(root: Path, packages=SCANNED) -> dict[str, Path]:
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")) if (root / pkg).is_dir() else []:
            mods[module_name(root, path)] = path
    return mods


def _resolve_relative(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *([name] if name else [])])


def _internal(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in mods:
            return cand
    return None


def import_edges(root: Path, packages=SCANNED) -> tuple[dict[str, Path], list[Edge]]:
    mods = find_modules(root, packages)
    edges = []
    for mod, path in mods.items():
        rel = str(path.relative_to(root))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    dst = _internal(alias.name, mods)
                    if dst:
                        edges.append(Edge(mod, dst, ("",), rel, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = (_resolve_relative(mod, is_pkg, node.level, node.module) if node.level
                        else node.module or "")
                plain = []
                for alias in node.names:   # `from pkg import submodule` imports the submodule
                    sub = f"{base}.{alias.name}"
                    if sub in mods:
                        edges.append(Edge(mod, sub, ("",), rel, node.lineno))
                    else:
                        plain.append(alias.name)
                dst = _internal(base, mods)
                if dst and plain:
                    edges.append(Edge(mod, dst, tuple(plain), rel, node.lineno))
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str) and _is_import_call(node.func)):
                dst = _internal(node.args[0].value, mods)
                if dst:
                    edges.append(Edge(mod, dst, ("",), rel, node.lineno))
    return mods, edges


def _is_import_call(func: ast.expr) -> bool:
    """importlib.import_module(...), import_module(...) or __import__(...)."""
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__")


def _layer_of(mod: str) -> str:
    return mod.split(".")[0]


def _within(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def layer_of(mod: str) -> int | None:
    """Index into LAYERS of a module (longest matching prefix); None if no layer holds it."""
    if mod in PACKAGE_LAYERS:
        return PACKAGE_LAYERS[mod]
    best = None
    for i, (_, _, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if _within(mod, (p,)) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


# -- the four rules: each returns human-readable violations, "file:line: what" ------------------

def cycle_violations(mods: dict[str, Path], edges: list[Edge]) -> list[str]:
    graph: dict[str, dict[str, Edge]] = {m: {} for m in mods}
    for e in edges:
        if e.src != e.dst:
            graph[e.src].setdefault(e.dst, e)
    index, low, on_stack, stack, sccs, counter = {}, {}, set(), [], [], [0]

    def strongconnect(v: str) -> None:       # Tarjan, iterative enough for a few hundred modules
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    out = []
    for comp in sccs:
        members = set(comp)
        hops = [graph[a][b] for a in comp for b in sorted(graph[a]) if b in members]
        out.append("import cycle between " + ", ".join(comp) + ": "
                   + "; ".join(f"{e.file}:{e.line}: {e.src} -> {e.dst}" for e in hops))
    return out


def heads_layer_violations(edges: list[Edge]) -> list[str]:
    return [f"{e.file}:{e.line}: {e.src} imports {e.dst} (mtp_heads may import only {', '.join(HEADS_MAY_IMPORT)})"
            for e in edges if _layer_of(e.src) == "mtp_heads" and not _within(e.dst, HEADS_MAY_IMPORT)]


def experiments_violations(edges: list[Edge]) -> list[str]:
    return [f"{e.file}:{e.line}: library module {e.src} imports {e.dst}"
            for e in edges if _layer_of(e.src) in LIBRARY and _layer_of(e.dst) == "experiments"]


def private_name_violations(edges: list[Edge]) -> list[str]:
    return [f"{e.file}:{e.line}: {e.src} imports private name {n} from {e.dst}"
            for e in edges if e.src != e.dst for n in e.names
            if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]


def downward_violations(mods: dict[str, Path], edges: list[Edge]) -> list[str]:
    out = [f"module {m} has no layer: add its prefix to LAYERS in tests/test_layering.py"
           for m in mods if layer_of(m) is None]
    for e in edges:
        src, dst = layer_of(e.src), layer_of(e.dst)
        if src is not None and dst is not None and dst > src:
            out.append(f"{e.file}:{e.line}: {e.src} ({LAYERS[src][1]}) imports {e.dst}, a higher layer "
                       f"({LAYERS[dst][1]})")
    return out


def entry_points(mods: dict[str, Path]) -> set[str]:
    """experiments modules that define a top-level main() (the CLI itself excepted)."""
    return {m for m, path in mods.items() if m.startswith("experiments.") and m != "experiments.cli"
            and any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(path.read_text()).body)}


def entry_point_violations(mods: dict[str, Path], edges: list[Edge]) -> list[str]:
    entries = entry_points(mods)
    return [f"{e.file}:{e.line}: {e.src} imports entry point {e.dst}; move what they share to experiments.common"
            for e in edges if e.dst in entries and e.src != e.dst and e.src != "experiments.cli"
            and e.src.startswith("experiments.") and (e.src, e.dst) not in COMPOSES]


RULES = {"cycles": lambda mods, edges: cycle_violations(mods, edges),
         "down": downward_violations,
         "heads": lambda mods, edges: heads_layer_violations(edges),
         "experiments": lambda mods, edges: experiments_violations(edges),
         "private": lambda mods, edges: private_name_violations(edges),
         "entry_points": entry_point_violations}


# -- the real tree -------------------------------------------------------------------------------

class ImportGraph(tuple):
    """(modules, edges) with a short repr, so a failing test prints the violations, not the graph."""

    def __repr__(self) -> str:
        return f"<import graph: {len(self[0])} modules, {len(self[1])} imports>"


@pytest.fixture(scope="module")
def tree():
    return ImportGraph(import_edges(ROOT))


def test_the_walk_sees_every_kind_of_import(tree):
    """Guards the walker itself on the real tree: lazy, TYPE_CHECKING and importlib imports count."""
    mods, edges = tree
    pairs = {(e.src, e.dst) for e in edges}
    assert len(mods) > 30 and "rollout.accelerator" in mods and "rollout.monitor" in mods
    assert ("rollout.accelerator", "rollout.workers") in pairs                       # top level
    assert ("rollout.workers", "rollout.torch_engine") in pairs                      # inside a function
    assert ("rollout.workers", "mtp_heads.heads") in pairs                           # under TYPE_CHECKING
    assert any(s == "rollout.workers" and d.startswith("rollout.vllm") for s, d in pairs)   # importlib


@pytest.mark.parametrize("rule", sorted(RULES))
def test_layering_rule_holds(tree, rule):
    mods, edges = tree
    violations = RULES[rule](mods, edges)
    assert not violations, f"{len(violations)} violation(s) of rule {rule!r}:\n" + "\n".join(violations)


# -- the rules can fail: a synthetic tree with one planted violation each -------------------------

CLEAN = {
    "rollout/__init__.py": "",
    "rollout/models/__init__.py": "",
    "rollout/models/config.py": "",
    "rollout/models/decoder.py": "import torch\nfrom rollout.models.config import ModelConfig\n",
    "rollout/verify.py": "import torch\n",
    "rollout/torch_engine.py": "from rollout.models.decoder import x\nfrom mtp_heads.heads import MTPHeads\n",
    "rollout/accelerator.py": "from rollout.torch_engine import TorchEngine\nfrom mtp_heads.cotrainer import C\n",
    "mtp_heads/__init__.py": "",
    "mtp_heads/heads.py": "from rollout.models import decoder\n",
    "mtp_heads/cotrainer.py": "from mtp_heads.heads import MTPHeads\n",
    "trainers/__init__.py": "",
    "trainers/grpo.py": "from rollout.accelerator import RolloutAccelerator\n",
    "trainers/tasks.py": "",
    "experiments/__init__.py": "",
    "experiments/common.py": "from rollout.models.config import ModelConfig\n",
    "experiments/run.py": ("from trainers.grpo import G\nfrom experiments import common\n"
                           "def main(argv):\n    return 0\n"),
    "experiments/sweep.py": "from experiments.common import x\ndef main(argv):\n    return 0\n",
}

# rule -> (file, text appended to it, other rules that the same import rightly breaks too)
PLANTED = {
    "cycles": ("rollout/models/config.py",
               "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollout.models.decoder import X\n", ()),
    "heads": ("mtp_heads/heads.py", "def evaluate():\n    from rollout.verify import rejection_sample\n", ("down",)),
    "experiments": ("trainers/tasks.py", "import importlib\nm = importlib.import_module('experiments.run')\n",
                    ("down",)),
    "private": ("experiments/run.py", "from rollout.models.decoder import _helper\n", ()),
    "down": ("rollout/accelerator.py", "def tasks():\n    from trainers.tasks import T\n", ()),
    "entry_points": ("experiments/sweep.py", "def again():\n    from experiments.run import main\n", ()),
}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_clean_synthetic_tree_passes(tmp_path):
    _write(tmp_path, CLEAN)
    mods, edges = import_edges(tmp_path)
    assert {r: RULES[r](mods, edges) for r in RULES} == {r: [] for r in RULES}


@pytest.mark.parametrize("rule", sorted(PLANTED))
def test_a_planted_violation_fails_its_rule(tmp_path, rule):
    rel, extra, also = PLANTED[rule]
    _write(tmp_path, {**CLEAN, rel: CLEAN.get(rel, "") + extra})
    mods, edges = import_edges(tmp_path)
    found = {r: RULES[r](mods, edges) for r in RULES}
    assert len(found[rule]) == 1 and rel in found[rule][0], found
    assert {r for r, v in found.items() if v} == {rule, *also}, found


def test_layers_follow_the_folders():
    """Each layer's prefixes sit in its folder, and the folders' layers come in FOLDERS order."""
    def folder_of(prefix: str) -> str:
        return "rollout/models" if _within(prefix, FOUNDATION) else prefix.split(".")[0]
    assert all(folder_of(p) == folder for folder, _, prefixes in LAYERS for p in prefixes)
    order = [folder for folder, _, _ in LAYERS]
    assert sorted(order, key=FOLDERS.index) == order and set(order) == set(FOLDERS)


def test_a_lower_layer_in_the_same_folder_cannot_import_a_higher_one(tmp_path):
    _write(tmp_path, {**CLEAN, "rollout/torch_engine.py": CLEAN["rollout/torch_engine.py"]
                      + "def facade():\n    from rollout.accelerator import A\n"})
    mods, edges = import_edges(tmp_path)
    found = downward_violations(mods, edges)
    assert len(found) == 1 and "rollout.torch_engine (engines) imports rollout.accelerator" in found[0]


def test_a_module_without_a_layer_fails(tmp_path):
    _write(tmp_path, {**CLEAN, "rollout/new_thing.py": "from rollout.types import X\n"})
    mods, edges = import_edges(tmp_path)
    assert downward_violations(mods, edges) == [
        "module rollout.new_thing has no layer: add its prefix to LAYERS in tests/test_layering.py"]


def test_relative_and_from_package_imports_resolve(tmp_path):
    _write(tmp_path, {**CLEAN, "mtp_heads/losses.py": "from . import heads\nfrom .heads import _private\n"
                                                     "from ..rollout import accelerator\n"})
    mods, edges = import_edges(tmp_path)
    pairs = {(e.src, e.dst) for e in edges}
    assert ("mtp_heads.losses", "mtp_heads.heads") in pairs
    assert len(private_name_violations(edges)) == 1
    assert any("rollout.accelerator" in v for v in heads_layer_violations(edges))
