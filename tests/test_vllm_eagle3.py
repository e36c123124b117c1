"""An EAGLE-3 drafter written by us, run by vLLM's built-in `eagle3` method (no drafter plugin), refreshed
through vLLM's weight-transfer API with our CPU backend (the engine's only refresh path).

What can fail here: every draft vLLM proposes (read per step from the model runner) is compared with our
reference drafting function (mtp_heads.eagle3.draft_greedy) on the prefix committed at that step, at every
draft position; outputs are compared with plain greedy decoding of the torch policy. The drafter is
trained briefly on the policy's own greedy text so that drafts are accepted and vLLM's multi-token first
pass (accepted drafts re-run through the drafter) is exercised, and it has a reduced draft vocabulary
(d2t / t2d maps). One vLLM instance (k = 3, greedy drafts, float32) serves every test; the policy update
runs last.
"""
import copy
import types

import pytest
import torch
import torch.nn.functional as F

from mtp_heads.eagle3 import aux_hidden_states, draft_greedy, init_eagle3
from mtp_heads.eagle3_checkpoint import save_eagle3
from rollout.models.decoder import random_model
from rollout.models.fast_linear import linear
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from tests.conftest import tiny_config

pytestmark = pytest.mark.vllm

# head_dim 32: the vLLM CPU attention kernels want a multiple of 16
CFG = tiny_config(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, eos_token_ids=(1,), num_hidden_layers=4)
AUX = (1, 2, 4)                                   # low / middle / high: after layers 1, 2 and the last
DRAFT_VOCAB = torch.tensor([i for i in range(256) if i % 4 != 3])   # a reduced vocabulary: d2t is not 0
K = 3


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, CFG.vocab_size, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 13, (n,), generator=g)]


def _greedy(policy, prompts, n=24):
    """Plain greedy decoding of the torch policy (no drafts)."""
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [c.tokens for c in TorchEngine(policy).generate(prompts, sp).completions]


def _trained_drafter(policy, seed: int, steps: int = 20):
    """A drafter fitted for a few seconds to predict x_{i+2} from (x_{i+1}, aux_i) on the policy's greedy
    continuations of the tests' prompts (teacher-forced, first draft position only; it memorises them):
    enough for drafts to be accepted, which is all these tests need of it."""
    drafter = init_eagle3(policy, AUX, draft_vocab=DRAFT_VOCAB, seed=seed)
    prompts = _prompts() + _prompts(4, seed=5)
    rows = [p + t for p, t in zip(prompts, _greedy(policy, prompts))]
    T = max(map(len, rows))
    seqs = torch.tensor([r + [0] * (T - len(r)) for r in rows])                                # [N, T], right-padded
    aux = aux_hidden_states(policy, seqs[:, :-1], AUX)                                          # [N, T-1, 3d]
    to_draft = torch.full((CFG.vocab_size,), -100)
    to_draft[DRAFT_VOCAB] = torch.arange(len(DRAFT_VOCAB))
    labels = to_draft[seqs[:, 2:]]                                                              # [N, T-2]
    labels[torch.arange(T - 2)[None] + 2 >= torch.tensor([len(r) for r in rows])[:, None]] = -100
    positions = torch.arange(T - 1)[None].expand(len(rows), -1)
    params = list(drafter.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(steps):
        post, _ = drafter.step(policy, seqs[:, 1:], drafter.fc(aux), positions, None)
        logits = linear(post[:, :-1], drafter.lm_head.weight)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in params:
        p.requires_grad_(False)
    return drafter.eval()


# ------------------------------------------------------------------ what vLLM drafted, read in its worker
def _record_drafts(worker) -> None:
    """Wrap the runner's take_draft_token_ids (called once per step with every request's k drafts)."""
    runner = worker.model_runner
    if getattr(runner, "_test_drafts", None) is not None:
        return
    runner._test_drafts = {}
    original = runner.take_draft_token_ids

    def take(self):
        out = original()
        if out is not None:
            for req_id, drafts in zip(out.req_ids, out.draft_token_ids):
                self._test_drafts.setdefault(req_id, []).append([int(t) for t in drafts])
        return out

    runner.take_draft_token_ids = types.MethodType(take, runner)


def _take_drafts(worker) -> dict:
    out, worker.model_runner._test_drafts = worker.model_runner._test_drafts, {}
    return out


def _generate_with_drafts(engine, prompts, n=24):
    """generate() at temperature 0, and per prompt the k drafts vLLM proposed at each step."""
    llm = engine._ensure_llm(K, "greedy")
    llm.collective_rpc(_record_drafts)
    llm.collective_rpc(_take_drafts)
    batch = engine.generate(prompts, _sp(n))
    records = llm.collective_rpc(_take_drafts)[0]     # by vLLM request id "<counter>-<random>"
    drafts = [v for _, v in sorted(records.items(), key=lambda kv: int(kv[0].split("-")[0]))]
    assert len(drafts) == len(prompts), list(records)
    return batch, drafts


def _sp(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, num_draft_tokens=K, draft_mode="greedy",
                          ignore_eos=True)


def _assert_drafts_match_reference(policy, drafter, prompts, batch, drafts) -> int:
    """vLLM's drafts at every step equal draft_greedy on the prefix committed at that step (prompt + the
    tokens emitted so far); returns the number of steps compared."""
    compared = 0
    for prompt, comp, steps in zip(prompts, batch.completions, drafts):
        committed = 1                                    # the prefill step emitted one token, then drafted
        assert len(steps) >= len(comp.round_accepted), (len(steps), len(comp.round_accepted))
        for r, proposed in enumerate(steps):
            if committed > len(comp.tokens):
                break
            assert proposed == draft_greedy(policy, drafter, prompt + comp.tokens[:committed], K), (r, committed)
            compared += 1
            if r < len(comp.round_accepted):
                committed += comp.round_accepted[r] + 1
    return compared


@pytest.fixture(scope="module")
def policy():
    return random_model(CFG, seed=0)


@pytest.fixture(scope="module")
def drafter(policy):
    return _trained_drafter(policy, seed=1)


@pytest.fixture(scope="module")
def engine(policy, drafter, tmp_path_factory):
    from rollout.vllm import VLLMEngine, VLLMEngineConfig

    path = save_eagle3(tmp_path_factory.mktemp("eagle3"), drafter)
    eng = VLLMEngine(copy.deepcopy(policy), config=VLLMEngineConfig(
        work_dir=str(tmp_path_factory.mktemp("vllm")), max_model_len=512, draft_method="eagle3",
        drafter_path=str(path)))
    yield eng
    eng.close()


def test_vllm_eagle3_drafts_equal_ours_at_every_position_and_outputs_equal_plain_decoding(engine, policy, drafter):
    prompts = _prompts()
    batch, drafts = _generate_with_drafts(engine, prompts)
    assert [c.tokens for c in batch.completions] == _greedy(policy, prompts)
    accepted = sum(sum(c.round_accepted) for c in batch.completions)
    rounds = sum(len(c.round_accepted) for c in batch.completions)
    assert accepted >= 10, (accepted, rounds)               # drafts are accepted: the multi-token pass runs
    assert _assert_drafts_match_reference(policy, drafter, prompts, batch, drafts) >= rounds
    assert all(t % 4 != 3 for steps in drafts for d in steps for t in d)   # only draft-vocabulary tokens


def test_drafter_refresh_through_the_weight_transfer_api_changes_vllm_drafts_without_restart(engine, policy,
                                                                                            drafter):
    new = _trained_drafter(policy, seed=2)
    starts = engine.num_starts
    engine.update_drafter(new.state_dict(), version=1)
    prompts = _prompts(4, seed=5)
    batch, drafts = _generate_with_drafts(engine, prompts)
    assert engine.num_starts == starts and engine.head_version == 1
    assert [c.tokens for c in batch.completions] == _greedy(policy, prompts)
    _assert_drafts_match_reference(policy, new, prompts, batch, drafts)
    first = [draft_greedy(policy, drafter, p + c.tokens[:1], K) for p, c in zip(prompts, batch.completions)]
    assert first != [steps[0] for steps in drafts]          # the old weights would have drafted otherwise


def test_policy_update_through_the_weight_transfer_api_changes_generated_tokens(engine, policy, drafter):
    new_policy = random_model(CFG, seed=5)
    prompts = _prompts(4, seed=6)
    assert _greedy(new_policy, prompts) != _greedy(policy, prompts)
    starts = engine.num_starts
    engine.update_policy(new_policy.state_dict(), version=1)
    batch, drafts = _generate_with_drafts(engine, prompts)
    assert engine.num_starts == starts and all(c.policy_version == 1 for c in batch.completions)
    assert [c.tokens for c in batch.completions] == _greedy(new_policy, prompts)
    # the drafter reads the new policy's aux states and embedding
    _assert_drafts_match_reference(new_policy, engine.eagle3, prompts, batch, drafts)


# ------------------------------------------------------------------ configuration and bad input (no vLLM start)
def test_backend_is_registered_through_the_plugin_entry_point():
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from rollout.vllm.drafter import register
    from rollout.vllm.weight_transfer import BACKEND, ShmTrainerEngine, ShmWeightTransferEngine

    register()
    register()                                                        # idempotent
    assert WeightTransferEngineFactory._registry[BACKEND]() is ShmWeightTransferEngine
    assert WeightTransferTrainerFactory._registry[BACKEND]() is ShmTrainerEngine


def test_eagle3_settings_and_a_drafter_of_another_policy_are_refused_before_vllm_starts(policy, drafter, tmp_path):
    from rollout.vllm import VLLMEngine, VLLMEngineConfig

    with pytest.raises(ValueError, match="drafter_path is needed by draft_method='eagle3'"):
        VLLMEngineConfig(draft_method="eagle3")
    assert VLLMEngineConfig(draft_method="eagle3", drafter_path="d").speculative_config(3, "greedy", "d") == {
        "method": "eagle3", "num_speculative_tokens": 3, "model": "d", "draft_sample_method": "greedy"}
    path = save_eagle3(tmp_path / "d", drafter)
    other = random_model(tiny_config(vocab_size=256, hidden_size=64, num_hidden_layers=4), seed=0)
    with pytest.raises(ValueError, match=r"config.json: hidden_size 128 != the policy's 64"):
        VLLMEngine(other, config=VLLMEngineConfig(draft_method="eagle3", drafter_path=str(path)))
