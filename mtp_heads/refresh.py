"""When the head co-trainer refreshes the MTP heads.

Heads trained against an earlier policy lose acceptance as RL raises the policy's entropy
(Bebop). Refreshing costs co-trainer compute, never rollout time; these small policies say
when it is worth it. Each one sees the step's observation and returns (should_refresh,
reason); `build_refresh_policy` turns a config tuple of names into one policy (any of them).
All keep their state as plain JSON-able dicts so a restarted co-trainer resumes them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol


@dataclass(frozen=True)
class StepObservation:
    """What the co-trainer learns about one RL step's rollouts."""

    step: int
    mean_entropy: float      # nats, mean over emitted tokens of the processed target dist.
    acceptance_rate: float   # accepted / proposed drafts; nan without drafts
    head_version: int        # the (newest) head version these rollouts ran with


class RefreshPolicy(Protocol):
    def decide(self, obs: StepObservation) -> tuple[bool, str]: ...
    def on_refresh(self, obs: StepObservation, new_head_version: int) -> None: ...
    def state(self) -> dict[str, Any]: ...
    def load_state(self, state: dict[str, Any]) -> None: ...


class Never:
    """Heads stay as pre-trained (Bebop's suggestion when drafts are sampled and TV-trained)."""

    def decide(self, obs: StepObservation) -> tuple[bool, str]:
        return False, ""

    def on_refresh(self, obs: StepObservation, new_head_version: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        pass


class EveryNSteps:
    """Refresh every n RL steps (counted from the first observed step, then from each refresh)."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {n}")
        self.n = n
        self.last: int | None = None

    def decide(self, obs: StepObservation) -> tuple[bool, str]:
        if self.last is None:
            self.last = obs.step
        if obs.step - self.last >= self.n:
            return True, f"every_n_steps: {obs.step - self.last} steps since step {self.last}"
        return False, ""

    def on_refresh(self, obs: StepObservation, new_head_version: int) -> None:
        self.last = obs.step

    def state(self) -> dict[str, Any]:
        return {"last": self.last}

    def load_state(self, state: dict[str, Any]) -> None:
        self.last = state.get("last")


class EntropyRise:
    """Refresh when mean policy entropy rose by >= delta nats since the last refresh
    (baseline: the first observed step until the first refresh)."""

    def __init__(self, delta: float):
        if not delta > 0:
            raise ValueError(f"entropy_delta must be > 0 nats, got {delta}")
        self.delta = delta
        self.baseline: float | None = None

    def decide(self, obs: StepObservation) -> tuple[bool, str]:
        if not math.isfinite(obs.mean_entropy):
            return False, ""
        if self.baseline is None:
            self.baseline = obs.mean_entropy
        rise = obs.mean_entropy - self.baseline
        if rise >= self.delta:
            return True, (f"entropy_rise: {obs.mean_entropy:.3f} nats is {rise:+.3f} above "
                          f"{self.baseline:.3f} (delta {self.delta})")
        return False, ""

    def on_refresh(self, obs: StepObservation, new_head_version: int) -> None:
        if math.isfinite(obs.mean_entropy):
            self.baseline = obs.mean_entropy

    def state(self) -> dict[str, Any]:
        return {"baseline": self.baseline}

    def load_state(self, state: dict[str, Any]) -> None:
        self.baseline = state.get("baseline")


class AcceptanceDrop:
    """Refresh when acceptance fell >= epsilon below its level after the last refresh.

    The level is the first acceptance measured with the refreshed heads (head_version >=
    the version the refresh produced), since heads reach the workers a step or so later.
    """

    def __init__(self, epsilon: float):
        if not 0 < epsilon < 1:
            raise ValueError(f"acceptance_epsilon must be in (0, 1), got {epsilon}")
        self.epsilon = epsilon
        self.level: float | None = None
        self.wait_for_version = 0

    def decide(self, obs: StepObservation) -> tuple[bool, str]:
        if not math.isfinite(obs.acceptance_rate) or obs.head_version < self.wait_for_version:
            return False, ""
        if self.level is None:
            self.level = obs.acceptance_rate
        drop = self.level - obs.acceptance_rate
        if drop >= self.epsilon:
            return True, (f"acceptance_drop: {obs.acceptance_rate:.3f} is {drop:.3f} below "
                          f"{self.level:.3f} (epsilon {self.epsilon})")
        return False, ""

    def on_refresh(self, obs: StepObservation, new_head_version: int) -> None:
        self.level = None
        self.wait_for_version = new_head_version

    def state(self) -> dict[str, Any]:
        return {"level": self.level, "wait_for_version": self.wait_for_version}

    def load_state(self, state: dict[str, Any]) -> None:
        self.level = state.get("level")
        self.wait_for_version = int(state.get("wait_for_version", 0))


class AnyOf:
    """Refresh when any member says so; every member sees every observation and every refresh."""

    def __init__(self, members: dict[str, RefreshPolicy]):
        self.members = members

    def decide(self, obs: StepObservation) -> tuple[bool, str]:
        verdicts = [m.decide(obs) for m in self.members.values()]   # all see it: baselines start together
        reasons = [r for fire, r in verdicts if fire]
        return bool(reasons), "; ".join(reasons)

    def on_refresh(self, obs: StepObservation, new_head_version: int) -> None:
        for m in self.members.values():
            m.on_refresh(obs, new_head_version)

    def state(self) -> dict[str, Any]:
        return {name: m.state() for name, m in self.members.items()}

    def load_state(self, state: dict[str, Any]) -> None:
        for name, m in self.members.items():
            m.load_state(state.get(name, {}))


# name -> factory from the co-trainer config (any object with the CoTrainerConfig fields it reads)
REFRESH_POLICIES: dict[str, Callable[[Any], RefreshPolicy]] = {
    "never": lambda cfg: Never(),
    "every_n_steps": lambda cfg: EveryNSteps(cfg.every_n_steps),
    "entropy_rise": lambda cfg: EntropyRise(cfg.entropy_delta),
    "acceptance_drop": lambda cfg: AcceptanceDrop(cfg.acceptance_epsilon),
}


def build_refresh_policy(cfg: Any) -> AnyOf:
    """cfg.refresh: a tuple of names from REFRESH_POLICIES (refresh when any fires)."""
    names = (cfg.refresh,) if isinstance(cfg.refresh, str) else tuple(cfg.refresh)
    if not names:
        raise ValueError(f"refresh is empty: name at least one of {sorted(REFRESH_POLICIES)} (or 'never')")
    unknown = [n for n in names if n not in REFRESH_POLICIES]
    if unknown:
        raise ValueError(f"unknown refresh policies {unknown}; choose from {sorted(REFRESH_POLICIES)}")
    return AnyOf({n: REFRESH_POLICIES[n](cfg) for n in dict.fromkeys(names)})
