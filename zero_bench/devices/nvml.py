"""NVML, the one seam to the GPUs: devices of this node, mapped to the CUDA indices ranks use.

`nvml_module()` returns the real pynvml (package nvidia-ml-py); tests replace it with a fake that
carries pynvml's names. Every NVML failure becomes a message, never a crash or a zero.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple, Optional


def nvml_module():
    """The seam: the real pynvml (package nvidia-ml-py)."""
    import pynvml

    return pynvml


@dataclass
class Gpu:
    """One NVML device of this node, with the identities CUDA_VISIBLE_DEVICES and torch use."""
    nvml_index: int
    uuid: str  # "GPU-8b5c..." (MIG instances: "MIG-...")
    pci_bus_id: str  # normalised "dddd:bb:dd.f", lower case
    name: str
    handle: object = field(repr=False, default=None)


def norm_pci(bus_id) -> str:
    """'00000000:3B:00.0' (NVML), '0000:3b:00.0' (CUDA), '3b:00.0', b'...' -> '0000:3b:00.0'."""
    text = (bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)).strip().lower()
    parts = text.split(":")
    if len(parts) == 2:
        parts = ["0"] + parts
    try:
        dom, bus, devfn = parts
        dev, _, fn = devfn.partition(".")
        return f"{int(dom, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn or '0', 16)}"
    except ValueError:
        return text


class Mem(NamedTuple):
    """One device's memory as NVML reports it, in bytes.

    `used` is nvidia-smi's "used": nvmlMemory_v2_t.used, "Allocated device memory" (nvml.h).
    `used_v1` is nvmlMemory_t.used, "Sum of Reserved and Allocated device memory": it also counts
    `reserved`, memory the driver or firmware keeps for itself (~0.4-0.9 GiB on recent drivers).
    A driver without the v2 call gives v1 only: then used == used_v1 and reserved is None.
    """
    used: int
    total: int
    reserved: Optional[int]
    used_v1: int


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Nvml:
    """GPUs of this node as NVML sees them, mapped to CUDA indices the way CUDA maps them.

    CUDA_VISIBLE_DEVICES may name GPUs by index, by UUID (full or a unique prefix, with or without
    "GPU-") or by MIG UUID; CUDA stops at the first entry it cannot resolve. NVML numbers devices
    in PCI bus order, CUDA by default "fastest first": the two agree on a node of identical GPUs
    or under CUDA_DEVICE_ORDER=PCI_BUS_ID, which every zero_bench GPU rank runs under
    (launcher.gpu_order_env), so an index means nvidia-smi's GPU for the runner's sampler and the
    ranks alike; a process without it (mixed models) is told in `note`. A rank that knows its
    device's UUID or PCI bus id (torch.cuda.get_device_properties) is matched by that instead:
    `for_rank`.

    Every NVML failure becomes `self.error` (a message) and the device or the whole GPU path is
    left out: a trial never crashes and never reports zeros because of NVML. NVML reads only the
    GPUs of the node it runs on: on a multi-node run each node's ranks read their own (`for_rank`).
    """

    def __init__(self, visible: Optional[str] = None):
        self.error: Optional[str] = None
        self.note: Optional[str] = None
        self.handles: dict[int, object] = {}  # CUDA index (as ranks see it) -> NVML handle
        self.names: dict[int, str] = {}
        self.gpus: list[Gpu] = []  # every NVML device of this node, NVML order
        self.visible: list[Gpu] = []  # CUDA order under CUDA_VISIBLE_DEVICES
        self.driver: Optional[str] = None
        self.v2 = True  # memory read with nvmlDeviceGetMemoryInfo_v2 (False: the driver lacks it)
        try:
            self.nv = nvml_module()
            self.nv.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded
            self.nv = None
            self.error = f"memory not sampled by NVML: {type(exc).__name__}: {exc}"
            return
        try:
            self.driver = _text(self.nv.nvmlSystemGetDriverVersion())
        except Exception:
            pass
        try:
            self.gpus = self._enumerate()
            env = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
            self.visible = self.cuda_order(env)
            for cuda_idx, gpu in enumerate(self.visible):
                self.handles[cuda_idx] = gpu.handle
                self.names[cuda_idx] = gpu.name
        except Exception as exc:
            self.error = f"memory not sampled by NVML: {type(exc).__name__}: {exc}"
            self.handles, self.names, self.visible = {}, {}, []

    # -- identities ---------------------------------------------------------------------------
    def _enumerate(self) -> list[Gpu]:
        out = []
        for i in range(self.nv.nvmlDeviceGetCount()):
            h = self.nv.nvmlDeviceGetHandleByIndex(i)
            pci = self.nv.nvmlDeviceGetPciInfo(h)
            bus = (f"{pci.domain:04x}:{pci.bus:02x}:{pci.device:02x}.0" if hasattr(pci, "domain")
                   else norm_pci(pci.busId))
            out.append(Gpu(i, _text(self.nv.nvmlDeviceGetUUID(h)), norm_pci(bus),
                           _text(self.nv.nvmlDeviceGetName(h)), h))
        return out

    def _by_index_order(self) -> list[Gpu]:
        """The order CUDA numbers devices in, as far as NVML can tell (PCI bus order)."""
        order = sorted(self.gpus, key=lambda g: g.pci_bus_id)
        if os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") != "PCI_BUS_ID" and \
                len({g.name for g in order}) > 1:
            # zero_bench's ranks run under PCI_BUS_ID (launcher.gpu_order_env): only this process's
            # own CUDA numbering (FASTEST_FIRST) may differ, which is worth saying to the user
            self.note = ("GPUs of different models and this shell's CUDA_DEVICE_ORDER is not PCI_BUS_ID: "
                         "its CUDA numbers them differently from nvidia-smi; zero_bench's ranks use "
                         "nvidia-smi's (PCI bus) order for hardware.devices / CUDA_VISIBLE_DEVICES indices")
        return order

    def resolve(self, token: str) -> Gpu:
        """One CUDA_VISIBLE_DEVICES entry -> its device; LookupError where CUDA would stop."""
        tok = token.strip()
        if tok.isdigit():
            order = self._by_index_order()
            if int(tok) >= len(order):
                raise LookupError(f"CUDA_VISIBLE_DEVICES entry {tok}: only {len(order)} GPUs on this node")
            return order[int(tok)]
        if tok.upper().startswith("MIG-"):  # MIG instance: NVML resolves it, memory is the slice's
            h = self.nv.nvmlDeviceGetHandleByUUID(tok)
            return Gpu(-1, tok, "", _text(self.nv.nvmlDeviceGetName(h)), h)
        want = tok if tok.upper().startswith("GPU-") else f"GPU-{tok}"
        hits = [g for g in self.gpus if g.uuid.lower().startswith(want.lower())]
        if len(hits) != 1:
            raise LookupError(f"CUDA_VISIBLE_DEVICES entry {tok}: "
                              f"{'no' if not hits else 'more than one'} GPU with that UUID")
        return hits[0]

    def cuda_order(self, env: Optional[str]) -> list[Gpu]:
        """The devices CUDA index 0, 1, ... refer to under CUDA_VISIBLE_DEVICES=`env`."""
        if env is None or env.strip() == "":
            return self._by_index_order() if env is None else []
        out = []
        for tok in env.split(","):
            try:
                gpu = self.resolve(tok)
            except LookupError:
                break  # CUDA stops at the first invalid entry
            if gpu in out:
                break  # a repeated device is invalid too
            out.append(gpu)
        return out

    def find(self, uuid: Optional[str] = None, pci_bus_id: Optional[str] = None) -> Optional[Gpu]:
        """The device with this UUID (as torch prints it, with or without "GPU-") or PCI bus id."""
        if uuid:
            u = _text(uuid).lower()
            u = u if u.startswith(("gpu-", "mig-")) else f"gpu-{u}"
            for g in self.gpus + self.visible:
                if g.uuid.lower() == u:
                    return g
        if pci_bus_id:
            p = norm_pci(pci_bus_id)
            for g in self.gpus:
                if g.pci_bus_id == p:
                    return g
        return None

    def for_rank(self, local_rank: int, uuid: Optional[str] = None, pci_bus_id: Optional[str] = None,
                 visible: Optional[str] = None) -> Optional[Gpu]:
        """The GPU a rank uses: by its UUID / PCI bus id when known, else CUDA index = local rank
        under that rank's CUDA_VISIBLE_DEVICES (the deepspeed launcher sets it per node)."""
        gpu = self.find(uuid, pci_bus_id)
        if gpu is not None:
            return gpu
        order = self.visible if visible is None else self.cuda_order(visible)
        return order[local_rank] if 0 <= local_rank < len(order) else None

    # -- memory ---------------------------------------------------------------------------------
    def _info(self, handle) -> Mem:
        """v2 where the driver has it (nvmlDeviceGetMemoryInfo_v2), v1 otherwise (and from then on)."""
        nv = self.nv
        if self.v2:
            try:
                m = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
                return Mem(int(m.used), int(m.total), int(m.reserved), int(m.used) + int(m.reserved))
            except (nv.NVMLError_FunctionNotFound, nv.NVMLError_ArgumentVersionMismatch, nv.NVMLError_NotSupported):
                self.v2 = False  # an older driver: pynvml finds no nvmlDeviceGetMemoryInfo_v2
        m = nv.nvmlDeviceGetMemoryInfo(handle)
        return Mem(int(m.used), int(m.total), None, int(m.used))

    def memory(self, gpu: Gpu) -> Optional[Mem]:
        """One device's memory, None (and `error` set) if NVML cannot answer."""
        try:
            return self._info(gpu.handle)
        except Exception as exc:
            self.error = f"GPU {gpu.uuid} not readable: {type(exc).__name__}: {exc}"
            return None

    def read(self) -> list[tuple[int, int, int]]:
        """(cuda index, used bytes, total bytes) per visible GPU still answering."""
        out = []
        for idx, h in list(self.handles.items()):
            try:
                mem = self._info(h)
                out.append((idx, mem.used, mem.total))
            except Exception as exc:  # e.g. NVMLError_GpuIsLost mid-run: drop it, say so
                self.error = f"GPU {idx} lost during sampling: {type(exc).__name__}: {exc}"
                del self.handles[idx]
        return out

    def processes(self, gpu: Gpu) -> Optional[list[tuple[int, Optional[int]]]]:
        """(pid, bytes or None where NVML cannot say) of each compute process on the device; None if
        NVML cannot answer. PIDs are the host's: in a container they need not match os.getpid()."""
        try:
            return [(int(p.pid), p.usedGpuMemory) for p in self.nv.nvmlDeviceGetComputeRunningProcesses(gpu.handle)]
        except Exception:  # noqa: BLE001 - a count we cannot get is left out, never guessed
            return None

    def status(self) -> str:
        """One line for `zero_bench doctor`."""
        if self.nv is None:
            return self.error or "NVML not available"
        names = ", ".join(sorted({g.name for g in self.gpus})) or "no GPU"
        return f"NVML driver {self.driver or '?'}: {len(self.gpus)} GPU(s) ({names}), {len(self.visible)} visible"

    def close(self) -> None:
        if self.nv is not None:
            try:
                self.nv.nvmlShutdown()
            except Exception:
                pass
            self.nv = None


def torch_identity(props) -> tuple[Optional[str], Optional[str]]:
    """(uuid, pci bus id) of a torch.cuda device from get_device_properties(i), where torch has them."""
    uuid = getattr(props, "uuid", None)
    uuid = str(uuid) if uuid is not None else None
    try:
        pci = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except (AttributeError, TypeError, ValueError):
        pci = None
    return uuid, pci
