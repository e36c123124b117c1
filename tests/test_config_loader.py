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


@pytest.mark.parametrize("arg, says", [
    ("=5", "override '=5' has no key before '='"),
    ("inner..lr=1", "'inner..lr' is not a config key"),
    ("inner lr=1", "'inner lr' is not a config key"),
    ("steps=[1", "'[1' is not a YAML value"),
])
def test_malformed_overrides_say_what_is_malformed(arg, says):
    with pytest.raises(ValueError) as e:
        load_config(Job, [arg])
    assert says in str(e.value) and "'?'" not in str(e.value)


def test_malformed_override_through_the_cli_exits_2(capsys):
    from experiments import cli
    assert cli.main(["train-heads", "=5"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mtp-rollout")]
    assert len(err) == 1 and "override '=5' has no key before '='" in err[0], err


def test_a_yaml_file_that_does_not_parse_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1\n")
    with pytest.raises(ValueError, match=r"bad.yaml is not valid YAML"):
        load_config(Job, [str(bad)])


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


# -- every command: --help works and shows the values a run would use; one vocabulary ------------

def _commands():
    from experiments.cli import COMMANDS
    return [name for name in COMMANDS if name != "clean-ray"]


@pytest.mark.parametrize("name", _commands())
def test_every_command_help_exits_0_and_lists_keys(name, capsys):
    from experiments import cli
    assert cli.main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert "Config keys of" in out and " = " in out


def test_bench_decode_help_prints_the_yaml_values_not_the_dataclass_defaults(capsys):
    from omegaconf import OmegaConf

    from experiments import cli
    from experiments.bench_decode import DEFAULT_CONFIG, BenchDecodeConfig
    assert cli.main(["bench-decode", "--help"]) == 0
    out = capsys.readouterr().out
    yaml = OmegaConf.to_container(OmegaConf.load(DEFAULT_CONFIG))
    shown = {k.key: k.default for k in config_keys(BenchDecodeConfig, [str(DEFAULT_CONFIG)])}
    for key, value in yaml.items():
        if isinstance(value, dict):
            continue
        text = value if isinstance(value, str) else __import__("json").dumps(value)
        assert shown[key] == text and any(ln.strip().startswith(f"{key} = {text}") for ln in out.splitlines()), key
    assert yaml["repeats"] == 5 and "repeats = 5" in out    # the dataclass says 3
    # and a run without arguments uses exactly those values
    from experiments.bench_decode import load_bench_config
    assert load_bench_config([])[0] == load_config(BenchDecodeConfig, [str(DEFAULT_CONFIG)])[0]


def test_sweep_help_shows_a_given_yaml_and_overrides(tmp_path, capsys):
    from experiments import cli
    assert cli.main(["sweep", "num_draft_tokens=5", "--help"]) == 0
    assert any(ln.strip().startswith("num_draft_tokens = 5 ") for ln in capsys.readouterr().out.splitlines())


def _schema_leaf_names(cls) -> set[str]:
    return {k.key.rsplit(".", 1)[-1] for k in config_keys(cls)}


def test_one_vocabulary_across_commands():
    """num_draft_tokens for the draft count, out_dir for outputs, heads for which draft model."""
    from experiments.bench_cotrainer import BenchCotrainerConfig
    from experiments.bench_decode import BenchDecodeConfig
    from experiments.bench_vllm import AgainstVLLMConfig
    from experiments.entropy_ablation import AblationConfig
    from experiments.entropy_sweep import SweepConfig
    from experiments.generate import GenerateJobConfig
    from experiments.pretrain_heads import TrainHeadsConfig
    from experiments.refresh_study import RefreshStudyConfig
    from experiments.trl_grpo import TRLRunConfig
    from trainers.config import RunConfig
    schemas = [BenchCotrainerConfig, BenchDecodeConfig, AgainstVLLMConfig, AblationConfig, SweepConfig,
               GenerateJobConfig, TrainHeadsConfig, RefreshStudyConfig, TRLRunConfig, RunConfig]
    for cls in schemas:
        names = _schema_leaf_names(cls)
        assert not names & {"k", "extra_ks", "out", "heads_path"}, (cls.__name__, names & {"k", "out", "heads_path"})
    for cls in (BenchCotrainerConfig, AblationConfig, SweepConfig, TrainHeadsConfig, RefreshStudyConfig,
                TRLRunConfig, RunConfig):
        assert "out_dir" in _schema_leaf_names(cls), cls.__name__
    for cls in (BenchCotrainerConfig, BenchDecodeConfig, AgainstVLLMConfig, SweepConfig, GenerateJobConfig,
                TRLRunConfig, RunConfig):
        assert "num_draft_tokens" in _schema_leaf_names(cls), cls.__name__
    for cls in (BenchCotrainerConfig, BenchDecodeConfig, AgainstVLLMConfig, GenerateJobConfig, TRLRunConfig,
                RunConfig):
        field = {f.name: f for f in dataclasses.fields(cls)}["heads"]
        assert field.default == "shipped", cls.__name__
        with pytest.raises(ValueError, match="heads=pretrained is no longer accepted: write heads=shipped"):
            load_config(cls, ["heads=pretrained"])


@pytest.mark.parametrize("command", ["bench-decode", "train-heads"])
@pytest.mark.parametrize("device,says", [("tpu", "device must be cpu, cuda or cuda:N, got 'tpu'"),
                                         ("cuda:7", "device='cuda:7': this machine has 0 CUDA devices")])
def test_a_device_the_machine_lacks_is_refused_before_work(command, device, says, monkeypatch, capsys):
    """bench-decode, train-heads and the head-data builder run on a GPU where one is asked for; a device the
    machine does not have is one line naming the key, exit 2, before the model is loaded."""
    import torch

    from experiments import cli
    from experiments.build_head_data import HeadDataConfig
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cli.main([command, f"device={device}"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mtp-rollout")]
    assert len(err) == 1 and says in err[0], err
    with pytest.raises(ValueError, match="device"):
        HeadDataConfig(device=device)
