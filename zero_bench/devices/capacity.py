"""One answer to "how many bytes may a rank use", and which measured peak is compared with it.

Capacity per rank: the user's `hardware.memory_mib` / `memory_gb` (on CPU, a budget the sampler
enforces; on GPU, the card itself, or an emulated smaller card, see `memory_fraction`); otherwise,
on GPU, the card itself (`search_capacity`: CUDA's total of the smallest GPU the ranks use, the
same number for the search's prediction and the estimate); on CPU, the host's RAM shared by the
ranks on it (a search replaces that with `search.cpu_budget_gb`, see `with_cpu_budget`).

The peak compared with it: on CPU the rank process's peak RSS; on GPU the rank's device peak:
torch's peak reserved bytes (what the caching allocator holds, the figure the memory fraction
limits) plus what lives outside the allocator (context, NCCL, cuBLAS), as a real card holds both.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

import psutil

from zero_bench.config.hosts import device_tokens, local_ranks
from zero_bench.config.schema import BenchConfig, Device
from zero_bench.devices.nvml import Nvml
from zero_bench.records import RankRecord
from zero_bench.units import GiB, MiB


def capacity_bytes(cfg: BenchConfig) -> Optional[int]:
    """Per-rank capacity a launch enforces; None on GPU without memory_gb (the card decides)."""
    if cfg.hardware.memory_mib:
        return cfg.hardware.memory_mib * MiB
    if cfg.hardware.memory_gb:
        return int(cfg.hardware.memory_gb * GiB)
    if cfg.hardware.device == Device.gpu:
        return None
    return psutil.virtual_memory().total // local_ranks(cfg)


def marketed_gb_warning(device: Device, memory_gb: Optional[float]) -> Optional[str]:
    """hardware.memory_gb is GiB, while a card sold as "40GB" exposes another total (an A100-40GB
    40537 MiB in nvidia-smi, the reference table's cells, against 40 GiB = 40960): a capacity typed
    as the card's marketed size emulates a card that does not exist. The line names the presets of
    that size and their real totals (conf/hardware/*.yaml, the one place those figures live)."""
    if device != Device.gpu or not memory_gb:
        return None
    asked = int(memory_gb * GiB) // MiB
    same = {name: mib for name, mib in preset_totals().items() if _marketed_gb(name) == memory_gb}
    if not same or all(mib == asked for mib in same.values()):
        return None
    cards = " or ".join(f"hardware={name} ({mib} MiB)" for name, mib in sorted(same.items()))
    return (f"hardware.memory_gb={memory_gb:g} is {asked} MiB (GiB), not what a {memory_gb:g}GB card shows in "
            f"nvidia-smi: {cards}, or hardware.memory_mib=<its total>, emulates the card")


def preset_totals() -> dict[str, int]:
    """GPU preset -> its card's total in MiB, as nvidia-smi shows it (conf/hardware/*.yaml)."""
    import yaml

    from zero_bench.config.schema import CONF_DIR

    out = {}
    for path in sorted((CONF_DIR / "hardware").glob("*.yaml")):
        mib = (yaml.safe_load(path.read_text()) or {}).get("memory_mib")
        if mib:
            out[path.stem] = int(mib)
    return out


def _marketed_gb(preset: str) -> Optional[float]:
    """The size in a preset's name ("a100_40gb" -> 40), None without one."""
    tail = preset.rsplit("_", 1)[-1].lower()
    return float(tail[:-2]) if tail.endswith("gb") and tail[:-2].isdigit() else None


def card_totals(cfg: BenchConfig) -> list[int]:
    """CUDA's total bytes of each GPU the ranks of this node use, read with NVML so that the
    runner never starts a CUDA context: NVML's total minus the driver's reserve (nvml.h,
    nvmlMemory_v2_t.reserved), which cudaMemGetInfo leaves out of its total. Without the v2 call
    NVML's whole total, a little high. Empty without NVML."""
    tokens = device_tokens(cfg)
    n = Nvml(visible=",".join(tokens) if tokens is not None else None)
    try:
        mems = [n.memory(g) for g in n.visible[:local_ranks(cfg)]]
        return [m.total - (m.reserved or 0) for m in mems if m]
    finally:
        n.close()


def search_capacity(cfg: BenchConfig, ranks: Iterable[RankRecord] = ()) -> Optional[int]:
    """Per-rank capacity the search predicts with and the estimate sizes against: the launch's,
    else (GPU) the smallest CUDA total the ranks reported, else the one NVML gives here."""
    cap = capacity_bytes(cfg)
    if cap is not None or cfg.hardware.device != Device.gpu:
        return cap
    seen = [r.cuda_total_bytes for r in ranks if r.cuda_total_bytes]
    if seen:
        return min(seen)
    totals = card_totals(cfg)
    return min(totals) if totals else None


def with_cpu_budget(cfg: BenchConfig, budget_gb: float) -> BenchConfig:
    """On CPU a search needs a per-rank budget: filling the host's whole RAM would take hours."""
    if cfg.hardware.device != Device.cpu or cfg.hardware.memory_gb or cfg.hardware.memory_mib:
        return cfg
    return dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, memory_gb=budget_gb))


def compared_peak(rec: RankRecord, device: Device) -> Optional[int]:
    """The peak of one rank that is compared with the capacity. On GPU the device peak: under
    emulation torch's reserved bytes alone stay below the fraction by construction, and a real
    card also holds what grew outside the allocator (records without it: reserved bytes)."""
    if device == Device.cpu:
        return rec.peak_rss_bytes
    return rec.device_peak_bytes if rec.device_peak_bytes is not None else rec.torch_peak_reserved


def trial_peak(ranks: Iterable[RankRecord], device: str, peak: Callable = compared_peak) -> Optional[int]:
    """The largest compared peak over a trial's ranks (None when no rank reported one); `peak`:
    which of a rank's peaks (growing_peak: what a search extrapolates)."""
    vals = [p for p in (peak(r, device) for r in ranks) if p]
    return max(vals) if vals else None


# The phases of a step whose memory grows with the micro-batch (the worker's phase marks).
GROWING_PHASES = ("forward", "backward")


def growing_peak(rec: RankRecord, device: str) -> Optional[int]:
    """The compared peak as the phases that grow with the batch reach it: what a search extrapolates.

    On CPU a step's RSS peak may sit in a phase that does not grow (the optimizer step's
    temporaries): the demo's ZeRO-0 peaked at the same 931 MiB at micro 15 and 17, and a slope
    taken from there put the boundary 4 samples low. The profiled step's live bytes per phase say
    how far the forward/backward peak lies below it; RSS keeps the same distance to the live
    tensors in every phase (RSS - live: 422 MiB at micro 15, 17, 19 and 21 there). Elsewhere (GPU,
    or a record without per-phase figures): the compared peak."""
    peak = compared_peak(rec, device)
    grow = [b for b in (rec.phase_live_bytes.get(ph) for ph in GROWING_PHASES) if b]
    if device != Device.cpu or not peak or not rec.peak_live_bytes or not grow:
        return peak
    return peak - max(0, rec.peak_live_bytes - max(grow))


def over_capacity(peak: Optional[int], cap: Optional[int]) -> bool:
    return bool(cap and peak and peak > cap)


def memory_fraction(cap: Optional[int], card: int, outside_allocator: int) -> Optional[float]:
    """torch's per-process memory fraction that emulates a card of `cap` bytes on a GPU whose CUDA
    total is `card` bytes (torch multiplies the fraction by that total, not NVML's, which also
    counts the driver's reserve).

    The fraction caps only PyTorch's caching allocator; the CUDA context, NCCL buffers and cuBLAS
    handles (`outside_allocator`: CUDA's used bytes minus torch's reserved bytes minus other
    processes', measured on the rank's device) come on top. So the allocator gets cap - outside,
    and allocator + the rest stays within the emulated card, as on a real one. None: no emulation
    (no cap, or cap >= card). A float in (0, 1]: torch refuses anything else.
    """
    if not cap or cap >= card:
        return None
    return float(min(1.0, max(cap - max(outside_allocator, 0), 1) / card))
