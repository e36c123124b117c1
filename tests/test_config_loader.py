"""rollout.config_loader on a small schema of its own: overrides, errors, help, resolved file."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rollout.config_loader import config_help, config_keys, keys_table, load_config, wants_help, write_resolved


@dataclasses.dataclass(frozen=True)
class Inner:
    lr: float = 1e-3            # learning rate of the toy optimiser
    names: tuple[str, ...] = ("a", "b")
    depth: int = dataclasses.field(default=2, metadata={"help": "how deep the toy goes"})

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"inner.depth must be >= 1, got {self.depth}")


@dataclasses.dataclass(frozen=True)
class Job:
    inner: Inner = dataclasses.field(default_factory=Inner)
    out_dir: str = "runs/${now:%Y}"      # where the job writes
    log_dir: str = "${out_dir}/logs"     # follows out_dir
    steps: int = 3
    note: str = "x"                      # a meaning that goes on
                                         # over two lines
    # a comment-only line in another column belongs to nobody
    other: int = 0


def test_yaml_then_overrides_left_to_right_and_interpolation(tmp_path):
    yaml = tmp_path / "job.yaml"
    yaml.write_text("steps: 7\ninner: {lr: 0.5}\n")
    cfg, resolved = load_config(Job, [str(yaml), "inner.lr=0.25", f"out_dir={tmp_path}", "inner.names=[x]"])
    assert cfg == Job(Inner(lr=0.25, names=("x",)), out_dir=str(tmp_path), log_dir=f"{tmp_path}/logs", steps=7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 1
    path = write_resolved(resolved, tmp_path / "run")
    assert path.name == "config.yaml" and "${" not in path.read_text()
    assert load_config(Job, [str(path)])[0] == cfg


def test_now_is_resolved_once_per_process():
    a, _ = load_config(Job, [])
    b, _ = load_config(Job, [])
    assert a.out_dir == b.out_dir and "${" not in a.out_dir and a.out_dir[len("runs/"):].isdigit()


@pytest.mark.parametrize("arg,key,value", [
    ("inner.lrr=1", "inner.lrr", "1"), ("steps=abc", "steps", "abc"), ("bogus=2", "bogus", "2"),
    ("inner.depth=0", "depth", "0"),
])
def test_errors_name_the_key_and_the_value(arg, key, value):
    with pytest.raises(ValueError) as e:
        load_config(Job, [arg])
    assert key in str(e.value) and value in str(e.value)


def test_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("inner:\n  lrate: 4\n")
    with pytest.raises(ValueError, match=r"bad.yaml.*'inner.lrate'.*4"):
        load_config(Job, [str(bad)])
    with pytest.raises(ValueError, match="neither a YAML file"):
        load_config(Job, [str(tmp_path / "missing.yaml")])


def test_help_lists_every_key_with_default_and_meaning():
    keys = {k.key: k for k in config_keys(Job)}
    assert list(keys) == ["inner.lr", "inner.names", "inner.depth", "out_dir", "log_dir", "steps", "note", "other"]
    assert keys["note"].help == "a meaning that goes on over two lines" and keys["other"].help == ""
    assert keys["inner.lr"].default == "0.001" and keys["inner.lr"].help == "learning rate of the toy optimiser"
    assert keys["inner.depth"].help == "how deep the toy goes"          # metadata wins over comments
    assert keys["inner.names"].default == '["a", "b"]' and keys["steps"].help == ""
    text = config_help(Job, usage="usage: toy [key=value ...]")
    assert text.startswith("usage: toy")
    for k in keys.values():
        line = next(l for l in text.splitlines() if l.strip().startswith(f"{k.key} = "))
        assert k.default in line and k.help in line
    assert "| `log_dir` | `${out_dir}/logs` | follows out_dir |" in keys_table(Job)
    assert wants_help(["x=1", "--help"]) and not wants_help(["x=1"])


# -- the benchmarks that use it: their YAML loads and --help documents every key ----------------

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module,cls_name,yaml", [
    ("experiments.bench_cotrainer", "BenchCotrainerConfig", "bench_cotrainer.yaml"),
    ("experiments.bench_tv_loss", "BenchTVLossConfig", "bench_tv_loss.yaml"),
])
def test_benchmark_configs_load_and_help_documents_every_key(module, cls_name, yaml, capsys):
    import importlib

    mod = importlib.import_module(module)
    cls = getattr(mod, cls_name)
    cfg, resolved = load_config(cls, [str(ROOT / "configs" / yaml)])
    assert isinstance(cfg, cls) and load_config(cls, [])[0] == cls()        # no argument: the defaults
    assert [k.key for k in config_keys(cls) if not k.help] == []
    mod.main(["--help"])
    out = capsys.readouterr().out
    assert all(f"{k.key} = {k.default}" in out for k in config_keys(cls))
    with pytest.raises(ValueError, match="rounds|study"):
        load_config(cls, ["rounds=0"] if "rounds" in resolved else ["study=speed"])
