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


class Nvml:
    """GPUs of this node as NVML sees them, mapped like CUDA_VISIBLE_DEVICES maps them for torch.

    Every NVML failure becomes `self.error` (a message) and the device or the whole GPU path is
    left out: a trial never crashes and never reports zeros because of NVML.
    """

    def __init__(self):
        self.error: Optional[str] = None
        self.handles: dict[int, object] = {}
        self.names: dict[int, str] = {}
        try:
            self.nv = nvml_module()
            self.nv.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded
            self.nv = None
            self.error = f"memory not sampled by NVML: {type(exc).__name__}: {exc}"
            return
        try:
            for cuda_idx, handle in enumerate(self._visible()):
                self.handles[cuda_idx] = handle
                name = self.nv.nvmlDeviceGetName(handle)
                self.names[cuda_idx] = name.decode() if isinstance(name, bytes) else name
        except Exception as exc:
            self.error = f"memory not sampled by NVML: {type(exc).__name__}: {exc}"
            self.handles = {}

    def _visible(self) -> list:
        """Handles in CUDA order: CUDA_VISIBLE_DEVICES may name GPUs by index, UUID or MIG UUID."""
        count = self.nv.nvmlDeviceGetCount()
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if env is None or env.strip() == "":
            return [self.nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        handles = []
        for tok in (t.strip() for t in env.split(",")):
            if not tok or tok == "-1":
                break  # CUDA stops at the first invalid entry
            if tok.isdigit():
                handles.append(self.nv.nvmlDeviceGetHandleByIndex(int(tok)))
            else:
                handles.append(self.nv.nvmlDeviceGetHandleByUUID(tok if tok.startswith(("GPU-", "MIG-"))
                                                                 else f"GPU-{tok}"))
        return handles

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

    def close(self) -> None:
        if self.nv is not None:
            try:
                self.nv.nvmlShutdown()
            except Exception:
                pass


def rank_of(proc: psutil.Process) -> Optional[int]:
    try:
        return int(proc.environ().get("RANK", ""))
    except (ValueError, psutil.Error):
        return None


class Sampler(threading.Thread):
    """Polls every `interval` s until stopped; calls `on_over(msg)` once if a rank passes `budget`."""

    def __init__(self, root_pid: int, interval: float = 0.05, use_gpu: bool = False,
                 budget: Optional[int] = None, on_over: Optional[Callable[[str], None]] = None):
        super().__init__(daemon=True, name="zero_bench-sampler")
        self.root_pid, self.interval, self.budget, self.on_over = root_pid, interval, budget, on_over
        self.samples: list[Sample] = []
        self.procs: dict[int, psutil.Process] = {}  # pid -> process, every worker ever seen
        self.ranks: dict[int, int] = {}  # pid -> rank
        self.nvml = Nvml() if use_gpu else None
        self.total_ram = psutil.virtual_memory().total
        self.over_msg: Optional[str] = None
        self._stop_evt = threading.Event()

    def _workers(self) -> list[psutil.Process]:
        try:
            kids = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.Error:
            return []
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
