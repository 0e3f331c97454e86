"""What a stakeholder reads first, derived from the Details frame and the trials:

- the Summary in the reference table's own columns (shared/seeds/zero_table_8xA100.md);
- the memory breakdown of every configuration at one common batch size (what ZeRO saves);
- "what each optimization buys": a baseline, then each configuration that changes one key.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from zero_bench.records import TrialResult
from zero_bench.report.rows import Loaded, Row
from zero_bench.report.tables import device_memory, measured_model_states

MiB = 2 ** 20

# The reference table's columns, in its order; per device a text cell and the number beside it.
LEAD = ["Model", "num_layers", "hidden_size", "num_heads", "# gpus", "data parallel", "model parallel", "ZeRO stage",
        "CPU offload", "Max Global BSZ", "time/it (ms)", "Throughput (samples/sec)"]
# Keys "what each optimization buys" compares, and each one's order from baseline to most optimised.
OPTIMIZATIONS = {"ZeRO stage": [0, 1, 2, 3], "CPU offload": ["No", "Yes", "Yes (+params)"],
                 "precision": ["fp32", "fp16", "bf16"], "recompute": ["none", "selective", "full"],
                 "compile": ["No", "Yes"], "ds preset": ["default", "megatron_deepspeed"]}
SAME = ["Model", "num_layers", "hidden_size", "num_heads", "# gpus", "data parallel", "model parallel", "grad accum",
        "device"]


def device_columns(details: pd.DataFrame) -> list[int]:
    return sorted({int(c[3:].split()[0]) for c in details.columns if c.startswith("Dev") and c.endswith("used MiB")})


def summary_view(details: pd.DataFrame) -> pd.DataFrame:
    """The table's layout: "used MiB / total MiB" per device as nvidia-smi shows it, each next to
    its number (what the charts read); everything else is on the Details sheet."""
    out = details.reindex(columns=LEAD[:-1]).copy()
    out["Throughput (samples/sec)"] = details.get("throughput (samples/s)")
    kinds = set(details.get("memory of", pd.Series(dtype=object)).dropna())
    prefix = {frozenset({"GPU (NVML used)"}): "GPU", frozenset({"rank RSS"}): "Rank"}.get(frozenset(kinds), "Device")
    for i in device_columns(details):
        name = f"{prefix}{i}"
        used, total = details[f"Dev{i} used MiB"], details[f"Dev{i} total MiB"]
        text = used.map(_mib) + " / " + total.map(_mib)
        out[f"{name} Memory Usage"] = text.where(used.notna() & total.notna(), used.map(_mib))
        out[f"{name} used MiB"] = used
    out["Notes"] = details.get("Notes")
    out["config"] = details.get("config")  # the charts' category labels
    return out


def _mib(v) -> str:
    return "" if pd.isna(v) else f"{v:.0f}MiB"  # as nvidia-smi and the reference table write it


# -- memory breakdown at a common batch ------------------------------------------------------------

def breakdown_frame(rows: list[Row], loaded: Loaded) -> pd.DataFrame:
    """Each measured configuration's peak per device at one common micro-batch (the smallest max
    micro among them, so every configuration fitted it), split into: model states (the worker's
    exact counts), activations (the measured peak's slope over the batch sizes the search tried,
    times the micro-batch), DeepSpeed's buffers (the estimate, from the ds_config the trial ran
    with), and other (the rest of the measured peak: process, libraries, allocator). Where only one
    size fitted, other is the estimate's fixed cost per process and activations the rest."""
    cols = ["config", "micro batch", "model states MiB", "activations MiB", "buffers MiB", "other MiB",
            "total MiB", "activations from"]
    measured = [r for r in rows if r.measure is not None and r.max_micro]
    if not measured:
        return pd.DataFrame(columns=cols)
    micro = min(r.max_micro for r in measured)
    by_key: dict[str, list[TrialResult]] = {}
    for t, _ in loaded.trials:
        if t.status == "ok":
            by_key.setdefault(t.search_key, []).append(t)
    return pd.DataFrame([_breakdown(r, by_key.get(r.key, []), micro) for r in measured], columns=cols)


def _peak(t: TrialResult) -> Optional[int]:
    peaks = [d.peak_bytes for d in device_memory(t)[1] if d.peak_bytes]
    return max(peaks) if peaks else None


def _breakdown(r: Row, trials: list[TrialResult], micro: int) -> dict:
    states = measured_model_states(r.measure)[0] or 0
    est = _estimate(r)
    buffers = est.buffers_total if est else 0
    peak = _peak(r.measure) or 0
    points = {t.micro: _peak(t) for t in trials if _peak(t)}
    if len(points) >= 2:
        x = sorted(points)
        slope = float(np.polyfit(np.array(x, dtype=float), [points[m] for m in x], 1)[0])
        other, source = max(0.0, peak - states - buffers - slope * r.max_micro), "measured slope"
    else:  # one size only: the process's fixed cost from the estimate, the rest of the peak is activations
        other = est.overhead if est else 0
        slope, source = max(0.0, (peak - states - buffers - other) / r.max_micro), "peak minus the rest"
    parts = [states / MiB, slope * micro / MiB, buffers / MiB, other / MiB]
    return {"config": r.label, "micro batch": micro, "model states MiB": parts[0], "activations MiB": parts[1],
            "buffers MiB": parts[2], "other MiB": parts[3], "total MiB": sum(parts), "activations from": source}


def _estimate(r: Row):
    from zero_bench.config import BenchConfig
    from zero_bench.estimate import estimate

    try:
        return estimate(BenchConfig.from_dict(r.config))
    except Exception:  # noqa: BLE001 - an old or partial config: no estimate terms for it
        return None


# -- what each optimization buys -------------------------------------------------------------------

def buys_frame(details: pd.DataFrame) -> pd.DataFrame:
    """A baseline, then each configuration that differs from it in one key only: samples/s, max
    global batch and max memory, each with its change against the baseline in %. Empty unless the
    configurations share model and hardware and at least one changes a single key."""
    cols = ["change", "config", "Throughput (samples/sec)", "throughput Δ %", "Max Global BSZ", "max batch Δ %",
            "max memory MiB", "max memory Δ %"]
    df = details[details["Max Global BSZ"].notna()].copy()
    if len(df) < 2 or any(df[c].nunique(dropna=False) > 1 for c in SAME if c in df):
        return pd.DataFrame(columns=cols)
    df["max memory MiB"] = df[[c for c in df.columns if c.startswith("Dev") and c.endswith("used MiB")]].max(axis=1)
    base = df.loc[baseline_index(df)]
    out = [_buys_row("baseline", base, base)]
    for i in df.index:
        changed = [k for k in OPTIMIZATIONS if k in df and df.at[i, k] != base[k]]
        if len(changed) == 1:
            k = changed[0]
            out.append(_buys_row(f"{k}: {base[k]} -> {df.at[i, k]}", df.loc[i], base))
    return pd.DataFrame(out if len(out) > 1 else [], columns=cols)


def baseline_index(df: pd.DataFrame):
    """The least optimised configuration: lowest ZeRO stage, no offload, no recompute, eager, ..."""
    return min(df.index, key=lambda i: _rank(df.loc[i]))


def _rank(row: pd.Series) -> tuple:
    return tuple(order.index(row[k]) if k in row and row[k] in order else len(order)
                 for k, order in OPTIMIZATIONS.items())


def _buys_row(change: str, row: pd.Series, base: pd.Series) -> dict:
    def delta(col: str):
        b, v = base[col], row[col]
        return None if pd.isna(b) or pd.isna(v) or not b else (v - b) / b * 100

    return {"change": change, "config": row["config"], "Throughput (samples/sec)": row["throughput (samples/s)"],
            "throughput Δ %": delta("throughput (samples/s)"), "Max Global BSZ": row["Max Global BSZ"],
            "max batch Δ %": delta("Max Global BSZ"), "max memory MiB": row["max memory MiB"],
            "max memory Δ %": delta("max memory MiB")}
