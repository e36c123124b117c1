"""Bad input a user may type or be handed, refused as one line naming the file or key (exit 2):
non-finite heads, a k beyond the widest verification, prompts that are not UTF-8, unpickling."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import pre_tokenizers

from experiments import cli
from mtp_heads.checkpoint import HeadMeta, load_heads, save_heads
from mtp_heads.heads import init_heads
from rollout.models.decoder import random_model
from rollout.models.loaders import LoadedModel, bpe_tokenizer, export_hf_dir
from rollout.types import SamplingParams, validate_request
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs/smoke.yaml")
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *sorted(pre_tokenizers.ByteLevel.alphabet())]


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("mtp-rollout ")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny HF directory with a byte-level tokenizer: what `generate --model <dir>` loads."""
    cfg = tiny_config(vocab_size=len(TOKENS), eos_token_ids=(2,), bos_token_id=1)
    policy = random_model(cfg, seed=0)
    tok = bpe_tokenizer(TOKENS, [], token_types=[3, 3, 3] + [1] * (len(TOKENS) - 3))
    out = tmp_path_factory.mktemp("model") / "tiny"
    export_hf_dir(LoadedModel(cfg, policy.state_dict(), tok, None, "tiny"), out)
    return out, policy


def broken_heads(policy, path: Path, value: float) -> Path:
    heads = init_heads(policy, 1, seed=0)
    with torch.no_grad():
        heads.depths[0].eh_proj.weight[3, 5] = value
    save_heads(path, heads, HeadMeta.for_heads(heads, loss="tv", steps=1))
    return path


# ------------------------------------------------------------------ heads with NaN or inf


@pytest.mark.parametrize("value, word", [(float("nan"), "1 NaN"), (float("inf"), "1 inf")])
def test_generate_refuses_non_finite_heads_naming_file_and_tensor(model_dir, tmp_path, capsys, value, word):
    model, policy = model_dir
    path = broken_heads(policy, tmp_path / "h.safetensors", value)
    assert cli.main(["generate", "--model", str(model), "--heads", str(path), "--prompt", "hi",
                     "--max-new-tokens", "2", "--dtype", "float32"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and str(path) in lines[0] and "depths.0.eh_proj.weight" in lines[0] \
        and word in lines[0], lines


def test_run_refuses_non_finite_heads_before_ray(tmp_path, capsys, monkeypatch):
    import ray

    from trainers.rl_policy import load_rl_policy
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started with non-finite heads"))
    policy = load_rl_policy("tiny-random", "float32").model
    heads = init_heads(policy, 2, seed=0)
    with torch.no_grad():
        heads.depths[1].norm.weight[0] = float("nan")
    path = tmp_path / "nan.safetensors"
    save_heads(path, heads, HeadMeta.for_heads(heads))
    assert cli.main(["run", SMOKE, f"out_dir={tmp_path / 'run'}", "progress=false", f"heads={path}"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and str(path) in lines[0] and "depths.1.norm.weight" in lines[0], lines


def test_every_heads_loader_checks_finiteness(tmp_path, monkeypatch):
    """load_heads, resolve_heads (a path and shipped) and the policy-free check_heads_file."""
    import mtp_heads.shipped as shipped
    from mtp_heads.checkpoint import check_heads_file
    policy = random_model(tiny_config(), seed=0)
    path = broken_heads(policy, tmp_path / "tiny.safetensors", float("-inf"))
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path)
    monkeypatch.setattr(shipped, "SHIPPED", {"tiny": "tiny.safetensors"})
    calls = (lambda: load_heads(path, policy), lambda: check_heads_file(path),
             lambda: shipped.resolve_heads(policy, str(path), model="tiny"),
             lambda: shipped.resolve_heads(policy, "shipped", model="tiny"))
    for call in calls:
        with pytest.raises(ValueError, match=r"tiny\.safetensors: tensor depths\.0\.eh_proj\.weight .*1 inf"):
            call()


# ------------------------------------------------------------------ k beyond the widest verification


def test_k_above_the_limit_is_refused_by_generate_before_loading(capsys):
    from rollout.types import MAX_DRAFT_TOKENS
    assert cli.main(["generate", "--model", "/nonexistent-model", "--k", "1000"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"<= {MAX_DRAFT_TOKENS}" in lines[0] and "1000" in lines[0] \
        and "num_draft_tokens" in lines[0] and "--k" in lines[0], lines
    from experiments.generate import load_generate_config
    assert load_generate_config(["--k", str(MAX_DRAFT_TOKENS)])[0].num_draft_tokens == MAX_DRAFT_TOKENS


def test_k_above_the_limit_is_refused_by_run_before_ray(tmp_path, capsys, monkeypatch):
    import ray

    from rollout.types import MAX_DRAFT_TOKENS
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started with k = 16"))
    out = tmp_path / "run"
    assert cli.main(["run", SMOKE, f"out_dir={out}", f"sampling.num_draft_tokens={MAX_DRAFT_TOKENS + 1}"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "sampling.num_draft_tokens" in lines[0] and f"<= {MAX_DRAFT_TOKENS}" in lines[0]
    assert not out.exists()


def test_k_above_the_limit_is_refused_by_the_api():
    from rollout.engine.config import EngineConfig
    from rollout.types import MAX_DRAFT_TOKENS
    assert max(EngineConfig().verify_widths) == MAX_DRAFT_TOKENS + 1     # k drafts + the bonus token
    sp = SamplingParams(max_new_tokens=4, num_draft_tokens=MAX_DRAFT_TOKENS + 1)
    with pytest.raises(ValueError, match=rf"num_draft_tokens \(k\) must be <= {MAX_DRAFT_TOKENS}.*got 16"):
        validate_request([[1, 2]], sp, vocab_size=64, context_length=256, has_heads=True)
    validate_request([[1, 2]], SamplingParams(max_new_tokens=4, num_draft_tokens=MAX_DRAFT_TOKENS),
                     vocab_size=64, context_length=256, has_heads=True)


# ------------------------------------------------------------------ prompts that are not UTF-8


def test_generate_prompt_with_invalid_utf8_bytes_exits_2_naming_it():
    """As typed in a shell: `mtp-rollout generate --prompt $'\\xff\\xfe'` (argv holds raw bytes)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "experiments.cli", "generate", "--prompt", "hi",
                          "--prompt", b"ok \xff\xfe"], capture_output=True, env=env, cwd=ROOT, timeout=120)
    lines = error_lines(res.stderr.decode(errors="replace"))
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "--prompt 2" in lines[0] and "byte 0xff at byte position 3" in lines[0], lines


def test_config_with_invalid_utf8_is_refused_naming_file_key_and_position(tmp_path, capsys):
    bad = tmp_path / "prompts.yaml"
    bad.write_bytes(b"prompts:\n  - \"hello \xfe\"\n")
    assert cli.main(["generate", str(bad)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and str(bad) in lines[0] and "byte 0xfe at byte position 20 (line 2)" in lines[0], lines
    escaped = b"prompts=[a\xff]".decode("utf-8", "surrogateescape")     # what Python makes of such an argv
    assert cli.main(["generate", escaped]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "config key prompts" in lines[0] and "byte 0xff at byte position 2" in lines[0]


def test_api_refuses_text_that_is_not_utf8():
    from experiments.generate import GenerateJobConfig
    from rollout.models.loaders import apply_chat_template
    text = b"ab\xff".decode("utf-8", "surrogateescape")
    with pytest.raises(ValueError, match=r"prompts\[1\] is not valid UTF-8 text: byte 0xff at byte position 2"):
        GenerateJobConfig(prompts=["fine", text])
    tok = bpe_tokenizer(TOKENS, [])
    with pytest.raises(ValueError, match=r"message 0 \(user\) is not valid UTF-8 text: byte 0xff"):
        apply_chat_template(tok, [{"role": "user", "content": text}])


# ------------------------------------------------------------------ unpickling what a user is handed


class Trap:
    """Unpickling this runs code: what torch.load(weights_only=False) would do with a handed-over file."""

    def __reduce__(self):
        return (os.system, ("touch TRAPPED",))


def test_resume_state_is_read_without_unpickling_code(tmp_path, monkeypatch):
    from mtp_heads.pretrain import train_heads, train_state_path
    from tests.test_pretrain import _cfg
    monkeypatch.chdir(tmp_path)
    policy = random_model(tiny_config(), seed=0)
    heads = init_heads(policy, 1, seed=0)
    ckpt = tmp_path / "heads.safetensors"
    save_heads(ckpt, heads, HeadMeta.for_heads(heads, steps=2))
    train_state_path(ckpt).write_bytes(pickle.dumps({"step": 2, "optimizer": Trap(), "config": {}}, protocol=2))
    with pytest.raises(ValueError, match=r"heads\.train\.pt is not a readable train-heads state"):
        train_heads(policy, [object()], _cfg(), checkpoint=ckpt, resume=True, progress=False)
    assert not (tmp_path / "TRAPPED").exists()


def test_eval_set_cache_is_read_without_unpickling_code_and_rebuilt(tmp_path, monkeypatch):
    import numpy as np

    from experiments.pretrain_heads import EvalConfig, cached_eval_set
    from mtp_heads.token_data import TokenData
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path / "cache"))
    policy = random_model(tiny_config(), seed=0)
    tokens = np.arange(2, 22, dtype=np.int32)
    hidden = policy.hidden_states(torch.tensor(tokens[None], dtype=torch.long))[0].numpy()
    source = TokenData(tokens, hidden, np.array([0, 10, 20]), np.array([3, 3], dtype=np.int32))
    ev = EvalConfig(temperatures=[1.0], heldout_sequences=2)
    first = cached_eval_set(policy, source, ev, 2, {"split": "heldout"})
    (cached,) = (tmp_path / "cache" / "eval_sets").glob("*.pt")
    again = cached_eval_set(policy, source, ev, 2, {"split": "heldout"})     # read back with weights_only
    assert torch.equal(again.batches[0].hidden, first.batches[0].hidden) and again.lse.keys() == first.lse.keys()
    cached.write_bytes(pickle.dumps({"batches": Trap(), "lse": {}}, protocol=2))
    rebuilt = cached_eval_set(policy, source, ev, 2, {"split": "heldout"})
    assert not (tmp_path / "TRAPPED").exists()
    torch.testing.assert_close(rebuilt.lse[1.0][0], first.lse[1.0][0])


def test_no_full_unpickling_anywhere():
    offenders = [f"{p.relative_to(ROOT)}:{i}" for d in ("rollout", "mtp_heads", "trainers", "experiments")
                 for p in (ROOT / d).rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
                 if "torch.load(" in line and "weights_only=True" not in line]
    assert not offenders, offenders
