"""This machine's fixed terms as `zero_bench calibrate` measured them: the record, its cache, which
estimate may use it, and what a GPU rank measures for it.

The cache is cache_dir()/calibration.json (ZERO_BENCH_CACHE, else ~/.cache/zero_bench), one entry per
key: the device (the CPU's model, or the GPU's NVML name with the driver) and the software that sets
the terms (torch, CUDA, NCCL, DeepSpeed, megatron-core; on CPU torch's CPU capability and oneDNN's
ISA limit, as metrics.peak_key; on GPU the CUDA module loading). Another driver, torch or DeepSpeed
is another key: a stale figure is never used, the published ranges are.

The estimate (estimate.fixed_terms) uses an entry when the configuration is about this machine:
device=cpu on this CPU; on GPU this machine's GPU, with hardware.card (a preset's card) either unset
or naming it (`for_bench`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from zero_bench.config.schema import BenchConfig, Device, software_versions
from zero_bench.devices.metrics import _read_json, _write_json_atomic, cache_dir, cpu_identity

CACHE_FILE = "calibration.json"
PUBLISHED = "published ranges"  # the GPU terms without a calibration (estimate/gpu.py)
BUILT_IN_CPU = "built-in CPU figure"  # CPU without one: estimate.CPU_RANK_OVERHEAD
PROBE_SIDE = 64  # the cuBLAS probe's matrices: any size makes the handle's workspace


@dataclass
class Calibration:
    """One machine's fixed terms, measured in one short real launch (one entry of calibration.json).
    Bytes are the largest over the launch's ranks (the estimate is per rank)."""
    key: str
    """The machine and software it holds for (cpu_key / gpu_key)."""
    kind: Device
    """The device it was measured on: cpu or gpu."""
    device: str
    """The CPU's model name, or the GPU's name as NVML gives it."""
    date: str
    """When it was measured, local time, "YYYY-MM-DD HH:MM"."""
    label: str
    """The launch that measured it (model, tp, dp, ZeRO stage, precision, engine) and its micro-batch."""
    model: str
    """The launch's model name: calibrated fragmentation is used for this model only."""
    engine: str
    zero: int
    tp: int
    dp: int
    ep: int = 1
    """The launch's expert-parallel size: its expert groups are communicators of their own
    (estimate/gpu.communicators). Entries written before it was recorded ran ep=1."""
    sp: int = 1
    """The launch's Ulysses size: its sp group is a communicator of its own. Entries written before
    it was recorded ran sp=1."""
    hpz: int = 1
    """The launch's ZeRO++ hpZ size: its hpZ group is a communicator of its own (hpz > 1). Entries
    written before it was recorded ran hpz=1."""
    software: dict = field(default_factory=dict)
    """Versions in the key: torch, deepspeed, megatron-core (GPU: cuda, nccl, driver)."""
    runtime_bytes: Optional[int] = None
    """A rank before its model is built: CPU its RSS, GPU outside the allocator (worker.start)."""
    # -- CPU ---------------------------------------------------------------------------------------
    overhead_bytes: Optional[int] = None
    """CPU: peak RSS less the peak live tensors at the entry's end: what a rank's RSS holds besides
    tensors (the measurement estimate.CPU_RANK_OVERHEAD was taken by); the estimate's fixed term."""
    matmul_flops: dict = field(default_factory=dict)
    """CPU: precision -> best FLOP/s of a 1024 x 1024 F.linear on one rank's threads (metrics.matmul_flops)."""
    threads: Optional[int] = None
    """CPU: the threads the rates were measured with (one rank's OMP_NUM_THREADS)."""
    memory_bytes_per_s: Optional[float] = None
    """CPU: bytes/s of an elementwise add on one rank's threads (rate_probes.py): the time estimate's
    memory-bound rate. Entries written before it was measured: None (the stated default is used)."""
    cpu_adam_params_per_s: Optional[float] = None
    """CPU: parameters/s DeepSpeedCPUAdam steps on one rank's threads (rate_probes.py); None: not measured."""
    rank_rates: dict = field(default_factory=dict)
    """CPU: rate_probes.RankRates of the launch's ranks all probing at once (matmul, memory-bound ops,
    gloo's collectives, torch AdamW) in the launch's precision; {}: not measured."""
    engine_points: list = field(default_factory=list)
    """CPU: estimate/time/engine.EnginePoint dicts: the launch's own time/it against its kernel terms
    at rank_rates (the engine's time per step beyond the kernels, for its engine and stage); points
    of other engines and stages from earlier calibrations under the same key are kept."""
    # -- GPU ---------------------------------------------------------------------------------------
    module_loading: Optional[str] = None
    """GPU: CUDA_MODULE_LOADING the ranks ran with (lazy / eager): it sets the context's size."""
    context_at_init_bytes: Optional[int] = None
    """GPU: the CUDA context alone, right after its initialisation (RankRecord.context_bytes)."""
    nccl_bytes: dict = field(default_factory=dict)
    """GPU: group size (as text) -> bytes per communicator, the growth outside the allocator over the
    world group's first all-reduce (RankRecord.nccl_world_bytes); sizes of earlier calibrations under
    the same key are kept."""
    nccl_all_to_all_bytes: dict = field(default_factory=dict)
    """GPU: group size (as text) -> bytes of a group of its own that runs all-to-alls (Ulysses' sp
    group, the MoE dispatcher's ep group), the growth outside the allocator over a new group of the
    world's ranks and its first all-to-all (RankRecord.nccl_all_to_all_bytes); kept as nccl_bytes are."""
    cublas_workspace_bytes: Optional[int] = None
    """GPU: cuBLAS's workspaces of the main and autograd's threads (RankRecord.cublas_workspace_bytes)."""
    outside_bytes: Optional[int] = None
    """GPU: outside the allocator at the entry's end (context, kernels loaded so far, NCCL)."""
    context_bytes: Optional[int] = None
    """GPU: the CUDA context with the kernels the entry loaded: outside_bytes less NCCL's bytes for
    the launch's communicators (estimate/gpu.communicators of its tp, dp, sp, ep and hpz layout) and
    for the probe's all-to-all group; the estimate's context term."""
    peak_allocated_bytes: Optional[int] = None
    """GPU: torch's max allocated over the entry."""
    peak_reserved_bytes: Optional[int] = None
    """GPU: torch's max reserved over the entry."""
    fragmentation: Optional[float] = None
    """GPU: reserved / allocated at the peak (largest rank), for this model, engine and ZeRO stage."""

    @property
    def said(self) -> str:
        """How the estimate names its source."""
        return f"calibrated on {self.device}, {self.date[:10]}"

    def fragmentation_for(self, bench: BenchConfig) -> Optional[float]:
        """The measured reserved / allocated where `bench` is the configuration it was measured on
        (model, engine, ZeRO stage: the allocator's rounding depends on the tensors); else None."""
        same = (bench.model.name, str(bench.engine), bench.zero) == (self.model, self.engine, self.zero)
        return self.fragmentation if same else None

    def __post_init__(self) -> None:
        self.kind = Device(self.kind)  # the cache holds the plain value

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# -- keys ------------------------------------------------------------------------------------------

def _software() -> str:
    return "|".join(f"{pkg}={ver}" for pkg, ver in software_versions())


def cpu_key() -> str:
    """This CPU (metrics.CpuIdentity: its rank's threads, torch's CPU capability, oneDNN's limit) and
    the software."""
    c = cpu_identity()
    return (f"cpu|{c.model}|cores={c.cores}|threads={c.threads}|capability={c.capability}|onednn={c.onednn}"
            f"|{_software()}")


@dataclass(frozen=True)
class GpuIdentity:
    """This machine's first visible GPU and the GPU software, as a calibration's key names them."""
    name: str
    driver: str
    cuda: str
    nccl: str


def gpu_identity(devices: Optional[str] = None) -> Optional[GpuIdentity]:
    """The first GPU the ranks would use (hardware.devices, else CUDA_VISIBLE_DEVICES) as NVML names
    it; None without NVML or a GPU."""
    return _gpu_identity(devices or os.environ.get("CUDA_VISIBLE_DEVICES"))


@functools.lru_cache(maxsize=8)
def _gpu_identity(visible: Optional[str]) -> Optional[GpuIdentity]:
    from zero_bench.devices.nvml import Nvml

    n = Nvml(visible=visible)
    try:
        if n.nv is None or not n.visible:
            return None
        return GpuIdentity(n.visible[0].name, n.driver or "unknown", *_cuda_versions())
    finally:
        n.close()


def _cuda_versions() -> tuple[str, str]:
    """torch's CUDA and NCCL versions; neither starts CUDA (ncclGetVersion reads the library)."""
    import torch

    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except (AttributeError, RuntimeError):  # a CPU build has no NCCL
        nccl = "none"
    return str(torch.version.cuda), nccl


def gpu_key(loading: str, ident: Optional[GpuIdentity] = None, devices: Optional[str] = None) -> Optional[str]:
    """This machine's GPU, driver, CUDA, NCCL, the software and the module loading; None: no GPU."""
    ident = ident or gpu_identity(devices)
    if ident is None:
        return None
    return (f"gpu|{ident.name}|driver={ident.driver}|cuda={ident.cuda}|nccl={ident.nccl}|{_software()}"
            f"|loading={loading}")


# -- the cache -------------------------------------------------------------------------------------

def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def load() -> dict[str, Calibration]:
    """Every entry of the cache by key ({} when there is none or it cannot be read)."""
    out = {}
    for key, d in _read_json(cache_path()).items():
        try:
            out[key] = Calibration.from_dict(d)
        except (TypeError, ValueError):  # an entry of another version: a required field missing, a kind unknown
            continue
    return out


def save(cal: Calibration) -> Path:
    """Write `cal` under its key (atomically: a reader sees the old file or the new one). NCCL sizes
    an earlier calibration of the same key measured and this one did not are kept."""
    path = cache_path()
    data = _read_json(path)
    old = data.get(cal.key) or {}
    cal = dataclasses.replace(cal, nccl_bytes={**(old.get("nccl_bytes") or {}), **cal.nccl_bytes},
                              nccl_all_to_all_bytes={**(old.get("nccl_all_to_all_bytes") or {}),
                                                     **cal.nccl_all_to_all_bytes},
                              engine_points=merged_points(old.get("engine_points") or [], cal.engine_points))
    data[cal.key] = cal.to_dict()
    _write_json_atomic(path, data)
    if cal.key not in _read_json(path):
        raise OSError(f"{path}: could not be written")
    return path


def merged_points(old: list, new: list) -> list:
    """Engine points (dicts): the new ones, and the old ones of engines, stages, models and tp / sp
    degrees they do not measure again (a point at tp=2 measures the tensor-parallel calls, not the
    stage: estimate/time/engine.py)."""
    def ident(p: dict) -> tuple:
        return p["key"], p["model"], p.get("tp", 1), p.get("sp", 1), p.get("grad_accum", 1)
    again = {ident(p) for p in new}
    return [p for p in old if ident(p) not in again] + list(new)


# -- which estimate uses which entry ---------------------------------------------------------------

def _words(text: str) -> set[str]:
    return set(re.split(r"[^0-9A-Z]+", text.upper())) - {""}


def card_matches(card: Optional[str], name: str) -> bool:
    """hardware.card names this GPU: every word of it is a word of NVML's name (None: any GPU)."""
    return card is None or _words(card) <= _words(name)


def for_bench(bench: BenchConfig) -> Optional[Calibration]:
    """The calibration an estimate of `bench` uses: this machine's, where `bench` is about it."""
    entries = load()
    if bench.hardware.device == Device.cpu:
        return entries.get(cpu_key()) if entries else None
    if not any(e.kind == Device.gpu for e in entries.values()):
        return None  # no GPU calibration here: NVML is not even asked
    key = gpu_key(str(bench.hardware.cuda_module_loading), devices=bench.hardware.devices)
    cal = entries.get(key) if key else None
    return cal if cal is not None and card_matches(bench.hardware.card, cal.device) else None


# -- what a GPU rank measures (worker.start, calibrate only) ---------------------------------------

class FixedTermsProbe:
    """A GPU rank's fixed terms, each measured where it appears. Made before the process group (its
    constructor starts CUDA, so the context is measured alone), `measure`d once the rank's RankGpu
    exists and before the engine is built. `torch` is the seam (tests: a fake torch.cuda)."""

    def __init__(self, torch: Any, local_rank: int):
        self.torch, self.local_rank = torch, local_rank
        torch.cuda.set_device(local_rank)
        free, total = torch.cuda.mem_get_info(local_rank)  # starts CUDA: the context, nothing else yet
        self.used_at_init = int(total - free)

    def measure(self, gpu: Any, dist: Any, dtype: Any) -> dict:
        """RankRecord's context_bytes, nccl_world_bytes, nccl_all_to_all_bytes and cublas_workspace_bytes."""
        context = max(0, self.used_at_init - gpu.others)  # nothing was reserved yet
        return {"context_bytes": context, "nccl_world_bytes": self.first_collective(gpu, dist, context),
                "nccl_all_to_all_bytes": self.all_to_all_group(gpu, dist),
                "cublas_workspace_bytes": self.cublas_workspaces(dtype)}

    def first_collective(self, gpu: Any, dist: Any, context: int) -> Optional[int]:
        """Outside-the-allocator bytes the world group's communicator holds once connected: its first
        all-reduce (DeepSpeed created it at init_process_group, with device_id; NCCL connects its
        buffers at the first collective). A world of one rank has none the estimate counts."""
        if dist.get_world_size() < 2:
            return None
        t = self.torch.empty(1, device=self.torch.device("cuda", self.local_rank))  # no fill kernel to load
        dist.all_reduce(t)
        self.torch.cuda.synchronize(self.local_rank)
        del t
        return max(0, gpu.outside_now() - context)

    def all_to_all_group(self, gpu: Any, dist: Any) -> Optional[int]:
        """Outside-the-allocator bytes a group of its own holds once it has run an all-to-all, as
        Ulysses' sp group and the MoE dispatcher's ep group do: NCCL connects every peer point to
        point for it, not the rings and trees of the world's all-reduce. Measured on a new group of
        the world's ranks (the only group every rank is sure to be in before the engine builds its
        own), from before its creation to after its first all-to-all. The group stays: calibrate
        takes these bytes out of the context term with the launch's own communicators'."""
        n = dist.get_world_size()
        if n < 2:
            return None
        before = gpu.outside_now()
        group = dist.new_group(list(range(n)))
        dev = self.torch.device("cuda", self.local_rank)
        out, inp = self.torch.empty(n, device=dev), self.torch.empty(n, device=dev)
        dist.all_to_all_single(out, inp, group=group)
        self.torch.cuda.synchronize(self.local_rank)
        del out, inp
        return max(0, gpu.outside_now() - before)

    def cublas_workspaces(self, dtype: Any) -> int:
        """torch's allocated bytes a linear layer's forward and backward leave behind: the workspace
        torch allocates through its allocator per cuBLAS handle and stream (CublasHandlePool.cpp;
        cuBLASLt's is that one unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=0), one for this thread's
        handle and one for autograd's device thread, which runs the backward with its own. The model's matmuls later
        run on the same threads and stream: the probe adds no memory of its own."""
        torch, cuda = self.torch, self.torch.cuda
        dev = torch.device("cuda", self.local_rank)
        cuda.synchronize(self.local_rank)
        before = cuda.memory_allocated(self.local_rank)
        x, w = (torch.ones(PROBE_SIDE, PROBE_SIDE, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
        b = torch.ones(PROBE_SIDE, device=dev, dtype=dtype, requires_grad=True)
        torch.nn.functional.linear(x, w, b).sum().backward()
        cuda.synchronize(self.local_rank)
        del x, w, b
        return max(0, cuda.memory_allocated(self.local_rank) - before)
