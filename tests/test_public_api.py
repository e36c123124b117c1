"""The supported surface: `from rollout import ...` (docs/api.md). User code written against it must
not depend on where the names live inside the package, and its defaults are the fast ones the CLI
uses."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import rollout
from tests.conftest import tiny_config


def test_every_exported_name_resolves_and_is_the_defining_object():
    import importlib
    for name in rollout.__all__:
        value = getattr(rollout, name)
        if name != "__version__":
            assert value is getattr(importlib.import_module(rollout._EXPORTS[name]), name), name
    assert set(dir(rollout)) >= set(rollout.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rollout.nope  # noqa: B018


def test_importing_the_package_or_its_foundation_pulls_in_no_ray_engine_or_trainer():
    code = ("import sys, rollout, rollout.models.decoder, mtp_heads.heads; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('trainers', 'experiments', "
            "'rollout.accelerator', 'rollout.torch_engine'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_version_matches_the_installed_distribution():
    from importlib.metadata import version
    assert rollout.__version__ == version("mtp-rollout")


def test_load_policy_defaults_to_the_dtype_the_commands_use(monkeypatch, tmp_path):
    """load_policy's default is dtype "auto" (the machine's fastest: bfloat16 where the CPU computes
    it natively), as every command passes; float32 stays available for exact checks."""
    import inspect

    from rollout.models import loaders
    from rollout.models.decoder import random_model
    from rollout.models.dtypes import preferred_dtype
    from rollout.models.hf_loader import LoadedModel
    assert inspect.signature(rollout.load_policy).parameters["dtype"].default == "auto"
    cfg = tiny_config()
    state = random_model(cfg, seed=0).state_dict()
    monkeypatch.setattr(loaders, "load_model", lambda spec: LoadedModel(cfg, state, None, None, str(spec)))
    policy, _ = rollout.load_policy("anything")
    assert next(policy.parameters()).dtype == preferred_dtype()
    policy32, _ = rollout.load_policy("anything", "float32")
    assert next(policy32.parameters()).dtype == torch.float32


def test_a_user_loop_through_the_public_names_only(tiny_policy):
    """The README's example shape, on a tiny model: heads, engine, sampling, counters."""
    heads, desc = rollout.resolve_heads(tiny_policy, "init", model="tiny", num_depths=1)
    engine = rollout.TorchEngine(tiny_policy, heads)
    batch = engine.generate([[5, 6, 7], [8, 9]], rollout.SamplingParams(
        max_new_tokens=12, temperature=0.0, num_draft_tokens=2, draft_mode="greedy", seed=0))
    plain = rollout.TorchEngine(tiny_policy).generate([[5, 6, 7], [8, 9]], rollout.SamplingParams(
        max_new_tokens=12, temperature=0.0, seed=0))
    assert [c.tokens for c in batch.completions] == [c.tokens for c in plain.completions]
    stats = batch.spec_stats()
    assert isinstance(stats, rollout.SpecDecodingStats) and stats.num_draft_tokens > 0
    assert "untrained" in desc
