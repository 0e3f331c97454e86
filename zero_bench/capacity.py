"""One answer to "how many bytes may a rank use", and which measured peak is compared with it.

Capacity per rank: the user's `hardware.memory_mib` / `memory_gb` (on CPU, a budget the sampler
enforces; on GPU, the card itself, or an emulated smaller card, see `memory_fraction`); otherwise,
on GPU, the card itself; on CPU, the host's RAM shared by the ranks on it (a search replaces that
with `search.cpu_budget_gb`, see `with_cpu_budget`).

The peak compared with it: on CPU the rank process's peak RSS; on GPU torch's peak reserved bytes
(what the caching allocator holds, the figure the memory fraction limits).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import psutil

from zero_bench.config import BenchConfig
from zero_bench.records import RankRecord
from zero_bench.units import GiB, MiB


def local_ranks(cfg: BenchConfig) -> int:
    """Ranks on one node (the deepspeed launcher spreads them evenly)."""
    return max(1, cfg.parallel.world_size // max(1, cfg.hardware.num_nodes))


def capacity_bytes(cfg: BenchConfig) -> Optional[int]:
    """Per-rank capacity a launch enforces; None on GPU without memory_gb (the card decides)."""
    if cfg.hardware.memory_mib:
        return cfg.hardware.memory_mib * MiB
    if cfg.hardware.memory_gb:
        return int(cfg.hardware.memory_gb * GiB)
    if cfg.hardware.device == "gpu":
        return None
    return psutil.virtual_memory().total // local_ranks(cfg)


def device_capacity(cfg: BenchConfig) -> Optional[int]:
    """Per-rank capacity for the estimate: the launch's, else the visible card's total memory."""
    cap = capacity_bytes(cfg)
    if cap is None and cfg.hardware.device == "gpu":
        try:
            import torch

            if torch.cuda.is_available():
                cap = torch.cuda.get_device_properties(0).total_memory
        except Exception:  # noqa: BLE001 - no GPU: the estimate cannot say
            cap = None
    return cap


def with_cpu_budget(cfg: BenchConfig, budget_gb: float) -> BenchConfig:
    """On CPU a search needs a per-rank budget: filling the host's whole RAM would take hours."""
    if cfg.hardware.device != "cpu" or cfg.hardware.memory_gb or cfg.hardware.memory_mib:
        return cfg
    return dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, memory_gb=budget_gb))


def compared_peak(rec: RankRecord, device: str) -> Optional[int]:
    """The peak of one rank that is compared with the capacity."""
    return rec.peak_rss_bytes if device == "cpu" else rec.torch_peak_reserved


def trial_peak(ranks: Iterable[RankRecord], device: str) -> Optional[int]:
    """The largest compared peak over a trial's ranks (None when no rank reported one)."""
    vals = [p for p in (compared_peak(r, device) for r in ranks) if p]
    return max(vals) if vals else None


def over_capacity(peak: Optional[int], cap: Optional[int]) -> bool:
    return bool(cap and peak and peak > cap)


def memory_fraction(cap: Optional[int], card: int, outside_allocator: int) -> Optional[float]:
    """torch's per-process memory fraction that emulates a card of `cap` bytes on a `card`-byte GPU.

    The fraction caps only PyTorch's caching allocator; the CUDA context, NCCL buffers and cuBLAS
    workspaces (`outside_allocator`: NVML's used bytes minus torch's reserved bytes, measured on
    the rank's device) come on top. So the allocator gets cap - outside, and allocator + the rest
    stays within the emulated card, as on a real one. None: no emulation (no cap, or cap >= card).
    """
    if not cap or cap >= card:
        return None
    return max(cap - max(outside_allocator, 0), 1) / card
