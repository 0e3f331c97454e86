"""Rows -> the report's DataFrames: Summary, Trials, Scaling, Compare, Environment. No file is written here."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

from zero_bench.config.schema import BenchConfig, Device, OffloadDevice
from zero_bench.devices.metrics import cpu_peak_flops, gpu_peak_flops, mfu_hfu
from zero_bench.engines.specs import SPECS, load, spec
from zero_bench.models.description import describes
from zero_bench.models.flops import model_flops_per_seq
from zero_bench.models.params import active_params, num_params
from zero_bench.records import DeviceMemStats, Dimension, MemoryKind, ModelStates, TrialResult
from zero_bench.report.rows import Loaded, Row
from zero_bench.units import MiB


# The seed table's columns (shared/seeds/zero_table_8xA100.md), then what it lacked.
SEED_COLUMNS = ["Model", "num_layers", "hidden_size", "num_heads", "# gpus", "data parallel", "model parallel",
                "engine", "ZeRO Stage", "CPU Offload", "precision", "recompute", "ds preset", "compile",
                "Max Global BSZ", "micro batch", "grad accum", "time/it (ms)", "Throughput (samples/sec)", "tokens/s",
                "tokens/s per GPU", "model TFLOP/s per GPU", "MFU", "HFU", "compile time (s)", "loss scale",
                "skipped steps", "num params", "offload", "NVMe disk peak (MiB/rank)"]
REPEAT_COLUMNS = ["time/it median (ms)", "time/it min (ms)", "time/it max (ms)", "repeats"]
ESTIMATE_COLUMNS = ["model states est. (MiB/rank)", "model states measured (MiB/rank)", "model states error (%)"]
NOTE_KEY = "_note"  # a record's extra note, moved into Notes
# Details: the time estimate (estimate/time/) at the row's max micro-batch, every figure named predicted
PRED_TIME, PRED_SPS, PRED_TPS = "time/it (ms, predicted)", "Throughput (samples/sec, predicted)", "tokens/s (predicted)"
PRED_TPS_GPU, PRED_MFU, PRED_TERM = "tokens/s per GPU (predicted)", "MFU (predicted)", "dominant term (predicted)"
PREDICTED_TIME_COLUMNS = [PRED_TIME, PRED_SPS, PRED_TPS, PRED_TPS_GPU, PRED_MFU, PRED_TERM]
TAIL_COLUMNS = ["Notes", "status", "device", "config", "search key", "source"]
# What identifies "the same configuration" across stores (the Compare and Scaling sheets).
CONFIG_KEY = ["Model", "num_layers", "hidden_size", "num_heads", "# gpus", "data parallel", "model parallel",
              "expert parallel", "engine", "ZeRO Stage", "ZeRO++", "CPU Offload", "precision", "recompute", "ds preset",
              "compile", "grad accum", "device", "search", "sequence parallel", "tiled MLP",
              "checkpoint offload"]  # "search": only where maxseq's rows are; the long-sequence keys where used
# maxseq's rows (shown where the store holds one): what was searched, and the longest sequence
SEQ_COLUMNS = ["search", "Max seq len"]
# Details only: the estimate's longest sequence for the same configuration, beside the measured one
SEQ_ESTIMATE = "Max seq len (estimate)"


def batch_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of max-batch searches (and single runs): maxseq's rows measure another thing."""
    return df[df["search"] != "maxseq"] if "search" in df.columns else df


COMPARED = ["Max seq len", "Max Global BSZ", "time/it (ms)", "Throughput (samples/sec)", "tokens/s per GPU", "MFU",
            "peak memory used"]

# -- configuration fields (rows.bench_of: the stored config through the schema) --------------------

def _offloaded(s: BenchConfig) -> bool:
    """Optimizer states offloaded: a skipped grid entry stores the config as given, so
    offload_device=nvme may come without offload=true."""
    return s.offload or s.offload_device not in (None, OffloadDevice.none)


def zeropp_text(s: BenchConfig) -> str:
    """The "ZeRO++" cell: as labels name it without "zeropp=" (qwz+hpz2); none without it."""
    return s.zeropp.tag().removeprefix("zeropp=") or "none"


def _offload_text(s: BenchConfig) -> str:
    """The reference table's "CPU Offload" cell; the NVMe rung says so there too."""
    yes = "NVMe" if s.rung == OffloadDevice.nvme else "Yes"
    return f"{yes} (+params)" if s.offload_param else (yes if _offloaded(s) else "No")


def offload_rung(s: BenchConfig) -> str:
    """The "offload" cell: the rung and what it holds, e.g. "nvme: optimizer+params", "none"."""
    if not (_offloaded(s) or s.offload_param):
        return "none"
    held = "+".join(k for k, on in (("optimizer", _offloaded(s)), ("params", s.offload_param)) if on)
    return f"{s.rung}: {held}"


def disk_peak_mib(t: TrialResult) -> Optional[float]:
    """The largest rank's NVMe swap files at their peak (sampled beside the memory timeline)."""
    disk = t.devices_of("disk")
    return max(d.peak_bytes for d in disk) / MiB if disk else None


def _params(s: BenchConfig) -> tuple[Optional[int], Optional[int]]:
    """(num params, active params) of a stored model; active only for a mixture of experts (it
    would repeat num params); None where the stored model does not describe one."""
    if not describes(s.model):
        return None, None
    return num_params(s.model), active_params(s.model) if s.model.is_moe else None


def _shape(s: BenchConfig, key: str) -> Optional[int]:
    """A shape of the stored model as stored (None where a skipped entry's partial model lacks it)."""
    v = getattr(s.model, key)
    return v if isinstance(v, int) else None


# -- environment and peak FLOP/s ------------------------------------------------------------------

def recorded_environment(loaded: Loaded) -> Optional[dict]:
    """An environment the trials carry themselves (TrialResult.env), when the launcher records one."""
    for t, _ in loaded.trials:
        env = getattr(t, "env", None)
        if env:
            return dict(env)
    return None


@dataclass
class Peaks:
    """Peak FLOP/s per device for each (device kind, precision), with where each figure came from."""
    env: dict
    found: dict = field(default_factory=dict)  # (device, precision) -> (flops or None, source text)

    def get(self, device: str, precision: str) -> Optional[float]:
        if (device, precision) not in self.found:
            self.found[(device, precision)] = self._lookup(device, precision)
        return self.found[(device, precision)][0]

    def _lookup(self, device: str, precision: str) -> tuple[Optional[float], str]:
        if device == Device.cpu:
            m = cpu_peak_flops(precision)
            how = "cached" if m["cached"] else "measured now"
            limit = f", oneDNN up to {m['onednn_isa']}" if m.get("onednn_isa") else ""
            return m["flops"], (f"matmul microbenchmark on {m['cpu']} ({m['threads']} thread(s) = one rank, "
                                f"torch {m.get('capability', '?')}{limit}), {how}, measured {m['measured_at']}, "
                                f"cache {m['path']}")
        name = str(self.env.get("gpu", ""))
        flops = gpu_peak_flops(name, precision)
        return flops, (f"datasheet table: {name} {precision}" if flops else
                       f"unknown: GPU '{name}' / {precision} not in zero_bench.devices.metrics.PEAK_FLOPS")


# -- rows -> DataFrames ---------------------------------------------------------------------------

def summary_frame(rows: list[Row], peaks: Peaks) -> pd.DataFrame:
    records = [_summary_record(r, peaks) for r in rows]
    df = pd.DataFrame.from_records(records)
    if df.empty:
        return pd.DataFrame(columns=SEED_COLUMNS + TAIL_COLUMNS)
    devs = sorted({c for rec in records for c in rec if c.startswith("Dev")}, key=_dev_order)
    cols = list(SEED_COLUMNS)
    if df["active params"].notna().any():  # a mixture of experts: what each token is computed with
        cols.insert(cols.index("num params") + 1, "active params")
    if (df["expert parallel"] > 1).any():  # shown where some row splits the experts (parallel.ep)
        cols.insert(cols.index("model parallel") + 1, "expert parallel")
    if (df["ZeRO++"] != "none").any():  # shown where some row runs ZeRO++ (zeropp.*)
        cols.insert(cols.index("ZeRO Stage") + 1, "ZeRO++")
    if (df["sequence parallel"] > 1).any():  # shown where some row splits its sequences (Ulysses)
        cols.insert(cols.index("model parallel") + 1, "sequence parallel")
    if (df["pipeline parallel"] > 1).any():  # shown where some row runs a pipeline (parallel.pp)
        at = cols.index("model parallel") + 1
        cols[at:at] = PIPELINE_COLUMNS
    for col in ("checkpoint offload", "tiled MLP"):  # where some row runs ALST's memory savers
        if (df[col] != "No").any():
            cols.insert(cols.index("recompute") + 1, col)
    if any(r.dimension == Dimension.SEQ for r in rows):
        at = cols.index("Max Global BSZ")
        cols[at:at] = SEQ_COLUMNS + [SEQ_ESTIMATE]
    cols += REPEAT_COLUMNS if any(len(r.repeats) > 1 for r in rows) else []
    if PRED_TIME in df.columns and df[PRED_TIME].notna().any():
        cols += PREDICTED_TIME_COLUMNS
    if df.get(ESTIMATE_COLUMNS[1]) is not None and df[ESTIMATE_COLUMNS[1]].notna().any():
        cols += ESTIMATE_COLUMNS
    cols += ["memory of"] + devs + ["peak memory used"] + TAIL_COLUMNS
    # the seed table's order: by model size, then ZeRO stage (DeepSpeed before FSDP2), then DP before MP, offload last
    order = ["num params", "ZeRO Stage", "engine", "model parallel", "CPU Offload"]
    return df.reindex(columns=cols).sort_values(order, kind="stable", na_position="last", ignore_index=True)


def _dev_order(col: str) -> tuple[int, int]:
    idx, _, kind = col[3:].partition(" ")
    return int(idx), 0 if kind.startswith(("used", "peak")) else 1


def _summary_record(r: Row, peaks: Peaks) -> dict:
    s = r.bench
    par, (params, active) = s.parallel, _params(s)
    rec = {"Model": s.model.name, "num_layers": _shape(s, "num_layers"), "hidden_size": _shape(s, "hidden_size"),
           "num_heads": _shape(s, "num_heads"), "# gpus": par.world_size, "data parallel": par.dp,
           "model parallel": par.tp, "expert parallel": par.ep, "sequence parallel": par.sp, "engine": str(s.engine),
           "pipeline parallel": par.pp, **_pipeline(r),
           "ZeRO Stage": s.zero, "ZeRO++": zeropp_text(s), "tiled MLP": s.tiled_mlp or "No",
           "checkpoint offload": "Yes" if s.recompute_offload else "No",
           "CPU Offload": _offload_text(s), "offload": offload_rung(s), "precision": str(s.precision),
           "recompute": str(s.recompute), "ds preset": s.ds_preset, "compile": "Yes" if s.compile else "No",
           "Max Global BSZ": r.max_global_batch, "micro batch": r.max_micro, "grad accum": s.batch.grad_accum,
           "search": "maxseq" if r.dimension == Dimension.SEQ else "maxbatch", "Max seq len": r.max_seq_len,
           SEQ_ESTIMATE: predicted_seq(s, r.max_micro) if r.dimension == Dimension.SEQ else None,
           "num params": params, "active params": active, "Notes": r.note, "status": r.status,
           "device": str(s.hardware.device), "config": r.label, "search key": r.key, "source": r.source}
    if r.measure is not None and r.measure.samples_per_s:
        rec.update(_performance(r.measure, s, peaks))
        rec.update(_memory(r.measure))
        rec["NVMe disk peak (MiB/rank)"] = disk_peak_mib(r.measure)
        states = _model_states(r.measure, s)
        failed = states.pop(NOTE_KEY, "")
        rec.update(states)
        rec["Notes"] = "; ".join(x for x in (r.note, emulation_note(r.measure), failed) if x)
    rec.update(_repeats(r.repeats))
    rec.update(predicted_time(r))
    return rec


def predicted_time(r: Row) -> dict:
    """The time estimate's figures at the row's max micro-batch ({} where there is none: nothing fitted,
    no estimate, no rates for the hardware)."""
    if not r.max_micro:
        return {}
    est = r.estimate()
    p = est.time_at(r.max_micro) if est is not None else None
    if p is None:
        return {}
    s = r.bench
    world = s.parallel.world_size
    samples = r.max_micro * s.batch.grad_accum * s.parallel.dp / s.parallel.sp  # per optimizer step
    return {PRED_TIME: p.step_s * 1e3, PRED_SPS: samples / p.step_s, PRED_TPS: p.tokens_per_s_per_device * world,
            PRED_TPS_GPU: p.tokens_per_s_per_device, PRED_MFU: p.mfu, PRED_TERM: p.dominant.name}


PIPELINE_COLUMNS = ["pipeline parallel", "pp schedule", "stage peaks (MiB)", "peak stage est."]


def _pipeline(r: Row) -> dict:
    """parallel.pp > 1: the schedule, each stage's measured peak (the largest of its tp x dp ranks,
    ranks laid out tp fastest, then dp, then pp) and the stage the estimate puts the peak on."""
    s = r.bench
    par = s.parallel
    if par.pp == 1:
        return {}
    out = {"pp schedule": str(par.pp_schedule) + (f" vpp={par.vpp}" if par.vpp > 1 else "")}
    if r.measure is not None:
        _, devs = device_memory(r.measure)
        # each rank's stage as its record says (RankRecord.stage), else from the layout (older records)
        recorded = {x.rank: x.stage for x in r.measure.ranks if x.stage is not None}
        if len(devs) == par.world_size:
            peaks = [0] * par.pp
            for i, d in enumerate(devs):
                st = recorded.get(i, s.layout.stage_of(i))
                peaks[st] = max(peaks[st], d.peak_bytes)
            top = max(range(par.pp), key=lambda i: peaks[i])
            out["stage peaks (MiB)"] = (" | ".join(f"{i}: {p / MiB:,.0f}" for i, p in enumerate(peaks))
                                        + f" (peak: stage {top})")
    try:
        est = r.estimate()
        out["peak stage est."] = est.stage_at(r.max_micro or 1).stage_name if est is not None else None
    except Exception:  # noqa: BLE001 - a prediction must not stop the report
        pass
    return out


def _performance(t: TrialResult, s: BenchConfig, peaks: Peaks) -> dict:
    m, sps, world = s.model if describes(s.model) else None, t.samples_per_s, s.parallel.world_size
    flops = model_flops_per_seq(m) * sps if m is not None else float("nan")
    out = {"time/it (ms)": t.time_per_step_s * 1e3, "Throughput (samples/sec)": sps, "tokens/s": t.tokens_per_s,
           "tokens/s per GPU": t.tokens_per_s / world, "model TFLOP/s per GPU": flops / world / 1e12,
           "compile time (s)": t.compile_s, "loss scale": t.loss_scale, "skipped steps": t.skipped_steps}
    peak = peaks.get(str(s.hardware.device), str(s.precision))
    if peak and m is not None:
        out["MFU"], out["HFU"] = mfu_hfu(m, sps, world, peak, s.recompute, s.recompute_layers)
    return out


def device_memory(t: TrialResult) -> tuple[str, list[DeviceMemStats]]:
    """The memory that limits the batch: GPUs when sampled (NVML), else each rank's RSS."""
    gpus = t.devices_of(MemoryKind.gpu)
    return ("GPU (NVML used)", gpus) if gpus else ("rank RSS", t.devices_of(MemoryKind.rank))


def _memory(t: TrialResult) -> dict:
    kind, devs = device_memory(t)
    out = {"memory of": kind}
    used = []
    for i, d in enumerate(devs):
        out[f"Dev{i} used MiB"] = d.peak_bytes / MiB
        out[f"Dev{i} total MiB"] = d.total_bytes / MiB if d.total_bytes else None
        if d.total_bytes:
            used.append(d.peak_bytes / d.total_bytes)
    out["peak memory used"] = max(used) if used else None
    return out


def emulation_note(t: TrialResult) -> str:
    """Say when the GPU capacity was emulated (its totals are the capacity, not the card)."""
    cards = sorted({d.card_bytes for d in t.devices_of(MemoryKind.gpu) if d.card_bytes})
    if not cards:
        return ""
    cap = t.devices_of(MemoryKind.gpu)[0].total_bytes
    return (f"capacity emulated: {cap / MiB:,.0f} MiB per GPU on "
            + " / ".join(f"{c / MiB:,.0f}" for c in cards) + " MiB cards")


def measured_model_states(t: TrialResult) -> tuple[Optional[int], bool]:
    """Largest per-rank sum of params, master copy, optimizer states and grads (counted tensors),
    and whether gradients were still held when counted."""
    states = [ModelStates.from_dict(r.model_states) for r in t.ranks if r.model_states]
    if not states:
        return None, False
    return max(s.total for s in states), any(s.grads for s in states)


def predicted_seq(s: BenchConfig, micro: Optional[int]) -> Optional[int]:
    """The estimate's longest sequence for this configuration at the micro-batch its maxseq held,
    on maxseq's default grid (estimate/seq.py); None where it cannot say (no capacity, no estimate)."""
    from zero_bench.config.schema import SearchConfig
    from zero_bench.estimate.seq import longest_seq
    from zero_bench.search.dimension import seq_grid

    try:
        return longest_seq(s, micro or 1, seq_grid(SearchConfig(), s.layout))
    except Exception:  # noqa: BLE001 - a prediction must not stop the report
        return None


def estimated_model_states(s: BenchConfig, with_grads: bool = True) -> Optional[int]:
    """zero_bench.estimate's figure for one rank (device + host bytes), None if it fails."""
    return estimate_or_error(s, with_grads)[0]


def estimate_or_error(s: BenchConfig, with_grads: bool = True) -> tuple[Optional[int], str]:
    """The estimate's model states for one rank, or None and why it could not answer."""
    try:
        est = load(spec(s.engine).stored_states)(s)
        return (est.total if with_grads else est.total - est.grads), ""
    except Exception as exc:  # noqa: BLE001 - the row says so (Notes); its columns stay, empty
        return None, f"{type(exc).__name__}: {exc}"


def _model_states(t: TrialResult, s: BenchConfig) -> dict:
    # The count covers every state tensor wherever it lives, so it is compared with device + host;
    # it is taken after the optimizer step, when ZeRO may have freed the gradients: compare like for like.
    measured, has_grads = measured_model_states(t)
    if not measured:
        return {}
    est, error = estimate_or_error(s, with_grads=has_grads)
    if est is None:  # shown, not dropped: a failing estimate must not look like "no estimate columns"
        return {ESTIMATE_COLUMNS[1]: measured / MiB, NOTE_KEY: f"model states estimate failed: {error}"}
    return {ESTIMATE_COLUMNS[0]: est / MiB, ESTIMATE_COLUMNS[1]: measured / MiB,
            ESTIMATE_COLUMNS[2]: (est - measured) / measured * 100}


def _repeats(times: list) -> dict:
    times = [x for x in times if x]
    if not times:
        return {}
    ser = pd.Series(times) * 1e3
    return {"time/it median (ms)": ser.median(), "time/it min (ms)": ser.min(), "time/it max (ms)": ser.max(),
            "repeats": len(times)}


def trials_frame(loaded: Loaded) -> pd.DataFrame:
    records = [_trial_record(t, src) for t, src in sorted(loaded.trials, key=lambda x: x[0].created)]
    cols = ["config", "search key", "launch", "mode", "micro batch", "global batch", "outcome", "phase", "reason",
            "duration (s)", "time/it (ms)", "Throughput (samples/sec)", "memory of"]
    devs = sorted({c for rec in records for c in rec if c.startswith("Dev")}, key=_dev_order)
    return pd.DataFrame.from_records(records, columns=cols + devs + ["created", "run dir", "source"])


def _trial_record(t: TrialResult, source: str) -> dict:
    rec = {"config": t.label, "search key": t.search_key, "launch": t.launch, "mode": t.mode, "micro batch": t.micro,
           "global batch": t.global_batch, "outcome": t.status, "phase": t.phase, "reason": t.reason,
           "duration (s)": t.duration_s, "time/it (ms)": t.time_per_step_s * 1e3 if t.time_per_step_s else None,
           "Throughput (samples/sec)": t.samples_per_s, "created": pd.Timestamp(t.created, unit="s").round("s"),
           "run dir": t.run_dir, "source": source}
    kind, devs = device_memory(t)
    if devs:
        rec["memory of"] = kind
    for i, d in enumerate(devs):
        rec[f"Dev{i} peak MiB"] = d.peak_bytes / MiB
        rec[f"Dev{i} total MiB"] = d.total_bytes / MiB if d.total_bytes else None
    return rec


def scaling_frame(summary: pd.DataFrame) -> pd.DataFrame:
    """Same model/ZeRO/precision at several data-parallel sizes: speedup vs the smallest, efficiency."""
    group = [c for c in CONFIG_KEY if c not in ("# gpus", "data parallel") and c in summary.columns]
    measured = summary[summary["Throughput (samples/sec)"].notna()]
    parts = []
    for _, g in measured.groupby(group, dropna=False, sort=False):
        if g["data parallel"].nunique() < 2:
            continue
        g = g.sort_values("# gpus")
        base = g.iloc[0]
        g = g.assign(**{"speedup": g["Throughput (samples/sec)"] / base["Throughput (samples/sec)"],
                        "ideal speedup": g["# gpus"] / base["# gpus"]})
        parts.append(g.assign(**{"scaling efficiency": g["speedup"] / g["ideal speedup"]}))
    cols = group + ["# gpus", "data parallel", "micro batch", "Max Global BSZ", "Throughput (samples/sec)", "speedup",
                    "ideal speedup", "scaling efficiency", "time/it (ms)"]
    cols += [c for c in REPEAT_COLUMNS if c in summary.columns] + ["config"]
    return pd.concat(parts).reindex(columns=cols) if parts else pd.DataFrame(columns=cols)


def compare_frame(base: pd.DataFrame, other: pd.DataFrame, names: tuple[str, str]) -> pd.DataFrame:
    """The same configurations side by side: value in each, delta (other - base) and ratio (other / base)."""
    a, b = names
    keys = [k for k in CONFIG_KEY if k in base.columns and k in other.columns]
    metrics = [m for m in COMPARED if m in base.columns or m in other.columns]

    def side(df: pd.DataFrame, name: str) -> pd.DataFrame:
        df = df.reindex(columns=keys + metrics + ["Notes"]).drop_duplicates(keys, keep="last")
        return df.rename(columns={c: f"{c} [{name}]" for c in metrics + ["Notes"]})

    both = side(base, a).merge(side(other, b), on=keys, how="outer", sort=False)
    cols = list(keys)
    for m in metrics:
        va, vb = (pd.to_numeric(both[f"{m} [{n}]"], errors="coerce") for n in (a, b))
        both[f"{m} Δ"] = vb - va
        both[f"{m} ratio"] = (vb / va).where(va != 0)
        cols += [f"{m} [{a}]", f"{m} [{b}]", f"{m} Δ", f"{m} ratio"]
    return both[cols + [f"Notes [{a}]", f"Notes [{b}]"]]


def environment_frames(env: dict, env_source: str, peaks: Peaks, rows: list[Row],
                       loaded: Loaded, sources: list[Path]) -> list[tuple[str, pd.DataFrame]]:
    """(title, table) pairs for the Environment sheet."""
    facts = [("environment from", env_source)] + list(env.items())
    facts += [("stores", ", ".join(str(p) for p in sources)),
              ("report written", time.strftime("%Y-%m-%d %H:%M:%S"))]
    peak_rows = [{"device": d, "precision": p, "peak FLOP/s per device": f, "source": src}
                 for (d, p), (f, src) in peaks.found.items()]
    on_cpu = [r.bench for r in rows if r.bench.hardware.device == Device.cpu]
    notes = []
    if on_cpu:
        notes.append("CPU: devices are ranks and memory is each rank's RSS; MFU/HFU use a measured matmul peak.")
    if any((_offloaded(s) or s.offload_param) and s.rung != OffloadDevice.nvme for s in on_cpu):
        notes.append("CPU offload on CPU moves bytes from CPU to CPU: it runs the code path but cannot lower RSS.")
    if any(s.rung == OffloadDevice.nvme for s in on_cpu):
        notes.append("NVMe offload on CPU: DeepSpeed's async_io swapper moves the states to files under nvme_path, "
                     "so RSS drops by them, less its pinned buffers; the disk peak per rank is sampled beside RSS.")
    engines = {r.bench.engine for r in rows}
    notes += [s.report_note for name, s in SPECS.items() if s.report_note and name in engines]
    per_row = [_reproduce(r, loaded) for r in rows]
    return [("Machine", pd.DataFrame(facts, columns=["item", "value"])),
            ("Peak FLOP/s used for MFU/HFU", pd.DataFrame(peak_rows, columns=["device", "precision",
                                                                              "peak FLOP/s per device", "source"])),
            ("Notes", pd.DataFrame({"note": notes})),
            ("Per configuration: the command that reproduces it and its DeepSpeed config",
             pd.DataFrame(per_row, columns=["config", "status", "search key", "source", "command", "ds_config"]))]


def _reproduce(r: Row, loaded: Loaded) -> dict:
    t = r.measure or next((t for t, src in reversed(loaded.trials)
                           if t.search_key == r.key and src == r.source and t.cmd), None)
    return {"config": r.label, "status": r.status, "search key": r.key, "source": r.source,
            "command": t.cmd if t else "", "ds_config": json.dumps(t.ds_config, sort_keys=True) if t else ""}
