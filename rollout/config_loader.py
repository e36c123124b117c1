"""One config system for every runnable job: frozen dataclasses + YAML + `key=value` overrides.

    cfg, resolved = load_config(RunConfig, ["configs/async_rl.yaml", "steps=5", "grpo.lr=3e-5"])
    write_resolved(resolved, cfg.out_dir)          # <out_dir>/config.yaml
    print(config_help(RunConfig))                  # what `--help` shows

The dataclasses are the schema (types, defaults, validation in __post_init__); YAML files and
overrides are applied left to right over the defaults, so later arguments win. Unknown keys
and ill-typed values fail with a ValueError that names the key, the value and where it came
from, before anything runs. `${now:%Y%m%d-%H%M%S}` is the process start time (one value per
process) and `${other.key}` interpolates. A field's meaning, shown by config_help, is its
`metadata={"help": ...}` or else the comment on the line(s) of its declaration.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import io
import json
import re
import textwrap
import tokenize
import typing
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from rollout.fileio import atomic_write
from rollout.models.tokenizer import check_text

T = TypeVar("T")

RESOLVED_NAME = "config.yaml"
# configs/ in a checkout, or the `configs` package an installed wheel carries
CONFIGS_DIR = Path(importlib.util.find_spec("configs").origin).parent
HELP_FLAGS = ("-h", "--help")

if not OmegaConf.has_resolver("now"):
    _START = datetime.now()     # one timestamp per process, so every ${now:...} in a config agrees

    def _now(fmt: str) -> str:
        return _START.strftime(fmt)

    OmegaConf.register_resolver("now", _now, use_cache=True)


def packaged_config(name: str) -> Path:
    """configs/<name>.yaml for a bare name (`async_rl`), else the path as given."""
    if "/" in name or name.endswith((".yaml", ".yml")):
        return Path(name)
    path = CONFIGS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
        raise ValueError(f"no packaged config named {name!r}; known: {known}")
    return path


def wants_help(argv: list[str]) -> bool:
    """True when argv asks for the key listing instead of a run."""
    return any(a in HELP_FLAGS for a in argv)


def _value_at(layer: DictConfig | None, key: str) -> str:
    """The offending value as the user wrote it (for error messages); '?' if not recoverable."""
    if layer is None or not key or key == "?":
        return "?"
    try:
        node = OmegaConf.select(layer, key, throw_on_missing=False, throw_on_resolution_failure=False)
    except Exception:     # noqa: BLE001 - only used to enrich an error message
        return "?"
    if node is None:
        return "?"
    return json.dumps(OmegaConf.to_container(node) if isinstance(node, DictConfig) else node, default=str)


def _as_value_error(e: Exception, where: str, layer: DictConfig | None, cls: type) -> ValueError:
    key = getattr(e, "full_key", None) or "?"
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    value = _value_at(layer, key)
    if isinstance(e, ConfigKeyError):
        return ValueError(f"{where}: unknown config key {key!r} (value {value}). {first} "
                          f"(every key of {cls.__name__} is listed by --help)")
    return ValueError(f"{where}: bad value {value} for config key {key!r}: {first}")


def parse_override(arg: str) -> DictConfig:
    """One `key=value` override as a config layer. A missing or malformed key, bytes that are not
    UTF-8 and a value YAML cannot read fail here, naming the override, rather than as a key '?'."""
    key, _, value = arg.partition("=")
    if not key.strip():
        raise ValueError(f"override {arg!r} has no key before '=': write key=value (e.g. steps=5)")
    if any(not part or re.search(r"\s", part) for part in key.split(".")):
        raise ValueError(f"override {arg!r}: {key!r} is not a config key (dotted names such as grpo.lr, "
                         "written key=value)")
    check_text(value, f"the value of config key {key} (command line)")
    try:
        return OmegaConf.from_dotlist([arg])
    except yaml.YAMLError as e:
        raise ValueError(f"override {arg!r}: {value!r} is not a YAML value ({_one_line(e)})") from None


def load_yaml_file(path: str) -> DictConfig | ListConfig:
    """A YAML config file, with errors that name it (and the byte position of bytes that are not UTF-8)."""
    try:
        return OmegaConf.load(path)
    except UnicodeDecodeError as e:
        line = e.object.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path} is not valid UTF-8 text: byte 0x{e.object[e.start]:02x} at byte position "
                         f"{e.start} (line {line})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def merge_layers(cls: type, argv: list[str]) -> DictConfig:
    """The schema `cls` with argv's YAML files and overrides merged in, left to right, unresolved and
    not yet validated (load_config validates; config_help shows these values as the defaults)."""
    merged: DictConfig = OmegaConf.structured(cls)
    for arg in argv:
        if arg in HELP_FLAGS:
            raise ValueError(f"{arg} is not a config; print config_help({cls.__name__}) instead")
        if "=" in arg:
            layer, where = parse_override(arg), f"override {arg!r}"
        else:
            if not Path(arg).is_file():
                raise ValueError(f"{arg!r} is neither a YAML file nor a key=value override")
            layer, where = load_yaml_file(arg), arg
            if not isinstance(layer, DictConfig):
                raise ValueError(f"{arg}: a config file must hold a mapping of keys, not {type(layer).__name__}")
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise _as_value_error(e, where, layer, cls) from None
    return merged


def load_config(cls: type[T], argv: list[str]) -> tuple[T, str]:
    """argv: YAML files and `key=value` overrides (dotted keys, YAML values), left to right.

    Returns the validated frozen `cls` instance and the fully resolved config as YAML text
    (what write_resolved stores, and what load_config(cls, [that file]) reads back to `cfg`).
    """
    merged = merge_layers(cls, argv)
    try:       # to_object resolves interpolations and runs the dataclasses' own validation
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _as_value_error(e, "config", merged, cls) from None
    return cfg, OmegaConf.to_yaml(merged, resolve=True)


def write_resolved(resolved: str, out_dir: str | Path) -> Path:
    """<out_dir>/config.yaml (atomically): every key with the value this run used."""
    return atomic_write(Path(out_dir) / RESOLVED_NAME, resolved)


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    key: str          # dotted path
    default: str      # as YAML/JSON text ("???" = required)
    help: str         # the field's meaning ("" if undocumented)


def _field_comments(cls: type) -> dict[str, str]:
    """field name -> the comment on the line(s) of its declaration in the class body, continued
    by comment-only lines right below it whose `#` sits in the same column."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, tuple[int, str, bool]] = {}     # line -> (column, text, comment-only line)
    lines = src.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            comments[row] = (col, tok.string.lstrip("#").strip(), not lines[row - 1][:col].strip())
    out: dict[str, str] = {}
    body = ast.parse(src).body[0]
    for node in getattr(body, "body", []):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        end = node.end_lineno or node.lineno
        own = [comments[i] for i in range(node.lineno, end + 1) if i in comments]
        if not own:
            continue
        text, col = [c[1] for c in own], own[-1][0]
        nxt = end + 1
        while nxt in comments and comments[nxt][2] and comments[nxt][0] == col:
            text.append(comments[nxt][1])
            nxt += 1
        out[node.target.id] = " ".join(text)
    return out


def _field_help(cls: type) -> dict[str, str]:
    comments = _field_comments(cls)
    return {f.name: f.metadata.get("help") or comments.get(f.name, "") for f in dataclasses.fields(cls)}


def _yaml_scalar(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def config_keys(cls: type, argv: list[str] | None = None) -> list[ConfigKey]:
    """Every leaf key of the schema `cls` with its default and meaning, in declaration order; with
    `argv` (YAML files, overrides) the defaults are the values those layers give, i.e. what a run
    with that argv uses."""
    schema = OmegaConf.to_container(merge_layers(cls, argv or []), resolve=False)
    out: list[ConfigKey] = []

    def walk(node_cls: type, values: dict, prefix: str, context: str) -> None:
        helps = _field_help(node_cls)
        for f in dataclasses.fields(node_cls):
            v, h = values.get(f.name), helps[f.name]
            sub = _dataclass_type(node_cls, f)
            if sub is not None and isinstance(v, dict):
                # a reused schema (a schedule) gets its meaning from the field that holds it
                walk(sub, v, f"{prefix}{f.name}.", h)
            else:
                out.append(ConfigKey(f"{prefix}{f.name}", _yaml_scalar(v), f"{context}: {h}" if context and h else h))

    walk(cls, schema, "", "")
    return out


def _dataclass_type(owner: type, f: dataclasses.Field) -> type | None:
    """The dataclass type of a nested-config field (annotations may be strings)."""
    try:
        hint = typing.get_type_hints(owner).get(f.name, f.type)
    except Exception:     # noqa: BLE001 - fall back to the raw annotation
        hint = f.type
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


HELP_COLUMN = 60    # `key = default` wider than this gets its meaning on the next line


def config_help(cls: type, *, usage: str = "", argv: list[str] | None = None) -> str:
    """Text for `--help`: usage, then one line per key: `key = default  meaning`. `argv`: the YAML
    files (and overrides) a run without further arguments would load, so that the defaults shown
    are the values used, not the dataclass's."""
    argv = [a for a in argv or [] if a not in HELP_FLAGS]
    keys = config_keys(cls, argv)
    sides = [f"{k.key} = {k.default}" for k in keys]
    width = max((len(s) for s in sides if len(s) <= HELP_COLUMN), default=0)   # long defaults wrap instead
    lines = [usage.rstrip(), ""] if usage else []
    source = f"; defaults from {', '.join(argv)}" if argv else ""
    lines += [f"Config keys of {cls.__name__} (override any with key=value; later arguments win{source}):", ""]
    for k, lhs in zip(keys, sides):
        if len(lhs) > width:
            lines += [f"  {lhs}", f"  {'':<{width}}  {k.help}".rstrip()]
        else:
            lines.append(f"  {lhs:<{width}}  {k.help}".rstrip())
    return "\n".join(lines) + "\n"


def keys_table(cls: type) -> str:
    """Markdown table `| key | default | meaning |` of every key (for configs/README.md)."""
    rows = [f"| `{k.key}` | `{k.default}` | {k.help} |" for k in config_keys(cls)]
    return "\n".join(["| key | default | meaning |", "|---|---|---|", *rows])


def preset_main(cls: type[T], default_config: str | Path, run: Callable[[T, str], Any], argv: list[str],
                usage: str = "") -> int:
    """A command's main(argv): argv = YAML files and key=value overrides, with `default_config` first
    when no YAML file is given; then run(config, resolved YAML). `--help` lists cls's keys with the
    values those same arguments give (the default YAML's, not the dataclass's)."""
    argv = list(argv)
    asked_help = wants_help(argv)
    argv = [a for a in argv if a not in HELP_FLAGS]
    if all("=" in a for a in argv):
        argv = [str(default_config), *argv]
    if asked_help:
        print(config_help(cls, usage=usage, argv=argv), end="")
        return 0
    cfg, resolved = load_config(cls, argv)
    run(cfg, resolved)
    return 0
