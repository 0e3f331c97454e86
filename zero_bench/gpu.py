"""One rank's GPU: which device, the emulated capacity, and its memory as NVML sees it.

Runs inside a rank (worker.py), on whichever node the rank is on. The runner hands the GPUs of a
node in ZERO_BENCH_DEVICES, spelled as CUDA_VISIBLE_DEVICES spells them (indices, UUIDs, MIG
UUIDs); `select_devices` makes that the rank's CUDA_VISIBLE_DEVICES before CUDA starts, and the
rank uses CUDA index = its local rank. Its NVML device is found by that exact entry (a MIG slice
reports its own memory), else by the UUID / PCI bus id torch reports.

A thread reads the device's NVML used bytes every 50 ms: the peak over each plan entry goes into
the rank's record, so every node's GPUs are reported by the ranks on them.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

from zero_bench.capacity import memory_fraction
from zero_bench.nvml import Nvml, torch_identity

DEVICES_ENV = "ZERO_BENCH_DEVICES"


def select_devices(env: dict = os.environ) -> Optional[str]:
    """Make the runner's device list this process's CUDA_VISIBLE_DEVICES (before CUDA starts)."""
    devices = env.get(DEVICES_ENV)
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return devices


class RankGpu:
    """The GPU of one rank: set as torch's device, capped when a smaller card is emulated, sampled."""

    def __init__(self, torch, local_rank: int, cap: Optional[int], interval: float = 0.05):
        self.torch, self.local_rank, self.cap, self.interval = torch, local_rank, cap, interval
        torch.cuda.set_device(local_rank)
        tokens = (os.environ.get(DEVICES_ENV) or "").split(",")
        self.token = tokens[local_rank] if local_rank < len(tokens) and tokens[local_rank] else None
        self.nvml = Nvml()
        self.gpu = self._find(torch.cuda.get_device_properties(local_rank))
        mem = self.nvml.memory(self.gpu) if self.gpu is not None else None
        # the card's own total: NVML's (a MIG slice's, not its parent's), else torch's
        self.card = mem[1] if mem else torch.cuda.get_device_properties(local_rank).total_memory
        self.fraction: Optional[float] = None
        self.peak = 0
        self._stop = threading.Event()
        if self.gpu is not None and interval:
            threading.Thread(target=self._sample, daemon=True, name="zero_bench-gpu-peak").start()

    def _find(self, props):
        if self.nvml.nv is None:
            return None
        if self.token and self.token.upper().startswith(("MIG-", "GPU-")):
            try:
                return self.nvml.resolve(self.token)
            except (LookupError, Exception):  # noqa: BLE001 - fall back to torch's identity
                pass
        uuid, pci = torch_identity(props)
        return self.nvml.for_rank(self.local_rank, uuid, pci, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def emulate(self) -> None:
        """Cap torch's allocator so that it plus what lives outside it (context, NCCL, cuBLAS,
        measured now) stays within the emulated card. Called after init and again after the engine
        is built, when NCCL's buffers exist."""
        mem = self.nvml.memory(self.gpu) if self.gpu is not None else None
        outside = (mem[0] - self.torch.cuda.memory_reserved(self.local_rank)) if mem else 0
        f = memory_fraction(self.cap, self.card, outside)
        if f is not None:
            self.torch.cuda.set_per_process_memory_fraction(f, self.local_rank)
            self.fraction = f

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            mem = self.nvml.memory(self.gpu)
            if mem:
                self.peak = max(self.peak, mem[0])

    def reset_peak(self) -> None:
        mem = self.nvml.memory(self.gpu) if self.gpu is not None else None
        self.peak = mem[0] if mem else 0

    def record(self) -> dict:
        """What a RankRecord carries about this GPU."""
        if self.gpu is None:
            return {"nvml_error": self.nvml.error or f"no NVML device for local rank {self.local_rank}"}
        out = {"gpu_uuid": self.gpu.uuid, "gpu_pci_bus_id": self.gpu.pci_bus_id, "gpu_name": self.gpu.name,
               "gpu_card_bytes": self.card, "memory_fraction": self.fraction}
        mem = self.nvml.memory(self.gpu)
        if mem:
            out["nvml_used_bytes"], out["nvml_total_bytes"] = mem
            out["nvml_peak_bytes"] = max(self.peak, mem[0])
        elif self.nvml.error:
            out["nvml_error"] = self.nvml.error
        return out
