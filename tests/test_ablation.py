"""`mtp-rollout ablate` in its small setting (configs/ablation_tiny.yaml): the tiny random model, so
it checks the machinery — every cell of drafter x draft mode x objective trained, run and summarised, results
written, finished parts reused — not the science (that is the full grid on SmolLM2)."""
import json
import math
from pathlib import Path

import pytest

from experiments.entropy_ablation import AblationConfig, main
from mtp_heads.checkpoint import read_meta
from trainers.config import load_run_config

ROOT = Path(__file__).resolve().parents[1]
OBJECTIVES = ["ce", "fkl", "tv", "tv_e2e", "tv_top64"]
MODES = ("greedy", "rejection")


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The whole small grid once (every RL run starts and stops its own local Ray, as the CLI does)."""
    out = tmp_path_factory.mktemp("ablation")
    argv = [str(ROOT / "configs/ablation_tiny.yaml"), f"out_dir={out}", "rl=[steps=2,checkpoint_every=0,"
            "accelerator.num_depths=1]"]
    assert main(argv) == 0
    return out, argv


@pytest.mark.slow
@pytest.mark.ray
def test_every_cell_is_filled(grid):
    out, _ = grid
    records = json.loads((out / "ablation.json").read_text())
    assert [(r["draft_source"], r["draft_mode"], r["objective"]) for r in records] == \
        [(s, m, o) for o in OBJECTIVES for s in ("heads", "chosen") for m in MODES] + [("history", "-", "-")]
    for r in records:
        assert r["steps"] == 2 and r["tokens"] > 0 and r["rollout_s"] > 0
        assert 0 <= r["acceptance_rate"] <= 1 and r["acceptance_length"] >= 1
        assert math.isfinite(r["speedup"]) and r["speedup"] > 0
        assert r["domains"] and len(r["points"]) == 2
        assert set(r["slope_step"]) == set(r["slope_position"]) == {"slope", "intercept", "r2", "ci_low", "ci_high", "n"}
        run = out / "runs" / {"heads": f"{r['draft_mode']}-{r['objective']}", "history": "history"}.get(
            r["draft_source"], f"{r['draft_source']}-{r['draft_mode']}-{r['objective']}")
        cfg = load_run_config([str(run / "config.yaml")])[0]
        drafted = {src: g["draft_tokens"] for src, g in r["by_source"].items()}
        if r["draft_source"] == "history":          # history alone: no heads, no co-trainer
            assert cfg.accelerator.workers.draft_sources == ("history",) and not cfg.accelerator.cotrainer.enabled
            assert drafted["history"] > 0 and drafted.get("heads", 0) == 0 and r["heads_heldout"] == {}
            continue
        held = r["heads_heldout"]      # the heads' own held-out evaluation in this draft mode, per temperature
        assert held and all(len(v["per_position"]) == 3 and v["tau"] >= 1 for v in held.values())
        assert cfg.sampling.draft_mode == r["draft_mode"] and cfg.accelerator.cotrainer.loss == r["objective"]
        assert cfg.accelerator.workers.draft_lengths == ("fixed" if r["draft_source"] == "heads" else "chosen")
        assert drafted["heads"] > 0
        if r["draft_source"] == "heads":            # fixed lengths draft from the heads only
            assert drafted.get("history", 0) == 0
    # each objective's heads were trained once, with that objective, the same steps, and shared by both modes
    for objective in OBJECTIVES:
        meta = read_meta(out / "heads" / objective / "heads.safetensors")
        assert meta.loss.startswith(objective) and meta.steps == 3
    md = (out / "ablation.md").read_text()
    assert md.count("\n| heads | greedy |") + md.count("\n| heads | rejection |") >= 10 + 10   # cells + per-domain rows
    assert "\n| history | - | - | history |" in md                               # the per-source table
    csv_lines = (out / "ablation.csv").read_text().strip().splitlines()
    assert len(csv_lines) == 1 + len(records) and "speedup" in csv_lines[0]
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plain = json.loads((out / "runs" / "plain" / "rl.jsonl").read_text().splitlines()[0])
    assert plain["rollout_s"] > 0


@pytest.mark.slow
@pytest.mark.ray
def test_a_rerun_reuses_finished_heads_and_runs(grid):
    out, argv = grid
    stamps = {p: p.stat().st_mtime_ns for p in (out / "heads").glob("*/heads.safetensors")}
    stamps.update({p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/rl.jsonl")})
    assert main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


@pytest.mark.parametrize("override, named", [
    ("objectives=[tv,nope]", "nope"), ("draft_modes=[sampled]", "sampled"), ("head_steps=-1", "head_steps"),
    ("rl=[steps]", "key=value"), ("objectives=[]", "objectives"), ("draft_sources=[heads,suffix]", "draft_sources"),
])
def test_bad_input_is_refused_naming_the_key(override, named, tmp_path):
    with pytest.raises(ValueError, match=named):
        main([str(ROOT / "configs/ablation_tiny.yaml"), f"out_dir={tmp_path}", override])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("override, cell, key", [
    ("rl=[steps=3,sampling.draftmode=greedy]", "cell 'plain'", "sampling.draftmode"),     # every cell: the first fails
    ("heads_overrides=[model=tiny-random,train.bach_tokens=8]", "objective 'ce'", "train.bach_tokens"),
    ("rl=[steps=3,grpo.lr=fast]", "cell 'plain'", "grpo.lr"),                      # a bad value, not only keys
])
def test_a_misspelt_key_in_any_cell_fails_at_load_time_naming_cell_and_key(override, cell, key, tmp_path, monkeypatch):
    import experiments.entropy_ablation as ablation
    monkeypatch.setattr(ablation, "run_cell", lambda *a, **k: pytest.fail("a cell ran before the check"))
    monkeypatch.setattr(ablation, "train_objective_heads", lambda *a, **k: pytest.fail("heads trained before the check"))
    with pytest.raises(ValueError) as e:
        main([str(ROOT / "configs/ablation_tiny.yaml"), f"out_dir={tmp_path / 'a'}", override])
    assert cell in str(e.value) and key in str(e.value), e.value
    assert not (tmp_path / "a").exists()


def test_cells_run_with_the_trained_heads_file():
    from experiments.entropy_ablation import cell_overrides
    cfg, _ = load_run_config([str(ROOT / "configs/smoke.yaml"),
                              *cell_overrides("tv", "greedy", Path("/x/heads/tv/heads.safetensors"))])
    assert cfg.heads == cfg.accelerator.heads == "/x/heads/tv/heads.safetensors"


def test_head_steps_zero_runs_every_cell_with_the_shipped_heads_and_trains_none(tmp_path):
    """The drafter-source study without a token store: no head training, every heads cell drafts with the
    shipped heads while its co-trainer refreshes with the cell's objective."""
    cfg = AblationConfig(objectives=["tv"], draft_modes=["rejection"], draft_sources=["heads", "chosen", "history"],
                         head_steps=0, rl=["steps=2"], out_dir=str(tmp_path))
    cells = {name: overrides for name, overrides, _ in cfg.cells()}
    assert set(cells) == {"rejection-tv", "chosen-rejection-tv", "history"}
    for name in ("rejection-tv", "chosen-rejection-tv"):
        assert "heads=shipped" in cells[name] and "accelerator.cotrainer.loss=tv" in cells[name]
    assert "heads=init" in cells["history"]
    assert not (tmp_path / "heads").exists()


def test_help_lists_every_key(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for f in AblationConfig.__dataclass_fields__:
        assert f in text
