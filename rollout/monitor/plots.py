"""The monitor's two figures: acceptance vs entropy (per position and per step), and
acceptance, entropy and tau over RL steps with refreshes and alerts marked; the entropy
sweep's figure (acceptance vs mean entropy per temperature, a panel per draft mode); the
ablation's (acceptance vs entropy per RL step, a panel per draft mode, a colour per objective); and
the refresh-schedule study's (acceptance and entropy per RL step, a line per schedule).

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
from rollout.monitor.records import as_float, fit_from_dict
from rollout.monitor.slope import SlopeFit

def _new_figure(rows: int, cols: int, size: tuple[float, float], margins: dict, **kw):
    """Fixed margins, not constrained layout: layout solving was ~40% of the plotting time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    fig.subplots_adjust(**margins)
    return fig, axes


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write(path, buf.getvalue())


def _column(records: list[dict], key: str) -> np.ndarray:
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
    fig, axes = _new_figure(1, 2, (12.5, 4.8), dict(left=0.06, right=0.99, bottom=0.11, top=0.93, wspace=0.16),
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
    x, y = _column(records, "entropy_drafted"), _column(records, "acceptance_rate")
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.any():
        steps = _column(records, "step")[ok]
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
    _save(fig, path)


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
    """Acceptance, entropy and tau against RL step, with refresh events and alert steps marked."""
    fig, axes = _new_figure(3, 1, (10, 8), dict(left=0.08, right=0.98, bottom=0.06, top=0.98, hspace=0.08),
                            sharex=True)
    ax_acc, ax_ent, ax_tau = axes[:, 0]
    steps = _column(records, "step")
    acc = _column(records, "acceptance_rate")
    ax_acc.plot(steps, acc, "o-", ms=3, color="tab:blue", label="acceptance rate")
    ax_acc.plot(steps, _column(records, "acceptance_window"), "--", color="tab:blue",
                label=f"pooled over {window} steps")
    for d in sorted({d for r in records for d in r.get("domains", {})}):
        rows = [(r["step"], as_float(r["domains"][d]["acceptance_rate"])) for r in records if d in r.get("domains", {})]
        ax_acc.plot(*zip(*rows), lw=0.8, alpha=0.6, label=f"{d}")
    ax_acc.axhline(min_acceptance, color="tab:red", ls=":", lw=1, label="alert threshold")
    alerted = np.array([bool(r.get("alerts")) for r in records], dtype=bool)
    if alerted.any():
        ax_acc.plot(steps[alerted], acc[alerted], "x", color="tab:red", ms=7, label="alert active")
    ax_acc.set(ylabel="accepted / proposed")
    ax_ent.plot(steps, _column(records, "entropy_drafted"), "o-", ms=3, label="at drafted positions")
    ax_ent.plot(steps, _column(records, "entropy_token"), "s-", ms=3, alpha=0.7, label="per emitted token")
    ax_ent.set(ylabel="entropy (nats)")
    ax_tau.plot(steps, _column(records, "acceptance_length"), "o-", ms=3, color="tab:purple", label="tau")
    ax_tau.set(ylabel="tokens / verification (tau)", xlabel="RL step")
    for i, ax in enumerate((ax_acc, ax_ent, ax_tau)):
        _mark_events(ax, events, legend=i == 0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    _save(fig, path)



def _mode_panels(n: int):
    """A row of n panels (one per draft mode) sharing the acceptance axis."""
    return _new_figure(1, max(n, 1), (6.2 * max(n, 1), 4.8),
                       dict(left=0.07, right=0.99, bottom=0.11, top=0.92, wspace=0.12), sharey=True)


def _finish_mode_panel(ax, mode: str, xlabel: str, legend_title: str) -> None:
    ax.set(title=f"{mode} drafting", xlabel=xlabel, ylabel="acceptance rate (accepted / proposed)", ylim=(0, 1))
    ax.yaxis.set_tick_params(labelleft=True)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best", title=legend_title, title_fontsize=7)


def plot_sweep(path: Path, records: list[dict]) -> None:
    """One panel per draft mode, one line per heads file: acceptance rate against mean entropy at
    the reached draft positions, one point per temperature (labelled), the cell's slope over
    temperatures with its 95% interval in the legend."""
    modes = list(dict.fromkeys(r["draft_mode"] for r in records))
    heads = list(dict.fromkeys(r["head"] for r in records))
    fig, axes = _mode_panels(len(modes))
    colors = {h: f"C{i % 10}" for i, h in enumerate(heads)}
    for ax, mode in zip(axes[0], modes):
        for head in heads:
            cell = sorted((r for r in records if r["draft_mode"] == mode and r["head"] == head),
                          key=lambda r: r["temperature"])
            if not cell:
                continue
            x, y = _column(cell, "entropy_drafted"), _column(cell, "acceptance_rate")
            fit = fit_from_dict(cell[0].get("slope_temperature"))
            label = (f"{head}: {fit.slope:+.3f}/nat [{fit.ci_low:+.3f}, {fit.ci_high:+.3f}]"
                     if math.isfinite(fit.slope) else f"{head}: slope n/a (< 3 temperatures)")
            ax.plot(x, y, "o-", color=colors[head], label=label)
            for r, xi, yi in zip(cell, x, y):
                if math.isfinite(xi) and math.isfinite(yi):
                    ax.annotate(f"T={r['temperature']:g}", (xi, yi), textcoords="offset points", xytext=(3, 4),
                                fontsize=6, color=colors[head])
        _finish_mode_panel(ax, mode, "mean entropy H(p) at reached draft positions (nats)",
                           "heads: slope over temperatures, 95% CI")
    _save(fig, path)


def plot_ablation(path: Path, records: list[dict]) -> None:
    """The ablation's figure: one panel per draft mode, one colour per head objective; each RL
    step is a point (mean entropy at reached draft positions, acceptance rate), with the cell's
    across-step slope and its 95% interval in the legend."""
    modes = list(dict.fromkeys(r["draft_mode"] for r in records))
    objectives = list(dict.fromkeys(r["objective"] for r in records))
    fig, axes = _mode_panels(len(modes))
    colors = {o: f"C{i % 10}" for i, o in enumerate(objectives)}
    for ax, mode in zip(axes[0], modes):
        for r in (r for r in records if r["draft_mode"] == mode):
            x, y = _column(r["points"], "entropy"), _column(r["points"], "acceptance")
            ok = np.isfinite(x) & np.isfinite(y)
            fit = fit_from_dict(r.get("slope_step"))
            label = (f"{r['objective']}: {fit.slope:+.3f}/nat [{fit.ci_low:+.3f}, {fit.ci_high:+.3f}]"
                     if math.isfinite(fit.slope) else f"{r['objective']}: slope n/a")
            ax.plot(x[ok], y[ok], "o", color=colors[r["objective"]], alpha=0.7, label=label)
            if ok.sum() >= 2 and math.isfinite(fit.slope):      # the fitted line through the points' centroid
                xs = np.linspace(x[ok].min(), x[ok].max(), 20)
                ax.plot(xs, y[ok].mean() + fit.slope * (xs - x[ok].mean()), color=colors[r["objective"]])
        _finish_mode_panel(ax, mode, "mean entropy H(p) at reached draft positions (nats), per RL step",
                           "objective: slope per step, 95% CI")
    _save(fig, path)


def plot_refresh_study(path: Path, records: list[dict]) -> None:
    """The refresh-schedule study's figure: acceptance rate and mean entropy per RL step, a line per
    schedule, each refresh marked with a triangle on its schedule's line; the legend gives each
    schedule's refreshes and co-trainer training seconds."""
    fig, axes = _new_figure(2, 1, (10, 7), dict(left=0.08, right=0.98, bottom=0.07, top=0.97, hspace=0.08),
                            sharex=True)
    ax_acc, ax_ent = axes[:, 0]
    for i, r in enumerate(records):
        color = f"C{i % 10}"
        steps, acc = _column(r["per_step"], "step"), _column(r["per_step"], "acceptance_rate")
        label = (f"{r['schedule']}: {len(r['refresh_steps'])} refreshes, "
                 f"{as_float(r['cotrainer_train_s']):.0f} s co-trainer training")
        ax_acc.plot(steps, acc, "o-", ms=3, color=color, label=label)
        hit = np.isin(steps, np.asarray(r["refresh_steps"], dtype=np.float64))
        ax_acc.plot(steps[hit], acc[hit], "^", ms=8, color=color)
        ax_ent.plot(steps, _column(r["per_step"], "entropy"), "o-", ms=3, color=color, label=r["schedule"])
    ax_acc.set(ylabel="acceptance rate (accepted / proposed)")
    ax_ent.set(ylabel="mean entropy at drafted positions (nats)", xlabel="RL step")
    from matplotlib.ticker import MaxNLocator
    ax_ent.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_acc, ax_ent):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    _save(fig, path)
