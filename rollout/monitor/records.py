"""Monitor records on disk: strict-JSON values, flat CSV/TensorBoard columns, crash-safe JSONL.

Every record line must parse with any strict JSON reader (NaN/inf become null), and a run
that crashed mid-write must be readable and appendable again: a truncated last line is cut,
a complete one missing its newline is ended.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from rollout.monitor.slope import SlopeFit

logger = logging.getLogger(__name__)

_NOT_COLUMNS = frozenset({"bins_step", "calibration"})   # per-bin arrays stay in the JSONL, out of CSV/TensorBoard


def json_safe(v: Any) -> Any:
    """numpy -> Python and NaN/inf -> None, so every line is strict JSON (jq, pandas, browsers)."""
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, np.ndarray)):
        return [json_safe(x) for x in (v.tolist() if isinstance(v, np.ndarray) else v)]
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    return v if v is None or isinstance(v, str) else str(v)


def as_float(v: Any) -> float:
    """Record value -> float, None (a NaN written to JSON) -> nan."""
    return float("nan") if v is None else float(v)


def fit_from_dict(d: dict | None) -> SlopeFit:
    """A slope dict read back from a record -> SlopeFit (None -> nan)."""
    if not d:
        return SlopeFit.empty()
    return SlopeFit(*(as_float(d[k]) for k in ("slope", "intercept", "r2", "ci_low", "ci_high")), int(d["n"]))


def flatten_record(rec: dict, sep: str = ".") -> dict[str, Any]:
    """Nested step record -> flat columns (CSV, TensorBoard tags).

    slope_step_window.ci_low, cond_acceptance.0, domains.math.acceptance_rate; alerts
    become one column of ';'-joined names; the per-bin arrays (bins_step, calibration) are left out.
    """
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                if k not in _NOT_COLUMNS:
                    walk(f"{prefix}{sep}{k}" if prefix else k, x)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(f"{prefix}{sep}{i}", x)
        else:
            out[prefix] = v

    walk("", {k: v for k, v in rec.items() if k != "alerts"})
    if "alerts" in rec:
        out["alerts"] = ";".join(a["name"] for a in rec["alerts"])
    return out


def records_csv(records: list[dict]) -> str:
    """CSV text of records: one row per record, the union of their flat columns in first-seen
    order (a column missing from a record is left empty)."""
    rows = [flatten_record(r) for r in records]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=cols, restval="")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def repair_jsonl_tail(path: Path) -> None:
    """Make a crashed run's JSONL appendable: cut a truncated last line, or end a complete one."""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    try:
        json.loads(data[cut:])
    except ValueError:
        logger.warning("%s: dropping a truncated last line (%d bytes) from an interrupted write",
                       path, len(data) - cut)
        with open(path, "r+b") as f:
            f.truncate(cut)
            os.fsync(f.fileno())
        return
    with open(path, "ab") as f:   # a complete record whose newline was lost
        f.write(b"\n")
        os.fsync(f.fileno())



def load_records(path: Path) -> list[dict]:
    """All records of a JSONL file. A last line that does not parse (crash mid-write) is
    skipped with a warning; a bad line anywhere else is corruption and raises ValueError."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
    out = []
    for idx, (lineno, line) in enumerate(numbered):
        try:
            out.append(json.loads(line))
        except ValueError as e:
            if idx == len(numbered) - 1:
                logger.warning("%s:%d: skipping a truncated last line (%s)", path, lineno, e)
            else:
                raise ValueError(f"{path}:{lineno}: corrupt record: {e}") from e
    return out
