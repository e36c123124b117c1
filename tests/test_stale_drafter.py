"""The acceptance-collapse alert: a policy sync that leaves the drafter stale is caught at its step,
with the cause named from the versions (stale drafter, bad refresh, changed inputs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mtp_heads.heads import init_heads
from rollout.accelerator import AcceleratorConfig
from rollout.config_loader import load_config
from rollout.engine.config import EngineConfig
from rollout.models.decoder import build_model
from rollout.monitor import AcceptanceMonitor, MonitorConfig
from rollout.torch_engine import TorchEngine
from rollout.types import Completion, RolloutBatch, SamplingParams
from tests.conftest import tiny_model

COLLAPSE = "acceptance_collapse"


def config(tmp_path, **kw) -> MonitorConfig:
    base = dict(out_dir=str(tmp_path / "mon"), window=5, n_boot=50, tensorboard=False, plot_every=0, plots=False)
    return MonitorConfig(**{**base, **kw})


def collapse_alerts(rec: dict) -> list[dict]:
    return [a for a in rec["alerts"] if a["name"] == COLLAPSE]


# ---------------------------------------------------------------------------------------------
# End to end: the torch engine drafting for a policy whose next token is a fixed permutation
# ---------------------------------------------------------------------------------------------

V = 32     # vocabulary = hidden size, so one-hot embeddings are orthogonal


def permutation_policy(seed: int):
    """A real CausalLM whose next token is sigma(current token) with probability ~1 at T = 1: one-hot
    embeddings (tied LM head), layer 0 the identity, attention outputs zeroed, and layer 1's MLP mapping
    e_t to e_sigma(t). Heads from init_heads copy that last layer, so they draft sigma(sigma(t)) for the
    policy they were built from, and sigma_A(sigma_B(t)) (almost always wrong) for another one."""
    base = tiny_model(seed=seed, vocab_size=V)
    sd = dict(base.state_dict())
    sigma = torch.randperm(V, generator=torch.Generator().manual_seed(seed))
    eye, inter = torch.eye(V), base.config.intermediate_size
    sd["model.embed_tokens.weight"] = 5.0 * eye
    for i in (0, 1):
        sd[f"model.layers.{i}.self_attn.o_proj.weight"] = torch.zeros(V, V)
    sd["model.layers.0.mlp.down_proj.weight"] = torch.zeros(V, inter)
    unit = torch.zeros(inter, V)
    unit[:V] = eye                                            # hidden unit t fires on token t only
    sd["model.layers.1.mlp.gate_proj.weight"] = unit.clone()
    sd["model.layers.1.mlp.up_proj.weight"] = unit.clone()
    down = torch.zeros(V, inter)
    down[sigma, torch.arange(V)] = 1.0                        # ... and writes e_sigma(t)
    sd["model.layers.1.mlp.down_proj.weight"] = down
    return build_model(base.config, sd), sigma


PROMPTS = [[3 + i, 11 + i, 7] for i in range(8)]
SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0, num_draft_tokens=2, draft_mode="rejection",
                          ignore_eos=True, seed=0)


def run_sync(tmp_path, at_sync: str, draft_lengths: str = "fixed") -> tuple[list[dict], list[dict], bool]:
    """Steps 0..3 on policy A, its version moving every step and its weights not (heads lag by design);
    at step 4, by `at_sync`: "nothing" (policy B, version 4, heads kept: the stale drafter), "refresh"
    (policy B and heads built for B, head version 1) or "heads_only" (heads for B arrive, the policy
    stays A: a bad refresh). `draft_lengths`: the engine's ("chosen": per row and round, as in a run). Returns the monitor's step records, its events, and whether the last
    step's tokens follow B's permutation (the sync reached the engine)."""
    policy_a, _ = permutation_policy(0)
    policy_b, sigma_b = permutation_policy(1)
    a_weights = {k: v.clone() for k, v in policy_a.state_dict().items()}
    # heads only: history (this policy's rollouts repeat exactly) would take rows from the heads at
    # moments that depend on measured round times, and the test is about the heads' drafts
    engine = TorchEngine(policy_a, init_heads(policy_a, 2),
                         config=EngineConfig(draft_lengths=draft_lengths, draft_sources=("heads",)))
    mon = AcceptanceMonitor(config(tmp_path))
    for step in range(6):
        if step == 4 and at_sync in ("nothing", "refresh"):
            engine.update_policy(policy_b.state_dict(), step)
        elif 0 < step < 4:
            engine.update_policy(a_weights, step)
        if step == 4 and at_sync in ("refresh", "heads_only"):
            engine.update_heads(init_heads(policy_b, 2).state_dict(), 1)
        batch = engine.generate(PROMPTS, SAMPLING)
        mon.record_step(step, batch)
    mon.close()
    follows_b = all(int(sigma_b[t]) == n for c in batch.completions for t, n in zip(c.tokens, c.tokens[1:]))
    return mon.records, mon.events, follows_b


@pytest.mark.parametrize("draft_lengths", ["fixed", "chosen"])
def test_a_policy_sync_without_a_drafter_refresh_fires_at_that_step_naming_the_stale_drafter(tmp_path, draft_lengths):
    records, events, follows_b = run_sync(tmp_path, "nothing", draft_lengths)
    assert follows_b                                                    # the sync reached the engine
    heads_acc = [r["drafting"]["heads"]["acceptance_rate"] for r in records]
    assert min(heads_acc[:4]) > 0.9 and max(heads_acc[4:]) < 0.1       # the real engine collapsed at the sync
    assert records[4]["drafting"]["heads"]["draft_tokens"] >= 64        # enough drafts to judge that step
    assert [r["policy_version_max"] for r in records] == [0, 1, 2, 3, 4, 4]
    assert all(r["head_version_max"] == 0 for r in records)
    assert all(collapse_alerts(r) == [] for r in records[:4])          # the policy moved, its weights did not
    (alert,) = collapse_alerts(records[4])
    assert alert["cause"] == "stale_drafter"
    assert alert["policy_version"] == [3, 4] and alert["head_version"] == [0, 0]
    msg = alert["message"]
    assert "at step 4" in msg and "(3 -> 4)" in msg and "drafter stayed at version 0" in msg
    assert "not refreshed after the policy sync" in msg
    assert collapse_alerts(records[5])      # it holds while acceptance stays down (or the chooser drafts too little)
    assert [e["detail"]["name"] for e in events if e["event"] == "alert"].count(COLLAPSE) == 1


@pytest.mark.parametrize("draft_lengths", ["fixed", "chosen"])
def test_the_same_sync_with_the_heads_refreshed_does_not_fire(tmp_path, draft_lengths):
    records, events, follows_b = run_sync(tmp_path, "refresh", draft_lengths)
    assert follows_b
    assert [r["head_version_max"] for r in records] == [0, 0, 0, 0, 1, 1]
    assert min(r["drafting"]["heads"]["acceptance_rate"] for r in records) > 0.9
    assert all(collapse_alerts(r) == [] for r in records)
    assert not [e for e in events if e["event"] == "alert"]


def test_heads_for_another_policy_arriving_alone_are_named_a_bad_refresh(tmp_path):
    records, _, follows_b = run_sync(tmp_path, "heads_only")
    assert not follows_b
    assert records[4]["drafting"]["heads"]["acceptance_rate"] < 0.1
    (alert,) = collapse_alerts(records[4])
    assert alert["cause"] == "bad_refresh" and alert["head_version"] == [0, 1]
    assert "drafter moved from version 0 to 1" in alert["message"]


# ---------------------------------------------------------------------------------------------
# Synthetic records: the rule and the three causes
# ---------------------------------------------------------------------------------------------


def completion(acceptance: float, *, policy: int = 0, heads: int = 0, entropy: float = 0.6, k: int = 4,
               rounds: int = 50) -> Completion:
    """Exactly round(acceptance * k * rounds) accepted drafts, every drafted position at `entropy`."""
    total = round(acceptance * k * rounds)
    accepted = [k] * (total // k) + ([total % k] if total % k else [])
    accepted += [0] * (rounds - len(accepted))
    n_tok = sum(a + 1 for a in accepted)
    return Completion(prompt=[1], tokens=[7] * n_tok, logprobs=[0.0] * n_tok, entropies=[entropy] * n_tok,
                      round_accepted=accepted, draft_entropies=[[entropy] * k for _ in accepted], num_draft_tokens=k,
                      policy_version=policy, head_version=heads)


def plain_completion(policy: int = 0, heads: int = 0) -> Completion:
    return Completion(prompt=[1], tokens=[7] * 20, logprobs=[0.0] * 20, entropies=[0.6] * 20,
                      policy_version=policy, head_version=heads)


def record(mon: AcceptanceMonitor, step: int, *comps: Completion) -> dict:
    return mon.record_step(step, RolloutBatch(list(comps)))


def test_stale_drafter_policy_moved_heads_did_not(tmp_path):
    mon = AcceptanceMonitor(config(tmp_path))
    for s in range(9, 12):
        assert collapse_alerts(record(mon, s, completion(0.42, policy=s, heads=4))) == []
    rec = record(mon, 12, completion(0.03, policy=12, heads=4))
    (alert,) = collapse_alerts(rec)
    assert alert["cause"] == "stale_drafter"
    assert alert["message"] == ("heads' acceptance fell from 0.42 to 0.03 at step 12 while the policy moved 1 version "
                                "(11 -> 12) and the drafter stayed at version 4: the drafter was not refreshed after "
                                "the policy sync (stale or missing drafter weights)")
    assert alert["baseline"] == pytest.approx(0.42) and alert["threshold"] == pytest.approx(0.105)
    mon.close()


def test_stale_drafter_counts_every_version_the_policy_moved_since_the_last_healthy_step(tmp_path):
    mon = AcceptanceMonitor(config(tmp_path))
    for s in range(6):
        record(mon, s, completion(0.42, policy=9, heads=4))
    record(mon, 6, plain_completion(policy=10, heads=4))             # a plain step: no acceptance, not judged
    rec = record(mon, 7, completion(0.03, policy=12, heads=4))
    (alert,) = collapse_alerts(rec)
    assert alert["cause"] == "stale_drafter" and "moved 3 versions (9 -> 12)" in alert["message"]
    mon.close()


def test_bad_refresh_heads_moved_at_the_collapse(tmp_path):
    mon = AcceptanceMonitor(config(tmp_path))
    for s in range(4):
        record(mon, s, completion(0.6, policy=s, heads=2))
    (alert,) = collapse_alerts(record(mon, 4, completion(0.02, policy=5, heads=3)))
    assert alert["cause"] == "bad_refresh" and alert["head_version"] == [2, 3]
    assert "drafter moved from version 2 to 3 (policy 3 -> 5)" in alert["message"]
    assert "new drafter weights are wrong" in alert["message"]
    mon.close()


def test_inputs_changed_neither_version_moved_reports_the_entropy_change(tmp_path):
    mon = AcceptanceMonitor(config(tmp_path))
    for s in range(4):
        record(mon, s, completion(0.7, policy=3, heads=1, entropy=0.6))
    (alert,) = collapse_alerts(record(mon, 4, completion(0.05, policy=3, heads=1, entropy=2.5)))
    assert alert["cause"] == "inputs_changed" and alert["entropy"] == pytest.approx([0.6, 2.5])
    assert "policy (version 3) and the drafter (version 1) unchanged" in alert["message"]
    assert "entropy at drafted positions 0.60 -> 2.50 nats, +1.90" in alert["message"]
    mon.close()


def test_the_alert_holds_until_acceptance_recovers_and_through_steps_too_small_to_tell(tmp_path):
    mon = AcceptanceMonitor(config(tmp_path))
    for s in range(4):
        record(mon, s, completion(0.5, policy=s))
    fired = [record(mon, s, completion(0.02, policy=4)) for s in (4, 5, 6, 7, 8, 9)]
    assert all(collapse_alerts(r) for r in fired)           # flagged steps stay out of the baseline
    few = record(mon, 10, completion(0.0, policy=4, rounds=5))   # 20 drafts < collapse_min_draft_tokens
    assert collapse_alerts(few) and collapse_alerts(few)[0]["value"] == pytest.approx(0.02)
    plain = record(mon, 11, plain_completion(policy=4))
    assert collapse_alerts(plain)
    recovered = record(mon, 12, completion(0.5, policy=4, heads=1))
    assert collapse_alerts(recovered) == []
    kinds = [(e["event"], e["detail"].get("name")) for e in mon.events]
    assert kinds.count(("alert", COLLAPSE)) == 1 and kinds.count(("alert_cleared", COLLAPSE)) == 1
    mon.close()


def test_noise_within_the_window_does_not_fire(tmp_path):
    """RL-like: the policy moves every step, heads lag, acceptance wobbles 0.25..0.55 (also the binomial
    noise of a 200-draft step at p = 0.4, sd 0.035); dips to just above the rule, plain steps, and a
    low-acceptance step with too few drafts to judge: nothing fires."""
    rng = np.random.default_rng(0)
    mon = AcceptanceMonitor(config(tmp_path))
    recs = [record(mon, s, completion(float(rng.uniform(0.25, 0.55)), policy=s, heads=s // 5)) for s in range(30)]
    median = float(np.median([r["drafting"]["heads"]["acceptance_rate"] for r in recs[-5:]]))
    recs.append(record(mon, 30, completion(0.26 * median, policy=30, heads=6)))    # above fraction x median
    recs.append(record(mon, 31, plain_completion(policy=31, heads=6)))
    recs.append(record(mon, 32, completion(0.0, policy=32, heads=6, rounds=10)))    # 40 drafts: too few
    recs.append(record(mon, 33, completion(0.4, policy=33, heads=6)))
    assert all(collapse_alerts(r) == [] for r in recs)
    mon.close()


def test_a_drop_above_the_floor_or_without_a_baseline_does_not_fire(tmp_path):
    mon = AcceptanceMonitor(config(tmp_path))
    assert collapse_alerts(record(mon, 0, completion(0.9))) == []
    assert collapse_alerts(record(mon, 1, completion(0.9))) == []
    assert collapse_alerts(record(mon, 2, completion(0.01, policy=1))) == []   # 2 healthy steps: no median yet
    for s in range(3, 6):
        record(mon, s, completion(0.9, policy=1))
    # 0.9 -> 0.2: below 0.25 x median (0.225) but above the floor 0.15: a drop, not a collapse towards 0
    assert collapse_alerts(record(mon, 6, completion(0.2, policy=2))) == []
    assert collapse_alerts(record(mon, 7, completion(0.1, policy=3)))[0]["cause"] == "stale_drafter"
    mon.close()


def test_the_alert_survives_a_resume(tmp_path):
    mon = AcceptanceMonitor(config(tmp_path))
    for s in range(4):
        record(mon, s, completion(0.6, policy=s))
    assert collapse_alerts(record(mon, 4, completion(0.01, policy=4)))
    mon.close()
    again = AcceptanceMonitor(config(tmp_path))
    assert collapse_alerts(record(again, 5, completion(0.01, policy=5)))[0]["cause"] == "stale_drafter"
    again.close()
    assert [e["event"] for e in again.events if e["detail"].get("name") == COLLAPSE] == ["alert"]


# ---------------------------------------------------------------------------------------------
# Thresholds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, value", [
    ("collapse_fraction", 0.0), ("collapse_fraction", 1.0), ("collapse_fraction", float("nan")),
    ("collapse_fraction", "0.3"), ("collapse_floor", 0.0), ("collapse_floor", 1.5), ("collapse_floor", True),
    ("collapse_min_draft_tokens", 0), ("collapse_min_draft_tokens", 8.0),
])
def test_bad_thresholds_are_refused_naming_the_key(tmp_path, key, value):
    with pytest.raises(ValueError, match=key):
        config(tmp_path, **{key: value})


def test_bad_thresholds_from_a_config_file_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="collapse_floor"):
        load_config(AcceleratorConfig, [f"monitor.out_dir={tmp_path}", "monitor.collapse_floor=2"])
    cfg, _ = load_config(AcceleratorConfig, [f"monitor.out_dir={tmp_path}", "monitor.collapse_fraction=0.1"])
    assert cfg.monitor.collapse_fraction == 0.1 and cfg.monitor.collapse_min_draft_tokens == 64


def test_inputs_changed_without_recorded_entropy_says_so(tmp_path):
    """A producer without per-draft entropies: the message says so instead of printing nan."""
    def no_entropy(acc: float) -> Completion:
        c = completion(acc, policy=2, heads=1)
        c.draft_entropies = []
        return c
    mon = AcceptanceMonitor(config(tmp_path))
    for s in range(3):
        record(mon, s, no_entropy(0.5))
    (alert,) = collapse_alerts(record(mon, 3, no_entropy(0.01)))
    assert alert["cause"] == "inputs_changed" and "nan" not in alert["message"]
    assert "recorded no entropy at drafted positions" in alert["message"]
    mon.close()
