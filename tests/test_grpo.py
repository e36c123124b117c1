"""GRPO: advantages, the loss against a hand-computed reference, log-prob alignment with the
engine, the entropy controls, and the one-step-ahead prefetcher."""
import math
import threading
import time

import pytest
import torch

from rollout.torch_engine import TorchEngine
from rollout.types import Completion, RolloutBatch, SamplingParams
from tests.conftest import tiny_model
from trainers.grpo import (GRPOConfig, GRPOTrainer, Prefetcher, ScheduleConfig, group_advantages,
                           grpo_token_loss, pack_completions, token_logprobs)


@pytest.fixture
def policy():
    return tiny_model(seed=1, vocab_size=64)


def test_advantages_are_normalised_per_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0, 0.0, 1.0, 2.0, 3.0])
    a = group_advantages(r, group_size=4).view(3, 4)
    assert torch.allclose(a.mean(1), torch.zeros(3), atol=1e-6)
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(a[1], torch.zeros(4))                       # equal rewards: no signal
    assert torch.allclose(a[2].std(unbiased=False), torch.tensor(1.0), atol=1e-5)
    with pytest.raises(ValueError, match="groups of 5"):
        group_advantages(r, group_size=5)


def test_loss_matches_hand_computed_reference():
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1])
    old = torch.tensor([-1.2, -0.5, -1.0, -0.4])
    adv = torch.tensor([1.0, 1.0, -2.0, 0.5])
    ent = torch.tensor([2.0, 1.0, 0.5, 3.0])
    cl, ch, c, n = 0.2, 0.28, 0.1, 5          # n > 4: normalised by the step's token count
    ref = 0.0
    for lp, o, a, h in zip(logp.tolist(), old.tolist(), adv.tolist(), ent.tolist()):
        r = math.exp(lp - o)
        ref += -min(r * a, min(max(r, 1 - cl), 1 + ch) * a) - c * h
    ref /= n
    loss, stats = grpo_token_loss(logp, old, adv, ent, clip_low=cl, clip_high=ch, entropy_coef=c, num_tokens=n)
    assert loss.item() == pytest.approx(ref, rel=1e-6)
    # ratios: e^0.2 (clipped at 1.28? no: 1.22 < 1.28), 1, e^-1 = 0.37 (clipped low), e^0.3 = 1.35 (clipped high)
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)
    assert stats["entropy"].item() == pytest.approx(6.5 / 5)


def test_pack_places_completion_targets():
    p = pack_completions([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], [[-1.0, -2.0], [-3.0, -4.0, -5.0]], [0.5, -1.0])
    assert p.seq.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert p.seq[:, 1:][p.target].tolist() == [9, 10, 11, 12, 13]
    assert p.old_logp.tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert p.adv.tolist() == [0.5, 0.5, -1.0, -1.0, -1.0]


def _rollouts(policy, n=4, temperature=1.0, seed=0, max_new_tokens=6):
    prompts = [[2 + i, 3, 4 + i][: 2 + i % 2] for i in range(n)]
    return TorchEngine(policy).generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                                seed=seed, ignore_eos=True))


def test_trainer_logprobs_equal_rollout_logprobs_before_any_update(policy):
    batch = _rollouts(policy)
    cs = batch.completions
    packed = pack_completions([c.prompt for c in cs], [c.tokens for c in cs], [c.logprobs for c in cs],
                              [0.0] * len(cs))
    trainer = GRPOTrainer(policy, GRPOConfig(group_size=2), total_steps=1)
    with torch.no_grad():
        logp, ent = token_logprobs(trainer.model, packed)
    assert torch.allclose(logp, packed.old_logp, atol=1e-5)       # ratio 1 on-policy
    # the entropy bonus acts on the same per-token entropy the rollouts report (temperature 1)
    assert torch.allclose(ent, torch.tensor([h for c in cs for h in c.entropies]), atol=1e-5)


def test_positive_advantage_raises_that_completions_probability(policy):
    batch = _rollouts(policy, n=2)
    cfg = GRPOConfig(group_size=2, lr=1e-2, entropy_coef=ScheduleConfig(0.0, 0.0), micro_batch=1)
    trainer = GRPOTrainer(policy, cfg, total_steps=1)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    cs = batch.completions
    packed = pack_completions([c.prompt for c in cs], [c.tokens for c in cs], [c.logprobs for c in cs], [0.0, 0.0])
    stats = trainer.step(batch, rewards=[1.0, 0.0], step=0)
    with torch.no_grad():
        logp, _ = token_logprobs(trainer.model, packed)
    n0 = len(cs[0].tokens)
    assert logp[:n0].sum() > packed.old_logp[:n0].sum()           # rewarded completion: more likely
    assert logp[n0:].sum() < packed.old_logp[n0:].sum()           # the other: less likely
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(trainer.trainable_names)
    assert all(n.startswith(("model.layers.0.", "model.layers.1.", "model.norm.")) for n in changed)
    assert stats["reward"] == 0.5 and stats["num_tokens"] == 12


def test_trained_weights_reach_an_engine(policy):
    trainer = GRPOTrainer(policy, GRPOConfig(group_size=2, train_last_layers=1, lr=1e-2), total_steps=1)
    trainer.step(_rollouts(policy, n=2), rewards=[1.0, 0.0], step=0)
    w = trainer.trained_weights()
    assert set(w) == {n for n in w if n.startswith(("model.layers.1.", "model.norm."))} and w
    engine = TorchEngine(tiny_model(seed=1, vocab_size=64))
    engine.update_policy(w, version=1)
    tokens = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(engine.policy(tokens), trainer.model(tokens), atol=1e-5)


def test_bad_trainable_selection_is_rejected(policy):
    with pytest.raises(ValueError, match="train_last_layers"):
        GRPOTrainer(policy, GRPOConfig(train_last_layers=3), total_steps=1)
    with pytest.raises(ValueError, match="no policy parameter"):
        GRPOTrainer(policy, GRPOConfig(train_last_layers=0, train_final_norm=False), total_steps=1)


def test_schedules():
    lin = ScheduleConfig(0.5, 1.5)
    assert [lin.at(s, 5) for s in range(5)] == pytest.approx([0.5, 0.75, 1.0, 1.25, 1.5])
    assert ScheduleConfig(0.7, 2.0, "constant").at(4, 5) == 0.7
    cos = ScheduleConfig(0.0, 1.0, "cosine")
    assert cos.at(0, 11) == 0.0 and cos.at(5, 11) == pytest.approx(0.5) and cos.at(10, 11) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="shape"):
        ScheduleConfig(0, 1, "exponential")


def test_entropy_bonus_raises_policy_entropy(policy):
    """Zero-advantage batches (all rewards equal) leave only the bonus: entropy must climb."""
    cfg = GRPOConfig(group_size=2, lr=3e-2, entropy_coef=ScheduleConfig(0.5, 0.5, "constant"))
    trainer = GRPOTrainer(policy, cfg, total_steps=6)
    entropies = []
    for step in range(6):
        stats = trainer.step(_rollouts(trainer.model, n=4, seed=step), rewards=[0.0] * 4, step=step)
        entropies.append(stats["entropy"])
    assert entropies[-1] > entropies[0] + 0.05, entropies


def test_temperature_schedule_raises_rollout_entropy(policy):
    """The monitor's entropy is that of the sampled (temperature-scaled) distribution."""
    sched = ScheduleConfig(0.5, 1.5)
    means = []
    for step in range(3):
        b = _rollouts(policy, n=4, temperature=sched.at(step, 3), seed=step, max_new_tokens=8)
        means.append(sum(h for c in b.completions for h in c.entropies) / b.num_tokens)
    assert means[0] < means[1] < means[2], means


def test_prefetcher_runs_the_next_generation_while_the_caller_trains():
    started, log = threading.Event(), []

    def generate(step):
        log.append(("gen-start", step))
        started.set()
        time.sleep(0.05)
        return RolloutBatch([Completion(prompt=[1], tokens=[step], logprobs=[0.0], entropies=[0.0])])

    pre = Prefetcher(generate)
    pre.submit(0)
    assert pre.result().completions[0].tokens == [0]
    started.clear()
    pre.submit(1)
    assert started.wait(2.0)                  # generation of step 1 began before its result is asked for
    log.append(("train", 0))
    with pytest.raises(RuntimeError, match="in flight"):
        pre.submit(2)
    assert pre.result().completions[0].tokens == [1]
    pre.close()
    assert log == [("gen-start", 0), ("gen-start", 1), ("train", 0)]


# ------------------------------------------------------------------------------ config

from pathlib import Path  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402

from rollout.config_loader import config_keys, keys_table, write_resolved  # noqa: E402
from trainers.config import RunConfig, load_run_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_config_overrides_interpolation_and_resolved_roundtrip(tmp_path):
    run_dir = tmp_path / "run"
    cfg, resolved = load_run_config([str(ROOT / "configs/smoke.yaml"), f"out_dir={run_dir}", "grpo.lr=0.5",
                                 "sampling.temperature.end=2.0", "tasks.datasets=[spell_backward]"])
    assert isinstance(cfg, RunConfig) and cfg.grpo.lr == 0.5 and cfg.tasks.datasets == ("spell_backward",)
    assert cfg.sampling.temperature.end == 2.0 and cfg.sampling.temperature.start == 0.8   # YAML kept
    assert cfg.accelerator.model == "tiny-random"                                          # from the YAML
    assert cfg.accelerator.monitor.out_dir == str(run_dir)                                 # follows out_dir
    path = write_resolved(resolved, run_dir)
    assert "${" not in path.read_text()
    again, _ = load_run_config([str(path)])
    assert again == cfg


def test_now_gives_a_timestamped_run_dir():
    cfg, _ = load_run_config([])
    assert cfg.out_dir.startswith("runs/async_rl/") and "${" not in cfg.out_dir
    assert cfg.accelerator.cotrainer.checkpoint_dir == cfg.out_dir + "/cotrainer"


@pytest.mark.parametrize("args,key", [
    (["grpo.lrr=1"], "grpo.lrr"), (["accelerator.workers.num_worker=2"], "accelerator.workers.num_worker"),
    (["steps=abc"], "steps"), (["bogus=1"], "bogus"),
])
def test_bad_config_keys_name_the_key(args, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        load_run_config(args)


def test_bad_key_in_yaml_names_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  group_sise: 4\n")
    with pytest.raises(ValueError, match=r"bad.yaml.*'grpo.group_sise'"):
        load_run_config([str(bad)])
    with pytest.raises(ValueError, match="neither a YAML file"):
        load_run_config([str(tmp_path / "missing.yaml")])


def test_bad_values_are_rejected_by_the_dataclasses():
    with pytest.raises(ValueError, match="algebra"):
        load_run_config(["tasks.datasets=[algebra]"])
    with pytest.raises(ValueError, match="group_size"):
        load_run_config(["grpo.group_size=1"])
    with pytest.raises(ValueError, match="draft_mode"):
        load_run_config(["sampling.draft_mode=beam"])


def test_configs_readme_table_is_the_schema_and_every_key_has_a_meaning():
    text = (ROOT / "configs/README.md").read_text()
    after = text[text.index("## All keys"):]
    block = after[after.index("| key | default | meaning |"):].split("\n\n")[0].strip()
    assert block == keys_table(RunConfig), "configs/README.md is stale: paste `python -m trainers.config`"
    undocumented = [k.key for k in config_keys(RunConfig) if not k.help]
    assert not undocumented, f"give these fields a comment or metadata help: {undocumented}"


def test_update_readme_rewrites_only_a_stale_table(tmp_path):
    from trainers.config import update_readme_table

    readme = tmp_path / "README.md"
    current = (ROOT / "configs/README.md").read_text()
    stale = current.replace("| `tasks.epochs` | `2` | passes over it (sets the RL steps when `steps` is null) |\n", "")
    assert stale != current
    readme.write_text(stale)
    assert update_readme_table(readme) and readme.read_text() == current
    assert not update_readme_table(readme)


def test_run_help_lists_every_key_with_default_and_meaning(capsys):
    from experiments.async_rl import main

    from experiments.async_rl import DEFAULT_CONFIG

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for k in config_keys(RunConfig, [str(DEFAULT_CONFIG)]):        # the preset's values: what a run uses
        i = next(i for i, l in enumerate(lines) if l.strip().startswith(f"{k.key} = "))
        assert k.default in lines[i] and k.help in " ".join(lines[i:i + 2])   # a long default wraps its meaning


@pytest.mark.parametrize("name", ["async_rl.yaml", "smoke.yaml"])
def test_shipped_configs_load(name):
    cfg, resolved = load_run_config([str(ROOT / "configs" / name)])
    assert "${" not in resolved and OmegaConf.create(resolved).steps == cfg.steps
    assert cfg.grpo.group_size >= 2 and len(cfg.tasks.datasets) >= 2


def test_main_job_defaults_to_async_rl_yaml():
    from experiments.async_rl import DEFAULT_CONFIG, with_default_config

    assert with_default_config(["steps=3"]) == [str(DEFAULT_CONFIG), "steps=3"]
    assert with_default_config(["configs/smoke.yaml", "steps=3"]) == ["configs/smoke.yaml", "steps=3"]
    cfg, _ = load_run_config(with_default_config([]))
    assert cfg.accelerator.model == "smollm2-135m" and cfg.heads == cfg.accelerator.heads == "shipped"
