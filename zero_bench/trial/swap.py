"""NVMe offload's swap files (offload_device=nvme): one folder per launch, its bytes on disk sampled
beside the memory timeline, removed after the launch and, if the runner was killed, by the next
zero_bench that takes the machine lock (as trial/machine.py sweeps /dev/shm buffers).

DeepSpeed 0.19.8's swappers write under the nvme_path of its JSON: zero_stage_3/optimizer/rank{r}/
(optimizer_utils.py OptimizerSwapper) and zero_stage_3/{dtype}params/rank{r}/
(partitioned_param_swapper.py _configure_aio). A launch gets `<nvme_path>/zb-<launch id>/` as that
path, so that removing it never touches another launch's files or anything the user keeps there.
Each folder is registered (a file naming it, under the lock file's `.swap` folder, named after the
runner's pid) until removed: a registered folder whose runner is gone is stale.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import psutil

if TYPE_CHECKING:  # the machine lock imports this module: it stays light
    from zero_bench.config.schema import BenchConfig

FOLDER_PREFIX = "zb-"
_RANK = re.compile(r"^rank(\d+)$")


def registry() -> Path:
    """Beside the machine lock's file (machine.lock_path, which imports this module: read here from
    the same variable), so that whoever takes that lock sweeps these."""
    lock = Path(os.environ.get("ZERO_BENCH_LOCK", "/tmp/zero_bench.lock"))
    return lock.with_name(lock.name + ".swap")


def swap_root(cfg: "BenchConfig", run_dir: Path) -> Path:
    """Where a launch's swap folder goes: nvme_path, else `nvme` under the run directory."""
    return Path(cfg.nvme_path).expanduser() if cfg.nvme_path else run_dir / "nvme"


def make_swap_folder(cfg: "BenchConfig", run_dir: Path, launch_id: int) -> Optional[Path]:
    """The launch's own swap folder, created and registered (None: the config swaps nothing)."""
    if not cfg.nvme:
        return None
    folder = (swap_root(cfg, run_dir) / f"{FOLDER_PREFIX}{launch_id}").resolve()
    reg = registry()
    reg.mkdir(parents=True, exist_ok=True)
    (reg / f"{os.getpid()}-{launch_id}").write_text(str(folder))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def remove_swap_folder(folder: Optional[Path]) -> None:
    """Remove a launch's swap folder and its registration."""
    if folder is None:
        return
    shutil.rmtree(folder, ignore_errors=True)
    for marker in registry().glob(f"*-{folder.name[len(FOLDER_PREFIX):]}"):
        with contextlib.suppress(OSError):
            if marker.read_text() == str(folder):
                marker.unlink()


def remove_stale_swap() -> list[Path]:
    """Remove the swap folders of runners that are gone (killed before their cleanup). Called with the
    machine lock held, so no other zero_bench is launching; a live runner's folders are kept."""
    removed = []
    for marker in registry().glob("*-*"):
        pid = marker.name.split("-", 1)[0]
        if pid.isdigit() and psutil.pid_exists(int(pid)):
            continue
        with contextlib.suppress(OSError):
            folder = Path(marker.read_text())
            if folder.name.startswith(FOLDER_PREFIX):  # only what make_swap_folder made
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
            marker.unlink()
    return removed


def disk_bytes(folder: Path) -> dict[int, int]:
    """Bytes the swap files hold on disk (allocated blocks), per rank (the rank{r} folder they are in)."""
    out: dict[int, int] = {}
    for root, _dirs, files in os.walk(folder):
        rank = next((int(m.group(1)) for part in Path(root).parts[::-1] if (m := _RANK.match(part))), 0)
        for f in files:
            with contextlib.suppress(OSError):
                out[rank] = out.get(rank, 0) + os.stat(os.path.join(root, f)).st_blocks * 512
    return out
