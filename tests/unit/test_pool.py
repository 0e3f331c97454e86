"""The pool's pieces that need no DeepSpeed: a parent's wait and kill, the child's resident set, the
sampler that counts children only, and the pool's key. Real processes, no fakes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from zero_bench.config import HardwareConfig, ParallelConfig
from zero_bench.pool import pool_key
from zero_bench.pool_rank import _wait, map_again, resident_file_pages
from zero_bench.sampler import Sampler

from conftest import cpu_cfg


def _fork(body) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            body()
        finally:
            os._exit(7)
    os.setpgid(pid, pid)
    return pid


def test_wait_returns_the_childs_exit_code(tmp_path):
    pid = _fork(lambda: time.sleep(0.2))
    assert _wait(pid, tmp_path / "kill", tmp_path / "stop") == 7


def test_kill_file_ends_the_childs_whole_process_group(tmp_path):
    """The child and what it started (e.g. inductor's compile workers) go; the parent goes on."""
    def body():
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        time.sleep(60)

    pid = _fork(body)
    time.sleep(0.5)
    grandchildren = psutil.Process(pid).children()
    assert grandchildren
    (tmp_path / "kill").write_text("")
    t0 = time.time()
    assert _wait(pid, tmp_path / "kill", tmp_path / "stop") == -signal.SIGKILL
    assert time.time() - t0 < 2
    gone, alive = psutil.wait_procs(grandchildren, timeout=5)
    assert not alive


def test_child_starts_with_the_parents_resident_file_pages():
    """Pages of files that only the parent touched count in the child's RSS once mapped again, as
    they do in a process that ran the same imports itself."""
    import torch  # noqa: F401 - a large library whose pages the parent has touched

    runs = resident_file_pages()
    assert runs and all(length > 0 and addr % os.sysconf("SC_PAGE_SIZE") == 0 for addr, length in runs)
    resident = sum(length for _, length in runs)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        before = psutil.Process().memory_full_info()
        map_again(runs)
        after = psutil.Process().memory_full_info()
        os.write(w, f"{after.rss - before.rss}".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    grown = int(os.read(r, 64))
    # the child maps again what fork() left out: a good part of the file pages, never more
    assert 0 < grown <= resident


WORKER = textwrap.dedent("""
    import os, sys, time
    if os.fork() == 0:
        time.sleep(30)
        os._exit(0)
    time.sleep(30)
""")


@pytest.mark.parametrize("forked,expected", [(True, 1), (False, 2)])
def test_sampler_counts_the_forked_children_not_their_parents(forked, expected):
    # "zero_bench.rank" in the command line is how the sampler knows a rank
    proc = subprocess.Popen([sys.executable, "-c", WORKER, "zero_bench.rank", "--pool", "x"],
                            env={**os.environ, "RANK": "0"})
    try:
        time.sleep(1.0)
        s = Sampler(os.getpid(), interval=0.01, forked=forked)
        s.sample_once()
        assert len([x for x in s.samples if x.kind == "rank"]) == expected
        if forked:
            (pid,) = s.procs
            assert psutil.Process(pid).ppid() == proc.pid
    finally:
        for p in psutil.Process(proc.pid).children() + [psutil.Process(proc.pid)]:
            p.kill()
        proc.wait()


def test_trials_share_a_pool_only_with_the_same_ranks():
    a = cpu_cfg()
    assert pool_key(a) == pool_key(cpu_cfg(zero=3, precision="bf16"))  # what the child builds may differ
    assert pool_key(a) != pool_key(cpu_cfg(parallel=ParallelConfig(tp=1, dp=1)))
    assert pool_key(a) != pool_key(cpu_cfg(hardware=HardwareConfig(device="cpu", hostfile="hosts", num_nodes=2)))

