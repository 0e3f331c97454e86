"""Predicted vs measured: per configuration at its max batch, the estimate's terms beside what the
trial measured, so a user sees which term is off (and by how much) before trusting the estimate on
hardware they do not have yet.

GPU: the allocator's predicted peak vs torch's max allocated; the fragmentation (reserved minus
allocated) vs the ZeRO family's factor; what lives outside the allocator (NVML used minus torch's
reserved: the CUDA context, NCCL, workspaces) vs the named terms; the device's peak (nvidia-smi's
used) vs the prediction. CPU: the process's runtime before the model vs the estimate's constant,
the exact model states, the peak live tensors vs the predicted tensors, the peak RSS vs the
prediction. Every figure is the largest over the configuration's ranks (the estimate is per rank).

With `zero_bench report traced=true`, beside each term the traced prediction names too (the model
states, the tensors at the peak, and what follows from them: peak RSS, the device's peak) the traced
one: rank 0 of the configuration's world traced at its measured micro-batch (estimate/traced.py).
Only when asked: a trace costs seconds per configuration (a 70B model's ~10 s, a sweep's rows add
up), where the rest of the report is read from the stores; a row the tracer cannot run (DeepSpeed,
a mixture of experts, ...) says why in its `traced from` cell.
"""
from __future__ import annotations

from typing import Callable, Optional

import pandas as pd

from zero_bench.config.schema import Device
from zero_bench.devices.calibration import BUILT_IN_CPU, PUBLISHED
from zero_bench.estimate import Estimate
from zero_bench.records import RankRecord, TrialResult
from zero_bench.report.rows import Row, bench_of
from zero_bench.report.tables import estimated_model_states, measured_model_states
from zero_bench.units import MiB

# the time estimate (estimate/time/) at the measured micro-batch against the trial's median time/it, on
# each configuration's first line (the time is one figure per configuration, not per memory term)
TIME_COLUMNS = ["predicted time/it (ms)", "measured time/it (ms)", "time/it error (%)", "time predicted from"]
COLUMNS = ["config", "micro batch", "term", "predicted MiB", "measured MiB", "error (%)", "predicted from",
           *TIME_COLUMNS]
TRACED_COLUMNS = ["config", "micro batch", "term", "predicted MiB", "traced MiB", "measured MiB", "error (%)",
                  "traced error (%)", "predicted from", "traced from", *TIME_COLUMNS]


def predicted_frame(rows: list[Row], traced: bool = False) -> pd.DataFrame:
    """One line per term per measured configuration (empty when nothing was measured); traced: with
    the traced prediction's column beside the formula's."""
    lines = []
    for r in rows:
        if r.measure is None or not r.max_micro:
            continue
        est = r.estimate()
        if est is not None:
            got = _lines(r.label, r.measure, est)
            got = _with_trace(got, r, est) if traced else got
            if got:
                got[0] = {**got[0], **time_cells(r.measure, est)}
            lines += got
    return pd.DataFrame(lines, columns=TRACED_COLUMNS if traced else COLUMNS)


def _with_trace(lines: list[dict], r: Row, est: Estimate) -> list[dict]:
    """`lines` with the traced figure of each term the trace names, or why the row is not traced."""
    from zero_bench.config.schema import ConfigError
    from zero_bench.estimate.traced import trace

    t = r.measure
    try:
        tr = trace(r.bench, t.micro)
    except ConfigError as exc:
        return [{**x, "traced from": str(exc)} for x in lines]
    _, with_grads = measured_model_states(t)
    states = tr.terms["params"] + tr.terms["optimizer"] + (tr.terms["params"] if with_grads else 0)
    figures = {"model states (exact count after a step)": states,
               "tensors at the peak (live)": tr.peak_bytes, "peak RSS": est.overhead + tr.peak_bytes,
               "allocator peak (torch max allocated)": tr.peak_bytes,
               "device peak (NVML used, as nvidia-smi)": est.overhead + int(est.fragmentation * tr.peak_bytes)}
    where = (f"rank 0 of {tr.world} fake ranks, peak in the {tr.phase}, {tr.seconds:.1f} s"
             + ("" if est.device == Device.cpu else "; CPU kernels (estimate/traced.py GPU_DIFFERS)"))
    out = []
    for x in lines:
        v = figures.get(x["term"])
        measured = None if x["measured MiB"] is None else x["measured MiB"] * MiB
        out.append({**x, "traced MiB": None if v is None else v / MiB,
                    "traced error (%)": None if v is None else _error(v, measured),
                    "traced from": "" if v is None else where})
    return out


def _lines(label: str, t: TrialResult, est: Estimate) -> list[dict]:
    terms = _gpu_terms(t, est) if est.device == Device.gpu else _cpu_terms(t, est)
    return [{"config": label, "micro batch": t.micro, "term": name,
             "predicted MiB": predicted / MiB if predicted is not None else None,
             "measured MiB": measured / MiB if measured is not None else None,
             "error (%)": _error(predicted, measured), "predicted from": source}
            for name, predicted, measured, source in terms]


def time_cells(t: TrialResult, est: Estimate) -> dict:
    """The predicted step at the trial's micro-batch beside its measured time/it ({} without either)."""
    p = est.time_at(t.micro)
    measured = t.time_per_step_s
    if p is None:
        return {}
    rates = p.rates or "the hardware's rates"
    return {"predicted time/it (ms)": p.step_s * 1e3,
            "measured time/it (ms)": measured * 1e3 if measured else None,
            "time/it error (%)": _error(p.step_s, measured),
            "time predicted from": f"estimate/time/: {len(p.terms)} terms at {rates}, dominant {p.dominant.name}"}


def _error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured * 100


def _largest(t: TrialResult, read: Callable[[RankRecord], Optional[int]]) -> Optional[int]:
    values = [v for v in (read(r) for r in t.ranks) if v is not None]
    return max(values) if values else None


def _cpu_terms(t: TrialResult, est: Estimate) -> list[tuple]:
    micro = t.micro
    states, with_grads = measured_model_states(t)
    return [
        ("runtime before the model (RSS)", est.overhead, _largest(t, lambda r: r.runtime_bytes),
         "CPU_RANK_OVERHEAD (measured on this machine kind)" if est.calibration == BUILT_IN_CPU else est.calibration),
        ("model states (exact count after a step)", estimated_model_states(bench_of(t.config), with_grads), states,
         "ZeRO paper's states, as DeepSpeed allocates them"),
        ("tensors at the peak (live)", est.allocated_bytes(micro), _largest(t, lambda r: r.peak_live_bytes),
         "states + buffers + activations (Korthikanti)"),
        ("peak RSS", est.peak_bytes(micro), _largest(t, lambda r: r.peak_rss_bytes), "runtime + tensors"),
    ]


def _outside(r: RankRecord) -> Optional[int]:
    used = r.nvml_peak_bytes or r.device_peak_bytes
    return used - r.torch_peak_reserved if used and r.torch_peak_reserved is not None else None


def _fragmentation(r: RankRecord) -> Optional[int]:
    if r.torch_peak_reserved is None or r.torch_peak_allocated is None:
        return None
    return r.torch_peak_reserved - r.torch_peak_allocated


def _gpu_terms(t: TrialResult, est: Estimate) -> list[tuple]:
    micro, alloc = t.micro, est.allocated_bytes(t.micro)
    names = ", ".join(est.terms) + ("" if est.calibration == PUBLISHED else f" ({est.calibration})")
    return [
        ("allocator peak (torch max allocated)", alloc, _largest(t, lambda r: r.torch_peak_allocated),
         "states + buffers + activations (Korthikanti)"),
        ("fragmentation (reserved - allocated)", int((est.fragmentation - 1) * alloc), _largest(t, _fragmentation),
         f"x{est.fragmentation:.2f} for ZeRO-{est.zero} "
         f"({est.calibration if est.fragmentation_calibrated else 'published reserved/allocated'})"),
        ("outside the allocator (NVML used - reserved)", est.overhead, _largest(t, _outside), names),
        ("device peak (NVML used, as nvidia-smi)", est.peak_bytes(micro),
         _largest(t, lambda r: r.nvml_peak_bytes or r.device_peak_bytes), "all of the above"),
    ]
