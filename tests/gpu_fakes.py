"""The two seams of the GPU path, faked: NVML (`zero_bench.devices.nvml.nvml_module`) and torch.cuda.

`fake_pynvml` is a module object with pynvml's real function names, exception classes and structs
(c_nvmlMemory_t, c_nvmlMemory_v2_t), so that what the code catches is what a real driver raises.
`FakeCuda` is torch.cuda as one rank sees it. Both read the same device list, so CUDA's and NVML's
views agree the way nvml.h and cudaMemGetInfo say they do:

  device tuple: (name, uuid, (pci domain, bus, device), NVML total, NVML v1 used)
  NVML v2 used  = v1 used - reserved          (nvml.h: v1 used "Sum of Reserved and Allocated")
  CUDA total    = NVML total - reserved       (cudaMemGetInfo leaves the driver's reserve out)
  CUDA used     = v2 used + torch's reserved  (the fake's NVML used is what is outside torch)

The device list may be changed in place by a test (another process starts, NCCL grows).
"""
from __future__ import annotations

import os
import types
from typing import Optional

import pynvml

from zero_bench.devices.nvml import norm_pci

GiB, MiB = 2**30, 2**20

# name, uuid, (domain, bus, device), total, used (v1)
A100 = [("NVIDIA A100-SXM4-40GB", "GPU-1a2b3c4d-0000-1111-2222-333344445555", (0, 0x07, 0), 40 * GiB, 1 * GiB),
        ("NVIDIA A100-SXM4-40GB", "GPU-5e6f7a8b-0000-1111-2222-333344445555", (0, 0x0F, 0), 40 * GiB, 2 * GiB),
        ("NVIDIA A100-SXM4-40GB", "GPU-9c0d1e2f-0000-1111-2222-333344445555", (0, 0x47, 0), 40 * GiB, 3 * GiB),
        ("NVIDIA A100-SXM4-40GB", "GPU-1a2bffff-0000-1111-2222-333344445555", (0, 0x4E, 0), 40 * GiB, 4 * GiB)]
EIGHT = [("NVIDIA A100-SXM4-80GB", f"GPU-{i:08x}-0000-1111-2222-333344445555", (0, 0x10 + i, 0), 80 * GiB,
          (i + 1) * GiB) for i in range(8)]

FAKE_NAMES = ("nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount",
              "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByPciBusId",
              "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo", "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo",
              "nvmlDeviceGetComputeRunningProcesses")
ERRORS = ("NVMLError", "NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_Uninitialized",
          "NVMLError_GpuIsLost", "NVMLError_NotFound", "NVMLError_InvalidArgument", "NVMLError_NoPermission",
          "NVMLError_FunctionNotFound", "NVMLError_ArgumentVersionMismatch", "NVMLError_NotSupported",
          "NVMLError_Unknown")


class FakeHandle:
    def __init__(self, idx: int):
        self.idx = idx


def fake_pynvml(devices=A100, init_error: Optional[str] = None, mig: Optional[dict] = None, reserved: int = 0,
                v2: bool = True, fork_unsafe: bool = False) -> types.ModuleType:
    """A module object shaped like pynvml. `reserved`: the driver's reserve per device (v2 only);
    `v2=False`: a driver without nvmlDeviceGetMemoryInfo_v2; `fork_unsafe`: calls fail in a process
    that did not itself initialise NVML (an inherited count only bumps, nvml.h: nvmlShutdown)."""
    nv = types.ModuleType("pynvml")
    for name in ERRORS:
        setattr(nv, name, getattr(pynvml, name))  # the real classes: code catching them sees the real thing
    nv.nvmlMemory_v2 = pynvml.nvmlMemory_v2
    state = {"init": 0, "init_pid": None, "lost": set(), "calls": [], "procs": {}}
    nv.state = state

    def api(fn):
        def wrapped(*a, **kw):
            state["calls"].append(fn.__name__)
            if fn.__name__ != "nvmlInit":
                if not state["init"]:
                    raise pynvml.NVMLError_Uninitialized()
                if fork_unsafe and state["init_pid"] != os.getpid():
                    raise pynvml.NVMLError_Unknown()
            return fn(*a, **kw)
        wrapped.__name__ = fn.__name__
        setattr(nv, fn.__name__, wrapped)
        return wrapped

    def _dev(h):
        if h.idx in state["lost"]:
            raise pynvml.NVMLError_GpuIsLost()
        return devices[h.idx]

    @api
    def nvmlInit():
        if init_error:
            raise getattr(pynvml, init_error)()
        if not state["init"]:
            state["init_pid"] = os.getpid()
        state["init"] += 1

    @api
    def nvmlShutdown():
        state["init"] -= 1

    @api
    def nvmlSystemGetDriverVersion():
        return "550.54.15"

    @api
    def nvmlDeviceGetCount():
        return len(devices)

    @api
    def nvmlDeviceGetHandleByIndex(i):
        if not 0 <= i < len(devices):
            raise pynvml.NVMLError_InvalidArgument()
        return FakeHandle(i)

    @api
    def nvmlDeviceGetHandleByUUID(uuid):
        for i, d in enumerate(devices):
            if d[1] == uuid:
                return FakeHandle(i)
        if mig and uuid in mig:
            return FakeHandle(mig[uuid])
        raise pynvml.NVMLError_NotFound()

    @api
    def nvmlDeviceGetHandleByPciBusId(bus):
        for i, d in enumerate(devices):
            if norm_pci(bus) == "%04x:%02x:%02x.0" % d[2]:
                return FakeHandle(i)
        raise pynvml.NVMLError_NotFound()

    @api
    def nvmlDeviceGetUUID(h):
        return _dev(h)[1]

    @api
    def nvmlDeviceGetName(h):
        return _dev(h)[0]

    @api
    def nvmlDeviceGetPciInfo(h):
        info = pynvml.nvmlPciInfo_t()
        dom, bus, dev = _dev(h)[2]
        info.domain, info.bus, info.device = dom, bus, dev
        info.busId = b"%08X:%02X:%02X.0" % (dom, bus, dev)  # NVML's spelling: 8-digit domain, upper case
        return info

    @api
    def nvmlDeviceGetMemoryInfo(h, version=None):
        d = _dev(h)
        if not version:
            m = pynvml.c_nvmlMemory_t()
            m.total, m.used, m.free = d[3], d[4], d[3] - d[4]
            return m
        if not v2:  # what pynvml raises when libnvidia-ml has no nvmlDeviceGetMemoryInfo_v2
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        m = pynvml.c_nvmlMemory_v2_t()
        m.version, m.total, m.reserved = version, d[3], reserved
        m.used, m.free = d[4] - reserved, d[3] - d[4]
        return m

    @api
    def nvmlDeviceGetComputeRunningProcesses(h):
        _dev(h)
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in state["procs"].get(h.idx, [])]

    return nv


class FakeCuda:
    """torch.cuda as a rank sees it: its devices are CUDA_VISIBLE_DEVICES' entries, in order (an
    index, or a MIG UUID found in `mig`). `reserved` / `allocated`: torch's caching allocator;
    `driver`: the driver's reserve (as given to fake_pynvml), left out of CUDA's total."""

    def __init__(self, devices, reserved: int = 0, allocated: Optional[int] = None, driver: int = 0,
                 mig: Optional[dict] = None):
        self.devices, self.reserved, self.driver, self.mig = devices, reserved, driver, mig or {}
        self.allocated = reserved if allocated is None else allocated
        self.calls: dict = {}
        self.log: list = []  # (call, args) in order

    def _visible(self):
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if not env:
            return list(self.devices)
        return [self.mig[t] if t in self.mig else self.devices[int(t)] for t in env.split(",")]

    def _dev(self, i):
        return self._visible()[self.calls.get("device", 0) if i is None else i]

    def set_device(self, i):
        self.calls["device"] = i

    def current_device(self):
        return self.calls.get("device", 0)

    def is_initialized(self):
        return True

    def get_device_properties(self, i):
        d = self._dev(i)
        return types.SimpleNamespace(uuid=d[1][4:], pci_domain_id=d[2][0], pci_bus_id=d[2][1], pci_device_id=d[2][2],
                                     total_memory=d[3] - self.driver, name=d[0])

    def mem_get_info(self, i=None):
        d = self._dev(i)
        total = d[3] - self.driver
        return total - (d[4] - self.driver) - self.reserved, total

    def memory_reserved(self, i=None):
        return self.reserved

    def memory_allocated(self, i=None):
        return self.allocated

    def reset_peak_memory_stats(self, i=None):
        self.log.append(("reset_peak", ()))

    def max_memory_allocated(self, i=None):
        return self.allocated

    def empty_cache(self):
        self.log.append(("empty_cache", ()))

    def set_per_process_memory_fraction(self, f, i=None):
        if not isinstance(f, float):  # torch/cuda/memory.py: "Invalid type for fraction argument"
            raise TypeError("Invalid type for fraction argument, must be `float`")
        self.calls["fraction"] = (f, i)
        self.log.append(("fraction", (f, i)))
