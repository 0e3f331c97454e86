"""Memory timeline beside a running trial, sampled from the trial runner (never inside a step).

Per rank process: resident memory (RSS) from the OS, on every machine. Per GPU: NVML's used/total
bytes, the nvidia-smi figure (CUDA context and caching-allocator reserve included). NVML is reached
through one seam, `nvml_module()`, which tests replace with a fake carrying pynvml's names.
After the trial, `summarize` joins samples with the phase marks each rank wrote (init / forward /
backward / step) to name the phase in which every device peaked.
"""
from __future__ import annotations

import csv
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import psutil


def nvml_module():
    """The seam: the real pynvml (package nvidia-ml-py)."""
    import pynvml

    return pynvml


@dataclass
class Sample:
    t: float
    kind: str  # "rank" (process RSS) or "gpu" (NVML)
    ident: int  # global rank or GPU index on its node
    used: int
    total: int


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


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Nvml:
    """GPUs of this node as NVML sees them, mapped to CUDA indices the way CUDA maps them.

    CUDA_VISIBLE_DEVICES may name GPUs by index, by UUID (full or a unique prefix, with or without
    "GPU-") or by MIG UUID; CUDA stops at the first entry it cannot resolve. NVML numbers devices
    in PCI bus order, CUDA by default "fastest first": the two agree on a node of identical GPUs
    or under CUDA_DEVICE_ORDER=PCI_BUS_ID; where they may not (mixed models, default order) an
    index alone is ambiguous and `note` says so. A rank that knows its device's UUID or PCI bus id
    (torch.cuda.get_device_properties) is matched by that instead: `for_rank`.

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
            self.note = ("GPUs of different models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA may "
                         "number them differently from NVML; indices are matched in PCI bus order")
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
    def memory(self, gpu: Gpu) -> Optional[tuple[int, int]]:
        """(used, total) bytes of one device, None (and `error` set) if NVML cannot answer."""
        try:
            info = self.nv.nvmlDeviceGetMemoryInfo(gpu.handle)
            return int(info.used), int(info.total)
        except Exception as exc:
            self.error = f"GPU {gpu.uuid} not readable: {type(exc).__name__}: {exc}"
            return None

    def read(self) -> list[tuple[int, int, int]]:
        """(cuda index, used bytes, total bytes) per visible GPU still answering."""
        out = []
        for idx, h in list(self.handles.items()):
            try:
                info = self.nv.nvmlDeviceGetMemoryInfo(h)
                out.append((idx, int(info.used), int(info.total)))
            except Exception as exc:  # e.g. NVMLError_GpuIsLost mid-run: drop it, say so
                self.error = f"GPU {idx} lost during sampling: {type(exc).__name__}: {exc}"
                del self.handles[idx]
        return out

    def rank_record(self, local_rank: int, uuid: Optional[str] = None,
                    pci_bus_id: Optional[str] = None) -> dict:
        """What a rank adds to its records about its own GPU, read on its own node."""
        rec: dict = {}
        gpu = None if self.nv is None else self.for_rank(local_rank, uuid, pci_bus_id)
        if gpu is None:
            rec["nvml_error"] = self.error or f"no NVML device for local rank {local_rank}"
            return rec
        rec.update(gpu_uuid=gpu.uuid, gpu_pci_bus_id=gpu.pci_bus_id, gpu_name=gpu.name)
        mem = self.memory(gpu)
        if mem:
            rec["nvml_used_bytes"], rec["nvml_total_bytes"] = mem
        else:
            rec["nvml_error"] = self.error
        return rec

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


def find_workers(marker: str) -> list[psutil.Process]:
    """Rank processes of one trial anywhere on this host, found by `marker` (the trial's spec path)
    in their command line - not only the launcher's children.

    A multi-node launch over pdsh/ssh starts this node's ranks as children of sshd, so walking the
    launcher's process tree misses them. On a real cluster every node's ranks report their own
    figures (ru_maxrss, torch peaks, NVML of their own GPU) in the rank records; on one machine
    with loopback "hosts" this finds them all, so the runner can sample them too.
    """
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except (psutil.Error, TypeError):
            continue
        if "zero_bench.worker" in cmd and marker in cmd and "deepspeed.launcher" not in cmd:
            found.append(p)
    return found


def env_of(proc: psutil.Process, *names: str) -> dict:
    """Selected environment variables of a process ({} where it cannot be read)."""
    try:
        env = proc.environ()
    except psutil.Error:
        return {}
    return {n: env[n] for n in names if n in env}


def rank_of(proc: psutil.Process) -> Optional[int]:
    try:
        return int(proc.environ().get("RANK", ""))
    except (ValueError, psutil.Error):
        return None


class Sampler(threading.Thread):
    """Polls every `interval` s until stopped; calls `on_over(msg)` once if a rank passes `budget`."""

    def __init__(self, root_pid: int, interval: float = 0.05, use_gpu: bool = False,
                 budget: Optional[int] = None, on_over: Optional[Callable[[str], None]] = None,
                 marker: Optional[str] = None):
        super().__init__(daemon=True, name="zero_bench-sampler")
        self.root_pid, self.interval, self.budget, self.on_over = root_pid, interval, budget, on_over
        self.marker = marker  # the trial's spec path: finds ranks that sshd started on this host
        self.samples: list[Sample] = []
        self.procs: dict[int, psutil.Process] = {}  # pid -> process, every worker ever seen
        self.ranks: dict[int, int] = {}  # pid -> rank
        self.nvml = Nvml() if use_gpu else None
        self.total_ram = psutil.virtual_memory().total
        self.over_msg: Optional[str] = None
        self._stop_evt = threading.Event()

    def _workers(self) -> list[psutil.Process]:
        # Walking /proc for new ranks costs ~1.5 ms: do it once a second, not on every tick.
        now = time.monotonic()
        if now - getattr(self, "_scanned", 0.0) < 1.0:
            return [p for p in self.procs.values() if p.is_running()]
        self._scanned = now
        try:
            kids = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.Error:
            kids = []
        if self.marker:
            kids += find_workers(self.marker)
        for p in kids:
            if p.pid not in self.procs:
                try:
                    if "zero_bench.worker" in " ".join(p.cmdline()):
                        self.procs[p.pid] = p
                except psutil.Error:
                    continue
        return [p for p in self.procs.values() if p.is_running()]

    def sample_once(self) -> None:
        now = time.time()
        for p in self._workers():
            if p.pid not in self.ranks:
                r = rank_of(p)
                if r is None:
                    continue
                self.ranks[p.pid] = r
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            if not rss:  # an exited rank not yet reaped (zombie) reads as 0: no sample, not a zero
                continue
            rank = self.ranks[p.pid]
            self.samples.append(Sample(now, "rank", rank, rss, self.budget or self.total_ram))
            if self.budget and rss > self.budget and self.over_msg is None:
                self.over_msg = f"rank {rank} RSS {rss / 2**20:.0f} MiB > budget {self.budget / 2**20:.0f} MiB"
                if self.on_over:
                    self.on_over(self.over_msg)
        if self.nvml is not None:
            for idx, used, total in self.nvml.read():
                self.samples.append(Sample(now, "gpu", idx, used, total))

    def run(self) -> None:
        if not self.interval:  # sampling off (benchmarks/sampler_overhead.py compares the two)
            return
        while not self._stop_evt.is_set():
            self.sample_once()
            self._stop_evt.wait(self.interval)

    def stop(self) -> None:
        self._stop_evt.set()
        if self.is_alive():
            self.join(timeout=5)
        if self.nvml is not None:
            self.nvml.close()

    @property
    def error(self) -> Optional[str]:
        return self.nvml.error if self.nvml is not None else None

    def write_csv(self, path: Path) -> None:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["time", "kind", "id", "used_bytes", "total_bytes"])
            for s in self.samples:
                w.writerow([f"{s.t:.3f}", s.kind, s.ident, s.used, s.total])


def phase_at(marks: list, t: float) -> str:
    """The phase a rank was in at time t, from its (time, phase) marks."""
    phase = "init"
    for mt, ph in marks:
        if mt > t:
            break
        phase = ph
    return phase


def summarize(samples: list[Sample], marks_by_rank: dict[int, list]) -> dict[str, dict]:
    """Per device ("rank0", "gpu0", ...): peak used, total, the time and phase of the peak.

    A GPU's phase is read from the marks of the rank on the same index (local rank = CUDA index).
    """
    peaks: dict[str, dict] = {}
    for s in samples:
        key = f"{s.kind}{s.ident}"
        if key not in peaks or s.used > peaks[key]["peak_bytes"]:
            peaks[key] = {"peak_bytes": s.used, "total_bytes": s.total, "t": s.t}
    for key, p in peaks.items():
        ident = int(key.lstrip("rankgpu"))
        p["phase"] = phase_at(marks_by_rank.get(ident, []), p.pop("t"))
        p["samples"] = sum(1 for s in samples if f"{s.kind}{s.ident}" == key)
    return peaks
