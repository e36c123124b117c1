"""The async RL job's configuration: frozen dataclasses, YAML files and `key=value` overrides.

    cfg, resolved = load_config(["configs/async_rl.yaml", "steps=5", "grpo.lr=3e-5"])

The dataclasses are the schema (types and defaults), a YAML file overrides some of them
and the command line overrides the YAML. Unknown keys and ill-typed values fail with a
ValueError naming the key. `${now:%Y%m%d-%H%M%S}` gives a fresh run directory per run and
`${out_dir}` lets nested keys (the monitor's directory) follow it; `write_resolved` stores
the fully resolved config as <out_dir>/config.yaml. All keys with their defaults are
listed in configs/README.md (`python -m trainers.config` prints them).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from datetime import datetime
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from rollout.accelerator import AcceleratorConfig, CoTrainerConfig, WorkerConfig
from rollout.monitor import MonitorConfig
from rollout.types import DRAFT_MODES, SamplingParams
from trainers.grpo import GRPOConfig, ScheduleConfig
from trainers.tasks import TaskConfig

if not OmegaConf.has_resolver("now"):
    # one timestamp per process, so every ${now:...} in a config agrees
    _START = datetime.now()


    def _now(fmt: str) -> str:
        return _START.strftime(fmt)

    OmegaConf.register_resolver("now", _now, use_cache=True)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How rollouts are sampled; the temperature follows a schedule over the run."""

    max_new_tokens: int = 32
    temperature: ScheduleConfig = dataclasses.field(default_factory=lambda: ScheduleConfig(0.8, 1.2))
    top_k: int = 0
    top_p: float = 1.0
    num_draft_tokens: int = 3          # k drafted by the MTP heads per round; 0 = no speculation
    draft_mode: str = "rejection"      # greedy | rejection (see DESIGN.md)

    def __post_init__(self) -> None:
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"sampling.draft_mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")

    def params(self, step: int, total_steps: int, seed: int) -> SamplingParams:
        """SamplingParams of one RL step (seeded per step: reruns draw the same completions)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens,
                              temperature=self.temperature.at(step, total_steps), top_k=self.top_k,
                              top_p=self.top_p, num_draft_tokens=self.num_draft_tokens,
                              draft_mode=self.draft_mode, seed=seed * 100_003 + step)


def _default_accelerator() -> AcceleratorConfig:
    return AcceleratorConfig(workers=WorkerConfig(),
                             cotrainer=CoTrainerConfig(checkpoint_dir="${out_dir}/cotrainer"),
                             monitor=MonitorConfig(out_dir="${out_dir}"))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One async RL run: the rollout side, the policy update, the tasks and the loop."""

    accelerator: AcceleratorConfig = dataclasses.field(default_factory=_default_accelerator)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    tasks: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    steps: int = 20
    out_dir: str = "runs/async_rl/${now:%Y%m%d-%H%M%S}"   # the run directory; must not hold another run
    heads: str = "pretrained"          # where the MTP heads come from: a key of experiments.async_rl.HEAD_SOURCES
    trainer_threads: int = 1           # torch threads of the GRPO update in the driver process
    progress: bool = True              # a tqdm line per step
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.trainer_threads < 1:
            raise ValueError(f"trainer_threads must be >= 1, got {self.trainer_threads}")


def _as_value_error(e: OmegaConfBaseException, where: str) -> ValueError:
    key = getattr(e, "full_key", None) or "?"
    first = str(e).splitlines()[0]
    if isinstance(e, ConfigKeyError):
        return ValueError(f"{where}: unknown config key {key!r} ({first}). "
                          "All keys are listed in configs/README.md (python -m trainers.config).")
    return ValueError(f"{where}: bad value for config key {key!r}: {first}")


def load_config(argv: list[str]) -> tuple[RunConfig, DictConfig]:
    """argv: YAML files and `key=value` overrides, applied left to right over the defaults.

    Returns the validated RunConfig and the resolved DictConfig (what write_resolved stores).
    """
    merged: DictConfig = OmegaConf.structured(RunConfig)
    for arg in argv:
        if "=" in arg:
            layer, where = OmegaConf.from_dotlist([arg]), f"override {arg!r}"
        else:
            if not Path(arg).is_file():
                raise ValueError(f"{arg!r} is neither a YAML file nor a key=value override")
            layer, where = OmegaConf.load(arg), arg
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise _as_value_error(e, where) from None
    try:       # to_object resolves interpolations and runs the dataclasses' validation
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _as_value_error(e, "config") from None
    return cfg, merged


def write_resolved(resolved: DictConfig, run_dir: str | Path) -> Path:
    """<run_dir>/config.yaml: every key with the value this run used."""
    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(resolved, resolve=True), encoding="utf-8")
    return path


def config_keys(cfg: DictConfig | None = None) -> list[tuple[str, str]]:
    """(dotted key, default as YAML) for every leaf of the schema, in declaration order."""
    cfg = OmegaConf.structured(RunConfig) if cfg is None else cfg
    out: list[tuple[str, str]] = []

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out.append((f"{prefix}{k}", v if isinstance(v, str) else json.dumps(v)))

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return out


def keys_table() -> str:
    """Markdown table of all keys and their defaults (pasted into configs/README.md)."""
    rows = [f"| `{k}` | `{v}` |" for k, v in config_keys()]
    return "\n".join(["| key | default |", "|---|---|", *rows])


if __name__ == "__main__":
    print(keys_table() if len(sys.argv) < 2 else OmegaConf.to_yaml(load_config(sys.argv[1:])[1]))
