"""FLOPs, MFU/HFU and the peak FLOP/s they are measured against.

One formula for every place that shows utilisation (the report's columns, its charts, the CLI):
FLOPs come from the model's description (zero_bench/models/flops.py, the MPT benchmark convention of
llm-foundry scripts/train/benchmarking, so our figures compare with published tables); this module
divides them by the peak FLOP/s of the device.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from zero_bench.config.schema import Recompute
from zero_bench.devices.cpu_features import onednn_limit, torch_capability
from zero_bench.models import ModelConfig
from zero_bench.models.flops import hardware_flops_per_seq, model_flops_per_seq

# Dense (no sparsity) peak FLOP/s per GPU: NVIDIA's datasheet figures "with sparsity", halved. fp32 is
# the plain CUDA-core figure: PyTorch leaves TF32 matmuls off by default, so an fp32 run is held to
# what fp32 can reach. H100/H200 bf16: 1979 TFLOP/s with sparsity / 2; MPT's tables divide by
# 989.5e12, so do we. fp8 (Transformer Engine; no zero_bench precision runs it yet, listed for
# comparison) where sourced: the H100 datasheet (SXM 3,958, PCIe 3,026 TFLOP/s with sparsity, as
# reproduced at archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html) and the H200's, which has the
# H100 SXM's compute (itkb.uw.cz "NVIDIA H200 vs B300", dense FP8 ~1,979). H100 NVL and GH200 fp8:
# not sourced here, left out. A100, V100: no fp8.
# Order matters: the first key found in the device name wins (H100 PCIe before H100, GH200 before H200).
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("GH200", {"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 67e12}),
    ("H200", {"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 67e12, "fp8": 1979e12}),
    ("H100 PCIE", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12, "fp8": 1513e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    ("H100", {"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 67e12, "fp8": 1979e12}),  # SXM
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    ("A10G", {}),  # AWS part: NVIDIA publishes no peak; unknown rather than the A10 figure
    ("A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),  # no bf16 tensor cores
]


def utilization(flops_per_seq: float, samples_per_sec: float, n_devices: int, peak_flops_per_device: float) -> float:
    """FLOP/s achieved over FLOP/s available, as a fraction."""
    return flops_per_seq * samples_per_sec / (n_devices * peak_flops_per_device)


def mfu_hfu(model: ModelConfig, samples_per_sec: float, n_gpus: int, peak_flops_per_gpu: float,
            recompute: Recompute = Recompute.none, recompute_layers: int = 1) -> tuple[float, float]:
    """(MFU, HFU) as fractions of the peak, FLOPs from the description (models/flops.py): HFU
    counts what recompute re-runs (full: the whole forward; block: recompute_layers of the layers'
    forwards; selective: the core attention)."""
    mfu = utilization(model_flops_per_seq(model), samples_per_sec, n_gpus, peak_flops_per_gpu)
    hfu = utilization(hardware_flops_per_seq(model, recompute, recompute_layers), samples_per_sec, n_gpus,
                      peak_flops_per_gpu)
    return mfu, hfu


def gpu_peak_flops(device_name: str, precision: str) -> Optional[float]:
    """Peak FLOP/s of one GPU from its name ("NVIDIA A100-SXM4-80GB"), or None when not in the table."""
    name = device_name.upper().replace("-", " ")
    for key, peaks in PEAK_FLOPS:
        if key in name:
            return peaks.get(precision)
    return None


# -- CPU: no datasheet figure fits a VM's share of a host, so measure it -------------------------

def cache_dir() -> Path:
    return Path(os.environ.get("ZERO_BENCH_CACHE", Path.home() / ".cache" / "zero_bench"))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rank_threads() -> int:
    """Threads one CPU rank computes with: the launcher gives each rank OMP_NUM_THREADS (default 1)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class CpuIdentity:
    """This CPU as every CPU cache keys it (a measured matmul rate here, a calibration in
    devices/calibration.py): the same figures hold only for the same CPU, cores, rank threads, torch's
    CPU capability and oneDNN's ISA limit (ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA change the kernels)."""
    model: str
    cores: Optional[int]
    threads: int
    capability: str
    onednn: str  # "unset" without a limit


def cpu_identity(threads: Optional[int] = None) -> CpuIdentity:
    """This machine's CpuIdentity, for ranks of `threads` threads (default: rank_threads())."""
    return CpuIdentity(cpu_model(), os.cpu_count(), threads or rank_threads(), torch_capability(),
                       onednn_limit() or "unset")


def matmul_flops(precision: str = "fp32", threads: int = 1, n: int = 1024, seconds: float = 0.5) -> float:
    """Best FLOP/s of an n x n matmul over about `seconds` with `threads` threads, as a linear layer
    computes it (x @ W.T: F.linear). The layout matters where bf16 is not native: with
    ONEDNN_MAX_CPU_ISA=AVX2 a bf16 x @ W.T ran at 21.6 GFLOP/s through oneDNN, a plain x @ W at 0.9
    through ATen's fallback; models run the former."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.nn.functional.linear(a, b)  # warm-up: first call pays for allocation and kernel selection
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            torch.nn.functional.linear(a, b)
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(before)


def peak_key(precision: str, threads: int) -> str:
    """The cache key of one measured rate. torch's CPU capability and oneDNN's ISA limit are in it:
    ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA change the kernels (a bf16 linear ran at 21.6 instead of
    212 GFLOP/s with ONEDNN_MAX_CPU_ISA=AVX2), so a restricted run must not reuse the unrestricted rate."""
    c = cpu_identity(threads)
    return f"{c.model}|cores={c.cores}|threads={c.threads}|{precision}|torch={c.capability}|onednn={c.onednn}"


def cpu_peak_flops(precision: str = "fp32", threads: Optional[int] = None) -> dict:
    """Measured matmul peak of one CPU rank, cached per machine in cache_dir()/cpu_peak.json.

    Returns {"flops", "cpu", "threads", "precision", "capability", "onednn_isa", "measured_at",
    "cached", "path"}.
    """
    threads = threads or rank_threads()
    path = cache_dir() / "cpu_peak.json"
    cache = _read_json(path)
    key = peak_key(precision, threads)
    if key in cache:
        return {**cache[key], "cached": True, "path": str(path)}
    return measure_cpu_peak(precision, threads)


def measure_cpu_peak(precision: str, threads: int) -> dict:
    """cpu_peak_flops measured now (`zero_bench calibrate` re-measures), its cache entry replaced."""
    path = cache_dir() / "cpu_peak.json"
    entry = {"flops": matmul_flops(precision, threads), "cpu": cpu_model(), "threads": threads,
             "precision": precision, "capability": torch_capability(), "onednn_isa": onednn_limit(),
             "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    cache = _read_json(path)
    cache[peak_key(precision, threads)] = entry
    _write_json_atomic(path, cache)
    return {**entry, "cached": False, "path": str(path)}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json_atomic(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
