"""TRL's GRPOTrainer with the accelerator as its rollout function, on a tiny llama exported by
our own exporter (CPU, local Ray): what TRL trains on is what the accelerator generated, with
the generating policy's log-probs and version, weights synced after each step, the monitor
recording each step, and speculation changing nothing at temperature 0. The `trl-grpo` job: a
user's module:function tasks, resume after a crash, no Ray left after kill -9; the README's TRL
snippet runs as written."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch

from mtp_heads.heads import init_heads
from rollout.accelerator import AcceleratorConfig, CoTrainerConfig, RolloutAccelerator, WorkerConfig
from tests.conftest import chat_tokens, export_tiny_chat_model, tiny_chat_llama_config
from rollout.models.decoder import random_model
from rollout.models.hf_loader import expected_tensor_shapes, hf_config_dict
from rollout.monitor import AcceptanceMonitor, MonitorConfig
from rollout.ray_guard import local_ray as guarded_ray

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")   # rollout_func is "experimental" in TRL 1.16

import datasets  # noqa: E402  dev dependencies (pyproject's dev extra): these tests must run, never skip
import transformers  # noqa: E402
import trl  # noqa: E402

from rollout.integrations.trl import ROLLOUT_STATE, TRLRollout, policy_tensors, sampling_from_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MAX_NEW = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF directory written by export_hf_dir, our policy, heads) for one tiny random llama."""
    policy = random_model(tiny_chat_llama_config(), seed=0)
    out = export_tiny_chat_model(policy, tmp_path_factory.mktemp("trl") / "hf")
    return out, policy, init_heads(policy, num_depths=2, seed=0)


@pytest.fixture(scope="module")
def local_ray():
    with guarded_ray(num_cpus=2, log_to_driver=False):
        yield


def accel_cfg(out_dir, cotrainer: bool) -> AcceleratorConfig:
    return AcceleratorConfig(
        workers=WorkerConfig(num_workers=1, num_cpus_per_worker=1),
        cotrainer=CoTrainerConfig(enabled=cotrainer, steps_per_refresh=2, batch_tokens=64, replay_capacity=16),
        monitor=MonitorConfig(out_dir=str(out_dir), n_boot=10, tensorboard=False, plot_every=0, plots=False),
        num_depths=2)


class RecordingGRPO(trl.GRPOTrainer):
    """Keeps what each loss call trained on: (global_step, ids, masks, rollout log-probs)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_per_token_logps")
        self.trained_on.append((self.state.global_step, {k: inputs[k].detach().clone() for k in keys}))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class Snapshots(transformers.TrainerCallback):
    """The HF model's weights before training and after every optimizer step."""

    def __init__(self):
        self.by_version = {}

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.by_version[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def on_step_end(self, args, state, control, model=None, **kw):
        self.by_version[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_trainer(hf_dir, out_dir, rollout, reward_calls, *, chat: bool, callbacks=(), freeze=(), **args):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(tuple(freeze)))
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    texts = [f"the cat {i}" for i in range(8)]
    prompts = [[{"role": "user", "content": t}] for t in texts] if chat else texts

    def reward(completions, completion_ids, **kw):
        reward_calls.append(kw)                          # our fields arrive as keyword arguments
        return [sum(ids) / (len(ids) * len(chat_tokens())) for ids in completion_ids]    # rarely equal: advantages != 0

    cfg = trl.GRPOConfig(output_dir=str(out_dir), per_device_train_batch_size=4, num_generations=4, max_steps=2,
                         max_completion_length=MAX_NEW, logging_steps=1, report_to="none", save_strategy="no",
                         use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, **args)
    trainer = RecordingGRPO(model=model, reward_funcs=[reward], args=cfg, processing_class=tok,
                            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}), rollout_func=rollout,
                            callbacks=[rollout, *callbacks])
    trainer.trained_on = []
    return trainer


def spy(accel, name):
    """Wrap accel.<name> to keep (args, kwargs, result) of every call."""
    calls, orig = [], getattr(accel, name)

    def wrapped(*a, **k):
        out = orig(*a, **k)
        calls.append((a, k, out))
        return out

    setattr(accel, name, wrapped)
    return calls


def rows(t: dict) -> list[tuple[tuple[int, ...], tuple[int, ...], list[float]]]:
    """(prompt ids, completion ids, rollout log-probs) per row, padding removed."""
    out = []
    for i in range(t["prompt_ids"].shape[0]):
        p = t["prompt_ids"][i][t["prompt_mask"][i].bool()].tolist()
        m = t["completion_mask"][i].bool()
        out.append((tuple(p), tuple(t["completion_ids"][i][m].tolist()), t["sampling_per_token_logps"][i][m].tolist()))
    return sorted(out)


def teacher_forced_logprobs(hf_dir, state_dict, prompt, completion) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.load_state_dict(state_dict)
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)           # [L-1, V]
    return logp[len(prompt) - 1:].gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


# ------------------------------------------------------------------------- no Ray needed

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_parameter_names_are_the_policy_names(arch):
    """transformers' parameter names are ours for every supported architecture: the sync needs no
    renaming beyond wrapper prefixes (and a tied lm_head is not a parameter of its own)."""
    cfg = dataclasses.replace(tiny_chat_llama_config(), architecture=arch, attention_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                              tie_word_embeddings=arch != "llama")
    d = hf_config_dict(cfg, torch.float32)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**d))
    assert set(policy_tensors(model, only_trainable=False)) == set(expected_tensor_shapes(cfg))
    wrapped = torch.nn.Module()
    wrapped.module = model                                    # DDP / accelerate-style "module." prefix
    assert set(policy_tensors(wrapped, only_trainable=False)) == set(expected_tensor_shapes(cfg))


def test_sampling_from_grpo_config_and_refusals():
    args = trl.GRPOConfig(output_dir="unused", max_completion_length=7, temperature=0.7, top_k=5, top_p=0.9,
                          report_to="none", use_cpu=True)
    sp = sampling_from_args(args, [2, 3], num_draft_tokens=3)
    assert (sp.max_new_tokens, sp.temperature, sp.top_k, sp.top_p, sp.stop_token_ids, sp.num_draft_tokens) == (
        7, 0.7, 5, 0.9, (2, 3), 3)
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampling_from_args(trl.GRPOConfig(output_dir="unused", repetition_penalty=1.1, report_to="none",
                                          use_cpu=True), [2])


# ------------------------------------------------------------------------- TRL end to end

def test_grpo_trainer_rolls_out_through_the_accelerator(tiny, local_ray, tmp_path):
    hf_dir, policy, heads = tiny
    accel = RolloutAccelerator.from_config(accel_cfg(tmp_path / "monitor", cotrainer=True), policy=policy, heads=heads)
    try:
        generated, synced = spy(accel, "generate"), spy(accel, "sync_policy")
        rollout = TRLRollout(accel, num_draft_tokens=2, seed=3)
        snaps, reward_calls = Snapshots(), []
        trainer = make_trainer(hf_dir, tmp_path / "trl", rollout, reward_calls, chat=True, callbacks=[snaps],
                               freeze=("model.embed_tokens.", "model.layers.0."), learning_rate=0.05)
        trainer.train()
        assert trainer.state.global_step == 2 and len(generated) == 2 and len(trainer.trained_on) == 2

        for step, ((_, _, batch), (gstep, trained)) in enumerate(zip(generated, trainer.trained_on)):
            assert gstep == step
            ours = sorted((tuple(c.prompt), tuple(c.tokens)) for c in batch.completions)
            assert [(p, c) for p, c, _ in rows(trained)] == ours             # TRL trains on our token ids
            assert {c.policy_version for c in batch.completions} == {step}
            for p, c, lp in rows(trained):                                   # ... with the generator's log-probs
                ref = teacher_forced_logprobs(hf_dir, snaps.by_version[step], p, c)
                torch.testing.assert_close(torch.tensor(lp), ref, atol=2e-4, rtol=0)
        # step 2's rollouts came from the weights TRL made in step 1, not the initial ones
        p, c, lp = rows(trainer.trained_on[1][1])[0]
        assert (torch.tensor(lp) - teacher_forced_logprobs(hf_dir, snaps.by_version[0], p, c)).abs().max() > 1e-3

        # the versions reward functions see: TRL's global step at generation time
        assert [set(call["policy_version"]) for call in reward_calls] == [{0}, {1}]
        assert all(len(call["entropies"]) == 4 and "acceptance_rate" in call for call in reward_calls)
        assert all(len(call["max_probs"]) == 4 and 0 < min(call["mean_max_prob"]) <= 1 for call in reward_calls)
        # partial sync after each optimizer step, HF names, version = global step
        assert [k["version"] for _, k, _ in synced] == [1, 2]
        names = set(synced[0][0][0])
        assert any(n.startswith("model.layers.1.") for n in names)
        assert not any(n.startswith(("model.layers.0.", "model.embed_tokens.")) for n in names)
        assert ray.get(accel.cotrainer.stats.remote(), timeout=120)["policy_version"] == 2
        # the monitor holds both steps, stamped with their policy versions and TRL's reward
        steps = [r for r in AcceptanceMonitor.load_records(tmp_path / "monitor") if "event" not in r]
        assert [(r["step"], r["policy_version_max"]) for r in steps] == [(0, 0), (1, 1)]
        assert all("reward" in r["extra"] and r["num_draft_tokens"] > 0 for r in steps)
        assert any(k.startswith("rollout/acceptance_rate") for row in trainer.state.log_history for k in row)
        assert any(k.startswith("rollout/max_prob_over_0_9") for row in trainer.state.log_history for k in row)
    finally:
        accel.shutdown()


def test_greedy_completions_inside_trl_do_not_depend_on_speculation(tiny, local_ray, tmp_path):
    hf_dir, policy, heads = tiny
    initial = {k: v.clone() for k, v in policy.state_dict().items()}
    accel = RolloutAccelerator.from_config(accel_cfg(tmp_path / "monitor", cotrainer=False), policy=policy, heads=heads)
    try:
        trained, drafts = {}, {}
        for k in (0, 3):
            accel.sync_policy(initial, version=0)             # both runs start from the same policy
            generated = spy(accel, "generate")
            # the entropy bonus moves the policy even though equal greedy completions have no advantage
            trainer = make_trainer(hf_dir, tmp_path / f"trl{k}", TRLRollout(accel, temperature=0.0, num_draft_tokens=k),
                                   [], chat=False, learning_rate=0.05, entropy_coef=0.1)
            trainer.train()
            del accel.generate                                # unwrap the spy
            trained[k] = [[(p, c) for p, c, _ in rows(t)] for _, t in trainer.trained_on]
            drafts[k] = sum(b.spec_stats().num_drafts for _, _, b in generated)
            assert {c.policy_version for c in generated[1][2].completions} == {1}
        assert len(trained[0]) == 2 and trained[0] == trained[3]
        assert drafts[0] == 0 and drafts[3] > 0                # speculation did run in the second
    finally:
        accel.shutdown()


def test_trl_dataset_and_reward_come_from_the_task_source(tmp_path):
    from experiments.trl_grpo import TRLRunConfig, TRLTrainConfig, task_data
    from trainers.tasks import TaskConfig, TaskSource

    tasks = TaskConfig(source="tests.custom_tasks:make_tasks", num_prompts=6, heldout_prompts=2, format_reward=0.25)
    cfg = TRLRunConfig(accelerator=AcceleratorConfig(heads="shipped"), trl=TRLTrainConfig(max_steps=3, prompts_per_step=2),
                       tasks=tasks)
    data, reward = task_data(cfg)
    source = TaskSource(tasks)
    expected = [t for s in range(3) for t in source.sample(2, s)]
    assert [p[-1]["content"] for p in data["prompt"]] == [t.prompt for t in expected]
    assert data["domain"] == [t.domain for t in expected]
    right = [[{"role": "assistant", "content": f"Answer: {t.answer}"}] for t in expected]
    wrong = [[{"role": "assistant", "content": "Answer: nope"}] for _ in expected]
    kw = {"task_index": data["task_index"], "domain": data["domain"]}
    assert reward(data["prompt"], right, **kw) == [1.25] * 6
    assert reward(data["prompt"], wrong, **kw) == [0.25] * 6


# ------------------------------------------------------------------------- the trl-grpo job

SAID: list[str] = []          # answers the user's reward function below was asked to score


def say_tasks():
    """A user's own task source (`tasks.source=tests.test_trl:say_tasks`): items and a reward."""
    items = [{"question": f"Say {w}.", "answer": w, "dataset": "say"} for w in ("yes", "no", "ok", "hi", "up", "go")]

    def reward(completion: str, item: dict) -> float:
        SAID.append(item["answer"])
        return float(item["answer"] in completion)

    return items, reward


def job_args(hf_dir, out_dir, *extra) -> list[str]:
    """trl-grpo on the tiny exported llama: 3 optimizer steps of 2 prompts x 2 completions."""
    return [f"accelerator.model={hf_dir}", "heads=init", "accelerator.num_depths=2", "num_draft_tokens=2",
            "tasks.source=tests.test_trl:say_tasks", "tasks.num_prompts=6", "tasks.heldout_prompts=0",
            "trl.max_steps=3", "trl.prompts_per_step=2", "trl.num_generations=2", "trl.max_completion_length=6",
            "trl.train_last_layers=1", "checkpoint_every=1",
            "accelerator.workers.num_cpus_per_worker=1", "accelerator.cotrainer.num_cpus=1",
            "accelerator.cotrainer.steps_per_refresh=2", "accelerator.cotrainer.batch_tokens=64",
            "accelerator.monitor.n_boot=10", "accelerator.monitor.tensorboard=false", "accelerator.monitor.plots=false",
            f"out_dir={out_dir}", *extra]


class CrashAfterStep(transformers.TrainerCallback):
    """A crash once optimizer step `n` is done and logged by the monitor, before its checkpoint."""

    def __init__(self, n: int):
        self.n = n

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.n:
            raise RuntimeError("simulated crash")


def test_trl_grpo_uses_a_users_task_source_and_resumes_after_a_crash(tiny, local_ray, tmp_path, monkeypatch, capsys):
    """tasks.source=module:function gives trl-grpo its prompts and reward. A crash after step 2 (its
    monitor record written, its checkpoint not) is resumed with `resume=true` from checkpoint-1:
    every step is in the monitor once, with its policy version, and TRL continues at global step 1."""
    from experiments import trl_grpo

    hf_dir, _, _ = tiny
    out = tmp_path / "run"
    SAID.clear()

    class Crashing(trl.GRPOTrainer):
        def __init__(self, *a, callbacks=(), **k):
            super().__init__(*a, callbacks=[*callbacks, CrashAfterStep(2)], **k)

    with monkeypatch.context() as m:
        m.setattr(trl, "GRPOTrainer", Crashing)
        with pytest.raises(RuntimeError, match="simulated crash"):
            trl_grpo.main(job_args(hf_dir, out))
    steps = [r["step"] for r in AcceptanceMonitor.load_records(out) if "event" not in r]
    assert steps == [0, 1] and [p.name for p in (out / "trl").glob("checkpoint-*")] == ["checkpoint-1"]
    assert set(SAID) <= {"yes", "no", "ok", "hi", "up", "go"} and len(SAID) == 2 * 4   # the user's reward

    with pytest.raises(ValueError, match="resume=true"):                # no silent restart into a run
        trl_grpo.main(job_args(hf_dir, out))
    with pytest.raises(ValueError, match="trl.max_steps"):               # a resumed run is the same run
        trl_grpo.main(job_args(hf_dir, out, "resume=true", "trl.max_steps=4"))
    capsys.readouterr()
    assert trl_grpo.main([f"out_dir={out}", "resume=true"]) == 0        # the run's own config.yaml
    assert "resuming" in capsys.readouterr().out

    records = [r for r in AcceptanceMonitor.load_records(out) if "event" not in r]
    assert [(r["step"], r["policy_version_max"]) for r in records] == [(0, 0), (1, 1), (2, 2)]
    assert [p.name for p in (out / "trl").glob("checkpoint-*")] == ["checkpoint-3"]
    assert (out / "trl" / "checkpoint-3" / ROLLOUT_STATE).is_file()
    state = json.loads((out / "trl" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    logged = [r["step"] for r in map(json.loads, (out / "trl_log.jsonl").read_text().splitlines()) if "loss" in r]
    assert logged == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["steps"] == [0, 1, 2]
    assert len(SAID) == 2 * 4 + 2 * 4                                    # steps 2 and 3 after the resume
    assert "all 3 steps are done" in run_again(trl_grpo, out, capsys)


def run_again(trl_grpo, out, capsys) -> str:
    capsys.readouterr()
    trl_grpo.main([f"out_dir={out}", "resume=true"])
    return capsys.readouterr().out


@pytest.mark.ray
@pytest.mark.slow          # a fresh interpreter, TRL's imports and a new Ray: ~30-60 s
def test_trl_grpo_killed_leaves_no_ray(tiny, tmp_path):
    """kill -9 of `mtp-rollout trl-grpo` once its actors run: its local Ray goes too (the guard)."""
    from tests.test_ray_exposure import has_actor, kill9_leaves_no_ray

    hf_dir, _, _ = tiny
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "trl-grpo",
                             *job_args(hf_dir, tmp_path / "run", "trl.max_steps=50", "checkpoint_every=0")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "local"})
    kill9_leaves_no_ray(proc, has_actor("ray::RolloutWor"))


def readme_trl_snippet() -> str:
    """The ```python block of README.md's TRL section."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### TRL", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    assert m, "README.md's TRL section has no ```python snippet"
    return m.group(1)


@pytest.mark.slow
def test_readme_trl_snippet_runs_as_written(tmp_path):
    """The real default model and its shipped heads, exactly the README's lines, in a fresh directory."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "local"}
    proc = subprocess.run([sys.executable, "-c", readme_trl_snippet()], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in AcceptanceMonitor.load_records(tmp_path / "runs" / "trl_example") if "event" not in r]
    assert [r["step"] for r in steps] == [0, 1] and all(r["num_draft_tokens"] > 0 for r in steps)
