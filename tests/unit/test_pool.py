"""The pool's pieces that need no DeepSpeed: a parent's wait and kill, the child's resident set, the
sampler that counts children only, and the pool's key, with real processes; and at the seams a
GPU pool meets (fake NVML, stand-in pools and launches): a pool that refuses to serve falls back
to a launch per trial, the parent releases NVML before forking, device files are not mapped again."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import psutil
import pytest

from zero_bench.trial import launch, pool, pool_rank

from zero_bench.devices import nvml


from zero_bench.config.schema import HardwareConfig, ParallelConfig
from zero_bench.devices.nvml import Nvml
from zero_bench.trial.launch import LaunchOptions, run_launch
from zero_bench.trial.pool import PoolSlot, pool_key
from zero_bench.trial.pool_rank import (PAGE, _wait, map_again, refused_path, release_nvml, resident_file_pages,
                                  write_whole)
from zero_bench.records import Entry, Event, RankRecord, RankStatus
from zero_bench.trial.sampler import Sampler

from conftest import cpu_cfg, wait_until
from gpu_fakes import fake_pynvml


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
    grandchildren = wait_until(lambda: psutil.Process(pid).children(), 30, "the child started its own")
    (tmp_path / "kill").write_text("")
    t0 = time.time()
    assert _wait(pid, tmp_path / "kill", tmp_path / "stop") == -signal.SIGKILL
    assert time.time() - t0 < 30  # acted on the kill file, not waited out the child's 60 s
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
    # "zero_bench.trial.rank" in the command line is how the sampler knows a rank
    proc = subprocess.Popen([sys.executable, "-c", WORKER, "zero_bench.trial.rank", "--pool", "x"],
                            env={**os.environ, "RANK": "0"})
    try:
        wait_until(lambda: psutil.Process(proc.pid).children(), 30, "the worker forked its child")
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



# -- a pool that cannot serve on a GPU, NVML across fork, device files ---------------------------------

def test_serve_writes_refused(tmp_path, monkeypatch):
    """Imports that initialized CUDA (e.g. an old Transformer Engine): the ranks say why and exit
    with REFUSED_EXIT instead of serving children that could not use the GPU."""
    monkeypatch.setattr(pool_rank, "preload", lambda: None)
    monkeypatch.setattr(pool_rank, "cuda_untouched", lambda: False)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    pid = os.fork()
    if pid == 0:
        try:
            pool_rank.serve(tmp_path, lambda spec: os._exit(3))
        finally:
            os._exit(9)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == pool_rank.REFUSED_EXIT
    assert "initialized CUDA" in refused_path(tmp_path).read_text()


class _RefusingPool:
    """A pool whose ranks refused at once (what pool_rank.serve leaves behind)."""
    made = 0

    def __init__(self, cfg, pool_dir):
        type(self).made += 1
        self.cfg, self.dir, self.key = cfg, pool_dir, pool_key(cfg)
        self.dir.mkdir(parents=True, exist_ok=True)
        write_whole(refused_path(self.dir), "importing the trial's modules initialized CUDA")

    def alive(self):
        return False

    refused = pool.Pool.refused  # the real reader of what the ranks wrote

    def submit(self, spec_path, run_dir, port):
        return _Ranks(run_dir, []), "pool request"

    def close(self):
        pass


class _Ranks:
    """A launch of its own whose ranks ended each plan entry ok (no process: the records only)."""

    def __init__(self, run_dir, plan, world=2):
        self.root_pid, self.forked, self.marker, self.rc = os.getpid(), False, None, 0
        for r in range(world):
            with open(run_dir / f"rank{r}.jsonl", "a") as f:
                for e in plan:
                    rec = RankRecord(rank=r, event=Event.END, micro=e.micro, mode=e.mode, status=RankStatus.OK,
                                     time_per_step=0.1, peak_rss_bytes=2**20, marks=[(time.time(), "idle")])
                    f.write(json.dumps(rec.to_dict()) + "\n")

    def wait(self, timeout):
        return True

    def kill(self):
        pass

    def end(self, known):
        pass

    def log_tail(self):
        return ""


def test_pool_refusal_falls_back_to_launches(tmp_path, monkeypatch, capsys):
    _RefusingPool.made = 0
    monkeypatch.setenv("ZERO_BENCH_LOCK", str(tmp_path / "lock"))
    monkeypatch.setattr(pool, "Pool", _RefusingPool)
    launched = []
    monkeypatch.setattr(launch, "Ranks", lambda cfg, cmd, env, run_dir: launched.append(run_dir) or
                        _Ranks(run_dir, plan))
    plan = [Entry(1), Entry(2)]
    slot = PoolSlot(tmp_path / "pools")
    opts = LaunchOptions(pools=slot, sample_interval=0)
    results = run_launch(cpu_cfg(), plan, tmp_path / "t1", opts)
    assert [r.status for r in results] == ["ok", "ok"] and launched == [tmp_path / "t1"]
    assert slot.disabled and "initialized CUDA" in slot.disabled and _RefusingPool.made == 1
    err = capsys.readouterr().err
    assert err.count("pool refused") == 1 and "launching each trial fresh" in err
    # the next trial goes straight to a launch of its own: no pool is started again
    assert [r.status for r in run_launch(cpu_cfg(), plan, tmp_path / "t2", opts)] == ["ok", "ok"]
    assert _RefusingPool.made == 1 and launched[-1] == tmp_path / "t2"
    assert "pool refused" not in capsys.readouterr().err


def test_pool_parent_releases_nvml(monkeypatch):
    """DeepSpeed's CUDA accelerator ran nvmlInit in the parent at import; a child forked with that
    count inherited only bumps it (nvml.h, nvmlShutdown) and keeps the parent's driver state. The
    fake NVML fails calls from a process that did not initialise it itself."""
    def child_reads() -> str:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            n = Nvml()
            mem = n.memory(n.visible[0]) if n.visible else None
            os.write(w, (f"ok {mem.used}" if mem else f"error {n.error}").encode())
            os._exit(0)
        os.waitpid(pid, 0)
        os.close(w)
        return os.read(r, 4096).decode()

    for release in (False, True):
        nv = fake_pynvml(fork_unsafe=True)
        monkeypatch.setattr(nvml, "nvml_module", lambda: nv)
        monkeypatch.setitem(sys.modules, "deepspeed.accelerator.cuda_accelerator", types.SimpleNamespace(pynvml=nv))
        nv.nvmlInit()  # what CUDA_Accelerator.__init__ does in the pool parent
        if release:
            assert release_nvml() == 1 and nv.state["init"] == 0
            assert child_reads().startswith("ok ")
        else:
            assert "NVMLError_Unknown" in child_reads()


def test_device_mappings_are_not_mapped_again():
    """A child maps again the parent's resident pages of files; device mappings (/dev/nvidia*)
    cannot be populated and may fault when read, so they are left out. /dev/shm is tmpfs."""
    spans = [("rw-s", "/dev/nvidiactl"), ("rw-s", "/dev/nvidia0"), ("r--s", "/dev/shm/x"),
             ("r-xp", "/usr/lib/libc.so.6"), ("r--p", "/tmp/gone (deleted)"), ("---p", "/usr/lib/libc.so.6"),
             ("rw-p", "[heap]")]
    maps = "".join(f"{(i + 1) * PAGE:08x}-{(i + 2) * PAGE:08x} {perm} 00000000 08:01 {i} {path}\n"
                   for i, (perm, path) in enumerate(spans))
    pagemap = io.BytesIO((1 << 63).to_bytes(8, "little") * (len(spans) + 2))  # every page present
    assert resident_file_pages(maps=io.StringIO(maps), pagemap=pagemap) == [(3 * PAGE, PAGE), (4 * PAGE, PAGE)]

