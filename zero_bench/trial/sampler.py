"""Memory timeline beside a running trial, sampled from the trial runner (never inside a step).

Per rank process: resident memory (RSS) from the OS, on every machine. Per GPU: NVML's used/total
bytes, the nvidia-smi figure (CUDA context and caching-allocator reserve included), through
zero_bench.devices.nvml. With NVMe offload, per rank: the bytes its swap files hold on disk (kind
"disk", trial/swap.py), in the same timeline.
After the trial, `summarize` joins samples with the phase marks each rank wrote (init / forward /
backward / step) to name the phase in which every device peaked.
"""
from __future__ import annotations

import csv
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil

from zero_bench.devices.nvml import Nvml
from zero_bench.records import DeviceMemStats, MemoryKind
from zero_bench.trial.swap import disk_bytes
from zero_bench.units import MiB

# The module every rank process runs (`python -m`): how a rank's command line is told from its launcher's.
RANK_MODULE = "zero_bench.trial.rank"


@dataclass
class Sample:
    t: float
    kind: str  # "rank" (process RSS), "gpu" (NVML) or "disk" (a rank's NVMe swap files)
    ident: int  # global rank or GPU index on its node
    used: int
    total: int


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
        if RANK_MODULE in cmd and marker in cmd and "deepspeed.launcher" not in cmd:
            found.append(p)
    return found


def is_worker(p: Optional[psutil.Process]) -> bool:
    """A rank process: RANK_MODULE's command line, not the launcher that starts it."""
    if p is None:
        return False
    cmd = " ".join(p.cmdline())
    return RANK_MODULE in cmd and "deepspeed.launcher" not in cmd


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
    """Polls every `interval` s until stopped; calls `on_over(msg)` once if a rank passes `budget`.

    `gpus`: the GPUs to read with NVML, as CUDA_VISIBLE_DEVICES spells them (None: no GPU)."""

    def __init__(self, root_pid: int, interval: float = 0.05, gpus: Optional[str] = None,
                 budget: Optional[int] = None, on_over: Optional[Callable[[str], None]] = None,
                 marker: Optional[str] = None, forked: bool = False, expect: int = 0,
                 disk: Optional[Path] = None):
        super().__init__(daemon=True, name="zero_bench-sampler")
        self.root_pid, self.interval, self.budget, self.on_over = root_pid, interval, budget, on_over
        self.marker = marker  # the trial's spec path: finds ranks that sshd started on this host
        self.forked = forked  # the ranks are children forked by a pool's ranks (zero_bench.trial.pool)
        self.expect = expect  # rank processes this host will have
        self.disk = disk  # the launch's NVMe swap folder (None: nothing swapped)
        self.samples: list[Sample] = []
        self.procs: dict[int, psutil.Process] = {}  # pid -> process, every worker ever seen
        self.ranks: dict[int, int] = {}  # pid -> rank
        # exactly the GPUs the ranks use (CUDA_VISIBLE_DEVICES spelling), never the whole node
        self.nvml = Nvml(visible=gpus) if gpus is not None else None
        self.total_ram = psutil.virtual_memory().total
        self.over_msg: Optional[str] = None
        self._stop_evt = threading.Event()

    def _workers(self) -> list[psutil.Process]:
        # Walking /proc for new ranks costs ~1.5 ms: do it once a second, not on every tick - except
        # until every rank of this host was seen (a forked trial can be over within a second).
        now = time.monotonic()
        if now - getattr(self, "_scanned", 0.0) < 1.0 and len(self.procs) >= self.expect:
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
                    if is_worker(p) and (not self.forked or is_worker(p.parent())):
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
            self.samples.append(Sample(now, MemoryKind.rank, rank, rss, self.budget or self.total_ram))
            if self.budget and rss > self.budget and self.over_msg is None:
                self.over_msg = f"rank {rank} RSS {rss / MiB:.0f} MiB > budget {self.budget / MiB:.0f} MiB"
                if self.on_over:
                    self.on_over(self.over_msg)
        if self.nvml is not None:
            for idx, used, total in self.nvml.read():
                self.samples.append(Sample(now, "gpu", idx, used, total))
        if self.disk is not None:
            for rank, used in sorted(disk_bytes(self.disk).items()):
                self.samples.append(Sample(now, "disk", rank, used, 0))

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


def summarize(samples: list[Sample], marks_by_rank: dict[int, list]) -> list[DeviceMemStats]:
    """Per device: peak used, total, the phase of the peak and the number of samples.

    A GPU's phase is read from the marks of the rank on the same index (local rank = CUDA index).
    """
    peaks: dict[tuple[str, int], tuple[Sample, int]] = {}
    for s in samples:
        best, n = peaks.get((s.kind, s.ident), (s, 0))
        peaks[(s.kind, s.ident)] = (s if s.used > best.used else best, n + 1)
    return [DeviceMemStats(kind=kind, id=ident, peak_bytes=s.used, total_bytes=s.total, samples=n,
                           phase=phase_at(marks_by_rank.get(ident, []), s.t))
            for (kind, ident), (s, n) in sorted(peaks.items())]
