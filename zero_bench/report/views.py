"""What a stakeholder reads first, derived from the Details frame and the trials:

- the Summary in the reference table's own columns (shared/seeds/zero_table_8xA100.md);
- the memory breakdown of every configuration at one common batch size (what ZeRO saves);
- "what each optimization buys": a baseline, then each configuration that changes one key.
"""
from __future__ import annotations

from typing import Optional

import pandas as pd

from zero_bench.config.schema import DEFAULT_ENGINE
from zero_bench.engines.specs import SPECS
from zero_bench.records import TrialResult
from zero_bench.report.costs import COST_PER_MTOK, present
from zero_bench.report.rows import Row
from zero_bench.report.tables import SEQ_COLUMNS, batch_rows, device_memory, measured_model_states
from zero_bench.units import MiB


# The reference table's columns, in its order; per device a text cell and the number beside it.
LEAD = ["Model", "num_layers", "hidden_size", "num_heads", "# gpus", "data parallel", "model parallel", "ZeRO Stage",
        "CPU Offload", "Max Global BSZ", "time/it (ms)", "Throughput (samples/sec)"]
# Keys "what each optimization buys" compares, and each one's order from baseline to most optimised.
OPTIMIZATIONS = {"ZeRO Stage": [0, 1, 2, 3], "engine": list(SPECS),
                 "CPU Offload": ["No", "Yes", "Yes (+params)", "NVMe", "NVMe (+params)"],
                 "precision": ["fp32", "fp16", "bf16"], "recompute": ["none", "selective", "op", "block", "full"],
                 "compile": ["No", "Yes"], "ds preset": ["default", "megatron_deepspeed"]}
SAME = ["Model", "num_layers", "hidden_size", "num_heads", "# gpus", "data parallel", "model parallel",
        "expert parallel", "grad accum",
        "device"]


def device_columns(details: pd.DataFrame) -> list[int]:
    return sorted({int(c[3:].split()[0]) for c in details.columns if c.startswith("Dev") and c.endswith("used MiB")})


def summary_view(details: pd.DataFrame) -> pd.DataFrame:
    """The table's layout: "used MiB / total MiB" per device as nvidia-smi shows it, each next to
    its number (what the charts read); everything else is on the Details sheet."""
    out = details.reindex(columns=LEAD[:-1]).copy()
    engines = details.get("engine", pd.Series(dtype=object)).dropna()
    if (engines != DEFAULT_ENGINE).any():  # only then: a ZeRO-only report keeps the reference table's layout
        out.insert(LEAD.index("ZeRO Stage"), "engine", engines)
    if "search" in details.columns:  # maxseq's rows are in the store: what each row searched, and its answer
        for col in SEQ_COLUMNS:
            out.insert(out.columns.get_loc("Max Global BSZ"), col, details[col])
    out["Throughput (samples/sec)"] = details.get("Throughput (samples/sec)")
    kinds = set(details.get("memory of", pd.Series(dtype=object)).dropna())
    prefix = {frozenset({"GPU (NVML used)"}): "GPU", frozenset({"rank RSS"}): "Rank"}.get(frozenset(kinds), "Device")
    for i in device_columns(details):
        name = f"{prefix}{i}"
        used, total = details[f"Dev{i} used MiB"], details[f"Dev{i} total MiB"]
        text = used.map(_mib) + " / " + total.map(_mib)
        out[f"{name} Memory Usage"] = text.where(used.notna() & total.notna(), used.map(_mib))
        out[f"{name} used MiB"] = used
    out["Notes"] = details.get("Notes")
    for col in present(details.columns):  # after the reference table's own columns
        out[col] = details[col]
    out["config"] = details.get("config")  # the charts' category labels
    return out


def _mib(v) -> str:
    return "" if pd.isna(v) else f"{v:.0f}MiB"  # as nvidia-smi and the reference table write it


# -- memory breakdown at a common batch ------------------------------------------------------------

OTHER = "other MiB (peak - rest)"
PARTS = ("model states MiB", "activations MiB", "buffers MiB", "runtime MiB", OTHER)
BREAKDOWN_COLUMNS = ["config", "micro batch", *PARTS, "total MiB", "measured peak MiB", "peak at micro",
                     "activations from", "runtime from"]


def breakdown_frame(rows: list[Row]) -> pd.DataFrame:
    """Each measured configuration's memory per device at one common micro-batch (the smallest max
    micro among them, so every configuration fitted it), by kind, each kind from one source for all:

    - model states: the worker's exact counts (params, master, optimizer states, grads still held);
    - activations: the estimate's bytes per sample x the micro-batch (Korthikanti et al., calibrated
      for the device): the same for every ZeRO stage of one model, as they physically are. Slopes of
      measured peaks are not used: for ZeRO-0 the optimizer step's temporaries dominate them;
    - buffers: the estimate's DeepSpeed buffers, from the ds_config the trial ran with;
    - runtime: the process before the model is built (interpreter, libraries; on GPU the CUDA context),
      as the rank recorded it (RankRecord.runtime_bytes), else the estimate's fixed cost per process;
    - other: the measured peak at the configuration's own max micro-batch minus all of the above at
      that batch: what nothing above explains (negative where the estimates overcount; not clamped).
    total = the kinds summed at the common micro-batch (other held constant over the batch)."""
    measured = [r for r in rows if r.measure is not None and r.max_micro]
    if not measured:
        return pd.DataFrame(columns=BREAKDOWN_COLUMNS)
    micro = min(r.max_micro for r in measured)
    return pd.DataFrame([_breakdown(r, micro) for r in measured], columns=BREAKDOWN_COLUMNS)


def _peak(t: TrialResult) -> Optional[int]:
    peaks = [d.peak_bytes for d in device_memory(t)[1] if d.peak_bytes]
    return max(peaks) if peaks else None


def _breakdown(r: Row, micro: int) -> dict:
    t, est = r.measure, r.estimate()
    states = measured_model_states(t)[0] or 0
    runtime, runtime_from = _runtime(t, est)
    peak, at = _peak(t), t.micro or r.max_micro
    per_sample = est.act_per_sample if est else float("nan")
    buffers = est.buffers_total if est else float("nan")
    other = peak - states - buffers - runtime - per_sample * at if peak else float("nan")
    parts = [states / MiB, per_sample * micro / MiB, buffers / MiB, runtime / MiB, other / MiB]
    return {"config": r.label, "micro batch": micro, **dict(zip(PARTS, parts)), "total MiB": sum(parts),
            "measured peak MiB": peak / MiB if peak else None, "peak at micro": at,
            "activations from": "estimate" if est else "no estimate for this configuration",
            "runtime from": runtime_from}


def _runtime(t: TrialResult, est) -> tuple[float, str]:
    """The rank's own baseline where recorded (the largest over ranks), else the estimate's."""
    recorded = [b for b in (getattr(rec, "runtime_bytes", None) for rec in t.ranks) if b]
    if recorded:
        return float(max(recorded)), "measured before the model was built"
    return (float(est.overhead), "estimate (fixed cost per process)") if est else (float("nan"), "no estimate")


# -- what each optimization buys -------------------------------------------------------------------

def buys_frame(details: pd.DataFrame) -> pd.DataFrame:
    """A baseline, then each configuration that differs from it in one key only: samples/s, max
    global batch and max memory, each with its change against the baseline in %. Empty unless the
    configurations share model and hardware and at least one changes a single key."""
    cols = ["change", "config", "Throughput (samples/sec)", "throughput Δ %", "Max Global BSZ", "max batch Δ %",
            "max memory MiB", "max memory Δ %"] + _cost_columns(details)
    df = batch_rows(details)
    df = df[df["Max Global BSZ"].notna()].copy()
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


def _cost_columns(details: pd.DataFrame) -> list[str]:
    """The cost columns the details carry, cost per 1M tokens with its change."""
    cols = present(details.columns)
    at = cols.index(COST_PER_MTOK) + 1 if COST_PER_MTOK in cols else 0
    return cols[:at] + (["cost Δ %"] if at else []) + cols[at:]


def _buys_row(change: str, row: pd.Series, base: pd.Series) -> dict:
    def delta(col: str):
        b, v = base[col], row[col]
        return None if pd.isna(b) or pd.isna(v) or not b else (v - b) / b * 100

    out = {"change": change, "config": row["config"], "Throughput (samples/sec)": row["Throughput (samples/sec)"],
           "throughput Δ %": delta("Throughput (samples/sec)"), "Max Global BSZ": row["Max Global BSZ"],
           "max batch Δ %": delta("Max Global BSZ"), "max memory MiB": row["max memory MiB"],
           "max memory Δ %": delta("max memory MiB")}
    for col in present(row.index):
        out[col] = row[col]
    if COST_PER_MTOK in row.index:
        out["cost Δ %"] = delta(COST_PER_MTOK)
    return out
