"""The entropy sweep (`mtp-rollout sweep`, rollout/monitor/sweep.py) on tiny random models.

The key check: what the sweep reports as conditional acceptance at draft position 1 is what
theory says it must be for the very contexts it decoded — E[1 - TV(p, q)] in rejection mode and
E[p(argmax q)] in greedy mode, with p and q recomputed by a teacher-forced pass over each round's
committed prefix — within sampling error (a z-test), and a wrong expectation fails the same test.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from experiments import cli
from experiments.entropy_sweep import DEFAULT_CONFIG, SweepConfig
from mtp_heads.checkpoint import HeadMeta, save_heads
from mtp_heads.heads import MTPHeads, init_heads
from mtp_heads.losses import draft_loss
from rollout.engine.config import EngineConfig
from rollout.config_loader import config_keys, load_config
from rollout.models.decoder import CausalLM
from experiments.sweep_measure import SweepSettings, TemperatureRun, decode_at, temperature_record
from rollout.torch_engine import TorchEngine
from rollout.verify import process_logits
from tests.helpers import entropy
from tests.conftest import random_heads, tiny_model
from trainers.rl_policy import load_rl_policy

Z_PASS, Z_FAIL = 4.0, 8.0     # |z| < 4 for the right expectation (false alarm ~6e-5); > 8 for a wrong one


# ---------------------------------------------------------------------------------------------
# position 1 of every round, recomputed by teacher forcing
# ---------------------------------------------------------------------------------------------

def round_starts(prompt_len: int, round_accepted: list[int]) -> np.ndarray:
    """Committed length at the start of each round: the prompt, the token sampled after prefill,
    then accepted + 1 tokens per earlier round."""
    done = np.cumsum([0] + [a + 1 for a in round_accepted[:-1]])
    return prompt_len + 1 + done


@torch.no_grad()
def position1_dists(policy: CausalLM, heads: MTPHeads, run: TemperatureRun):
    """p, q [R, V] at draft position 1 of every round R of the run (processed at its temperature),
    the engine's entropy there [R] and whether the draft was accepted [R] bool."""
    ps, qs, ent, acc = [], [], [], []
    for c in run.completions:
        if not c.round_accepted:
            continue
        full = torch.tensor([c.prompt + c.tokens])                                  # [1, L]
        hidden = policy.hidden_states(full)                                          # [1, L, d]
        head_states = heads.teacher_forced(policy, hidden, full)[0][0]               # [L-1, d]: i predicts x_{i+2}
        starts = torch.as_tensor(round_starts(len(c.prompt), c.round_accepted))     # [R_c] committed length c
        ps.append(process_logits(policy.compute_logits(hidden[0, starts - 1]), run.temperature))
        qs.append(process_logits(heads.draft_logits(policy, head_states[starts - 2]), run.temperature))
        ent += [e[0] for e in c.draft_entropies]
        acc += [a > 0 for a in c.round_accepted]
    return torch.cat(ps).double(), torch.cat(qs).double(), np.asarray(ent), np.asarray(acc)


def one_minus_tv(p: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    return (1 - 0.5 * (p - q).abs().sum(-1)).numpy()            # = sum_v min(p, q)


def p_of_argmax_q(p: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    return p.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1).numpy()


def z_score(rate: float, n: int, expected: np.ndarray) -> float:
    """n Bernoulli draws, draw r with success probability expected[r] given its context: the
    standardised distance of the observed success rate from the mean expectation."""
    return (rate * n - expected.sum()) / math.sqrt((expected * (1 - expected)).sum())


# ---------------------------------------------------------------------------------------------
# a policy and heads whose acceptance is far from 0 and 1 in both modes
# ---------------------------------------------------------------------------------------------

V = 64


@pytest.fixture(scope="module")
def policy() -> CausalLM:
    return tiny_model(seed=0, vocab_size=V)


@pytest.fixture(scope="module")
def trained_heads(policy) -> MTPHeads:
    """One recurrent depth fitted (forward KL, 150 Adam steps, ~2 s) to the policy's own samples:
    1 - TV ~0.4-0.8 and p(argmax q) ~0.05-0.25 over T = 0.3-1.6, where fresh heads give p(argmax q) ~1/V."""
    heads = init_heads(policy, 1)
    heads.requires_grad_(True)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    data = []
    with torch.no_grad():
        for _ in range(4):
            toks = torch.randint(2, V, (16, 4), generator=gen)
            for _ in range(48):
                nxt = torch.multinomial(policy(toks)[:, -1].softmax(-1), 1, generator=gen)
                toks = torch.cat([toks, nxt], 1)
            data.append((toks, policy.hidden_states(toks)))
    for step in range(150):
        toks, hidden = data[step % len(data)]
        student = policy.compute_logits(heads.teacher_forced(policy, hidden, toks)[0])     # [B, T-1, V]
        target = policy.compute_logits(hidden[:, 1:])
        loss = draft_loss("fkl", student.reshape(-1, V), target_logits=target.reshape(-1, V))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.requires_grad_(False).eval()


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (int(torch.randint(2, 9, (), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


SETTINGS = SweepSettings(num_draft_tokens=3, max_new_tokens=64, batch_size=32, seed=0, n_boot=50)


@pytest.fixture(scope="module")
def runs(policy, trained_heads):
    """(mode, T) -> the sweep's run and record, ~2k rounds each."""
    engine = TorchEngine(policy, trained_heads, config=EngineConfig(draft_lengths="fixed"))
    out = {}
    for mode in ("rejection", "greedy"):
        for t in (0.5, 1.2):
            run = decode_at(engine, prompts(64, seed=1), mode, t, SETTINGS)
            out[mode, t] = (run, temperature_record(run, SETTINGS)[0])
    return out


def checked_position1(policy, heads, run, record):
    """The recomputed distributions, after checking that they sit where the engine drafted: the
    entropy the sweep reports at position 1 is H(p) of the recomputed p, and the record's rate and
    count are those of the rounds recomputed."""
    p, q, ent, acc = position1_dists(policy, heads, run)
    np.testing.assert_allclose(entropy(p).numpy(), ent, atol=1e-4)
    assert record["reached_per_pos"][0] == len(acc) == record["num_drafts"]
    assert record["cond_acceptance"][0] == pytest.approx(acc.mean())
    return p, q


@pytest.mark.parametrize("t", [0.5, 1.2])
def test_rejection_acceptance_at_position_1_is_one_minus_tv(policy, trained_heads, runs, t):
    run, record = runs["rejection", t]
    p, q = checked_position1(policy, trained_heads, run, record)
    rate, n = record["cond_acceptance"][0], record["reached_per_pos"][0]
    right = one_minus_tv(p, q)
    assert 0.2 < right.mean() < 0.9 and n > 800                       # informative, not 0 or 1
    assert abs(z_score(rate, n, right)) < Z_PASS, (rate, right.mean(), n)
    # wrong expectations, each far from the right one, fail the same check
    q_colder = process_logits(q.log(), 1 / 3)                         # q at T/3: logits log q_T * T / (T/3)
    for wrong in (p_of_argmax_q(p, q), one_minus_tv(p, q_colder)):
        assert abs(wrong.mean() - right.mean()) > 0.04, (wrong.mean(), right.mean())
        assert abs(z_score(rate, n, wrong)) > Z_FAIL, (rate, wrong.mean(), n)


@pytest.mark.parametrize("t", [0.5, 1.2])
def test_greedy_acceptance_at_position_1_is_p_of_argmax_q(policy, trained_heads, runs, t):
    run, record = runs["greedy", t]
    p, q = checked_position1(policy, trained_heads, run, record)
    rate, n = record["cond_acceptance"][0], record["reached_per_pos"][0]
    right = p_of_argmax_q(p, q)
    assert 0.03 < right.mean() < 0.9 and n > 800 
    assert abs(z_score(rate, n, right)) < Z_PASS, (rate, right.mean(), n)
    wrong = one_minus_tv(p, q)                                        # the rejection-mode formula
    assert abs(wrong.mean() - right.mean()) > 0.04, (wrong.mean(), right.mean())
    assert abs(z_score(rate, n, wrong)) > Z_FAIL, (rate, wrong.mean(), n)


def test_record_statistics_are_consistent(runs):
    """tau, the acceptance rate and the per-position rates agree with each other in every record."""
    for (mode, t), (run, r) in runs.items():
        acc = np.asarray([a for c in run.completions for a in c.round_accepted])
        assert r["acceptance_length"] == pytest.approx(acc.mean() + 1)
        assert r["acceptance_rate"] == pytest.approx(acc.mean() / SETTINGS.num_draft_tokens)
        assert r["reached_per_pos"] == [int((acc >= j).sum()) for j in range(SETTINGS.num_draft_tokens)]
        assert r["cond_acceptance"] == pytest.approx([(acc > j).sum() / (acc >= j).sum() for j in range(3)])
        rate, n = np.asarray(r["cond_acceptance"]), np.asarray(r["reached_per_pos"])
        np.testing.assert_allclose(r["cond_acceptance_se"], np.sqrt(rate * (1 - rate) / n))


# ---------------------------------------------------------------------------------------------
# the command, end to end
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def head_files(tmp_path_factory):
    """Two head checkpoints for the `tiny-random` policy."""
    root = tmp_path_factory.mktemp("heads")
    policy = load_rl_policy("tiny-random", "float32").model
    paths = {}
    for name, seed in (("a", 1), ("b", 2)):
        heads = random_heads(policy, 1, seed=seed)
        save_heads(root / f"{name}.safetensors", heads, HeadMeta.for_heads(heads, loss=name))
        paths[name] = root / f"{name}.safetensors"
    return paths


TEMPS = (0.5, 1.0, 2.0)


def sweep_args(head_files, out, *extra):
    heads = ",".join(f"{n}={p}" for n, p in head_files.items())
    return ["sweep", "model=tiny-random", f"head_files=[{heads}]", f"temperatures=[{','.join(map(str, TEMPS))}]",
            "prompts=4", "max_new_tokens=24", "batch_size=4", "n_boot=50", "progress=false", f"out_dir={out}",
            *extra]


def test_the_command_fills_every_cell_and_temperature(head_files, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert cli.main(sweep_args(head_files, out)) == 0
    records = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    cells = {(r["head"], r["draft_mode"], r["temperature"]) for r in records}
    assert len(records) == len(cells) == 2 * 2 * len(TEMPS)
    assert cells == {(h, m, t) for h in ("a", "b") for m in ("greedy", "rejection") for t in TEMPS}
    for r in records:
        assert r["num_drafts"] > 0 and len(r["cond_acceptance"]) == 3 and r["acceptance_length"] >= 1
        assert set(r["slope_temperature"]) == {"slope", "intercept", "r2", "ci_low", "ci_high", "n"}
        assert r["slope_temperature"]["n"] == len(TEMPS)
    for h in ("a", "b"):
        for m in ("greedy", "rejection"):
            ent = [r["entropy_drafted"] for r in sorted(records, key=lambda r: r["temperature"])
                   if (r["head"], r["draft_mode"]) == (h, m)]
            assert all(np.diff(ent) > 0.2), (h, m, ent)                # entropy rises with temperature
    csv_rows = (out / "sweep.csv").read_text().splitlines()
    assert len(csv_rows) == 1 + len(records) and "cond_acceptance.0" in csv_rows[0]
    table = (out / "sweep.md").read_text()
    assert table.count("\n| a | greedy |") == len(TEMPS) + 1            # rows per temperature + the slope row
    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    assert matplotlib.image.imread(out / "sweep.png").shape[1] > 600    # decodes: two panels wide
    assert "slope over temperatures" in capsys.readouterr().out
    # a second sweep into the same directory is refused, unless told to overwrite
    assert cli.main(sweep_args(head_files, out)) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli.main(sweep_args(head_files, out, "overwrite=true", "draft_modes=[rejection]")) == 0
    assert len((out / "sweep.jsonl").read_text().splitlines()) == 2 * len(TEMPS)


@pytest.mark.parametrize("override, named", [
    ("temperatures=[]", "temperatures"),
    ("temperatures=[0.5,0]", "temperatures"),
    ("temperatures=[-1.0]", "temperatures"),
    ("temperatures=[.nan]", "temperatures"),
    ("temperatures=[1.0,nan]", "temperatures"),
    ("draft_modes=[beam]", "draft_modes"),
    ("draft_modes=[]", "draft_modes"),
    ("head_files=[a=/nonexistent/heads.safetensors]", "head_files"),
    ("num_draft_tokens=0", "num_draft_tokens"),
    ("prompts=0", "prompts"),
])
def test_bad_input_is_refused_naming_the_key(override, named, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert cli.main(["sweep", "model=tiny-random", "progress=false", f"out_dir={out}", override]) == 2
    err = capsys.readouterr().err
    assert f"error: {named}" in err, err
    assert not out.exists()                                             # refused before anything is written


def test_a_model_without_shipped_heads_needs_heads_files(tmp_path, capsys):
    assert cli.main(["sweep", "model=tiny-random", "progress=false", f"out_dir={tmp_path / 's'}"]) == 2
    assert "head_files: no heads are shipped for model 'tiny-random'" in capsys.readouterr().err


def test_the_yaml_holds_the_defaults_and_help_documents_every_key(capsys):
    assert load_config(SweepConfig, [str(DEFAULT_CONFIG)])[0] == load_config(SweepConfig, [])[0]
    assert [k.key for k in config_keys(SweepConfig) if not k.help] == []
    assert cli.main(["sweep", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"{k.key} = {k.default}" in out for k in config_keys(SweepConfig))


def test_prompts_from_tasks_are_the_task_sources_heldout_prompts():
    from experiments.entropy_sweep import SweepConfig, sweep_prompt_texts
    from trainers.tasks import TaskConfig, TaskSource

    tasks = TaskConfig(num_prompts=8, heldout_prompts=3)
    held = [t.prompt for t in TaskSource(tasks).heldout]
    texts = sweep_prompt_texts(SweepConfig(prompts=5, prompts_from="tasks", tasks=tasks))
    assert texts == held + held[:2]
    assert sweep_prompt_texts(SweepConfig(prompts=2))[0] not in held            # chat: the default
    with pytest.raises(ValueError, match="prompts_from"):
        SweepConfig(prompts_from="sharegpt")
