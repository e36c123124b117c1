"""AcceptanceMonitor and its statistics, on synthetic Completions (no model needed)."""
from __future__ import annotations

import csv
import json
import logging
import pickle
import struct

import numpy as np
import pytest

from rollout.monitor import (
    AcceptanceMonitor,
    EntropyHistogram,
    MonitorConfig,
    SlopeFit,
    binned_slope,
    entropy_bins,
    fit_slope,
    flatten_record,
    per_position_slope,
    per_step_slope,
    position_points,
)
from rollout.types import Completion, RolloutBatch, SpecDecodingStats

# ---------------------------------------------------------------------------------------------
# Synthetic data
# ---------------------------------------------------------------------------------------------


def linear_points(n: int, seed: int, slope: float = -0.3, noise: float = 0.05):
    """acceptance = 0.9 + slope * H + noise, H ~ U(0, 2)."""
    rng = np.random.default_rng(seed)
    h = rng.uniform(0.0, 2.0, n)
    return h, 0.9 + slope * h + rng.normal(0.0, noise, n)


def sampled_completion(rng, *, h_max: float, slope: float = -0.3, k: int = 3, rounds: int = 60,
                       domain: str | None = None, policy_version: int = 0, head_version: int = 0) -> Completion:
    """Drafts accepted with probability 0.95 + slope * H at each position, until the first rejection."""
    h = rng.uniform(0.0, h_max, (rounds, k))                                # [R, k]
    ok = rng.random((rounds, k)) < np.clip(0.95 + slope * h, 0.0, 1.0)      # [R, k]
    accepted = np.cumprod(ok, axis=1).sum(axis=1)                          # [R]
    n_tok = int((accepted + 1).sum())
    ent = rng.uniform(0.0, h_max, n_tok)
    return Completion(prompt=[1], tokens=[7] * n_tok, logprobs=[0.0] * n_tok,
                      entropies=ent.tolist(), max_probs=np.exp(-ent).tolist(),
                      round_accepted=accepted.tolist(), draft_entropies=h.tolist(), num_draft_tokens=k,
                      policy_version=policy_version, head_version=head_version, domain=domain)


def sourced_completion(rng, slopes: dict[str, float], *, h_max: float = 2.5, k: int = 3, rounds: int = 60,
                       domain: str | None = None) -> Completion:
    """Each round drafts from a random source whose drafts pass with probability 0.95 + slopes[source] * H,
    until the first rejection; the engine's prediction is that probability (a calibrated predictor)."""
    src = rng.choice(list(slopes), rounds)                                          # [R]
    h = rng.uniform(0.0, h_max, (rounds, k))                                        # [R, k]
    p = np.clip(0.95 + np.array([slopes[s] for s in src])[:, None] * h, 0.0, 1.0)   # [R, k]
    accepted = np.cumprod(rng.random((rounds, k)) < p, axis=1).sum(axis=1)          # [R]
    n_tok = int((accepted + 1).sum())
    ent = rng.uniform(0.0, h_max, n_tok)
    return Completion(prompt=[1], tokens=[7] * n_tok, logprobs=[0.0] * n_tok, entropies=ent.tolist(),
                      max_probs=np.exp(-ent).tolist(),
                      round_accepted=accepted.tolist(), draft_entropies=h.tolist(), round_draft_tokens=[k] * rounds,
                      round_sources=src.tolist(), round_predicted=p.tolist(), num_draft_tokens=k, domain=domain)


def fixed_completion(acceptance: float, entropy: float, *, k: int = 4, rounds: int = 50,
                     domain: str | None = None) -> Completion:
    """Exactly round(acceptance * k * rounds) accepted drafts, every draft position at `entropy`."""
    total = round(acceptance * k * rounds)
    accepted = [k] * (total // k) + ([total % k] if total % k else [])
    accepted += [0] * (rounds - len(accepted))
    n_tok = sum(a + 1 for a in accepted)
    return Completion(prompt=[1], tokens=[7] * n_tok, logprobs=[0.0] * n_tok, entropies=[entropy] * n_tok,
                      round_accepted=accepted, draft_entropies=[[entropy] * k for _ in accepted],
                      num_draft_tokens=k, domain=domain)


def config(tmp_path, **kw) -> MonitorConfig:
    base = dict(out_dir=str(tmp_path / "mon"), window=5, n_boot=200, tensorboard=False, plot_every=0, plots=False)
    return MonitorConfig(**{**base, **kw})


# ---------------------------------------------------------------------------------------------
# fit_slope
# ---------------------------------------------------------------------------------------------


def test_fit_slope_recovers_known_slope_and_ci_narrows_with_more_points():
    small = fit_slope(*linear_points(40, seed=1))
    large = fit_slope(*linear_points(2000, seed=2), n_boot=300)
    for fit in (small, large):
        assert fit.ci_low < -0.3 < fit.ci_high
        assert fit.ci_low < fit.slope < fit.ci_high
        assert abs(fit.intercept - 0.9) < 0.1
    assert abs(large.slope + 0.3) < 0.02 and large.r2 > 0.8 and large.n == 2000
    assert (large.ci_high - large.ci_low) < 0.5 * (small.ci_high - small.ci_low)


def test_fit_slope_ci_covers_true_slope_in_most_repetitions():
    covered = 0
    for rep in range(50):
        fit = fit_slope(*linear_points(30, seed=100 + rep, noise=0.1), n_boot=400, seed=rep)
        covered += fit.ci_low <= -0.3 <= fit.ci_high
    assert 40 <= covered <= 50  # nominal 95%: ~47.5 of 50; a percentile bootstrap runs a bit under


def test_fit_slope_is_deterministic_per_seed_and_weights_act_as_repeats():
    h, a = linear_points(20, seed=3)
    assert fit_slope(h, a, seed=5) == fit_slope(h, a, seed=5)
    w = np.where(np.arange(20) % 2 == 0, 2.0, 1.0)
    repeated = fit_slope(np.r_[h, h[::2]], np.r_[a, a[::2]], n_boot=0)
    weighted = fit_slope(h, a, weights=w, n_boot=0)
    assert weighted.slope == pytest.approx(repeated.slope) and weighted.intercept == pytest.approx(repeated.intercept)
    assert weighted.r2 == pytest.approx(repeated.r2)
    assert np.isnan(weighted.ci_low) and np.isnan(weighted.ci_high)  # n_boot=0: no interval


def test_fit_slope_equal_entropies_gives_nan_slope_not_an_error():
    fit = fit_slope([0.7, 0.7, 0.7, 0.7], [0.5, 0.6, 0.7, 0.8])
    assert np.isnan(fit.slope) and np.isnan(fit.ci_low) and np.isnan(fit.ci_high) and np.isnan(fit.r2)
    assert fit.intercept == pytest.approx(0.65) and fit.n == 4


@pytest.mark.parametrize("args, kwargs, match", [
    (([0.1, 0.2], [0.9, 0.8]), {}, "at least 3"),
    (([0.1, 0.2, 0.3], [0.9, 0.8]), {}, "differ in length"),
    (([0.1, np.nan, 0.3], [0.9, 0.8, 0.7]), {}, "finite"),
    (([0.1, 0.2, 0.3], [0.9, np.inf, 0.7]), {}, "finite"),
    (([[0.1, 0.2, 0.3]], [[0.9, 0.8, 0.7]]), {}, "1-D"),
    (([0.1, 0.2, 0.3], [0.9, 0.8, 0.7]), {"weights": [1.0, -1.0, 1.0]}, "weights"),
    (([0.1, 0.2, 0.3], [0.9, 0.8, 0.7]), {"weights": [1.0, 1.0]}, "weights"),
    (([0.1, 0.2, 0.3], [0.9, 0.8, 0.7]), {"n_boot": -1}, "n_boot"),
])
def test_fit_slope_rejects_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit_slope(*args, **kwargs)


def test_per_step_slope_skips_steps_without_drafts_and_needs_three():
    assert per_step_slope([0.1, np.nan, 0.3], [0.9, 0.5, 0.7]).n == 2
    assert np.isnan(per_step_slope([0.1, np.nan, 0.3], [0.9, 0.5, 0.7]).slope)
    fit = per_step_slope([0.1, 0.2, np.nan, 0.3], [0.8, 0.7, np.nan, 0.6], n_boot=0)
    assert fit.n == 3 and fit.slope == pytest.approx(-1.0)


# ---------------------------------------------------------------------------------------------
# Per-position points and bins
# ---------------------------------------------------------------------------------------------


def hand_completion() -> Completion:
    # k=3; round 0 rejects at j=0, round 1 accepts 2 then rejects j=2, round 2 accepts all three
    return Completion(prompt=[1], tokens=[0] * 9, logprobs=[0.0] * 9, entropies=[0.0] * 9,
                      round_accepted=[0, 2, 3],
                      draft_entropies=[[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]],
                      num_draft_tokens=3)


def test_position_points_match_hand_count():
    pts = position_points([hand_completion()])
    assert len(pts) == 9
    np.testing.assert_array_equal(pts.reached, [1, 0, 0, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(pts.accepted, [0, 0, 0, 1, 1, 0, 1, 1, 1])
    np.testing.assert_array_equal(pts.position, [0, 1, 2] * 3)
    reached = [int(pts.reached[pts.position == j].sum()) for j in range(3)]
    accepted = [int(pts.accepted[pts.position == j].sum()) for j in range(3)]
    assert reached == [3, 2, 2] and accepted == [2, 2, 1]
    stats = SpecDecodingStats.from_rounds([0, 2, 3], 3)  # the counters the monitor reports agree
    assert stats.reached_per_pos == reached and stats.accepted_per_pos == accepted


def test_position_points_accept_reached_only_entropies_and_skip_missing():
    c = hand_completion()
    c.draft_entropies = [[0.1], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]]   # engine kept reached positions only
    no_entropies = Completion(prompt=[1], tokens=[0], logprobs=[0.0], entropies=[0.0],
                              round_accepted=[1], num_draft_tokens=2)
    pts = position_points([c, no_entropies])
    assert len(pts) == 7 and pts.reached.all() and int(pts.accepted.sum()) == 5


@pytest.mark.parametrize("round_accepted, draft_entropies, match", [
    ([0, 2], [[0.1, 0.2, 0.3]], "rounds"),
    ([4], [[0.1, 0.2, 0.3]], "outside"),
    ([2], [[0.1, 0.2]], "draft entropies"),            # position 2 reached but has no entropy
    ([0], [[0.1, 0.2, 0.3, 0.4]], "draft entropies"),  # more than k
    ([0], [[float("nan"), 0.2, 0.3]], "NaN"),
])
def test_position_points_reject_inconsistent_rounds(round_accepted, draft_entropies, match):
    c = Completion(prompt=[1], tokens=[0], logprobs=[0.0], entropies=[0.0], round_accepted=round_accepted,
                   draft_entropies=draft_entropies, num_draft_tokens=3)
    with pytest.raises(ValueError, match=match):
        position_points([c])


def test_entropy_bins_by_hand_keep_ties_together():
    bins = entropy_bins([0.4, 0.1, 0.3, 0.2], [0, 1, 0, 1], n_bins=2)
    np.testing.assert_allclose(bins.entropy, [0.15, 0.35])
    np.testing.assert_allclose(bins.acceptance, [1.0, 0.0])
    np.testing.assert_array_equal(bins.count, [2, 2])
    tied = entropy_bins([0.5] * 6 + [1.0, 2.0], [1] * 6 + [0, 0], n_bins=4)
    # 6 of 8 tie at 0.5: the first three quartile edges coincide, the top quarter is one bin
    assert tied.count.tolist() == [6, 2] and tied.acceptance.tolist() == [1.0, 0.0]


def test_binned_slope_recovers_sign_and_magnitude_from_completions():
    rng = np.random.default_rng(0)
    comps = [sampled_completion(rng, h_max=2.5, slope=-0.3) for _ in range(30)]
    fit, bins = per_position_slope(position_points(comps), n_bins=10, n_boot=300)
    assert bins.entropy.size == 10 and int(bins.count.sum()) > 2000
    assert -0.4 < fit.slope < -0.2 and fit.ci_high < 0
    assert fit.ci_low < -0.3 < fit.ci_high


def test_histogram_bins_agree_with_raw_bins_and_round_trip():
    rng = np.random.default_rng(1)
    pts = position_points([sampled_completion(rng, h_max=2.0) for _ in range(10)])
    h, a = pts.entropy[pts.reached], pts.accepted[pts.reached]
    hist = EntropyHistogram(width=0.01)
    hist.add(h, a)
    raw, cells = entropy_bins(h, a), hist.bins()
    assert int(cells.count.sum()) == h.size and int(round(cells.acceptance @ cells.count)) == int(a.sum())
    np.testing.assert_allclose(cells.entropy, raw.entropy, atol=0.02)
    again = EntropyHistogram.from_dict(json.loads(json.dumps(hist.to_dict())))
    np.testing.assert_array_equal(again.reached, hist.reached)
    np.testing.assert_allclose(again.bins().acceptance, cells.acceptance)


# ---------------------------------------------------------------------------------------------
# AcceptanceMonitor
# ---------------------------------------------------------------------------------------------


def test_record_step_reports_counts_versions_domains_and_staleness(tmp_path):
    batch = RolloutBatch([hand_completion(), fixed_completion(0.5, 1.0, k=3, rounds=4, domain="code")],
                         wall_time_s=2.0)
    batch.completions[0].domain = "math"
    batch.completions[0].policy_version, batch.completions[1].policy_version = 4, 5
    batch.completions[0].head_version = 2
    batch.completions[1].nonfinite_draft_rounds = 3      # rounds whose draft q was NaN/inf (engine fallback)
    with AcceptanceMonitor(config(tmp_path)) as mon:
        mon.record_step(10, batch)
        mon.record_event(12, "head_refresh", {"reason": "entropy_rise", "head_version": 3})
        rec = mon.record_step(14, batch, tokens_per_s=123.0, extra={"reward": 0.25})
    stats = batch.spec_stats()
    assert rec["acceptance_rate"] == pytest.approx(stats.acceptance_rate)   # (5 + 6) / (9 + 12)
    assert rec["acceptance_length"] == pytest.approx(stats.acceptance_length)
    assert rec["cond_acceptance"] == pytest.approx(stats.conditional_acceptance)
    assert rec["num_draft_tokens"] == 21 and rec["num_accepted_tokens"] == 11
    assert rec["num_nonfinite_rounds"] == 3
    assert rec["policy_version_min"] == 4 and rec["policy_version_max"] == 5
    assert rec["head_version_min"] == 0 and rec["head_version_max"] == 2
    assert rec["head_staleness"] == 2 and rec["tokens_per_s"] == 123.0 and rec["extra"] == {"reward": 0.25}
    assert set(rec["domains"]) == {"math", "code"}
    assert rec["domains"]["math"]["acceptance_rate"] == pytest.approx(5 / 9)
    assert rec["domains"]["code"]["entropy_drafted"] == pytest.approx(1.0)
    # the cumulative per-position slope is the bins of both steps' reached positions, refitted
    cfg, hist = config(tmp_path), EntropyHistogram(0.01, 16.0)
    for _ in range(2):
        pts = position_points(batch.completions)
        hist.add(pts.entropy[pts.reached], pts.accepted[pts.reached])
    expected = binned_slope(hist.bins(cfg.n_bins), n_boot=cfg.n_boot, seed=cfg.seed + 14).to_dict()
    assert rec["slope_position_cum"] == pytest.approx(expected, nan_ok=True)
    lines = (tmp_path / "mon" / "monitor.jsonl").read_text().splitlines()
    assert [json.loads(ln).get("event") for ln in lines] == [None, "head_refresh", None]
    assert json.loads(lines[2]) == rec   # the returned record is exactly what was logged


def test_record_step_reports_max_prob_mean_and_share_over_0_9_per_batch_and_domain(tmp_path):
    """max_prob_mean: mean max_v p(v) over emitted tokens; max_prob_over_0_9: share of them above 0.9
    (0.9 itself is not above). Completions without max_probs count for nothing."""
    def comp(max_probs, domain):
        n = len(max_probs)
        return Completion(prompt=[1], tokens=[7] * n, logprobs=[0.0] * n, entropies=[0.5] * n,
                          max_probs=max_probs, domain=domain)
    batch = RolloutBatch([comp([0.95, 0.5, 0.99, 0.2], "math"), comp([0.9, 1.0], "code"),
                          Completion(prompt=[1], tokens=[7], logprobs=[0.0], entropies=[0.5], domain="code")])
    with AcceptanceMonitor(config(tmp_path)) as mon:
        rec = mon.record_step(0, batch)
        alone = mon.record_step(1, RolloutBatch([batch.completions[2]]))
    math, code = rec["domains"]["math"], rec["domains"]["code"]
    assert math["max_prob_mean"] == pytest.approx(0.66) and math["max_prob_over_0_9"] == pytest.approx(0.5)
    assert code["max_prob_mean"] == pytest.approx(0.95) and code["max_prob_over_0_9"] == pytest.approx(0.5)
    assert rec["max_prob_mean"] == pytest.approx(4.54 / 6) and rec["max_prob_over_0_9"] == pytest.approx(3 / 6)
    assert rec["entropy_token"] == pytest.approx(0.5)
    assert alone["max_prob_mean"] is None and alone["max_prob_over_0_9"] is None     # NaN, logged as null
    flat = flatten_record(rec)
    assert flat["domains.math.max_prob_over_0_9"] == pytest.approx(0.5) and flat["max_prob_mean"] == rec["max_prob_mean"]


def test_jsonl_survives_a_crash_mid_write_and_the_run_continues(tmp_path, caplog):
    rng = np.random.default_rng(2)
    mon = AcceptanceMonitor(config(tmp_path))
    for step in range(5):
        mon.record_step(step, RolloutBatch([sampled_completion(rng, h_max=1.0 + 0.1 * step)]))
    mon.record_event(3, "head_refresh", {"reason": "acceptance_drop", "head_version": 1})
    path = tmp_path / "mon" / "monitor.jsonl"
    complete = path.read_text().splitlines()
    with open(path, "a") as f:   # the process dies half-way through the next record
        f.write(complete[-2][: len(complete[-2]) // 2])
    del mon                      # no close(): a crash

    with caplog.at_level(logging.WARNING, logger="rollout.monitor"):
        records = AcceptanceMonitor.load_records(path)
    assert [r["step"] for r in records if "event" not in r] == [0, 1, 2, 3, 4]
    assert records[-1]["event"] == "head_refresh" and "truncated" in caplog.text

    mon = AcceptanceMonitor(config(tmp_path))   # re-open: tail repaired, history restored
    assert [r["step"] for r in mon.records] == [0, 1, 2, 3, 4]
    rec = mon.record_step(5, RolloutBatch([sampled_completion(rng, h_max=1.5)]))
    mon.close()
    assert rec["slope_step_run"]["n"] == 6 and rec["head_staleness"] == 2
    assert rec["slope_position_cum"]["n"] == 10     # cumulative histogram came back from the state file
    records = AcceptanceMonitor.load_records(path)   # every line parses again
    assert len(records) == len(path.read_text().splitlines())
    assert [r["step"] for r in records if "event" not in r] == [0, 1, 2, 3, 4, 5]


def test_load_records_raises_on_corruption_before_the_last_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "acc\n{"step": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        AcceptanceMonitor.load_records(path)


def test_acceptance_alert_fires_when_acceptance_drops_and_not_before(tmp_path, caplog):
    mon = AcceptanceMonitor(config(tmp_path, window=3, min_acceptance=0.5))
    with caplog.at_level(logging.WARNING, logger="rollout.monitor"):
        healthy = [mon.record_step(s, RolloutBatch([fixed_completion(0.8, 0.6 + 0.01 * s)])) for s in range(6)]
        assert not caplog.records
        dropped = [mon.record_step(s, RolloutBatch([fixed_completion(0.2, 0.6)])) for s in range(6, 12)]
    mon.close()
    assert all(r["alerts"] == [] for r in healthy)
    names = [[a["name"] for a in r["alerts"]] for r in dropped]
    assert names[0] == [] and all(n == ["acceptance_low"] for n in names[2:])   # pooled window catches up
    alert_events = [e for e in mon.events if e["event"] == "alert"]
    assert len(alert_events) == 1 and alert_events[0]["detail"]["name"] == "acceptance_low"
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_slope_alert_fires_on_a_steep_windowed_slope_only(tmp_path):
    def run(sub: str, slope: float) -> list[dict]:
        mon = AcceptanceMonitor(config(tmp_path / sub, min_acceptance=0.0, min_slope=-0.5))
        recs = [mon.record_step(s, RolloutBatch([fixed_completion(0.95 + slope * h, h)]))
                for s, h in enumerate(np.linspace(0.2, 0.8, 8))]
        mon.close()
        return recs

    steep, flat = run("steep", -1.0), run("flat", -0.1)
    assert steep[-1]["slope_step_window"]["slope"] == pytest.approx(-1.0, abs=0.02)
    assert all(r["alerts"] == [] for r in steep[:2])                    # fewer than 3 steps: no slope yet
    assert all([a["name"] for a in r["alerts"]] == ["slope_steep"] for r in steep[2:])
    assert all(r["alerts"] == [] for r in flat)


def test_csv_pngs_and_tensorboard_are_written(tmp_path):
    rng = np.random.default_rng(3)
    mon = AcceptanceMonitor(config(tmp_path, tensorboard=True, plots=True))
    for step in range(5):
        comps = [sourced_completion(rng, {"heads": -0.1, "history": -0.3}, h_max=0.8 + 0.2 * step, domain=d,
                                    rounds=30) for d in ("math", "code")]
        mon.record_step(step, RolloutBatch(comps, wall_time_s=1.0))
        if step == 2:
            mon.record_event(step, "head_refresh", {"reason": "scheduled", "head_version": 1})
    mon.record_event(4, "worker_restarted", {"worker": 1})
    mon.close()
    mon.close()   # idempotent
    out = tmp_path / "mon"
    # PNGs at the figure sizes the plots promise (12.5 x 4.8, 10 x 12.5 and 6.5 x 7 in at 110 dpi)
    for name, size in (("acceptance_vs_entropy.png", (1375, 528)), ("over_steps.png", (1100, 1375)),
                       ("calibration.png", (715, 770))):
        head = (out / name).read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == size
    # the CSV holds every record's flat columns, value for value
    with open(out / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5
    for row, rec in zip(rows, mon.records):
        for col, v in flatten_record(rec).items():
            assert row[col] == ("" if v is None else str(v)), col
    assert "domains.math.slope_position_step.slope" in rows[0]
    assert {"max_prob_mean", "max_prob_over_0_9", "domains.code.max_prob_over_0_9"} <= set(rows[0])
    # per-source acceptance and token shares, the draft length and per-source slopes; no per-bin arrays
    assert {"drafting.heads.acceptance_rate", "drafting.history.acceptance_rate", "drafting.heads.token_share",
            "drafting.history.token_share", "drafting.plain_token_share", "drafting.draft_length.mean",
            "drafting.history.calibration_error", "slope_by_source.history.cum.slope"} <= set(rows[0])
    assert not [c for c in rows[0] if ".calibration." in c]
    for row in rows:
        shares = [float(row[f"drafting.{n}"])
                  for n in ("heads.token_share", "history.token_share", "plain_token_share")]
        assert sum(shares) == pytest.approx(1.0)
    # TensorBoard: the same numbers under '/'-joined tags
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    for tag, col in (("acceptance_rate", "acceptance_rate"), ("slope_step_window/slope", "slope_step_window.slope"),
                     ("domains/code/acceptance_rate", "domains.code.acceptance_rate"),
                     ("domains/math/max_prob_over_0_9", "domains.math.max_prob_over_0_9"),
                     ("drafting/history/token_share", "drafting.history.token_share")):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        want = [(r["step"], flatten_record(r)[col]) for r in mon.records if flatten_record(r)[col] is not None]
        assert [g[0] for g in got] == [w[0] for w in want] and [g[1] for g in got] == pytest.approx(
            [w[1] for w in want], rel=1e-6), tag
    with pytest.raises(RuntimeError, match="closed"):
        mon.record_step(5, RolloutBatch([]))


def test_replayed_step_replaces_later_steps(tmp_path, caplog):
    mon = AcceptanceMonitor(config(tmp_path))
    for s in range(5):
        mon.record_step(s, RolloutBatch([fixed_completion(0.7, 0.5 + 0.1 * s)]))
    with caplog.at_level(logging.WARNING, logger="rollout.monitor"):
        rec = mon.record_step(3, RolloutBatch([fixed_completion(0.7, 0.5)]))
    mon.close()
    assert [r["step"] for r in mon.records] == [0, 1, 2, 3] and rec["slope_step_run"]["n"] == 4
    assert "last recorded step 4" in caplog.text


def test_config_is_picklable_and_validated(tmp_path):
    cfg = config(tmp_path)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    for bad in ({"window": 2}, {"n_bins": 2}, {"min_acceptance": 1.5}, {"n_boot": -1}):
        with pytest.raises(ValueError):
            config(tmp_path, **bad)


def test_flatten_record_and_empty_fit():
    flat = flatten_record({"step": 1, "cond_acceptance": [0.5, None], "bins_step": {"entropy": [1.0]},
                           "domains": {"math": {"slope_step_run": SlopeFit.empty(2).to_dict()}},
                           "alerts": [{"name": "acceptance_low"}, {"name": "slope_steep"}]})
    assert flat["cond_acceptance.1"] is None and "bins_step.entropy.0" not in flat
    assert flat["domains.math.slope_step_run.n"] == 2 and flat["alerts"] == "acceptance_low;slope_steep"


def test_position_points_follow_each_rounds_own_k():
    """Rows draft 0..k tokens per round (Completion.round_draft_tokens): a round of 1 draft whose draft
    was accepted reached only its one position, which the fixed-k rule (min(accepted + 1, k)) would call
    incomplete; counts and reached/accepted flags follow each round's own k."""
    comp = Completion(prompt=[1], tokens=[7] * 9, logprobs=[0.0] * 9, entropies=[1.0] * 9,
                      round_accepted=[1, 1, 0, 2], round_draft_tokens=[3, 1, 2, 2],
                      draft_entropies=[[0.5, 0.6], [0.7], [0.8], [0.9, 1.0]], num_draft_tokens=3)
    pts = position_points([comp])
    assert pts.position.tolist() == [0, 1, 0, 0, 0, 1]
    assert pts.reached.tolist() == [True, True, True, True, True, True]
    assert pts.accepted.tolist() == [True, False, True, False, True, True]
    stats = comp.spec_stats()
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (8, 4)
    with pytest.raises(ValueError, match="round 1: 1 draft entropies for k=3"):
        position_points([Completion(prompt=[1], tokens=[7] * 4, logprobs=[0.0] * 4, entropies=[1.0] * 4,
                                    round_accepted=[0, 1], draft_entropies=[[0.5], [0.7]], num_draft_tokens=3)])


# ---------------------------------------------------------------------------------------------
# Per-source drafting, the acceptance predictor's calibration, per-source slopes
# ---------------------------------------------------------------------------------------------


def mixed_completions() -> list[Completion]:
    """Hand-counted: a torch-engine row drafting from both sources (3 plain rounds between), and a
    vLLM-style row (no sources, no predictions, fixed k = 2) whose last round a stop token cut after
    its first accepted draft."""
    torch_row = Completion(
        prompt=[1], tokens=[7] * 14, logprobs=[0.0] * 14, entropies=[1.0] * 14,
        round_accepted=[2, 4, 0, 1], round_draft_tokens=[3, 4, 2, 1],
        round_sources=["heads", "history", "history", "heads"],
        round_predicted=[[0.9, 0.8, 0.7], [0.95] * 4, [0.6, 0.6], [0.5]],
        draft_entropies=[[0.1, 0.2, 0.3], [0.4] * 4, [0.5, 0.6], [0.7]], num_draft_tokens=4)
    vllm_row = Completion(prompt=[1], tokens=[7] * 4, logprobs=[0.0] * 4, entropies=[1.0] * 4,
                          round_accepted=[1, 2], draft_entropies=[[0.2, 0.3], [0.4, 0.5]], num_draft_tokens=2)
    return [torch_row, vllm_row]


def test_drafting_block_counts_per_source_by_hand(tmp_path):
    with AcceptanceMonitor(config(tmp_path)) as mon:
        rec = mon.record_step(0, RolloutBatch(mixed_completions()))
    d = rec["drafting"]
    heads, history = d["heads"], d["history"]
    assert (heads["rounds"], heads["draft_tokens"], heads["accepted_tokens"]) == (4, 8, 6)
    assert (history["rounds"], history["draft_tokens"], history["accepted_tokens"]) == (2, 6, 4)
    assert heads["acceptance_rate"] == pytest.approx(0.75) and history["acceptance_rate"] == pytest.approx(4 / 6)
    assert heads["cond_acceptance"] == pytest.approx([1.0, 2 / 3, 0.0])
    assert history["cond_acceptance"] == pytest.approx([0.5, 1.0, 1.0, 1.0])
    # 18 emitted tokens: 5 from accepted head drafts (the cut draft is not emitted), 4 from history, 9 plain/bonus
    assert heads["token_share"] == pytest.approx(5 / 18) and history["token_share"] == pytest.approx(4 / 18)
    assert d["plain_token_share"] == pytest.approx(9 / 18)
    assert heads["token_share"] + history["token_share"] + d["plain_token_share"] == pytest.approx(1.0)
    assert d["draft_length"] == {"mean": pytest.approx(14 / 6), "row_rounds": {"1": 1, "2": 3, "3": 1, "4": 1}}
    # the sources together are the batch's counters
    assert heads["draft_tokens"] + history["draft_tokens"] == rec["num_draft_tokens"]
    assert heads["accepted_tokens"] + history["accepted_tokens"] == rec["num_accepted_tokens"]
    # calibration over reached positions only: history's round 2 never reached its second draft
    cal = heads["calibration"]
    assert cal["count"] == [0, 0, 0, 0, 0, 1, 0, 1, 1, 1]
    assert cal["predicted"][5] == pytest.approx(0.5) and cal["observed"][5:] == [1.0, None, 0.0, 1.0, 1.0]
    assert cal["predicted"][0] is None
    assert history["calibration"]["count"] == [0, 0, 0, 0, 0, 0, 1, 0, 0, 4]
    assert history["calibration"]["observed"][6] == 0.0 and history["calibration"]["observed"][9] == 1.0
    assert heads["calibration_error"] == pytest.approx((0.1 + 0.2 + 0.7 + 0.5) / 4)


def test_plain_decoding_and_vllm_steps_have_a_heads_only_drafting_block(tmp_path):
    plain = Completion(prompt=[1], tokens=[7] * 5, logprobs=[0.0] * 5, entropies=[1.0] * 5)
    with AcceptanceMonitor(config(tmp_path)) as mon:
        rec = mon.record_step(0, RolloutBatch([plain]))
        vllm = mon.record_step(1, RolloutBatch([sampled_completion(np.random.default_rng(4), h_max=2.0)]))
    d = rec["drafting"]
    assert d["plain_token_share"] == 1.0 and d["heads"]["token_share"] == 0.0 and d["history"]["rounds"] == 0
    assert d["heads"]["acceptance_rate"] is None and d["draft_length"] == {"mean": None, "row_rounds": {}}
    assert rec["slope_by_source"] == {}
    assert vllm["drafting"]["history"]["rounds"] == 0 and vllm["drafting"]["heads"]["rounds"] == 60
    assert vllm["drafting"]["heads"]["calibration_error"] is None       # no predictions recorded
    assert set(vllm["slope_by_source"]) == {"heads"}                   # history: no points, no fit


def test_a_calibrated_predictor_gives_observed_equal_to_predicted_per_bin(tmp_path):
    """Bin b holds 20 one-draft rounds predicted at (b + 0.5) / 10, of which exactly 20 * that were accepted;
    bin 0 also holds 20 two-draft rounds rejected at their first draft, whose unreached second draft
    (predicted 0.95) must not count. Fixed-k rounds (no predictions) count for nothing."""
    rounds_acc, rounds_k, preds = [], [], []
    for b in range(10):
        q = (b + 0.5) / 10
        n_acc = 2 if b == 0 else round(20 * q)
        rounds_acc += [1] * n_acc + [0] * (20 - n_acc)
        rounds_k += [1] * 20
        preds += [[q]] * 20
    rounds_acc += [0] * 20
    rounds_k += [2] * 20
    preds += [[0.05, 0.95]] * 20
    n = len(rounds_acc)
    history = Completion(prompt=[1], tokens=[7] * (sum(rounds_acc) + n), logprobs=[0.0] * (sum(rounds_acc) + n),
                         entropies=[1.0] * (sum(rounds_acc) + n), round_accepted=rounds_acc,
                         round_draft_tokens=rounds_k, round_sources=["history"] * n, round_predicted=preds,
                         num_draft_tokens=2)
    fixed_heads = fixed_completion(0.5, 1.0, k=2, rounds=10)      # round_predicted empty
    with AcceptanceMonitor(config(tmp_path)) as mon:
        for step in range(2):
            rec = mon.record_step(step, RolloutBatch([history, fixed_heads]))
    cal = rec["drafting"]["history"]["calibration"]
    assert cal["count"] == [40] + [20] * 9
    assert cal["observed"] == pytest.approx(cal["predicted"]) and cal["predicted"][9] == pytest.approx(0.95)
    assert rec["drafting"]["history"]["calibration_error"] == pytest.approx(0.0, abs=1e-12)
    assert rec["drafting"]["heads"]["calibration"]["count"] == [0] * 10
    state = json.loads((tmp_path / "mon" / "monitor_state.json").read_text())   # the run's aggregate: both steps
    assert state["calibration"]["history"]["count"] == [80] + [40] * 9
    assert state["calibration"]["heads"]["count"] == [0] * 10


def test_slope_by_source_recovers_each_sources_slope(tmp_path):
    """History's acceptance falls with entropy faster (-0.35/nat) than the heads' (-0.1/nat): the per-source
    fits recover both and their intervals separate; the engine's calibrated predictions show as such."""
    rng = np.random.default_rng(5)
    slopes = {"heads": -0.1, "history": -0.35}
    with AcceptanceMonitor(config(tmp_path)) as mon:
        recs = [mon.record_step(s, RolloutBatch([sourced_completion(rng, slopes) for _ in range(20)]))
                for s in range(2)]
    fits = recs[-1]["slope_by_source"]
    heads, history = fits["heads"]["step"], fits["history"]["step"]
    assert -0.2 < heads["slope"] < 0.0 and heads["ci_low"] < -0.1 < heads["ci_high"]
    assert -0.45 < history["slope"] < -0.25 and history["ci_low"] < -0.35 < history["ci_high"]
    assert history["ci_high"] < heads["ci_low"]
    assert heads["n"] == history["n"] == 10
    cum = fits["history"]["cum"]                                 # both steps' reached history positions
    assert -0.45 < cum["slope"] < -0.25 and cum["ci_high"] - cum["ci_low"] < history["ci_high"] - history["ci_low"]
    for name in slopes:
        assert recs[-1]["drafting"][name]["calibration_error"] < 0.05


def test_a_source_with_too_few_bins_gets_no_fit(tmp_path):
    """One history round gives at most 2 entropy bins: below the 3 every per-position fit needs."""
    few = Completion(prompt=[1], tokens=[7] * 3, logprobs=[0.0] * 3, entropies=[1.0] * 3, round_accepted=[1],
                     round_draft_tokens=[2], round_sources=["history"], round_predicted=[[0.9, 0.8]],
                     draft_entropies=[[0.3, 0.9]], num_draft_tokens=2)
    with AcceptanceMonitor(config(tmp_path)) as mon:
        rec = mon.record_step(0, RolloutBatch([few, sampled_completion(np.random.default_rng(6), h_max=2.0)]))
    assert "history" not in rec["slope_by_source"] and rec["drafting"]["history"]["rounds"] == 1
    assert rec["slope_by_source"]["heads"]["step"]["n"] == 10


def test_per_source_aggregates_survive_a_resume(tmp_path):
    """A run that crashed after step 1 and reopened ends with the same cumulative per-source slopes and
    calibration (state file) as one that never stopped."""
    rng = np.random.default_rng(7)
    batches = [RolloutBatch([sourced_completion(rng, {"heads": -0.1, "history": -0.35}, rounds=40)
                             for _ in range(4)]) for _ in range(4)]
    with AcceptanceMonitor(config(tmp_path / "straight")) as mon:
        straight = [mon.record_step(s, b) for s, b in enumerate(batches)]
    mon = AcceptanceMonitor(config(tmp_path / "resumed"))
    for s in range(2):
        mon.record_step(s, batches[s])
    del mon                                                          # no close(): a crash
    with AcceptanceMonitor(config(tmp_path / "resumed")) as mon:
        resumed = [mon.record_step(s, batches[s]) for s in range(2, 4)]
    assert resumed[-1]["slope_by_source"] == straight[-1]["slope_by_source"]
    assert resumed[-1]["drafting"] == straight[-1]["drafting"]
    state = [json.loads((tmp_path / run / "mon" / "monitor_state.json").read_text()) for run in ("straight", "resumed")]
    assert state[0] == state[1] and state[0]["calibration"]["history"]["count"][0] >= 0
    assert set(state[0]["sources"]) == {"heads", "history"}


@pytest.mark.parametrize("field, value, match", [
    ("round_sources", ["heads"], "round_sources has 1 rounds"),
    ("round_predicted", [[0.5, 0.5, 0.5]], "round_predicted has 1 rounds"),
    ("round_predicted", [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]], "4 predictions for 3 drafts"),
    ("round_predicted", [[float("nan")], [0.5]], "NaN"),
    ("round_draft_tokens", [1, 1], "round 1: accepted 2 outside"),
])
def test_drafting_rejects_inconsistent_rounds(field, value, match):
    from rollout.monitor import drafting_stats

    c = Completion(prompt=[1], tokens=[7] * 5, logprobs=[0.0] * 5, entropies=[1.0] * 5, round_accepted=[1, 2],
                   num_draft_tokens=3)
    setattr(c, field, value)
    with pytest.raises(ValueError, match=match):
        drafting_stats([c])
