"""The monitor's three figures: acceptance vs entropy (per position and per step); acceptance,
entropy, the policy's max-probability, tau and where emitted tokens came from over RL steps,
with refreshes and alerts marked; and the acceptance predictor's calibration. The studies in
experiments/ draw theirs with the same helpers (new_figure, save_png, column).

matplotlib's object API on Agg: no pyplot, no global backend switch, safe in Ray workers
and threads. PNGs are written atomically so a viewer never shows half a file.
"""
from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from rollout.fileio import atomic_write
from rollout.monitor.drafting import Calibration
from rollout.monitor.positions import EntropyBins
from rollout.monitor.records import as_float
from rollout.monitor.slope import SlopeFit

def new_figure(rows: int, cols: int, size: tuple[float, float], margins: dict, **kw):
    """Fixed margins, not constrained layout: layout solving was ~40% of the plotting time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    fig.subplots_adjust(**margins)
    return fig, axes


def save_png(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write(path, buf.getvalue())


def column(records: list[dict], key: str, *path: str) -> np.ndarray:
    """records[i][key][path...] as floats; a missing entry is NaN (older records lack newer keys)."""
    def get(r):
        v = r.get(key)
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        return v
    return np.array([as_float(get(r)) for r in records], dtype=np.float64)


def _fit_label(name: str, fit: SlopeFit) -> str:
    return (f"{name}: slope {fit.slope:+.3f}/nat, 95% CI [{fit.ci_low:+.3f}, {fit.ci_high:+.3f}], "
            f"R² {fit.r2:.2f}, n={fit.n}")


def _draw_fit(ax, fit: SlopeFit, x: np.ndarray, w: np.ndarray, color: str, name: str) -> None:
    """Fitted line over the data's x range; band = lines through the centroid with the CI slopes."""
    if not (math.isfinite(fit.slope) and x.size):
        return
    xs = np.linspace(x.min(), x.max(), 50)
    xc = float(np.average(x, weights=w))
    ax.plot(xs, fit.intercept + fit.slope * xs, color=color, label=_fit_label(name, fit))
    if math.isfinite(fit.ci_low) and math.isfinite(fit.ci_high):
        yc, dx = fit.intercept + fit.slope * xc, xs - xc
        lo = yc + np.minimum(fit.ci_low * dx, fit.ci_high * dx)
        hi = yc + np.maximum(fit.ci_low * dx, fit.ci_high * dx)
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2, label="95% CI of the slope")


def plot_acceptance_vs_entropy(path: Path, bins: EntropyBins, fit_pos: SlopeFit,
                                records: list[dict], fit_step: SlopeFit) -> None:
    """Left: cumulative per-position bins (size ~ count) + fit. Right: one point per RL step + fit."""
    fig, axes = new_figure(1, 2, (12.5, 4.8), dict(left=0.06, right=0.99, bottom=0.11, top=0.93, wspace=0.16),
                            sharey=True)
    ax_pos, ax_step = axes[0]
    if bins.count.size:
        size = 20 + 180 * bins.count / bins.count.max()
        ax_pos.scatter(bins.entropy, bins.acceptance, s=size, color="tab:blue", alpha=0.8,
                       label=f"entropy bins ({int(bins.count.sum())} reached positions)")
        _draw_fit(ax_pos, fit_pos, bins.entropy, bins.count.astype(float), "tab:blue", "per position")
    ax_pos.set(title="per draft position, cumulative over the run",
               xlabel="entropy H(p) at the draft position (nats)",
               ylabel="conditional acceptance (accepted / reached)")
    x, y = column(records, "entropy_drafted"), column(records, "acceptance_rate")
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.any():
        steps = column(records, "step")[ok]
        sc = ax_step.scatter(x[ok], y[ok], c=steps, cmap="viridis", s=18, label="RL steps")
        fig.colorbar(sc, ax=ax_step, label="RL step", pad=0.01)
        _draw_fit(ax_step, fit_step, x[ok], np.ones(ok.sum()), "tab:red", "per step")
    ax_step.set(title="per RL step (step means)", xlabel="mean entropy at drafted positions (nats)",
                ylabel="acceptance rate (accepted / proposed)")
    ax_step.yaxis.set_tick_params(labelleft=True)
    for ax in (ax_pos, ax_step):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower left")
    save_png(fig, path)


def _mark_events(ax, events: list[dict], legend: bool) -> None:
    """Dashed lines at head refreshes, dotted at other operational events (alerts are not lines)."""
    refresh = [e["step"] for e in events if e["event"] == "head_refresh"]
    other = [e["step"] for e in events if e["event"] not in ("head_refresh", "alert", "alert_cleared")]
    for i, s in enumerate(refresh):
        ax.axvline(s, color="tab:green", ls="--", lw=1, label="head refresh" if legend and i == 0 else None)
    for i, s in enumerate(other):
        ax.axvline(s, color="tab:orange", ls=":", lw=1,
                   label="co-trainer / worker event" if legend and i == 0 else None)


def plot_over_steps(path: Path, records: list[dict], events: list[dict], *, window: int,
                    min_acceptance: float) -> None:
    """Acceptance, entropy, the policy's max-probability, tau and the emitted tokens' sources against
    RL step, with refresh events and alert steps marked."""
    fig, axes = new_figure(5, 1, (10, 12.5), dict(left=0.08, right=0.92, bottom=0.04, top=0.988, hspace=0.08),
                            sharex=True)
    ax_acc, ax_ent, ax_max, ax_tau, ax_src = axes[:, 0]
    steps = column(records, "step")
    acc = column(records, "acceptance_rate")
    ax_acc.plot(steps, acc, "o-", ms=3, color="tab:blue", label="acceptance rate")
    ax_acc.plot(steps, column(records, "acceptance_window"), "--", color="tab:blue",
                label=f"pooled over {window} steps")
    for d in sorted({d for r in records for d in r.get("domains", {})}):
        rows = [(r["step"], as_float(r["domains"][d]["acceptance_rate"])) for r in records if d in r.get("domains", {})]
        ax_acc.plot(*zip(*rows), lw=0.8, alpha=0.6, label=f"{d}")
    ax_acc.axhline(min_acceptance, color="tab:red", ls=":", lw=1, label="alert threshold")
    alerted = np.array([bool(r.get("alerts")) for r in records], dtype=bool)
    if alerted.any():
        ax_acc.plot(steps[alerted], acc[alerted], "x", color="tab:red", ms=7, label="alert active")
    ax_acc.set(ylabel="accepted / proposed")
    ax_ent.plot(steps, column(records, "entropy_drafted"), "o-", ms=3, label="at drafted positions")
    ax_ent.plot(steps, column(records, "entropy_token"), "s-", ms=3, alpha=0.7, label="per emitted token")
    ax_ent.set(ylabel="entropy (nats)")
    ax_max.plot(steps, column(records, "max_prob_mean"), "o-", ms=3, color="tab:green", label="mean max_v p(v)")
    ax_max.plot(steps, column(records, "max_prob_over_0_9"), "s--", ms=3, color="tab:olive",
                label="share of tokens with max_v p(v) > 0.9")
    ax_max.set(ylabel="max-probability of p", ylim=(-0.02, 1.02))
    ax_tau.plot(steps, column(records, "acceptance_length"), "o-", ms=3, color="tab:purple", label="tau")
    ax_tau.set(ylabel="tokens / verification (tau)")
    _draw_sources(ax_src, records, steps)
    for i, ax in enumerate((ax_acc, ax_ent, ax_max, ax_tau)):
        _mark_events(ax, events, legend=i == 0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    _mark_events(ax_src, events, legend=False)
    save_png(fig, path)


_SOURCE_COLORS = {"heads": "tab:blue", "history": "tab:orange"}


def _draw_sources(ax, records: list[dict], steps: np.ndarray) -> None:
    """Share of emitted tokens per draft source and from plain/bonus tokens (left axis, [0, 1]) and the
    mean draft length of the rows that drafted (right axis)."""
    names = list(dict.fromkeys(n for r in records for n, v in r.get("drafting", {}).items()
                               if isinstance(v, dict) and "token_share" in v))
    for n in names:
        ax.plot(steps, column(records, "drafting", n, "token_share"), "o-", ms=3,
                color=_SOURCE_COLORS.get(n), label=f"{n} drafts")
    ax.plot(steps, column(records, "drafting", "plain_token_share"), "s-", ms=3, color="tab:gray",
            label="plain / bonus tokens")
    ax.set(ylabel="share of emitted tokens", ylim=(-0.02, 1.02), xlabel="RL step")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    length = column(records, "drafting", "draft_length", "mean")
    twin.plot(steps, length, "^--", ms=3, color="black", lw=1, label="mean draft length (right)")
    top = np.nanmax(length) if np.isfinite(length).any() else 1.0
    twin.set(ylabel="drafts per drafting row-round", ylim=(0, 1.4 * top))   # headroom for the legend
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, fontsize=7, loc="upper center", ncol=4)


def plot_calibration(path: Path, calibration: dict[str, Calibration]) -> None:
    """Reliability diagram of the engine's acceptance predictor, cumulative over the run: per source,
    mean predicted vs observed conditional acceptance per probability bin (area ~ reached positions),
    against the diagonal of perfect calibration; below, the positions per bin."""
    fig, axes = new_figure(2, 1, (6.5, 7.0), dict(left=0.12, right=0.97, bottom=0.08, top=0.95, hspace=0.08),
                            sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax, ax_n = axes[:, 0]
    ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=1, label="perfectly calibrated")
    shown = [(n, c) for n, c in calibration.items() if c.count.sum()]
    width = 1.0 / max(c.n_bins for _, c in shown) / (len(shown) + 1) if shown else 0.0
    for i, (name, cal) in enumerate(shown):
        pred, obs, cnt = cal.table()
        nz = cnt > 0
        color = _SOURCE_COLORS.get(name)
        ax.plot(pred[nz], obs[nz], "-", color=color, lw=1, alpha=0.7)
        ax.scatter(pred[nz], obs[nz], s=15 + 150 * cnt[nz] / cnt.max(), color=color, alpha=0.8,
                   label=f"{name}: {int(cnt.sum())} positions, calibration error {cal.error():.3f}")
        lefts = np.arange(cal.n_bins) / cal.n_bins
        ax_n.bar(lefts + (i + 0.5) * width, cnt, width=width, align="edge", color=color, alpha=0.8)
    if not shown:
        ax.text(0.5, 0.5, "no predicted acceptances recorded yet", ha="center", va="center", color="gray")
    ax.set(title="acceptance predictor, cumulative over the run", xlim=(0, 1), ylim=(-0.02, 1.02),
           ylabel="observed conditional acceptance")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    ax_n.set(xlabel="predicted conditional acceptance", ylabel="reached positions")
    ax_n.grid(alpha=0.3)
    save_png(fig, path)


