"""The async RL job's configuration schema: the frozen dataclasses of one `run`.

    cfg, resolved = load_run_config(["configs/async_rl.yaml", "steps=5", "grpo.lr=3e-5"])

Loading, overrides, errors, `--help` and the resolved config.yaml are rollout.config_loader's
job; this module only says what a run is made of. `${out_dir}` lets nested keys (the monitor's
directory, the co-trainer's checkpoints) follow the run directory, and the run's config.yaml keeps
them so (run_dir_relative): a moved or copied run directory resumes in place. All keys with their
defaults and meanings are listed in configs/README.md (`python -m trainers.config` prints them).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from omegaconf import OmegaConf

from mtp_heads.cotrainer import CoTrainerConfig
from mtp_heads.shipped import check_heads_spec
from rollout.accelerator import AcceleratorConfig
from rollout.config_loader import CONFIGS_DIR, keys_table, load_config
from rollout.fileio import atomic_write
from rollout.monitor import MonitorConfig
from rollout.types import DRAFT_MODES, SamplingParams
from trainers.grpo import GRPOConfig, ScheduleConfig
from trainers.tasks import TaskConfig, num_rl_steps


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How rollouts are sampled; the temperature follows a schedule over the run."""

    max_new_tokens: int = 32           # tokens generated per completion at most
    temperature: ScheduleConfig = dataclasses.field(   # sampling temperature
        default_factory=lambda: ScheduleConfig(0.8, 1.2))
    top_k: int = 0                     # 0 = off
    top_p: float = 1.0                 # 1 = off
    num_draft_tokens: int = 3          # k tokens drafted by the heads per round (0: plain decoding)
    draft_mode: str = "rejection"      # `rejection` (draft ~ q) or `greedy` (argmax q); both lossless

    def __post_init__(self) -> None:
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"sampling.draft_mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")

    def params(self, step: int, total_steps: int, seed: int) -> SamplingParams:
        """SamplingParams of one RL step (seeded per step: reruns draw the same completions)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens,
                              temperature=self.temperature.at(step, total_steps), top_k=self.top_k,
                              top_p=self.top_p, num_draft_tokens=self.num_draft_tokens,
                              draft_mode=self.draft_mode, seed=seed * 100_003 + step)


def run_dir_accelerator() -> AcceleratorConfig:
    """The accelerator of a job with a run directory `out_dir` and a top-level `heads`: co-trainer
    checkpoints and the monitor inside the run directory, accelerator.heads following `heads`."""
    return AcceleratorConfig(cotrainer=CoTrainerConfig(checkpoint_dir="${out_dir}/cotrainer"),
                             monitor=MonitorConfig(out_dir="${out_dir}"), heads="${heads}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One async RL run: the rollout side, the policy update, the tasks and the loop."""

    accelerator: AcceleratorConfig = dataclasses.field(default_factory=run_dir_accelerator)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    tasks: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    steps: int | None = None           # RL steps; null = ceil(tasks.num_prompts x tasks.epochs / grpo.prompts_per_step)
    out_dir: str = "runs/async_rl/${now:%Y%m%d-%H%M%S}"   # the run directory (must not hold another run)
    heads: str = "shipped"             # draft heads: `shipped` (the package's, or `mtp-rollout train-heads`' cached
                                       # ones), `init` (copy of the last policy layer, untrained), a checkpoint path
                                       # or an EAGLE-3 drafter directory (with accelerator.num_depths=1)
    trainer_threads: int = 1           # torch threads of the GRPO update in the driver
    progress: bool = True              # tqdm progress line per step
    seed: int = 0                      # seed of the policy update, sampling and tiny models
    resume: bool = False               # continue out_dir's run from its last checkpoint (README: When things go wrong)
    checkpoint_every: int = 5          # steps between run checkpoints in <out_dir>/checkpoints/ (policy, optimizer,
                                       # heads, co-trainer, logs); 0 = none
    keep_checkpoints: int = 2          # newest run checkpoints kept; an older one is deleted only once a newer one is
                                       # written and verified, and resume falls back to the newest intact one
    cotrainer_required: bool = True    # a run whose head co-trainer died for good (beyond
                                       # accelerator.cotrainer.max_restarts) fails (exit 1) after its last step;
                                       # false: it only says so

    @property
    def total_steps(self) -> int:
        """The RL steps this run makes: `steps`, or one pass of the prompt set per epoch."""
        return num_rl_steps(self.tasks, self.grpo.prompts_per_step, self.steps)

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1 or null (from tasks.num_prompts x tasks.epochs), got {self.steps}")
        check_heads_spec("heads", self.heads)
        if self.accelerator.heads != self.heads:
            raise ValueError(f"accelerator.heads={self.accelerator.heads!r} differs from heads={self.heads!r}; "
                             "set heads=... (accelerator.heads follows it)")
        if self.trainer_threads < 1:
            raise ValueError(f"trainer_threads must be >= 1, got {self.trainer_threads}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0 = no checkpoints), got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")


def load_run_config(argv: list[str]) -> tuple[RunConfig, str]:
    """The RL job's config from `[yaml_path?, key=value ...]`; see rollout.config_loader.load_config."""
    return load_config(RunConfig, argv)


def _string_leaves(node: dict, prefix: str = ""):
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _string_leaves(v, f"{prefix}{k}.")
        elif isinstance(v, str):
            yield f"{prefix}{k}", v


def inside_run_dir(config_text: str) -> dict[str, str]:
    """Keys of a saved config whose path lies inside its own out_dir, as `${out_dir}/...`.

    Why: a run directory that is moved or copied must resume with its paths (the co-trainer's
    checkpoints, the monitor's files) following it, not pointing back at the old place."""
    data = OmegaConf.to_container(OmegaConf.create(config_text), resolve=False)
    out = str(data.get("out_dir") or "").rstrip("/")
    if not out or "${" in out:
        return {}
    return {key: "${out_dir}" + v[len(out):] for key, v in _string_leaves(data)
            if key != "out_dir" and (v == out or v.startswith(out + "/"))}


def run_dir_relative(config_text: str) -> str:
    """config_text with the paths inside out_dir written relative to it (see inside_run_dir):
    what a run's config.yaml holds."""
    moved = inside_run_dir(config_text)
    if not moved:
        return config_text
    conf = OmegaConf.create(config_text)
    for key, value in moved.items():
        OmegaConf.update(conf, key, value, merge=False)
    return OmegaConf.to_yaml(conf)


USAGE = "python -m experiments.async_rl [configs/<job>.yaml] [key=value ...]"
README = CONFIGS_DIR / "README.md"
TABLE_SECTION = "## All keys"


def update_readme_table(readme: Path = README) -> bool:
    """Replace the key table under TABLE_SECTION with keys_table(RunConfig); True if it changed.

    Why: the table is generated from the dataclasses (a test insists), so adding a field only
    needs `python -m trainers.config --update-readme`, not hand-editing 80 rows."""
    text = readme.read_text(encoding="utf-8")
    head, sep, tail = text.partition(TABLE_SECTION)
    if not sep or "| key | default | meaning |" not in tail:
        raise ValueError(f"{readme} has no key table under {TABLE_SECTION!r}")
    before, _, rest = tail.partition("| key | default | meaning |")
    after = rest.split("\n\n", 1)[1] if "\n\n" in rest else ""
    new = head + sep + before + keys_table(RunConfig) + "\n" + ("\n" + after if after else "")
    if new != text:
        atomic_write(readme, new)
    return new != text


if __name__ == "__main__":
    # no argument: the keys table of configs/README.md; --update-readme: rewrite that table;
    # otherwise the resolved config of the arguments, nothing run
    if sys.argv[1:] == ["--update-readme"]:
        print("configs/README.md " + ("updated" if update_readme_table() else "already up to date"))
    else:
        print(keys_table(RunConfig) if len(sys.argv) < 2 else load_run_config(sys.argv[1:])[1], end="")
