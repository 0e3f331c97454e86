"""One zero_bench per machine (the lock names its holder), and stale DeepSpeed shared memory."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_bench.errors import MachineBusy
from zero_bench.trial import machine

HOLD = """
import sys, time
from zero_bench.trial.machine import machine_lock
with machine_lock():
    print("held", flush=True)
    time.sleep(float(sys.argv[1]))
"""


def hold(seconds: float) -> subprocess.Popen:
    """Another process holding the lock (ZERO_BENCH_LOCK from the test's environment) for `seconds`."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_second_process_is_refused_with_the_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_BENCH_LOCK", str(tmp_path / "lock"))
    monkeypatch.setenv("ZERO_BENCH_LOCK_WAIT_S", "")  # the product's default: refuse at once
    holder = hold(60)
    try:
        t0 = time.time()
        with pytest.raises(MachineBusy, match=rf"pid {holder.pid}\b"):
            with machine.machine_lock():
                pass
        assert time.time() - t0 < 5  # at once, not after a wait
    finally:
        holder.kill()
        holder.wait()
    with machine.machine_lock():  # free again once the holder is gone
        with machine.machine_lock():  # and re-entrant within one process
            pass


def test_a_bounded_wait_names_the_holder_after_it_or_takes_the_lock_once_free(tmp_path, monkeypatch, capsys):
    """ZERO_BENCH_LOCK_WAIT_S (what the test suite sets): wait that long, saying who holds it, then
    refuse naming the holder and the wait; a holder that ends within it hands the lock over."""
    monkeypatch.setenv("ZERO_BENCH_LOCK", str(tmp_path / "lock"))
    monkeypatch.setenv("ZERO_BENCH_LOCK_WAIT_S", "1.5")
    holder = hold(60)
    try:
        t0 = time.time()
        with pytest.raises(MachineBusy, match=rf"pid {holder.pid}\b.*waited \d+ s"):
            with machine.machine_lock():
                pass
        assert time.time() - t0 >= 1.5
        assert f"waiting for the machine: pid {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.setenv("ZERO_BENCH_LOCK_WAIT_S", "120")
    holder = hold(1)  # ends well within the wait
    t0 = time.time()
    with machine.machine_lock():
        assert machine.held_by_me() and time.time() - t0 > 0.5  # waited for the holder's second
    assert holder.wait(timeout=30) == 0  # it ended as it meant to: released, not refused or killed
    monkeypatch.setenv("ZERO_BENCH_LOCK_WAIT_S", "soon")
    with pytest.raises(MachineBusy, match="ZERO_BENCH_LOCK_WAIT_S=soon: must be a number"):
        with machine.machine_lock():
            pass


def test_stale_shm_is_removed_and_live_shm_kept(tmp_path):
    """On a folder of its own (the logic of /dev/shm's): the real /dev/shm belongs to whoever holds
    the machine lock, and a buffer between its creation and its mapping is not stale."""
    stale, live, other = tmp_path / "deepspeed_zbtest_stale", tmp_path / "deepspeed_zbtest_live", tmp_path / "other"
    for f in (stale, live, other):
        f.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as fh, mmap.mmap(fh.fileno(), 4096):  # mapped by this live process
        removed = machine.remove_stale_shm(tmp_path)
        assert removed == [stale] and not stale.exists()
        assert live.exists() and other.exists()  # mapped, and not DeepSpeed's
    assert machine.remove_stale_shm(tmp_path) == [live]  # unmapped now: stale


def test_launch_buffers_removed_by_port(tmp_path):
    ours = [tmp_path / f"deepspeed_allreduce_buffer_0_65001_{rank}" for rank in (0, 1)]
    theirs = tmp_path / "deepspeed_allreduce_buffer_0_65002_0"
    for f in (*ours, theirs):
        f.write_bytes(b"x")
    machine.remove_shm_buffers(65001, tmp_path)
    assert not any(f.exists() for f in ours) and theirs.exists()


def test_a_killed_jit_builds_lock_is_removed_a_live_ones_is_kept(tmp_path):
    """torch's JIT build leaves `lock` behind when killed; every later rank would wait for it forever."""
    dead, live, fresh = (tmp_path / n for n in ("dead_op", "live_op", "fresh_op"))
    for d in (dead, live, fresh):
        d.mkdir()
        (d / "lock").write_text("")
    old = time.time() - 2 * machine.BUILD_LOCK_STALE_S
    for d in (dead, live):
        os.utime(d / "lock", (old, old))
    # as ninja runs; Popen returns once the child has exec'd, in its working directory
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=live)
    try:
        assert machine.remove_stale_build_locks(tmp_path) == [dead / "lock"]
    finally:
        builder.kill()
        builder.wait()
    assert not (dead / "lock").exists() and (live / "lock").exists() and (fresh / "lock").exists()
