"""A pooled rank: started once per search by the deepspeed launcher, it forks a fresh child per trial.

`python -m zero_bench.trial.rank --pool DIR` (zero_bench.trial.pool starts it). Most of a launch's fixed cost
is the launcher and the imports of torch, deepspeed and megatron-core (issue 18: 10.7 s of a 16 s
trial). The parent pays them once and then only waits: it never creates a process group, never
touches CUDA and allocates no tensor, so each child starts from what a freshly launched rank holds
after its imports, and its memory figures are its own (peak RSS, torch's peaks, NVML).

The runner's requests are files in DIR, numbered from 1 (written whole, by rename):
  reqNNNNN.json              a records.PoolRequest: trial.json path, master port, run dir
  reqNNNNN.kill              the runner ends that trial: kill the child's process group
  reqNNNNN.rank{R}.exit      written here: the child's exit code (negative: killed by that signal)
  refused                    written here: why this pool cannot serve (the runner launches instead)
  stop                       end the pool (the runner also kills the launcher's process group)
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn, Optional, TextIO

from zero_bench.records import PoolRequest

POLL_S = 0.02  # how often an idle parent looks for a request (a stat call per rank)
# How often a parent looks for a kill request while its child runs: rarely, so that it takes no
# CPU time from the trial it waits for (a kill comes 0.25 s late at most; the child's exit wakes
# it at once through SIGCHLD).
CHILD_POLL_S = 0.25
PR_SET_PDEATHSIG = 1  # linux/prctl.h
MADV_POPULATE_READ = 22  # linux/mman.h (5.14)
PAGE = os.sysconf("SC_PAGE_SIZE")
REFUSED_EXIT = 75  # sysexits.h EX_TEMPFAIL: this pool cannot serve; a launch per trial can


# What every trial imports, whichever engine it runs (zero_bench.engines.base imports both: one pool
# serves a sweep over engine=deepspeed,fsdp2); children inherit these instead of importing them again.
PRELOAD = ("deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3",
           "deepspeed.runtime.zero.stage_1_and_2", "torch.distributed.fsdp", "torch.distributed.tensor",
           "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.tensor_parallel",
           "torch.profiler", "zero_bench.engines.fsdp2", "zero_bench.trial.worker")


def preload() -> None:
    """Imports only: anything that starts threads, a process group or CUDA here would be shared
    by (or broken in) every child."""
    for name in PRELOAD:
        importlib.import_module(name)


CUDA_ERROR_NOT_INITIALIZED = 3  # cuda.h: what the driver answers before anyone called cuInit


def cuda_untouched() -> bool:
    """True unless this process initialized CUDA (torch's lazy init, or the driver's cuInit that
    e.g. torch.cuda.is_available() runs): a child forked after that cannot use the GPU. Asks
    libcuda itself; a machine without it has nothing to initialize."""
    import torch

    if torch.cuda.is_initialized():
        return False
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    count = ctypes.c_int()
    return libcuda.cuDeviceGetCount(ctypes.byref(count)) == CUDA_ERROR_NOT_INITIALIZED


def release_nvml() -> int:
    """Shut NVML down in the pool parent; how many initialisations that undid.

    Importing DeepSpeed with DS_ACCELERATOR=cuda creates its CUDA accelerator, whose __init__ runs
    pynvml.nvmlInit() (cuda_accelerator.py, _init_pynvml). NVML keeps a count of initialisations
    and shuts down only when it reaches zero (nvml.h, nvmlShutdown): a forked child's nvmlInit
    would only raise the inherited count and keep using the parent's driver state, which is not
    safe across fork(). At zero, each child's first nvmlInit is its own. DeepSpeed's module global
    stays set, so its pynvml calls in a child still find the module."""
    mod = sys.modules.get("deepspeed.accelerator.cuda_accelerator")
    nv = getattr(mod, "pynvml", None)
    undone = 0
    while nv is not None and undone < 64:  # bounded: a fake or broken library must not loop forever
        try:
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001 - NVMLError_Uninitialized: the count is zero
            break
        undone += 1
    return undone


def keep_mapping(fields: list[str]) -> bool:
    """A /proc/self/maps line (split) worth mapping again in a child: a readable regular file.
    Device files (/dev/nvidia*: VM_IO/VM_PFNMAP, nvidia-uvm: not even copied by fork) cannot be
    populated and may fault when read; deleted files are not the child's to map. /dev/shm is tmpfs."""
    if len(fields) < 6 or "r" not in fields[1]:
        return False
    path = fields[5].rstrip("\n")
    if not path.startswith("/") or path.endswith("(deleted)"):
        return False
    return not path.startswith("/dev/") or path.startswith("/dev/shm/")


def resident_file_pages(maps: Optional[TextIO] = None, pagemap=None) -> list[tuple[int, int]]:
    """(address, length) runs of file-backed pages this process has mapped and resident.

    fork() copies the page tables of anonymous and written memory only; pages of files it never
    wrote (the libraries' code and read-only data) a child maps again only when it touches them.
    Without help its RSS would start lower than a freshly launched rank's by every page that only
    the imports touched (39 MiB for gpt-mini: enough to move a CPU boundary by a size).
    /proc/self/pagemap has one 64-bit entry per page; bit 63 says it is present.
    """
    with contextlib.ExitStack() as files:
        maps = maps or files.enter_context(open("/proc/self/maps"))
        pagemap = pagemap or files.enter_context(open("/proc/self/pagemap", "rb"))
        return _resident_runs(maps, pagemap)


def _resident_runs(maps: TextIO, pagemap) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for line in maps:
        fields = line.split(None, 5)
        if not keep_mapping(fields):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        pagemap.seek(lo // PAGE * 8)
        entries = memoryview(pagemap.read((hi - lo) // PAGE * 8)).cast("Q")
        start = None
        for i, e in enumerate(entries):
            if e >> 63 and start is None:
                start = i
            elif not e >> 63 and start is not None:
                runs.append((lo + start * PAGE, (i - start) * PAGE))
                start = None
        if start is not None:
            runs.append((lo + start * PAGE, (len(entries) - start) * PAGE))
    return runs


def map_again(runs: list[tuple[int, int]]) -> None:
    """Map the parent's resident file pages into this child (no copy: they are in the page cache),
    so the child starts with the resident set a fresh rank has after the same imports."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for addr, length in runs:
        if libc.madvise(addr, length, MADV_POPULATE_READ) == 0:
            continue
        # EINVAL: a kernel before 5.14 that does not know the advice: touch each page. Anything
        # else (EFAULT, ENOMEM: a mapping that cannot be populated) is left alone, not read.
        if ctypes.get_errno() == errno.EINVAL:
            for a in range(addr, addr + length, PAGE):
                ctypes.string_at(a, 1)


def request_path(pool_dir: Path, n: int, suffix: str = ".json") -> Path:
    return pool_dir / f"req{n:05d}{suffix}"


def refused_path(pool_dir: Path) -> Path:
    return pool_dir / "refused"


def exit_path(pool_dir: Path, n: int, rank: int) -> Path:
    return request_path(pool_dir, n, f".rank{rank}.exit")


def write_whole(path: Path, text: str) -> None:
    """Readers never see half a file: write beside it, then rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def serve(pool_dir: Path, run_trial: Callable[[Path], NoReturn]) -> NoReturn:
    """Fork a child per request until told to stop (the caller already watches the runner); each
    child runs `run_trial(spec path)` (zero_bench.trial.rank.trial), which never returns."""
    preload()
    if os.environ.get("DS_ACCELERATOR") == "cuda" and not cuda_untouched():
        # e.g. Transformer Engine's import, or a DeepSpeed older than 0.19.3's fork-safety fix
        write_whole(refused_path(pool_dir), "importing the trial's modules initialized CUDA, so forked "
                    "children could not use the GPU")
        os._exit(REFUSED_EXIT)
    release_nvml()
    resident = resident_file_pages()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # pending until sigtimedwait takes it
    rank = int(os.environ.get("RANK", "0"))
    n = 1
    while not (pool_dir / "stop").exists():
        req = request_path(pool_dir, n)
        if not req.exists():
            time.sleep(POLL_S)
            continue
        job = PoolRequest.from_json(req.read_text())
        pid = os.fork()
        if pid == 0:
            _child(job, resident, run_trial)
        with contextlib.suppress(OSError):  # as the child does: no window where killpg misses it
            os.setpgid(pid, pid)
        rc = _wait(pid, request_path(pool_dir, n, ".kill"), pool_dir / "stop")
        write_whole(exit_path(pool_dir, n, rank), str(rc))
        n += 1
    os._exit(0)


def _child(job: PoolRequest, resident: list[tuple[int, int]], run_trial: Callable[[Path], NoReturn]) -> NoReturn:
    """A fresh rank for one trial: its own process group (the parent kills it whole), killed with
    the parent, its own master port and log files; it never returns into the parent's loop."""
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})  # as a fresh process has it
        os.setpgid(0, 0)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        map_again(resident)
        out = Path(job.out_dir)
        for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
            f = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.environ["MASTER_PORT"] = str(job.port)
        run_trial(Path(job.spec))
    except BaseException:  # noqa: BLE001 - whatever happens, never return into the parent's loop
        import traceback

        traceback.print_exc()
    os._exit(1)  # run_spec ends the process itself: reaching here means it never started


def _wait(pid: int, kill_file: Path, stop_file: Path) -> int:
    """Wait for the child; kill its process group when the runner asks. Its exit code."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if kill_file.exists() or stop_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        signal.sigtimedwait({signal.SIGCHLD}, CHILD_POLL_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # what the child started (e.g. inductor's compile workers)
    return os.waitstatus_to_exitcode(status)
