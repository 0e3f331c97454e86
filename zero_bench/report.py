"""`zero_bench report`: store(s) -> DataFrames -> .xlsx (for the stakeholder), .csv, .md (for the PR).

One Summary row per configuration: a SearchResult, or a trial no search owns (`zero_bench run`).
Failed configurations keep their row, with the reason in Notes. Every file is written to a temporary
name beside the target and moved over it, so a crash mid-export leaves the previous report intact.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import pandas as pd

from zero_bench.config import ConfigError, ModelConfig
from zero_bench.environment import machine_environment
from zero_bench.metrics import cpu_peak_flops, gpu_peak_flops, mfu_hfu, model_flops_per_seq
from zero_bench.results import SearchResult, Store, TrialResult

MiB = 2 ** 20

# The seed table's columns (shared/seeds/zero_table_8xA100.md), then what it lacked.
SEED_COLUMNS = ["Model", "num_layers", "hidden_size", "num_heads", "# gpus", "data parallel", "model parallel",
                "ZeRO stage", "CPU offload", "precision", "Max Global BSZ", "micro batch", "grad accum",
                "time/it (ms)", "throughput (samples/s)", "tokens/s", "tokens/s per GPU",
                "model TFLOP/s per GPU", "MFU", "HFU", "num params"]
REPEAT_COLUMNS = ["time/it median (ms)", "time/it min (ms)", "time/it max (ms)", "repeats"]
ESTIMATE_COLUMNS = ["model states est. (MiB/rank)", "model states measured (MiB/rank)", "model states error (%)"]
TAIL_COLUMNS = ["Notes", "status", "device", "config", "search key", "source"]
# What identifies "the same configuration" across stores (the Compare and Scaling sheets).
CONFIG_KEY = ["Model", "num_layers", "hidden_size", "num_heads", "# gpus", "data parallel", "model parallel",
              "ZeRO stage", "CPU offload", "precision", "grad accum", "device"]
COMPARED = ["Max Global BSZ", "time/it (ms)", "throughput (samples/s)", "tokens/s per GPU", "MFU",
            "peak memory used"]

# Excel number formats by header; compare columns ("x [a]", "x Δ") take the format of x.
FORMATS = {"MFU": "0.00%", "HFU": "0.00%", "peak memory used": "0.0%", "scaling efficiency": "0.0%",
           "num params": "#,##0", "throughput (samples/s)": "#,##0.00", "tokens/s": "#,##0",
           "tokens/s per GPU": "#,##0", "model TFLOP/s per GPU": "0.000", "speedup": "0.00", "ideal speedup": "0.00",
           "duration (s)": "0.0", "peak FLOP/s per device": "0.00E+00", "created": "yyyy-mm-dd hh:mm:ss"}
# The same formats for the Markdown table.
PY_FORMATS = {"0.00%": "{:.2%}", "0.0%": "{:.1%}", "#,##0": "{:,.0f}", "#,##0.0": "{:,.1f}", "#,##0.00": "{:,.2f}",
              "0.000": "{:.3f}", "0.00": "{:.2f}", "0.0": "{:.1f}", "0.00E+00": "{:.2e}"}


def number_format(col: str) -> Optional[str]:
    m = re.match(r"^(.*) (\[.*\]|Δ|ratio)$", col)
    if m:
        return "0.000" if m.group(2) == "ratio" else number_format(m.group(1))
    if col in FORMATS:
        return FORMATS[col]
    if col.startswith("time/it"):
        return "#,##0.0"
    if col.endswith("MiB"):
        return "#,##0"
    if col.endswith("(MiB/rank)"):
        return "#,##0.00"
    if col.endswith("(%)"):
        return "0.0"
    return None


# -- stores -> records -------------------------------------------------------------------------------

def find_stores(runs: str | Path) -> list[Path]:
    """A store file, a directory holding stores (searched recursively), or a glob."""
    p = Path(runs)
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(p.rglob("*.sqlite"))
    return sorted(Path(m) for m in glob.glob(str(runs), recursive=True) if Path(m).is_file())


@dataclass
class Loaded:
    searches: list[tuple[SearchResult, str]] = field(default_factory=list)  # (result, source store)
    trials: list[tuple[TrialResult, str]] = field(default_factory=list)


def load(paths: list[Path]) -> Loaded:
    out = Loaded()
    for p in paths:
        store = Store(p)
        out.searches += [(s, p.name) for s in store.searches()]
        out.trials += [(t, p.name) for t in store.trials()]
    return out


@dataclass
class Row:
    """One configuration as the report sees it."""
    config: dict
    label: str
    key: str
    status: str
    note: str
    source: str
    measure: Optional[TrialResult] = None
    max_global_batch: Optional[int] = None
    max_micro: Optional[int] = None
    repeats: list = field(default_factory=list)


def rows_of(loaded: Loaded) -> list[Row]:
    searched = {(s.search_key, src) for s, src in loaded.searches}
    rows = [_search_row(s, src) for s, src in loaded.searches]
    lone = [(t, src) for t, src in loaded.trials if (t.search_key, src) not in searched]
    return rows + _lone_rows(lone)


def _search_row(s: SearchResult, source: str) -> Row:
    measure = TrialResult(**s.measure) if s.measure else None
    return Row(config=s.config, label=s.label, key=s.search_key, status=s.status, source=source,
               note=_note(s.status, s.note), measure=measure, max_global_batch=s.max_global_batch,
               max_micro=s.max_micro, repeats=list(s.repeats or []))


def _note(status: str, note: str) -> str:
    prefix = {"skipped": "skipped: ", "estimated_oom": "does not fit (estimated): "}.get(status, "")
    return prefix + (note or "") if prefix and not (note or "").startswith(prefix) else (note or "")


def _lone_rows(trials: list[tuple[TrialResult, str]]) -> list[Row]:
    """Trials of `zero_bench run` (no search): the latest one per trial key is a configuration.

    A search killed before its summary leaves probes only: one row says so, with the best batch seen.
    """
    latest: dict[tuple, tuple[TrialResult, str]] = {}
    probes: dict[tuple, list[TrialResult]] = {}
    for t, src in trials:
        if t.mode == "measure" or t.status == "estimated_oom":
            latest[(t.trial_key, src)] = (t, src)
        elif t.status != "not_run":
            probes.setdefault((t.search_key, src), []).append(t)
    rows = [_trial_row(t, src) for t, src in latest.values()]
    measured = {(t.search_key, src) for t, src in latest.values()}
    rows += [_incomplete_row(ts, src) for (key, src), ts in probes.items() if (key, src) not in measured]
    return rows


def _trial_row(t: TrialResult, source: str) -> Row:
    ok = t.status == "ok"
    note = {"ok": "", "oom": f"OOM at global batch {t.global_batch}", "estimated_oom": "does not fit (estimated)",
            "timeout": "timeout", "error": "error"}.get(t.status, t.status)
    if t.reason:
        note = f"{note}: {t.reason}" if note else t.reason
    return Row(config=t.config, label=t.label, key=t.search_key, status=t.status, note=note, source=source,
               measure=t if ok else None, max_global_batch=t.global_batch if ok else None,
               max_micro=t.micro if ok else None, repeats=[t.time_per_step_s] if ok else [])


def _incomplete_row(trials: list[TrialResult], source: str) -> Row:
    fits = [t for t in trials if t.status == "ok"]
    best = max(fits, key=lambda t: t.micro) if fits else None
    return Row(config=trials[0].config, label=trials[0].label, key=trials[0].search_key, status="incomplete",
               note=f"search stopped before its summary ({len(trials)} trials)", source=source,
               max_global_batch=best.global_batch if best else None, max_micro=best.micro if best else None)


# -- configuration fields (BenchConfig.to_dict(), or the raw Hydra dict of a skipped grid entry) ------

@dataclass
class Setup:
    model: dict
    tp: int
    dp: int
    zero: int
    offload_optimizer: bool
    offload_param: bool
    precision: str
    device: str
    grad_accum: int
    recompute: bool

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def num_params(self) -> Optional[int]:
        try:
            return ModelConfig(**self.model).num_params
        except TypeError:
            return None


def setup_of(c: dict) -> Setup:
    par, hw, batch = c.get("parallel") or {}, c.get("hardware") or {}, c.get("batch") or {}
    return Setup(model=dict(c.get("model") or {}), tp=int(par.get("tp", 1)), dp=int(par.get("dp", 1)),
                 zero=c.get("zero"), offload_optimizer=bool(c.get("offload_optimizer", c.get("offload", False))),
                 offload_param=bool(c.get("offload_param") or False), precision=str(c.get("precision", "")),
                 device=str(hw.get("device", "")), grad_accum=int(batch.get("grad_accum", 1)),
                 # no recompute switch exists yet; when one does, HFU follows it from here
                 recompute=bool(c.get("activation_checkpointing", False)))


def _offload_text(s: Setup) -> str:
    return "Yes (+params)" if s.offload_param else ("Yes" if s.offload_optimizer else "No")


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
        if device == "cpu":
            m = cpu_peak_flops(precision)
            how = "cached" if m["cached"] else "measured now"
            return m["flops"], (f"matmul microbenchmark on {m['cpu']} ({m['threads']} thread(s) = one rank), "
                                f"{how}, measured {m['measured_at']}, cache {m['path']}")
        name = str(self.env.get("gpu", ""))
        flops = gpu_peak_flops(name, precision)
        return flops, (f"datasheet table: {name} {precision}" if flops else
                       f"unknown: GPU '{name}' / {precision} not in zero_bench.metrics.PEAK_FLOPS")


# -- rows -> DataFrames ---------------------------------------------------------------------------

def summary_frame(rows: list[Row], peaks: Peaks) -> pd.DataFrame:
    records = [_summary_record(r, peaks) for r in rows]
    df = pd.DataFrame.from_records(records)
    if df.empty:
        return pd.DataFrame(columns=SEED_COLUMNS + TAIL_COLUMNS)
    devs = sorted({c for rec in records for c in rec if c.startswith("Dev")}, key=_dev_order)
    cols = SEED_COLUMNS + (REPEAT_COLUMNS if any(len(r.repeats) > 1 for r in rows) else [])
    if df.get(ESTIMATE_COLUMNS[0]) is not None and df[ESTIMATE_COLUMNS[0]].notna().any():
        cols += ESTIMATE_COLUMNS
    cols += ["memory of"] + devs + ["peak memory used"] + TAIL_COLUMNS
    # the seed table's order: by model size, then ZeRO stage, then DP before MP, offload last
    order = ["num params", "ZeRO stage", "model parallel", "CPU offload"]
    return df.reindex(columns=cols).sort_values(order, kind="stable", na_position="last", ignore_index=True)


def _dev_order(col: str) -> tuple[int, int]:
    idx, _, kind = col[3:].partition(" ")
    return int(idx), 0 if kind.startswith("used") else 1


def _summary_record(r: Row, peaks: Peaks) -> dict:
    s = setup_of(r.config)
    m = s.model
    rec = {"Model": m.get("name"), "num_layers": m.get("num_layers"), "hidden_size": m.get("hidden_size"),
           "num_heads": m.get("num_heads"), "# gpus": s.world, "data parallel": s.dp, "model parallel": s.tp,
           "ZeRO stage": s.zero, "CPU offload": _offload_text(s), "precision": s.precision,
           "Max Global BSZ": r.max_global_batch, "micro batch": r.max_micro, "grad accum": s.grad_accum,
           "num params": s.num_params, "Notes": r.note, "status": r.status, "device": s.device,
           "config": r.label, "search key": r.key, "source": r.source}
    if r.measure is not None and r.measure.samples_per_s:
        rec.update(_performance(r.measure, s, peaks))
        rec.update(_memory(r.measure))
        rec.update(_model_states(r.measure, s))
    rec.update(_repeats(r.repeats))
    return rec


def _performance(t: TrialResult, s: Setup, peaks: Peaks) -> dict:
    m, sps = s.model, t.samples_per_s
    flops = model_flops_per_seq(s.num_params, m["num_layers"], m["hidden_size"], m["seq_len"]) * sps
    out = {"time/it (ms)": t.time_per_step_s * 1e3, "throughput (samples/s)": sps, "tokens/s": t.tokens_per_s,
           "tokens/s per GPU": t.tokens_per_s / s.world, "model TFLOP/s per GPU": flops / s.world / 1e12}
    peak = peaks.get(s.device, s.precision)
    if peak:
        out["MFU"], out["HFU"] = mfu_hfu(s.num_params, m["num_layers"], m["hidden_size"], m["seq_len"], sps,
                                         s.world, peak, activation_checkpointing=s.recompute)
    return out


def device_memory(t: TrialResult) -> tuple[str, list[dict]]:
    """The memory that limits the batch: GPUs when sampled (NVML), else each rank's RSS."""
    gpus = sorted((k for k in t.devices if k.startswith("gpu")), key=lambda k: int(k[3:]))
    if gpus:
        return "GPU (NVML used)", [t.devices[k] for k in gpus]
    ranks = sorted((k for k in t.devices if k.startswith("rank")), key=lambda k: int(k[4:]))
    return "rank RSS", [t.devices[k] for k in ranks]


def _memory(t: TrialResult) -> dict:
    kind, devs = device_memory(t)
    out = {"memory of": kind}
    used = []
    for i, d in enumerate(devs):
        out[f"Dev{i} used MiB"] = d["peak_bytes"] / MiB
        out[f"Dev{i} total MiB"] = d["total_bytes"] / MiB if d.get("total_bytes") else None
        if d.get("total_bytes"):
            used.append(d["peak_bytes"] / d["total_bytes"])
    out["peak memory used"] = max(used) if used else None
    return out


def measured_model_states(t: TrialResult) -> tuple[Optional[int], bool]:
    """Largest per-rank sum of params, master copy, optimizer states and grads (counted tensors),
    and whether gradients were still held when counted."""
    states = [r["model_states"] for r in t.ranks if r.get("model_states")]
    if not states:
        return None, False
    sums = [sum(s.get(k, 0) for k in ("params", "master", "optimizer", "grads")) for s in states]
    return max(sums), any(s.get("grads") for s in states)


def estimated_model_states(s: Setup, with_grads: bool = True) -> Optional[int]:
    """zero_bench.estimate's figure for one rank (device + host bytes), None if it is missing or fails."""
    try:
        from zero_bench.estimate import model_states_bytes

        est = model_states_bytes(s.num_params, s.zero, s.dp, tp=s.tp, precision=s.precision,
                                 offload_optimizer=s.offload_optimizer, offload_param=s.offload_param)
        total = int(est["gpu"]) + int(est["cpu"])
        return total if with_grads else total - int(est.get("grads", 0))
    except Exception:  # not written yet, or cannot answer for this configuration
        return None


def _model_states(t: TrialResult, s: Setup) -> dict:
    # The count covers every state tensor wherever it lives, so it is compared with device + host;
    # it is taken after the optimizer step, when ZeRO may have freed the gradients: compare like for like.
    measured, has_grads = measured_model_states(t)
    est = estimated_model_states(s, with_grads=has_grads)
    if not measured or est is None:
        return {}
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
            "duration (s)", "time/it (ms)", "throughput (samples/s)", "memory of"]
    devs = sorted({c for rec in records for c in rec if c.startswith("Dev")}, key=_dev_order)
    return pd.DataFrame.from_records(records, columns=cols + devs + ["created", "run dir", "source"])


def _trial_record(t: TrialResult, source: str) -> dict:
    rec = {"config": t.label, "search key": t.search_key, "launch": t.launch, "mode": t.mode, "micro batch": t.micro,
           "global batch": t.global_batch, "outcome": t.status, "phase": t.phase, "reason": t.reason,
           "duration (s)": t.duration_s, "time/it (ms)": t.time_per_step_s * 1e3 if t.time_per_step_s else None,
           "throughput (samples/s)": t.samples_per_s, "created": pd.Timestamp(t.created, unit="s").round("s"),
           "run dir": t.run_dir, "source": source}
    kind, devs = device_memory(t)
    if devs:
        rec["memory of"] = kind
    for i, d in enumerate(devs):
        rec[f"Dev{i} peak MiB"] = d["peak_bytes"] / MiB
        rec[f"Dev{i} total MiB"] = d["total_bytes"] / MiB if d.get("total_bytes") else None
    return rec


def scaling_frame(summary: pd.DataFrame) -> pd.DataFrame:
    """Same model/ZeRO/precision at several data-parallel sizes: speedup vs the smallest, efficiency."""
    group = [c for c in CONFIG_KEY if c not in ("# gpus", "data parallel")]
    measured = summary[summary["throughput (samples/s)"].notna()]
    parts = []
    for _, g in measured.groupby(group, dropna=False, sort=False):
        if g["data parallel"].nunique() < 2:
            continue
        g = g.sort_values("# gpus")
        base = g.iloc[0]
        g = g.assign(**{"speedup": g["throughput (samples/s)"] / base["throughput (samples/s)"],
                        "ideal speedup": g["# gpus"] / base["# gpus"]})
        parts.append(g.assign(**{"scaling efficiency": g["speedup"] / g["ideal speedup"]}))
    cols = group + ["# gpus", "data parallel", "micro batch", "Max Global BSZ", "throughput (samples/s)", "speedup",
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
    on_cpu = [setup_of(r.config) for r in rows if setup_of(r.config).device == "cpu"]
    notes = []
    if on_cpu:
        notes.append("CPU: devices are ranks and memory is each rank's RSS; MFU/HFU use a measured matmul peak.")
    if any(s.offload_optimizer or s.offload_param for s in on_cpu):
        notes.append("CPU offload on CPU moves bytes from CPU to CPU: it runs the code path but cannot lower RSS.")
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


# -- DataFrames -> files ----------------------------------------------------------------------------

@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; move it over `path` only if the block finishes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_xlsx(path: Path, sheets: dict[str, pd.DataFrame], environment: list[tuple[str, pd.DataFrame]]) -> None:
    """Summary, Trials, Charts, Environment, then Scaling / Compare when present."""
    with replacing(path) as tmp:
        with pd.ExcelWriter(tmp, engine="openpyxl") as xw:
            for name in ("Summary", "Trials"):
                _table_sheet(xw, name, sheets[name])
            _memory_colour_scale(xw.sheets["Summary"], sheets["Summary"])
            _charts_sheet(xw.book, sheets["Summary"])
            _environment_sheet(xw, environment)
            for name, df in sheets.items():
                if name not in ("Summary", "Trials"):
                    _table_sheet(xw, name, df)


def _table_sheet(xw: pd.ExcelWriter, name: str, df: pd.DataFrame) -> None:
    df.to_excel(xw, sheet_name=name, index=False)
    ws = xw.sheets[name]
    _style_header(ws, 1)
    ws.freeze_panes = "B2"  # header and the first (Model / config) column stay in view
    ws.auto_filter.ref = ws.dimensions
    _format_columns(ws, df, first_row=2)


def _style_header(ws, row: int) -> None:
    from openpyxl.styles import Alignment, Font, PatternFill

    for cell in ws[row]:
        cell.font = Font(bold=True)
        cell.fill = PatternFill("solid", fgColor="DDEBF7")
        cell.alignment = Alignment(wrap_text=True, vertical="top")


def _format_columns(ws, df: pd.DataFrame, first_row: int) -> None:
    from openpyxl.utils import get_column_letter

    last = first_row + len(df) - 1
    for i, col in enumerate(df.columns, start=1):
        fmt = number_format(str(col))
        if fmt:
            for (cell,) in ws.iter_rows(min_row=first_row, max_row=last, min_col=i, max_col=i):
                cell.number_format = fmt
        ws.column_dimensions[get_column_letter(i)].width = _width(col, df[col])


def _width(col, values: pd.Series) -> float:
    """Wide enough for the header's longest word and typical values; long text is capped."""
    header = max((len(w) for w in str(col).split()), default=4)
    sample = values.dropna().astype(str).str.len()
    body = int(sample.quantile(0.9)) if len(sample) else 0
    return min(max(header, body, 6) + 2, 60)


def _memory_colour_scale(ws, df: pd.DataFrame) -> None:
    """Green (room left) -> yellow -> red (at capacity) on each configuration's fullest device."""
    from openpyxl.formatting.rule import ColorScaleRule
    from openpyxl.utils import get_column_letter

    if "peak memory used" not in df.columns or df.empty:
        return
    letter = get_column_letter(df.columns.get_loc("peak memory used") + 1)
    rule = ColorScaleRule(start_type="num", start_value=0, start_color="63BE7B", mid_type="num", mid_value=0.8,
                          mid_color="FFEB84", end_type="num", end_value=1, end_color="F8696B")
    ws.conditional_formatting.add(f"{letter}2:{letter}{len(df) + 1}", rule)


def _charts_sheet(book, summary: pd.DataFrame) -> None:
    """Bar charts drawn from the Summary sheet's own cells, one bar group per configuration."""
    ws = book.create_sheet("Charts")
    n = len(summary)
    if n == 0:
        ws["A1"] = "no configurations"
        return
    used = [c for c in summary.columns if c.startswith("Dev") and c.endswith("used MiB")]
    specs = [("Max global batch per configuration", "global batch", ["Max Global BSZ"]),
             ("Throughput per configuration", "samples/s", ["throughput (samples/s)"]),
             ("Peak memory per device per configuration", "MiB", used)]
    for i, (title, y_title, cols) in enumerate(specs):
        ws.add_chart(_bar_chart(book["Summary"], summary, title, y_title, cols), f"A{1 + i * 22}")


def _bar_chart(src, summary: pd.DataFrame, title: str, y_title: str, cols: list[str]):
    from openpyxl.chart import BarChart, Reference
    from openpyxl.chart.data_source import AxDataSource, StrRef

    n = len(summary)
    col = {c: summary.columns.get_loc(c) + 1 for c in summary.columns}
    chart = BarChart()
    chart.type, chart.title, chart.y_axis.title = "col", title, y_title
    chart.x_axis.title = "configuration"
    for c in cols:
        chart.add_data(Reference(src, min_col=col[c], min_row=1, max_row=n + 1), titles_from_data=True)
    labels = Reference(src, min_col=col["config"], min_row=2, max_row=n + 1)
    for series in chart.series:  # the labels are text: a string reference, not openpyxl's default number one
        series.cat = AxDataSource(strRef=StrRef(f=str(labels)))
    chart.width, chart.height = max(16, 2.2 * n), 10
    return chart


def _environment_sheet(xw: pd.ExcelWriter, tables: list[tuple[str, pd.DataFrame]]) -> None:
    from openpyxl.styles import Font
    from openpyxl.utils import get_column_letter

    row = 0
    for title, df in tables:
        df.to_excel(xw, sheet_name="Environment", index=False, startrow=row + 1)
        ws = xw.sheets["Environment"]
        ws.cell(row=row + 1, column=1, value=title).font = Font(bold=True, size=12)
        _style_header(ws, row + 2)
        for i, col in enumerate(df.columns, start=1):
            fmt = number_format(str(col))
            for r in range(row + 3, row + 3 + len(df)):
                if fmt:
                    ws.cell(row=r, column=i).number_format = fmt
        row += len(df) + 3
    ws = xw.sheets["Environment"]
    for i, width in enumerate((34, 60, 22, 22, 90, 90), start=1):
        ws.column_dimensions[get_column_letter(i)].width = width


def write_csv(path: Path, summary: pd.DataFrame) -> None:
    with replacing(path) as tmp:
        summary.to_csv(tmp, index=False)


def write_markdown(path: Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)


def markdown_report(summary: pd.DataFrame, scaling: pd.DataFrame, env: dict) -> str:
    hw = env.get("gpu") if env.get("gpu count") else f"CPU: {env.get('cpu')} ({env.get('cpu cores')} cores)"
    parts = ["# zero_bench report", "",
             f"{hw} | torch {env.get('torch')} | deepspeed {env.get('deepspeed')} | "
             f"megatron-core {env.get('megatron-core')}", "", markdown_table(_markdown_summary(summary))]
    if len(scaling):
        parts += ["", "## Scaling", "", markdown_table(scaling.drop(columns=["config"]))]
    return "\n".join(parts) + "\n"


def _markdown_summary(summary: pd.DataFrame) -> pd.DataFrame:
    """The seed's layout: one "used / total MiB" cell per device; no empty or bookkeeping columns."""
    df = summary.drop(columns=["search key", "source", "config"])
    for c in [c for c in df.columns if c.startswith("Dev") and c.endswith("used MiB")]:
        total = c.replace("used", "total")
        cell = df[c].map(_mib) + " / " + df[total].map(_mib)
        df.insert(df.columns.get_loc(c), c.replace(" used MiB", " MiB"), cell.where(df[c].notna(), ""))
        df = df.drop(columns=[c, total])
    return df.dropna(axis=1, how="all")


def _mib(v) -> str:
    return "" if pd.isna(v) else f"{v:,.0f}"


def markdown_table(df: pd.DataFrame) -> str:
    def cell(col: str, v) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
            return ""
        fmt = PY_FORMATS.get(number_format(col) or "")
        if fmt and isinstance(v, (int, float)) and not isinstance(v, bool):
            return fmt.format(v)
        if isinstance(v, float) and v.is_integer():
            return str(int(v))
        return str(v).replace("|", "\\|").replace("\n", " ")

    head = "| " + " | ".join(str(c) for c in df.columns) + " |"
    rule = "| " + " | ".join("---" for _ in df.columns) + " |"
    body = ["| " + " | ".join(cell(c, v) for c, v in zip(df.columns, rec)) + " |"
            for rec in df.itertuples(index=False)]
    return "\n".join([head, rule, *body])


# -- the command ---------------------------------------------------------------------------------

@dataclass
class Report:
    summary: pd.DataFrame
    trials: pd.DataFrame
    scaling: pd.DataFrame
    environment: list[tuple[str, pd.DataFrame]]
    env: dict


def build(runs: str | Path) -> Report:
    """Store(s) -> every table of the report (nothing written)."""
    sources = find_stores(runs)
    if not sources:
        raise ConfigError(f"report.runs={runs}: no store (*.sqlite) found there")
    loaded = load(sources)
    if not loaded.searches and not loaded.trials:
        raise ConfigError(f"report.runs={runs}: the store(s) hold no results yet")
    rows = rows_of(loaded)
    recorded = recorded_environment(loaded)
    env = recorded or machine_environment()
    env_source = ("recorded with the results" if recorded else
                  "the machine that wrote this report (the store does not record one)")
    peaks = Peaks(env)
    summary = summary_frame(rows, peaks)
    return Report(summary=summary, trials=trials_frame(loaded), scaling=scaling_frame(summary),
                  environment=environment_frames(env, env_source, peaks, rows, loaded, sources), env=env)


def compare_summary(compare: str | Path) -> pd.DataFrame:
    """The other side of a comparison: a store (or dir / glob of stores), or a report .xlsx already written."""
    if str(compare).endswith(".xlsx") and Path(compare).is_file():
        return pd.read_excel(compare, sheet_name="Summary")
    return build(compare).summary


def side_names(runs, compare) -> tuple[str, str]:
    def name(p, fallback: str) -> str:
        return Path(p).stem if Path(p).exists() else fallback

    a, b = name(runs, "runs"), name(compare, "compare")
    return (a, b) if a != b else ("runs", "compare")


def output_paths(out: str | Path) -> tuple[Path, Path, Path]:
    out = Path(out)
    base = out.with_suffix("") if out.suffix in (".xlsx", ".csv", ".md") else out
    return Path(f"{base}.xlsx"), Path(f"{base}.csv"), Path(f"{base}.md")


def write_reports(runs: str | Path, out: str | Path = "reports/zero_bench.xlsx",
                  compare: Optional[str | Path] = None) -> list[Path]:
    """`zero_bench report`: the .xlsx, .csv and .md beside each other; returns their paths."""
    rep = build(runs)
    sheets = {"Summary": rep.summary, "Trials": rep.trials}
    if len(rep.scaling):
        sheets["Scaling"] = rep.scaling
    if compare:
        sheets["Compare"] = compare_frame(rep.summary, compare_summary(compare), side_names(runs, compare))
    xlsx, csv, md = output_paths(out)
    write_xlsx(xlsx, sheets, rep.environment)
    write_csv(csv, rep.summary)
    write_markdown(md, markdown_report(rep.summary, rep.scaling, rep.env))
    return [xlsx, csv, md]
