"""The README and docs/ stay true to the code: a short front door, commands and config keys that
exist, links that resolve, no citations of things outside the repository, a Python example that runs."""
from __future__ import annotations

import ast
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.cli import COMMANDS
from rollout.config_loader import config_keys

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# a command line that dispatches to another module than COMMANDS says (bench_decode.main hands it on)
SUB_COMMANDS = {("bench-decode", "--against vllm"): "experiments.bench_vllm"}
CONFIG_CALLS = ("load_config", "preset_main", "config_help")   # their first argument is the command's config class


def text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def code_spans(page: Path) -> list[str]:
    """Fenced code blocks (line by line, `\\` continuations joined) and inline code spans."""
    src = text(page)
    spans = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", src, flags=re.S | re.M):
        spans += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", src, flags=re.S | re.M)
    spans += re.findall(r"`([^`\n]+)`", prose.replace("\n", " "))
    return spans


def command_lines(page: Path) -> list[tuple[str, list[str]]]:
    """(command, its arguments) for every `mtp-rollout <command> ...` in the page's code."""
    out = []
    for span in code_spans(page):
        for m in re.finditer(r"mtp-rollout\s+(\S+)(.*)", span):
            name, rest = m.group(1), m.group(2)
            if name.startswith(("-", "<")):      # --help, <command>
                continue
            try:
                args = shlex.split(rest, comments=True)
            except ValueError:                   # an unbalanced quote in prose: take the plain words
                args = rest.split()
            out.append((name, args))
    return out


def test_readme_is_a_short_front_door():
    n = len(text(README).splitlines())
    assert n <= 350, f"README.md has {n} lines; move detail into docs/"


def test_every_named_command_exists():
    named = {(p.name, m) for p in PAGES for m in re.findall(r"mtp-rollout\s+([a-z][a-z-]*)", text(p))}
    unknown = sorted((page, cmd) for page, cmd in named if cmd not in COMMANDS)
    assert not unknown, f"commands not in experiments/cli.py COMMANDS: {unknown}"


def config_class(module_name: str) -> type | None:
    """The config dataclass a command's module hands to the shared loader (load_config,
    preset_main or config_help), found in its source; None for commands without one (clean-ray)."""
    module = importlib.import_module(module_name)
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CONFIG_CALLS
                and node.args and isinstance(node.args[0], ast.Name)):
            cls = getattr(module, node.args[0].id, None)
            if isinstance(cls, type):
                return cls
    return None


def key_exists(key: str, leaves: dict[str, object]) -> bool:
    """A leaf key, a nested section holding leaves (`sampling.temperature` of a schedule), or a key
    inside a mapping-valued leaf (`schedules.never.x`)."""
    if key in leaves or any(leaf.startswith(key + ".") for leaf in leaves):
        return True
    return any(key.startswith(leaf + ".") and str(v).startswith("{") for leaf, v in leaves.items())


def test_config_keys_in_documented_commands_exist():
    leaves_of: dict[str, dict[str, object]] = {}
    bad = []
    for page in PAGES:
        for name, args in command_lines(page):
            if name not in COMMANDS:
                continue                                     # reported by test_every_named_command_exists
            module = COMMANDS[name][0]
            joined = " ".join(args)
            for (cmd, marker), sub in SUB_COMMANDS.items():
                if cmd == name and marker in joined:
                    module = sub
            if module not in leaves_of:
                cls = config_class(module)
                leaves_of[module] = {} if cls is None else {k.key: k.default for k in config_keys(cls)}
            leaves = leaves_of[module]
            for arg in args:
                if arg.startswith("-") or "=" not in arg:      # flags (--prompt) and YAML files / presets
                    continue
                key = arg.split("=", 1)[0]
                if not re.fullmatch(r"[A-Za-z_][\w.]*", key):
                    continue                                 # not a key (a placeholder, a shell variable)
                if not key_exists(key, leaves):
                    bad.append(f"{page.relative_to(ROOT)}: mtp-rollout {name} ... {key}= ({module})")
    assert not bad, "config keys the commands do not have:\n" + "\n".join(sorted(set(bad)))


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", text(page)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue                                     # URLs, same-page anchors
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"links to missing files: {broken}"


CITATIONS = [
    (r"(?-i:DESIGN\.md)", "DESIGN.md (now docs/design.md)"),
    (r"\bissues?\s+#?\d+", "an issue number"),
    (r"\bsessions?\s+\d+", "a session number"),
    (r"\bstage[- ]\d+", "a stage number"),
]


def test_no_citations_of_things_outside_the_repository():
    found = []
    for page in PAGES:
        for pattern, what in CITATIONS:
            for m in re.finditer(pattern, text(page), flags=re.I):
                found.append(f"{page.relative_to(ROOT)}: {m.group(0)!r} ({what})")
    assert not found, "\n".join(found)


def readme_python_example() -> str:
    m = re.search(r"^```python\n(.*?)^```", text(README), flags=re.S | re.M)
    assert m, "README.md has no ```python example"
    return m.group(1)


def test_readme_example_uses_only_the_public_api():
    tree = ast.parse(readme_python_example())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports and all(isinstance(n, ast.ImportFrom) and n.module == "rollout" for n in imports)
    import rollout
    assert all(a.name in rollout.__all__ for n in imports for a in n.names)


@pytest.mark.slow
def test_readme_python_example_runs():
    """The real SmolLM2 model (fetched once into $MTP_ROLLOUT_CACHE, as the other slow tests do) and
    the shipped heads, 8 new tokens."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", readme_python_example()], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the example printed nothing"
