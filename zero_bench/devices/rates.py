"""The rates a time prediction needs (zero_bench/estimate/time/), each a named number with where it
comes from, in one place: the GPU presets' by card (as PEAK_FLOPS in metrics.py is keyed), this
CPU's from `zero_bench calibrate` where it measured them.

A Rate says whether it was measured here (calibrated), published (the source names the page), or is
a stated default nobody has measured yet (source starts with "assumed"): the estimate prints that
word, so a figure built on it is never read as checked. Nothing here is fitted to a table of runs.

Published figures (re-check before relying on one):
- MAMF, the achievable bf16 matmul rate: stas00/ml-engineering, compute/accelerator/README.md,
  "Maximum Achievable Matmul FLOPS comparison table": A100 SXM 267.9, H100 SXM 792.1 TFLOP/s.
- HBM bandwidth: NVIDIA's datasheets (A100 40GB SXM 1,555 GB/s; A100 80GB SXM 2,039 GB/s; H100 SXM
  3.35 TB/s; H200 4.8 TB/s).
- NCCL all-reduce bus bandwidth within a node (nccl-tests' busbw, large messages): 8 x A100 ~200
  GB/s (NVIDIA/nccl-tests#149), 8 x H100 with NVLS ~476 GB/s (nccl-tests#290), 8 x H200 482 GB/s at
  16 GiB (ml-engineering, network/benchmarks).
- Across nodes, one NIC per GPU: NDR 400 Gb/s InfiniBand ~46-48 GB/s measured per NIC (DGX H100 /
  H200: 8 x ConnectX-7 400 Gb/s); HDR 200 Gb/s on DGX A100 (8 x ConnectX-6), 25 GB/s line rate.
- Host <-> device copies (nvbandwidth, NVIDIA/nvbandwidth issues): A100 PCIe gen4 ~25 GB/s; H100
  ~35 GB/s host-to-device, ~53 device-to-host.
- Host cores per GPU: DGX A100 2 x AMD EPYC 7742 (128 cores) for 8 GPUs = 16; DGX H100 / H200
  2 x Xeon Platinum 8480C (112 cores) for 8 GPUs = 14 (NVIDIA's DGX datasheets).
- DeepSpeed's CPU Adam: no per-core rate is published (cpu_adam.py: "5x to 7x" torch's Adam; PR
  #735: an 11.6B-parameter step in 8.2 s on an unnamed host, 1.4e9 params/s for the whole host).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

from zero_bench.config.schema import BenchConfig, Device

ASSUMED = "assumed"  # a source starting with it: a stated default, to be calibrated


@dataclass(frozen=True)
class Rate:
    """One rate and where it comes from."""
    value: float
    source: str
    calibrated: bool = False
    """Measured on this machine (`zero_bench calibrate`)."""

    @property
    def assumed(self) -> bool:
        """A stated default nobody measured: to be calibrated."""
        return self.source.startswith(ASSUMED)


@dataclass(frozen=True)
class EnginePoint:
    """One timed calibration trial of an engine and stage, and what the kernel terms predicted for it."""
    key: str
    """engine_key of the trial's configuration."""
    model: str
    tensors: int
    """Parameter tensors on a rank (engine_size)."""
    params: float
    """Parameters on a rank before ZeRO's partitioning (engine_size)."""
    measured_s: float
    """The trial's time/it (its ranks' slowest median)."""
    kernels_s: float
    """The prediction without the engine term and the step overhead, at the same rates."""
    token_layers: float = 0.0
    """Tokens a rank's layers see per micro-step, x layers (engine_size)."""
    micro: int = 0
    tp: int = 1
    sp: int = 1
    """The trial's tensor- and sequence-parallel degrees: points at tp or sp > 1 measure what those
    collectives cost per call (estimate/time/engine.py), not the stage's own engine time."""
    arch: str = ""
    """The model's layer architecture (engine.layer_arch: norm, activation, positions, attention);
    "" for points stored before it was recorded (all of them gpt-tiny's: GPT's layer)."""
    calls: float = 0.0
    """Tensor-parallel or Ulysses collective calls of the trial's optimizer step (comm.py's counts)."""
    grad_accum: int = 1
    """The trial's micro-steps per optimizer step: a point at grad_accum > 1 measures which share of
    the stage's per-tensor and per-parameter time repeats every micro-step (estimate/time/engine.py)."""

    @property
    def residual_s(self) -> float:
        """What the engine spent beyond the kernel terms (never below zero)."""
        return max(0.0, self.measured_s - self.kernels_s)

    def features(self) -> tuple[float, float, float]:
        return float(self.tensors), self.params, self.token_layers

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EnginePoint":
        return cls(d["key"], d["model"], int(d["tensors"]), float(d["params"]), float(d["measured_s"]),
                   float(d["kernels_s"]), float(d.get("token_layers", 0.0)), int(d.get("micro", 0)),
                   int(d.get("tp", 1)), int(d.get("sp", 1)), str(d.get("arch", "")), float(d.get("calls", 0.0)),
                   int(d.get("grad_accum", 1)))


@dataclass(frozen=True)
class HardwareRates:
    """What one device and its host deliver, the units in each name."""
    name: str
    matmul_flops: Rate
    """Achieved dense 16-bit matmul FLOP/s (MAMF), for bf16 and fp16."""
    fp32_flops: Rate
    """fp32 matmul FLOP/s (PyTorch leaves TF32 off: the CUDA-core peak, metrics.PEAK_FLOPS)."""
    memory_bytes_per_s: Rate
    """Device memory bandwidth: what memory-bound kernels (norms, elementwise, the optimizer) run at."""
    intra_node_bytes_per_s: Rate
    """Collective bus bandwidth between the GPUs of one node (nccl-tests' busbw)."""
    inter_node_bytes_per_s: Rate
    """Per-GPU bandwidth across nodes (one NIC per GPU): a ring across nodes runs at it."""
    host_to_device_bytes_per_s: Rate
    device_to_host_bytes_per_s: Rate
    host_cores: Rate
    """Host CPU cores per device: what DeepSpeed's CPU Adam of one rank runs on."""
    cpu_adam_params_per_s_per_core: Rate
    """DeepSpeed's CPU Adam (DeepSpeedCPUAdam) parameters updated per second per host core."""
    nvme_read_bytes_per_s: Rate
    nvme_write_bytes_per_s: Rate
    """One node's NVMe bandwidth, shared by its ranks (ZeRO-Infinity's swap files)."""
    step_overhead_s: Rate
    """Per optimizer step outside the model's kernels (Python, launches, the loss's reduction)."""
    # -- measured on CPU only (rate_probes.rank_rates, all the machine's ranks busy at once); None on GPU,
    # where the terms above stand for them
    elementwise_bytes_per_s: Optional[Rate] = None
    """The layer's memory-bound ops (norm, activation, softmax, residual) in the compute precision:
    what compute.py's memory-bound bytes run at (else memory_bytes_per_s)."""
    scores_bytes_per_s: Optional[Rate] = None
    """Unfused attention's mask and softmax over the [b, a, s, s] scores (else elementwise_bytes_per_s)."""
    loss_bytes_per_s: Optional[Rate] = None
    """The loss: the 16-bit logits upcast to fp32 and their cross-entropy (else elementwise_bytes_per_s)."""
    gather_bytes_per_s: Optional[Rate] = None
    """Bus bandwidth of all-gathers, reduce-scatters and all-to-alls where it differs from the
    all-reduce's intra_node_bytes_per_s (gloo's all-gather is its own algorithm)."""
    collective_latency_s: Optional[Rate] = None
    """What each collective call costs before its bytes (gloo's round trip)."""
    optimizer_params_per_s: Optional[Rate] = None
    """The optimizer the ranks step on CPU (torch.optim.AdamW: ds_configs/cpu.json's torch_adam,
    FSDP2's) per parameter; with it the device's step is timed by it, not by memory bandwidth."""
    optimizer_per_tensor_s: Optional[Rate] = None
    """What each tensor adds to that optimizer's step (its per-parameter loop)."""
    engine_points: tuple = ()
    """EnginePoint: timed calibration trials (gpt-tiny) per engine and ZeRO stage;
    where one matches a configuration, its engine term replaces the assumed step overhead."""

    def flops(self, precision: str) -> Rate:
        """The matmul rate a precision runs at."""
        return self.fp32_flops if precision == "fp32" else self.matmul_flops


# -- stated defaults: no published figure; `zero_bench calibrate` is to measure them ------------------
CPU_ADAM_PER_CORE = Rate(1e8, "assumed 1e8 params/s per core (not published: DeepSpeed PR #735's 1.4e9 params/s "
                              "per host would be 14 cores at this rate); to be calibrated")
STEP_OVERHEAD = Rate(0.01, "assumed 10 ms per optimizer step (Python, kernel launches, loss); to be calibrated")
# A data-centre PCIe gen4 NVMe drive: Samsung PM1733 datasheet, 7.0 GB/s sequential read, 3.8 GB/s write;
# the DGX datasheets list U.2 NVMe data drives (A100: 4 x 3.84 TB, H100/H200: 8 x 3.84 TB) without naming
# the model: one drive's figures are used per node (DeepSpeed's swapper writes one file per rank).
NVME_READ = Rate(7.0e9, "assumed one PCIe gen4 U.2 drive per node (Samsung PM1733 datasheet: 7.0 GB/s read)")
NVME_WRITE = Rate(3.8e9, "assumed one PCIe gen4 U.2 drive per node (Samsung PM1733 datasheet: 3.8 GB/s write)")

_MAMF = "stas00/ml-engineering MAMF table"
_NDR = Rate(46e9, "NDR 400 Gb/s InfiniBand, one NIC per GPU: ~46-48 GB/s measured per NIC (DGX H100/H200)")
_H100_HOST = dict(
    host_to_device_bytes_per_s=Rate(35e9, "nvbandwidth on H100 (PCIe gen5): ~35 GB/s host-to-device"),
    device_to_host_bytes_per_s=Rate(53e9, "nvbandwidth on H100 (PCIe gen5): ~53 GB/s device-to-host"),
    host_cores=Rate(14, "DGX H100/H200 datasheet: 2 x Xeon 8480C, 112 cores for 8 GPUs"))
_A100_SHARED = dict(
    inter_node_bytes_per_s=Rate(25e9, "DGX A100 datasheet: 8 x ConnectX-6 HDR 200 Gb/s, one per GPU (line rate)"),
    host_to_device_bytes_per_s=Rate(25e9, "nvbandwidth on A100 (PCIe gen4): ~25 GB/s"),
    device_to_host_bytes_per_s=Rate(25e9, "nvbandwidth on A100 (PCIe gen4): ~25 GB/s"),
    host_cores=Rate(16, "DGX A100 datasheet: 2 x EPYC 7742, 128 cores for 8 GPUs"),
    intra_node_bytes_per_s=Rate(200e9, "8 x A100 NVLink all-reduce busbw ~200 GB/s (NVIDIA/nccl-tests#149)"),
    matmul_flops=Rate(267.9e12, f"{_MAMF}: A100 SXM 267.9 TFLOP/s bf16"),
    fp32_flops=Rate(19.5e12, "A100 fp32 CUDA-core peak (metrics.PEAK_FLOPS)"))
_COMMON = dict(cpu_adam_params_per_s_per_core=CPU_ADAM_PER_CORE, nvme_read_bytes_per_s=NVME_READ,
               nvme_write_bytes_per_s=NVME_WRITE, step_overhead_s=STEP_OVERHEAD)

# The words of the card's name each entry is for (all of them in it), first match wins (as PEAK_FLOPS).
GPU_RATES: list[tuple[tuple[str, ...], HardwareRates]] = [
    (("H200",), HardwareRates(
        "H200", matmul_flops=Rate(792.1e12, f"{_MAMF} has no H200 row: the H100 SXM's 792.1 TFLOP/s (same compute)"),
        fp32_flops=Rate(67e12, "H200 fp32 CUDA-core peak (metrics.PEAK_FLOPS)"),
        memory_bytes_per_s=Rate(4.8e12, "H200 datasheet: 4.8 TB/s HBM3e"),
        intra_node_bytes_per_s=Rate(482e9, "8 x H200 NCCL all-reduce busbw 482 GB/s at 16 GiB (ml-engineering)"),
        inter_node_bytes_per_s=_NDR, **_H100_HOST, **_COMMON)),
    (("H100",), HardwareRates(
        "H100 SXM", matmul_flops=Rate(792.1e12, f"{_MAMF}: H100 SXM 792.1 TFLOP/s bf16"),
        fp32_flops=Rate(67e12, "H100 SXM fp32 CUDA-core peak (metrics.PEAK_FLOPS)"),
        memory_bytes_per_s=Rate(3.35e12, "H100 SXM datasheet: 3.35 TB/s HBM3"),
        intra_node_bytes_per_s=Rate(476e9, "8 x H100 NVLS all-reduce busbw ~476 GB/s (NVIDIA/nccl-tests#290)"),
        inter_node_bytes_per_s=_NDR, **_H100_HOST, **_COMMON)),
    (("A100", "80GB"), HardwareRates(
        "A100 80GB", memory_bytes_per_s=Rate(2.039e12, "A100 80GB SXM datasheet: 2,039 GB/s HBM2e"),
        **_A100_SHARED, **_COMMON)),
    (("A100",), HardwareRates(
        "A100 40GB", memory_bytes_per_s=Rate(1.555e12, "A100 40GB SXM datasheet: 1,555 GB/s HBM2"),
        **_A100_SHARED, **_COMMON)),
]


def gpu_rates(card: Optional[str]) -> Optional[HardwareRates]:
    """The rates of a card named like NVML names it ("NVIDIA H100 80GB HBM3") or as a preset's
    hardware.card; None when no entry's words are all in it."""
    if not card:
        return None
    words = set(card.upper().replace("-", " ").split())
    for key, rates in GPU_RATES:
        if all(any(k in w for w in words) for k in key):
            return rates
    return None


# -- this CPU: the matmul rate measured, the rest stated defaults until calibrate measures them -------
CPU_DEFAULTS = dict(
    memory_bytes_per_s=Rate(10e9, "assumed 10 GB/s per rank for memory-bound ops; to be calibrated"),
    intra_node_bytes_per_s=Rate(2e9, "assumed 2 GB/s gloo bus bandwidth between ranks; to be calibrated"),
    inter_node_bytes_per_s=Rate(1e9, "assumed 1 GB/s gloo across hosts; to be calibrated"),
    host_to_device_bytes_per_s=Rate(10e9, "assumed 10 GB/s host copy (CPU: offload is a copy in RAM); to be calibrated"),
    device_to_host_bytes_per_s=Rate(10e9, "assumed 10 GB/s host copy (CPU: offload is a copy in RAM); to be calibrated"),
    host_cores=Rate(1, "one rank's threads (OMP_NUM_THREADS, 1 by default)"),
    **_COMMON)


def cpu_rates(bench: BenchConfig, measured: Optional[dict] = None) -> HardwareRates:
    """One CPU rank's rates: what `zero_bench calibrate` measured here (the matmul rate, memory
    bandwidth, CPU Adam, and the ranks' own rates: devices/calibration.py), else
    metrics.cpu_peak_flops for the matmul (cached per machine, measured on first use) and CPU_DEFAULTS
    for the rest. `measured`: the same figures from elsewhere (a benchmark measuring them itself):
    {"matmul_flops": {precision: FLOP/s}, "memory_bytes_per_s": ..., "cpu_adam_params_per_s": ...,
    "ranks": rate_probes.RankRates.to_dict(), "said": how they were measured}.

    The ranks' rates (rate_probes.rank_rates: every rank of the machine running the probe at once)
    replace the single-rank ones where their precision is the configuration's: the matmul rate, the
    memory-bound ops' rate, gloo's all-reduce and all-gather bandwidth and latency, torch AdamW."""
    from zero_bench.devices import calibration
    from zero_bench.devices.metrics import cpu_peak_flops

    if measured is None:
        cal = calibration.for_bench(bench)
        measured = {} if cal is None else {"matmul_flops": cal.matmul_flops, "memory_bytes_per_s": cal.memory_bytes_per_s,
                                           "cpu_adam_params_per_s": cal.cpu_adam_params_per_s,
                                           "ranks": cal.rank_rates, "engine": cal.engine_points, "said": cal.said}
    said, prec = measured.get("said", "measured here"), str(bench.precision)
    got = measured.get("matmul_flops") or {}
    flops = (Rate(got[prec], f"{prec} F.linear 1024^2 on one rank, {said}", calibrated=True) if prec in got else
             Rate(cpu_peak_flops(prec)["flops"], f"{prec} F.linear 1024^2 on one rank, measured here (cpu_peak.json)",
                  calibrated=True))
    rates = dict(CPU_DEFAULTS)
    if measured.get("memory_bytes_per_s"):
        mem = Rate(measured["memory_bytes_per_s"], f"fp32 add on one rank, {said}", calibrated=True)
        rates.update(memory_bytes_per_s=mem, host_to_device_bytes_per_s=mem, device_to_host_bytes_per_s=mem)
    if measured.get("cpu_adam_params_per_s"):
        rates["cpu_adam_params_per_s_per_core"] = Rate(measured["cpu_adam_params_per_s"] / rates["host_cores"].value,
                                                       f"DeepSpeedCPUAdam on one rank, {said}", calibrated=True)
    ranks = measured.get("ranks") or {}
    if ranks and ranks.get("precision") == prec:
        flops, more = rank_rates_of(ranks, said)
        rates.update(more)
    rates["engine_points"] = engine_points_of(measured.get("engine") or [])
    return HardwareRates("this CPU", matmul_flops=flops, fp32_flops=flops, **rates)


def engine_points_of(stored: list) -> tuple:
    """EnginePoints of stored dicts (a calibration's, a benchmark's)."""
    return tuple(p if isinstance(p, EnginePoint) else EnginePoint.from_dict(p) for p in stored)


# stored RankRates key -> (HardwareRates field, what the probe ran; "{p}": the precision). The first three
# every stored figure has; the others are left out of figures stored before they were probed (the
# layers' mix and the stated defaults stand in).
RANK_PROBES = {
    "elementwise_bytes_per_s": ("elementwise_bytes_per_s",
                                "{p} norm + GeLU + softmax + add forward and backward on [1024, 1024]"),
    "adam_params_per_s": ("optimizer_params_per_s", "torch AdamW on one 4M fp32 tensor"),
    "adam_per_tensor_s": ("optimizer_per_tensor_s", "torch AdamW's per-tensor cost (64 x 1024 tensors)"),
    "scores_bytes_per_s": ("scores_bytes_per_s",
                           "{p} masked_fill + softmax forward and backward on [4, 4, 256, 256] scores"),
    "loss_bytes_per_s": ("loss_bytes_per_s",
                         "{p} [256, 4, 8192] logits to fp32 + cross-entropy forward and backward"),
    "all_reduce_bytes_per_s": ("intra_node_bytes_per_s", "gloo all-reduce busbw of 16 MB fp32"),
    "all_gather_bytes_per_s": ("gather_bytes_per_s", "gloo all-gather busbw of 16 MB fp32"),
    "collective_latency_s": ("collective_latency_s", "gloo one-element all-reduce"),
}


def rank_rates_of(r: dict, said: str) -> tuple[Rate, dict]:
    """(the matmul rate, the other HardwareRates fields) of a rate_probes.RankRates' figures."""
    p = r["precision"]
    together = f"{r['ranks']} ranks at once, {r['threads']} thread(s) each"
    out = {field: Rate(r[key], f"{what.format(p=p)}, {together}, {said}", calibrated=True)
           for key, (field, what) in RANK_PROBES.items() if r.get(key)}
    flops = Rate(r["matmul_flops"], f"{p} F.linear 1024^2, {together}, {said}", calibrated=True)
    return flops, out


def rates_for(bench: BenchConfig) -> Optional[HardwareRates]:
    """The rates an estimate of `bench` uses: the preset's card on GPU, this CPU's on CPU; None: a GPU
    with no card named (hardware=gpu) or one not in GPU_RATES."""
    if bench.hardware.device == Device.cpu:
        return cpu_rates(bench)
    return gpu_rates(bench.hardware.card)


def with_rate(rates: HardwareRates, **changed: Rate) -> HardwareRates:
    """A copy with some rates replaced (a calibration, a test)."""
    return replace(rates, **changed)
