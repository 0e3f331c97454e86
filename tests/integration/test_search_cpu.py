"""Real max-batch searches on CPU against a per-rank budget: the boundary holds in fresh trials,
and the answer does not depend on how the search was run (one size per launch in one go on a slow
machine, or several sizes per launch SIGKILLed and resumed).

The module's cheap searches (gpt-tiny) run first: the pool they start is warm for the calibrated
search, whose 1.5 s time-limit floor would not cover a pool's start-up (imports, ~10 s here)."""
from __future__ import annotations

import dataclasses
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_bench.config.schema import HardwareConfig, SearchConfig
from zero_bench.estimate import seed_micro
from zero_bench.records import Entry, Fault, SearchStatus, Status
from zero_bench.search.maxbatch import SearchOptions, run_search
from zero_bench.store import Store
from zero_bench.trial.launch import run_launch

from conftest import FRESH_MICROS, cpu_cfg, worker_processes

pytestmark = pytest.mark.slow
CLOSES_POOL = True  # test_same_answer_resumed_after_sigkill: last of the modules on the session's pool (conftest)
QUIET = SearchOptions(progress=lambda s: None)


SLOW = Fault(kind="slow", rank=1, seconds=0.25)  # rank 1's every step sleeps 0.25 s per sample
SLOW_FLOOR_S = 1.5  # timeout_s of the slow search: below its steps near the boundary


def budget_cfg(gb: float, **kw):
    cfg = cpu_cfg("gpt-mini", **kw)
    return dataclasses.replace(cfg, hardware=HardwareConfig(device="cpu", memory_gb=gb))


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, gpt_mini_fresh, pools):
    """A budget midway between the measured peaks of two fresh trials at micro 6 and 7 (the
    session's, conftest.gpt_mini_fresh): half a sample's growth from either, whatever the machine
    (a budget on a line extrapolated from smaller micros lands wherever the line misses); and one
    uninterrupted search against it, one size per launch (search.multi=false: every trial fresh),
    on a slow machine (SLOW, time-limit floor SLOW_FLOOR_S: test_a_slow_machine_one_size_per_launch_*).
    The slowness only stretches steps, so this one search is also the in-one-go reference the
    resumed one is held to (one search for three claims: each of its own repeated the trials).
    (cfg with the default time limit, the search's result, its store)"""
    tmp = tmp_path_factory.mktemp("calibrated")
    _, fresh = gpt_mini_fresh
    lo, hi = (max(r.peak_rss_bytes for r in fresh[m].ranks) for m in FRESH_MICROS)
    assert hi > lo, f"micro {FRESH_MICROS[1]} peaked no higher than {FRESH_MICROS[0]}: no budget between them"
    cfg = budget_cfg((lo + hi) / 2 / 2**30)
    store = Store(tmp / "s.sqlite")
    opts = SearchOptions(seed=seed_micro(cfg), progress=lambda s: None, pools=pools, fault=SLOW)
    res = run_search(dataclasses.replace(cfg, timeout_s=SLOW_FLOOR_S), SearchConfig(max=64, multi=False), store,
                     tmp / "search", opts)
    return cfg, res, store


def _cli(store: Path, run_dir: Path, cfg) -> subprocess.Popen:
    args = ["maxbatch", "model=gpt-mini", "zero=2", "precision=fp32", "hardware=cpu",
            f"hardware.memory_gb={cfg.hardware.memory_gb!r}", "steps.warmup=1", "steps.timed=2", "search.max=64",
            f"store={store}", f"hydra.run.dir={run_dir}"]
    return subprocess.Popen([sys.executable, "-m", "zero_bench", *args], start_new_session=True,
                            stdout=open(run_dir.parent / f"{run_dir.name}.log", "a"), stderr=subprocess.STDOUT)


def _trials(db: Path) -> int:
    try:
        with sqlite3.connect(db) as c:
            return c.execute("SELECT COUNT(*) FROM trials WHERE status != 'not_run'").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def test_cannot_initialize_is_reported(tmp_path, no_leftovers, pools):
    cfg = budget_cfg(0.25)  # less than a rank needs for torch + deepspeed + the model
    res = run_search(cfg, SearchConfig(max=8), Store(tmp_path / "s.sqlite"), tmp_path / "search",
                     SearchOptions(pools=pools))
    assert res.status == "cannot_initialize" and res.max_global_batch is None
    assert "cannot even initialize" in res.note


def test_killed_rank_is_oom_and_the_search_goes_on(tmp_path, no_leftovers, pools):
    """Rank 1 is SIGKILLed (as by the kernel's OOM killer) from micro 5 on: boundary 4."""
    cfg = cpu_cfg(hardware=HardwareConfig(device="cpu", memory_gb=4.0))
    store = Store(tmp_path / "s.sqlite")
    res = run_search(cfg, SearchConfig(max=16, strategy="doubling"), store, tmp_path / "search",
                     SearchOptions(fault=Fault(kind="kill", rank=1, min_micro=5), pools=pools))
    assert (res.status, res.max_micro, res.first_fail_micro) == ("done", 4, 5)
    statuses = {t.micro: t.status for t in store.trials(cfg.search_key()) if t.status != "not_run"}
    assert statuses[5] == "oom" and statuses[4] == "ok"


def test_rank_error_stops_the_search_with_its_message(tmp_path, no_leftovers, pools):
    cfg = cpu_cfg(hardware=HardwareConfig(device="cpu", memory_gb=4.0))
    res = run_search(cfg, SearchConfig(max=16, strategy="doubling"), Store(tmp_path / "s.sqlite"),
                     tmp_path / "search", SearchOptions(fault=Fault(kind="raise", rank=1, min_micro=4), pools=pools))
    assert res.status == "error" and "injected fault on rank 1" in res.note
    # the bracket found before the error is kept, and said to be unconfirmed
    assert res.max_micro == 2 and "before it, micro 2 fitted (not confirmed fresh)" in res.note


def test_finished_search_is_not_repeated(tmp_path, pools):
    cfg = cpu_cfg(hardware=HardwareConfig(device="cpu", memory_gb=4.0))
    store = Store(tmp_path / "s.sqlite")
    first = run_search(cfg, SearchConfig(max=2), store, tmp_path / "a", SearchOptions(pools=pools))
    n = len(store.trials(cfg.search_key()))
    again = run_search(cfg, SearchConfig(max=2), store, tmp_path / "b", SearchOptions(pools=pools))
    assert again.max_micro == first.max_micro == 2 and len(store.trials(cfg.search_key())) == n


def test_real_search_boundary_holds_in_independent_trials(calibrated, no_leftovers):
    """The search's b fits and b + 1 fails, each re-run as its own fresh trial (no pool)."""
    cfg, res, _ = calibrated
    assert res.status == "done" and res.max_micro and res.first_fail_micro == res.max_micro + 1
    assert res.max_micro == FRESH_MICROS[0]  # the budget lies between the fresh peaks of 6 and 7
    assert res.max_global_batch == res.max_micro * 2
    assert res.measure and res.measure.time_per_step_s > 0 and res.measure.fresh
    b = res.max_micro
    (fits,) = run_launch(cfg.with_micro(b), [Entry(b)], no_leftovers / "again_b")
    (fails,) = run_launch(cfg.with_micro(b + 1), [Entry(b + 1)], no_leftovers / "again_b1")
    assert fits.status == "ok" and fails.status == "oom", (fits.reason, fails.reason)


def test_a_slow_machine_one_size_per_launch_gets_the_true_boundary_and_no_timeout(calibrated):
    """The calibrated search ran one size per launch with rank 1's steps slowed (0.25 s per sample)
    and a time-limit floor of 1.5 s, below the steps near the boundary: the limit grows with the
    measured pace, so the search decides the true boundary (the fresh peaks' b and b + 1), every
    trial fresh, with no trial called timeout (a fixed 1.5 s limit would have killed them)."""
    _, res, store = calibrated
    trials = [t for t in store.trials() if t.status != Status.NOT_RUN]
    assert [t.reason for t in trials if t.status == Status.TIMEOUT] == []
    assert (res.status, res.max_micro, res.first_fail_micro) == (
        SearchStatus.DONE, FRESH_MICROS[0], FRESH_MICROS[0] + 1), res.note
    assert all(t.fresh for t in trials), [(t.micro, t.mode) for t in trials]  # one size per launch
    slowest = max(s for t in trials for r in t.ranks for s in r.step_times)
    assert slowest > SLOW_FLOOR_S, f"no step took longer than the floor ({slowest:.2f} s): nothing was tested"


# Last in the module: it closes the module's pool (whose lock would refuse the command's own), so
# no later test has to start another one.
def test_same_answer_resumed_after_sigkill(calibrated, pools, tmp_path):
    """`zero_bench maxbatch` (several sizes per launch, the default) SIGKILLed while its first
    launch runs its second size, then run again: nothing finished is lost or run again, and the
    answer is the uninterrupted search's."""
    cfg, uninterrupted, _ = calibrated
    pools.close()  # its lock would refuse the command's own
    db = tmp_path / "resumed.sqlite"
    proc = _cli(db, tmp_path / "first", cfg)
    deadline = time.time() + 300
    # killed once its first launch's fresh trial is stored, while the size above it runs as a probe:
    # that trial must be kept, the probe's work is lost
    while _trials(db) < 1 and time.time() < deadline:
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-2000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = Store(db).trials()
    deadline = time.time() + 15  # ranks notice their parent is gone within a second, the launcher then
    while worker_processes(str(tmp_path)) and time.time() < deadline:  # sees them exit (it polls each 1 s)
        time.sleep(0.5)
    assert not worker_processes(str(tmp_path)), "ranks outlived the killed search"
    proc = _cli(db, tmp_path / "second", cfg)
    assert proc.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    (resumed,) = Store(db).searches()
    after = Store(db).trials()
    kept = {(t.launch, t.micro, t.mode, t.status) for t in after}
    assert before and all((t.launch, t.micro, t.mode, t.status) in kept for t in before), "a finished trial was lost"
    finished = [(t.micro, t.mode, t.fresh) for t in after if t.status in (Status.OK, Status.OOM)]
    assert len(finished) == len(set(finished)), "a finished trial was run again"
    answers = [(r.status, r.max_micro, r.first_fail_micro) for r in (uninterrupted, resumed)]
    assert answers == [(SearchStatus.DONE, uninterrupted.max_micro, uninterrupted.max_micro + 1)] * 2, answers
