"""Acceptance-vs-entropy monitoring (docs/design.md "Definitions").

    slope        fit_slope, per_step_slope, SlopeFit: the estimator with its bootstrap interval
    positions    per-draft-position points, entropy bins, the cumulative histogram
    records      strict-JSON records, flat columns, crash-safe JSONL reading
    step_stats   step means per group (batch or domain) and their history
    drafting     per draft source (heads, history): rounds, acceptance, token shares, predictor calibration
    collapse     the acceptance-collapse alert and its likely cause (stale drafter, bad refresh, inputs)
    monitor      AcceptanceMonitor and MonitorConfig: records, alerts, files
    plots        the three PNG figures
"""
from rollout.monitor.drafting import Calibration, drafting_stats
from rollout.monitor.monitor import AcceptanceMonitor, MonitorConfig
from rollout.monitor.positions import (EntropyBins, EntropyHistogram, PositionPoints, binned_slope, entropy_bins,
                                       per_position_slope, position_points)
from rollout.monitor.records import flatten_record, load_records
from rollout.monitor.slope import SlopeFit, fit_slope, per_step_slope

__all__ = ["AcceptanceMonitor", "Calibration", "EntropyBins", "EntropyHistogram", "MonitorConfig", "PositionPoints",
           "SlopeFit", "binned_slope", "drafting_stats", "entropy_bins", "fit_slope", "flatten_record", "load_records",
           "per_position_slope", "per_step_slope", "position_points"]
