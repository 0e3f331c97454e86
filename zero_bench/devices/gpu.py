"""One rank's GPU: which device, the emulated capacity, and its memory as CUDA and NVML see it.

Runs inside a rank (worker.py), on whichever node the rank is on. The runner hands the GPUs of a
node in ZERO_BENCH_DEVICES, spelled as CUDA_VISIBLE_DEVICES spells them (indices, UUIDs, MIG
UUIDs); `select_devices` makes that the rank's CUDA_VISIBLE_DEVICES before CUDA starts, and the
rank uses CUDA index = its local rank. Its NVML device is found by that exact entry (a MIG slice
reports its own memory), else by the UUID / PCI bus id torch reports.

Three views of one device's memory, kept apart:
- CUDA's (torch.cuda.mem_get_info: cudaMemGetInfo): `total` leaves out what the driver reserves;
  it is the total torch's memory fraction multiplies, and the one a real smaller card is compared by.
- torch's caching allocator: reserved (segments) and allocated bytes; the fraction caps reserved.
- NVML's (nvidia-smi's "used", v2), device-wide: every process on the GPU counts.
"Outside the allocator" is CUDA's used minus torch's reserved minus what other processes held
before this rank started (`others`): the CUDA context, NCCL, cuBLAS handles, loaded kernels.

A thread reads the device's NVML used bytes every 50 ms: the peak over each plan entry goes into
the rank's record, so every node's GPUs are reported by the ranks on them.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

from zero_bench.devices.capacity import memory_fraction
from zero_bench.devices.nvml import Gpu, Mem, Nvml, torch_identity
from zero_bench.units import GiB, MiB

DEVICES_ENV = "ZERO_BENCH_DEVICES"
# An allocation failure is likely when less than this is free on the device (cuBLAS creates its
# handle with cudaMalloc, outside torch's cache: on a full card that fails as NOT_INITIALIZED).
NEAR_FULL_FREE = 1 * GiB
NEAR_CAP_MARGIN = 256 * MiB  # under emulation: this close to the capacity counts as full
# Growth outside the allocator after the fraction was set that is worth setting it again for.
REFRESH_GROWTH = 16 * MiB
# Another process's CUDA context alone is a few hundred MiB: less than this held by others before
# the rank started is the driver's own bookkeeping, not a second user of the GPU.
SHARED_OTHERS = 256 * MiB


def select_devices(env: dict = os.environ) -> Optional[str]:
    """Make the runner's device list this process's CUDA_VISIBLE_DEVICES (before CUDA starts).

    GPU UUIDs become NVML indices under CUDA_DEVICE_ORDER=PCI_BUS_ID (NVML's order): DeepSpeed's
    CUDA accelerator runs int() on every CUDA_VISIBLE_DEVICES entry (cuda_accelerator.py,
    _get_nvml_gpu_id: `ids = list(map(int, ...split(",")))`), which a UUID would crash. MIG
    slices keep their UUIDs (CUDA names a slice no other way); RankGpu answers DeepSpeed's
    available_memory for them instead. ZERO_BENCH_DEVICES keeps the user's spelling. Indices, the
    user's too, are nvidia-smi's (PCI bus order), as the runner's NVML sampler resolves them: CUDA's
    default FASTEST_FIRST would put another of mixed GPUs under the same index (launcher.gpu_order_env
    sets the same for every rank; set here too, where the index is chosen)."""
    devices = env.get(DEVICES_ENV)
    if not devices:
        return devices
    indices = nvml_indices(devices)
    if not any(t.strip().upper().startswith("MIG-") for t in devices.split(",")):
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = devices if indices is None else ",".join(map(str, indices))
    return devices


def nvml_indices(devices: str) -> Optional[list[int]]:
    """The NVML indices of a device list naming GPUs by UUID; None where it stays as it is:
    indices only, any MIG slice, or an entry NVML cannot resolve (CUDA then decides, as before)."""
    tokens = [t.strip() for t in devices.split(",")]
    if all(t.isdigit() for t in tokens) or any(t.upper().startswith("MIG-") for t in tokens):
        return None
    n = Nvml(visible="")
    try:
        if n.nv is None:
            return None
        return [n.resolve(t).nvml_index for t in tokens]
    except Exception:  # noqa: BLE001 - LookupError, NVMLError: leave the list to CUDA
        return None
    finally:
        n.close()  # the rank's own NVML use starts later, in this process or a pool's child


def rank_token(local_rank: int) -> Optional[str]:
    """This rank's entry of the runner's device list (the user's spelling), if there is one."""
    tokens = (os.environ.get(DEVICES_ENV) or "").split(",")
    if local_rank >= len(tokens):
        return None
    return tokens[local_rank].strip() or None


def find_device(nvml: Nvml, local_rank: int, props=None) -> Optional[Gpu]:
    """The rank's NVML device: by its UUID entry (exact: a MIG slice is its own device), else by
    torch's identity of the device (`props`, once CUDA runs), else by CUDA index = local rank."""
    if nvml.nv is None:
        return None
    token = rank_token(local_rank)
    if token and token.upper().startswith(("MIG-", "GPU-")):
        try:
            return nvml.resolve(token)
        except Exception:  # noqa: BLE001 - LookupError or NVMLError: fall back to the identity
            pass
    uuid, pci = torch_identity(props) if props is not None else (None, None)
    return nvml.for_rank(local_rank, uuid, pci, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))


def baseline(local_rank: int) -> Optional[Mem]:
    """NVML's view of the rank's device before this process touched CUDA: what other processes
    hold there. Call it before the first CUDA call (deepspeed.init_distributed forms NCCL's
    communicator on the device)."""
    n = Nvml()
    try:
        gpu = find_device(n, local_rank)
        return n.memory(gpu) if gpu is not None else None
    finally:
        n.close()


def others_bytes(base: Optional[Mem], nvml_total: Optional[int], cuda_total: int) -> int:
    """Bytes other processes held at the baseline, as CUDA counts used memory (without the
    driver's reserve). v2's used already leaves the reserve out; v1's includes it, and the reserve
    is then NVML's total minus CUDA's."""
    if base is None:
        return 0
    if base.reserved is not None or nvml_total is None:
        return base.used
    return max(0, base.used - max(0, nvml_total - cuda_total))


def near_full(cuda, device: int, cap: Optional[int] = None, others: int = 0) -> bool:
    """Is the device (or, under emulation, the emulated card) close to full right now?"""
    free, total = cuda.mem_get_info(device)
    if free < NEAR_FULL_FREE:
        return True
    return bool(cap) and total - free - others > cap - NEAR_CAP_MARGIN


class RankGpu:
    """The GPU of one rank: set as torch's device, capped when a smaller card is emulated, sampled."""

    def __init__(self, torch, local_rank: int, cap: Optional[int], base: Optional[Mem] = None,
                 interval: float = 0.05):
        self.torch, self.local_rank, self.cap, self.interval = torch, local_rank, cap, interval
        cuda = torch.cuda
        cuda.set_device(local_rank)
        self.nvml = Nvml()
        self.gpu = find_device(self.nvml, local_rank, cuda.get_device_properties(local_rank))
        mem = self.nvml.memory(self.gpu) if self.gpu is not None else None
        # the total torch's memory fraction multiplies (CUDACachingAllocator: cudaMemGetInfo's total)
        self.cuda_total = int(cuda.mem_get_info(local_rank)[1])
        # the card's own total as NVML reports it (a MIG slice's, not its parent's), else CUDA's
        self.card = mem.total if mem else self.cuda_total
        self.others = others_bytes(base, mem.total if mem else None, self.cuda_total)
        self.fraction: Optional[float] = None
        self.outside_at_emulate = 0
        self.peak = 0
        self._stop = threading.Event()
        self.sampler: Optional[threading.Thread] = None
        if self.gpu is not None and interval:
            self.sampler = threading.Thread(target=self._sample, daemon=True, name="zero_bench-gpu-peak")
            self.sampler.start()

    def close(self) -> None:
        """Stop the NVML sampling thread (a rank process ends with it anyway)."""
        self._stop.set()
        if self.sampler is not None:
            self.sampler.join(timeout=5)

    # -- CUDA's view ----------------------------------------------------------------------------
    def outside_now(self) -> int:
        """This rank's device memory outside torch's allocator (context, NCCL, cuBLAS, kernels)."""
        free, total = self.torch.cuda.mem_get_info(self.local_rank)
        return max(0, (total - free) - self.torch.cuda.memory_reserved(self.local_rank) - self.others)

    def emulate(self) -> None:
        """Cap torch's allocator so that it plus what lives outside it (measured now) stays within
        the emulated card. Called after init and again after the engine is built, when NCCL's
        communicators exist; `refresh` follows growth after that."""
        outside = self.outside_now()
        f = memory_fraction(self.cap, self.cuda_total, outside)
        if f is not None:
            self.torch.cuda.set_per_process_memory_fraction(f, self.local_rank)
            self.fraction, self.outside_at_emulate = f, outside

    def refresh(self) -> bool:
        """After an entry's first step: memory outside the allocator that appeared since the
        fraction was set (NCCL connects its buffers at the first collective that needs them,
        kernels load lazily, autograd's thread makes its own cuBLAS handle) would make the emulated
        card larger than asked. Lower the fraction by that growth; blocks cached above the new
        limit stay usable, so the cache is emptied first. True if the fraction changed."""
        if self.fraction is None or self.outside_now() <= self.outside_at_emulate + REFRESH_GROWTH:
            return False
        self.torch.cuda.empty_cache()
        self.emulate()
        return True

    def available_memory(self, device_index: Optional[int] = None) -> int:
        """DeepSpeed's accelerator.available_memory for this rank, from CUDA's view: free memory
        plus torch's cache, and under emulation no more than the fraction leaves. DeepSpeed's own
        reads NVML by an int() of CUDA_VISIBLE_DEVICES (no MIG) and NVML's free of the whole card."""
        cuda = self.torch.cuda
        i = self.local_rank if device_index is None else device_index
        free, total = cuda.mem_get_info(i)
        allocated = cuda.memory_allocated(i)
        avail = free + cuda.memory_reserved(i) - allocated
        if self.fraction is not None and i == self.local_rank:
            avail = min(avail, int(self.fraction * total) - allocated)
        return max(avail, 0)

    def serve_deepspeed(self, accelerator) -> None:
        """Answer DeepSpeed's available_memory (ZeRO-1/2 ask it in DeepSpeedZeroOptimizer.__init__
        whether to flatten on the GPU) for this rank's device. An instance attribute: stage_1_and_2
        calls it on the accelerator object."""
        if getattr(accelerator, "_name", None) == "cuda":
            accelerator.available_memory = self.available_memory

    def near_full(self) -> bool:
        return near_full(self.torch.cuda, self.local_rank, self.cap if self.fraction is not None else None,
                         self.others)

    # -- NVML's view ----------------------------------------------------------------------------
    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            mem = self.nvml.memory(self.gpu)
            if mem:
                self.peak = max(self.peak, mem.used)

    def reset_peak(self) -> None:
        mem = self.nvml.memory(self.gpu) if self.gpu is not None else None
        self.peak = mem.used if mem else 0

    def record(self, peak_reserved: Optional[int] = None) -> dict:
        """What a RankRecord carries about this GPU; with torch's peak reserved bytes (an entry's
        end) also the device peak the capacity is compared with."""
        outside = self.outside_now()
        out = {"gpu_card_bytes": self.card, "cuda_total_bytes": self.cuda_total, "memory_fraction": self.fraction,
               "outside_bytes": outside, "gpu_others_bytes": self.others, **self._nvml_fields()}
        if peak_reserved is not None:
            # reserved + what is outside now: the outside part only grows (contexts, communicators)
            out["device_peak_bytes"] = max(peak_reserved + outside, out.get("nvml_peak_bytes") or 0)
        return out

    def _nvml_fields(self) -> dict:
        if self.gpu is None:
            return {"nvml_error": self.nvml.error or f"no NVML device for local rank {self.local_rank}"}
        out = {"gpu_uuid": self.gpu.uuid, "gpu_pci_bus_id": self.gpu.pci_bus_id, "gpu_name": self.gpu.name}
        mem = self.nvml.memory(self.gpu)
        if not mem:
            return {**out, "nvml_error": self.nvml.error or "NVML did not answer"}
        # the rank's own share: without other processes, and (v1 only) without the driver's reserve
        not_ours = self.others + (0 if mem.reserved is not None else max(0, mem.total - self.cuda_total))
        out.update(nvml_used_bytes=mem.used, nvml_total_bytes=mem.total, nvml_used_v1_bytes=mem.used_v1,
                   nvml_reserved_bytes=mem.reserved, nvml_v2=self.nvml.v2,
                   nvml_peak_bytes=max(0, max(self.peak, mem.used) - not_ours))
        procs = self.nvml.processes(self.gpu)
        if procs is not None:
            out["gpu_processes"] = len(procs)
        # NVML's figures are device-wide: say so when this rank is not alone on the GPU
        out["gpu_shared"] = len(procs or ()) > 1 or self.others >= SHARED_OTHERS
        return out
