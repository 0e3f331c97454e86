"""One zero_bench at a time per machine, and no DeepSpeed shared memory left behind.

DeepSpeed's cleanup `pkill`s launcher command lines, so two zero_bench processes launching on one
machine kill each other's trials and make both figures noise. `machine_lock` is a machine-wide
lock (flock on a file under /tmp) that says who holds it; it is re-entrant within one process,
so a command holds it for its whole run and every launch inside takes it again for free.

DeepSpeed's CPU collective keeps 66 MiB per rank in /dev/shm (RAM). Ranks ending by os._exit or
SIGKILL never unlink it: the runner removes a launch's buffers after it, and whoever takes the
lock removes the buffers of launches whose runner died (no live process maps them). The same holds
for the lock file of a JIT build of DeepSpeed's ops killed mid-way (a trial's timeout, a kill):
every later rank would wait for it forever. And for NVMe offload's swap files (trial/swap.py): a
killed launch's folder is removed by whoever takes the lock next.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from zero_bench.devices.toolkit import extensions_dir
from zero_bench.errors import MachineBusy
from zero_bench.trial.swap import remove_stale_swap

SHM = Path("/dev/shm")
# A JIT build's lock older than this, with no process building in its folder, was left by a killed build.
BUILD_LOCK_STALE_S = 60.0


def lock_path() -> Path:
    return Path(os.environ.get("ZERO_BENCH_LOCK", "/tmp/zero_bench.lock"))


@contextlib.contextmanager
def machine_lock(wait: bool = False) -> Iterator[None]:
    """Hold the machine's trial lock for the block. Another process has it: MachineBusy naming the
    holder, or with `wait` (jobs of one sweep on one machine, e.g. Hydra's submitit_local), wait
    for it; ZERO_BENCH_LOCK_WAIT_S bounds the wait either way (`lock_wait_s`). Within the holding
    process it is re-entrant: a command holds it for its whole run and every launch inside takes it
    again for free (the lock file names its holder: no state here)."""
    if held_by_me():
        yield
        return
    fd = _acquire(wait)
    try:
        yield
    finally:
        os.ftruncate(fd, 0)  # a released lock names no holder
        os.close(fd)  # closing the descriptor releases the flock


def held_by_me() -> bool:
    """This process holds the lock: the file names it, and the flock is taken (a probe on a
    second descriptor cannot get it)."""
    try:
        holder = lock_path().read_text()
    except OSError:
        return False
    if not holder.startswith(f"pid {os.getpid()}:"):
        return False
    fd = os.open(lock_path(), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False  # stale text left by a killed process that had our pid
    finally:
        os.close(fd)


def lock_wait_s(wait: bool) -> float:
    """How long a taker waits for another holder: ZERO_BENCH_LOCK_WAIT_S seconds when set (the test
    suite sets it, so that its launches and the `python -m zero_bench` it starts wait for an unrelated
    run, bounded); else not at all, or with `wait` as long as it takes."""
    env = os.environ.get("ZERO_BENCH_LOCK_WAIT_S", "").strip()
    if env:
        try:
            return max(0.0, float(env))
        except ValueError:
            raise MachineBusy(f"ZERO_BENCH_LOCK_WAIT_S={env}: must be a number of seconds") from None
    return float("inf") if wait else 0.0


def holder_of(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown process"


def _acquire(wait: bool) -> int:
    path = lock_path()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    start, said, limit = time.time(), 0.0, lock_wait_s(wait)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = holder_of(fd)
            waited = time.time() - start
            if waited >= limit:
                os.close(fd)
                after = f"; waited {waited:.0f} s" if limit else ""
                raise MachineBusy(f"another zero_bench is running trials on this machine ({holder}; lock {path}"
                                  f"{after}): DeepSpeed's cleanup would kill each other's trials; wait for it to "
                                  "finish") from None
            if time.time() - said > 60:
                print(f"zero_bench: waiting for the machine: {holder} holds {path}", file=sys.stderr, flush=True)
                said = time.time()
            time.sleep(min(0.5, max(0.0, limit - waited)))
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}".encode(), 0)
    remove_stale_shm()
    remove_stale_build_locks()
    remove_stale_swap()
    return fd


def remove_shm_buffers(port: int, root: Path = SHM) -> None:
    """Unlink one launch's /dev/shm buffers (DeepSpeed names them after the master port)."""
    for f in root.glob(f"deepspeed_*_{port}_*"):
        with contextlib.suppress(OSError):
            f.unlink()


def mapped_shm(root: Path = SHM) -> set[str]:
    """Files under `root` (/dev/shm) some live process maps (or holds open)."""
    prefix = f"{root}/"
    used: set[str] = set()
    for pid_dir in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            used.update(line.split(None, 5)[-1] for line in (pid_dir / "maps").read_text().splitlines()
                        if prefix in line)
        with contextlib.suppress(OSError):
            used.update(str(os.readlink(fd)) for fd in (pid_dir / "fd").iterdir()
                        if str(os.readlink(fd)).startswith(prefix))
    return used


def remove_stale_shm(root: Path = SHM) -> list[Path]:
    """Unlink DeepSpeed buffers no live process uses (left by a runner killed with SIGKILL). Called
    with the machine lock held: no other zero_bench is between creating a buffer and mapping it."""
    used = mapped_shm(root)
    stale = [f for f in root.glob("deepspeed_*") if str(f) not in used]
    for f in stale:
        with contextlib.suppress(OSError):
            f.unlink()
    return stale


def remove_stale_build_locks(root: Optional[Path] = None) -> list[Path]:
    """Remove the `lock` of a JIT build (torch.utils.cpp_extension's FileBaton) that no process is
    building any more: its folder is no live process's working directory (ninja and the compiler run
    there) and the lock is older than BUILD_LOCK_STALE_S (the builder writes build.ninja first)."""
    import psutil

    root = Path(root or extensions_dir())
    locks = [p for p in root.glob("**/lock") if time.time() - p.stat().st_mtime > BUILD_LOCK_STALE_S]
    if not locks:
        return []
    busy = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            busy.add(proc.cwd())
    stale = [p for p in locks if str(p.parent) not in busy]
    for p in stale:
        with contextlib.suppress(OSError):
            p.unlink()
    return stale
