"""One zero_bench per machine (the lock names its holder), and stale DeepSpeed shared memory."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_bench import machine
from zero_bench.errors import MachineBusy

HOLD = """
import sys, time
from zero_bench.machine import machine_lock
with machine_lock():
    print("held", flush=True)
    time.sleep(60)
"""


def test_second_process_is_refused_with_the_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_BENCH_LOCK", str(tmp_path / "lock"))
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(MachineBusy, match=rf"pid {holder.pid}\b"):
            with machine.machine_lock():
                pass
    finally:
        holder.kill()
        holder.wait()
    with machine.machine_lock():  # free again once the holder is gone
        with machine.machine_lock():  # and re-entrant within one process
            pass


def test_stale_shm_is_removed_and_live_shm_kept(tmp_path):
    stale = Path(f"/dev/shm/deepspeed_zbtest_{os.getpid()}_stale")
    live = Path(f"/dev/shm/deepspeed_zbtest_{os.getpid()}_live")
    for f in (stale, live):
        f.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as fh, mmap.mmap(fh.fileno(), 4096):  # mapped by this live process
        removed = machine.remove_stale_shm()
        assert stale in removed and not stale.exists()
        assert live.exists() and live not in removed
    live.unlink()


def test_launch_buffers_removed_by_port():
    f = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getpid()}_65001_0")
    f.write_bytes(b"x")
    machine.remove_shm_buffers(65001)
    assert not f.exists()
    time.sleep(0)


def test_a_killed_jit_builds_lock_is_removed_a_live_ones_is_kept(tmp_path):
    """torch's JIT build leaves `lock` behind when killed; every later rank would wait for it forever."""
    dead, live, fresh = (tmp_path / n for n in ("dead_op", "live_op", "fresh_op"))
    for d in (dead, live, fresh):
        d.mkdir()
        (d / "lock").write_text("")
    old = time.time() - 2 * machine.BUILD_LOCK_STALE_S
    for d in (dead, live):
        os.utime(d / "lock", (old, old))
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=live)  # as ninja runs
    try:
        time.sleep(0.2)
        assert machine.remove_stale_build_locks(tmp_path) == [dead / "lock"]
    finally:
        builder.kill()
        builder.wait()
    assert not (dead / "lock").exists() and (live / "lock").exists() and (fresh / "lock").exists()
