"""bench-decode's bookkeeping: what reaches the engines, and how repeats are pooled."""
import pytest

from experiments import bench_decode as bd
from rollout.types import SamplingParams


class _FakeEngine:
    def __init__(self, name):
        self.name = name


@pytest.fixture
def fake_runs(monkeypatch):
    """bench() with engines that decode nothing: each setting's run returns the given tokens and seconds."""
    calls = []
    # setting -> per repeat (tokens, seconds): plain's lengths differ from both's, as with rows stopping at EOS
    results = {"plain": [(100, 1.0), (300, 2.0)], "both": [(150, 1.0), (200, 2.0)]}

    def make_engine(policy, heads, *, compile, **fields):
        return _FakeEngine("plain" if heads is None else "both")

    def run_ours(engine, prompts, sampling):
        calls.append((engine.name, sampling))
        tokens, seconds = results[engine.name][sum(1 for n, _ in calls if n == engine.name) - 1]
        return dict(tok_s=tokens / seconds, tokens=tokens, decode_s=seconds, acceptance=0.5, tokens_per_round=1.0,
                    mean_drafts=1.0, speedup_estimate=1.0, margin=1.0, paused=False, tail_only=engine.name == "both", price_check=0.95, share={"heads": 0.0, "history": 0.0},
                    phase_ms={p: 0.0 for p in bd.PHASES})

    monkeypatch.setattr(bd, "make_engine", make_engine)
    monkeypatch.setattr(bd, "run_ours", run_ours)
    return calls


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_ignore_eos_reaches_every_timed_call(fake_runs, ignore_eos):
    cfg = bd.BenchDecodeConfig(settings=["plain", "both"], batch_sizes=[1], repeats=2, history_epochs=0,
                               ignore_eos=ignore_eos)
    bd.bench(None, object(), cfg, {1: [[[1, 2]], [[3, 4]]]}, "test")
    assert len(fake_runs) == 4 and all(sp.ignore_eos is ignore_eos for _, sp in fake_runs)


def test_repeats_alternate_which_setting_decodes_first_and_ratios_pair_the_same_repeat(fake_runs):
    cfg = bd.BenchDecodeConfig(settings=["plain", "both"], batch_sizes=[1], repeats=2, history_epochs=0)
    rows = {r["setting"]: r for r in bd.bench(None, object(), cfg, {1: [[[1, 2]], [[3, 4]]]}, "test")}
    assert [name for name, _ in fake_runs] == ["plain", "both", "both", "plain"]
    assert [sp.seed for _, sp in fake_runs] == [0, 0, 1, 1]
    assert rows["both"]["all_ratios"] == pytest.approx([1.5, 200 / 300])


def test_pooled_ratio_is_all_tokens_over_all_seconds_against_plains(fake_runs):
    cfg = bd.BenchDecodeConfig(settings=["plain", "both"], batch_sizes=[1], repeats=2, history_epochs=0,
                               ignore_eos=False)
    rows = {r["setting"]: r for r in bd.bench(None, object(), cfg, {1: [[[1, 2]], [[3, 4]]]}, "test")}
    # plain: 400 tokens in 3 s; both: 350 tokens in 3 s. Per repeat both is 1.5x then 0.67x (median 1.08x)
    assert rows["plain"]["pooled_ratio"] == pytest.approx(1.0)
    assert rows["both"]["pooled_ratio"] == pytest.approx(350 / 400)
    assert rows["both"]["ratio_to_plain"] == pytest.approx((1.5 + 200 / 300) / 2)
    assert rows["both"]["tokens_per_row"] == pytest.approx(175.0) and rows["plain"]["tokens_per_row"] == 200.0


def test_the_log_table_has_a_cell_for_every_column(fake_runs, tmp_path):
    cfg = bd.BenchDecodeConfig(settings=["plain", "both"], batch_sizes=[1], repeats=2, history_epochs=0)
    rows = bd.bench(None, object(), cfg, {1: [[[1, 2]], [[3, 4]]]}, "test")
    bd.append_log(str(tmp_path / "LOG.md"), ["repeats=2"], "fake heads", rows)
    table = [ln for ln in (tmp_path / "LOG.md").read_text().splitlines() if ln.startswith("|")]
    assert len(table) == 2 + len(rows)
    assert {ln.count("|") for ln in table} == {table[0].count("|")}
    assert "| 0.875 (0.67-1.50) | 175 |" in table[-1]    # both's pooled ratio (its interval) and tokens per row
    assert table[-1].endswith("| 0 / 2 of 2 | 0.950 |")   # calls run plain / tail only, and the price check


def _runs(pairs):
    return [dict(tokens=t, decode_s=s) for t, s in pairs]


def test_the_pooled_interval_resamples_each_repeat_with_its_plain_run():
    # every repeat 1.2x plain's tok/s, with lengths (and so call times) that differ a lot between repeats:
    # resampled in pairs the pooled ratio is 1.2 in every resample; resampled apart it would scatter
    plain = _runs([(100, 1.0), (800, 4.0), (300, 3.0), (50, 0.5)])
    both = _runs([(120, 1.0), (960, 4.0), (360, 3.0), (60, 0.5)])
    low, high = bd.pooled_ratio_interval(both, plain)
    assert low == pytest.approx(1.2) and high == pytest.approx(1.2)


def test_the_pooled_interval_holds_the_pooled_ratio_and_narrows_with_more_repeats():
    plain = _runs([(100, 1.0)] * 4)
    both = _runs([(150, 1.0), (80, 1.0), (120, 1.0), (90, 1.0)])
    low, high = bd.pooled_ratio_interval(both, plain)
    assert low < 440 / 400 < high and low >= 0.8 and high <= 1.5
    low4, high4 = bd.pooled_ratio_interval(both * 4, plain * 4)
    assert low4 < 440 / 400 < high4 and high4 - low4 < 0.7 * (high - low)
    assert bd.pooled_ratio_interval(both[:1], plain[:1]) == pytest.approx((1.5, 1.5))   # one repeat: no spread


def test_a_timed_call_breaks_its_rounds_down_into_every_phase_the_host_work_included(tiny_policy, tiny_heads):
    """run_ours on real engines, drafting and plain: every phase of PHASES is timed, the engine's host work
    around each round (the row view, what the chooser, the cost model and the history learn) included."""
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    drafting = bd.run_ours(bd.make_engine(tiny_policy, tiny_heads, compile=False), prompts,
                           SamplingParams(max_new_tokens=12, temperature=1.0, num_draft_tokens=2, seed=0))
    plain = bd.run_ours(bd.make_engine(tiny_policy, None, compile=False), prompts,
                        SamplingParams(max_new_tokens=12, temperature=1.0, seed=0))
    assert set(drafting["phase_ms"]) == set(bd.PHASES) and "host" in bd.PHASES
    assert drafting["phase_ms"]["host"] > 0 and plain["phase_ms"]["host"] > 0
    assert drafting["phase_ms"]["draft"] > 0 and all(v >= 0 for v in plain["phase_ms"].values())
