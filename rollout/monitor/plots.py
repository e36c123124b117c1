"""The monitor's two figures: acceptance vs entropy (per position and per step), and
acceptance, entropy, the policy's max-probability and tau over RL steps with refreshes and
alerts marked. The studies in experiments/ draw theirs with the same helpers (new_figure,
save_png, column).

matplotlib's object API on Agg: no pyplot, no global backend switch, safe in Ray workers
and threads. PNGs are written atomically so a viewer never shows half a file.
"""
from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from rollout.fileio import atomic_write
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


def column(records: list[dict], key: str) -> np.ndarray:
    return np.array([as_float(r.get(key)) for r in records], dtype=np.float64)


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
    """Acceptance, entropy, the policy's max-probability and tau against RL step, with refresh events
    and alert steps marked."""
    fig, axes = new_figure(4, 1, (10, 10), dict(left=0.08, right=0.98, bottom=0.05, top=0.985, hspace=0.08),
                            sharex=True)
    ax_acc, ax_ent, ax_max, ax_tau = axes[:, 0]
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
    ax_tau.set(ylabel="tokens / verification (tau)", xlabel="RL step")
    for i, ax in enumerate((ax_acc, ax_ent, ax_max, ax_tau)):
        _mark_events(ax, events, legend=i == 0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    save_png(fig, path)


