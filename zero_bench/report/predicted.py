"""Predicted vs measured: per configuration at its max batch, the estimate's terms beside what the
trial measured, so a user sees which term is off (and by how much) before trusting the estimate on
hardware they do not have yet.

GPU: the allocator's predicted peak vs torch's max allocated; the fragmentation (reserved minus
allocated) vs the ZeRO family's factor; what lives outside the allocator (NVML used minus torch's
reserved: the CUDA context, NCCL, workspaces) vs the named terms; the device's peak (nvidia-smi's
used) vs the prediction. CPU: the process's runtime before the model vs the estimate's constant,
the exact model states, the peak live tensors vs the predicted tensors, the peak RSS vs the
prediction. Every figure is the largest over the configuration's ranks (the estimate is per rank).
"""
from __future__ import annotations

from typing import Callable, Optional

import pandas as pd

from zero_bench.devices.calibration import BUILT_IN_CPU, PUBLISHED
from zero_bench.estimate import Estimate
from zero_bench.records import RankRecord, TrialResult
from zero_bench.report.rows import Row
from zero_bench.report.tables import estimated_model_states, measured_model_states, setup_of
from zero_bench.units import MiB

COLUMNS = ["config", "micro batch", "term", "predicted MiB", "measured MiB", "error (%)", "predicted from"]


def predicted_frame(rows: list[Row]) -> pd.DataFrame:
    """One line per term per measured configuration (empty when nothing was measured)."""
    lines = []
    for r in rows:
        if r.measure is None or not r.max_micro:
            continue
        est = r.estimate()
        if est is not None:
            lines += _lines(r.label, r.measure, est)
    return pd.DataFrame(lines, columns=COLUMNS)


def _lines(label: str, t: TrialResult, est: Estimate) -> list[dict]:
    terms = _gpu_terms(t, est) if est.device == "gpu" else _cpu_terms(t, est)
    return [{"config": label, "micro batch": t.micro, "term": name,
             "predicted MiB": predicted / MiB if predicted is not None else None,
             "measured MiB": measured / MiB if measured is not None else None,
             "error (%)": _error(predicted, measured), "predicted from": source}
            for name, predicted, measured, source in terms]


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
        ("model states (exact count after a step)", estimated_model_states(setup_of(t.config), with_grads), states,
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
