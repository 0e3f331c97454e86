"""A sweep whose configurations are jobs of Hydra's submitit launcher (`submitit_local`: the same jobs
Slurm would run, as local processes), one job killed with SIGKILL mid-search, the sweep run again,
and the merged report of the per-job stores."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from zero_bench.store import Store
from zero_bench.sweeps import JOB_STORE, sweep_status

from conftest import worker_processes

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
GRID = ["model=gpt-tiny", "zero=1,2", "hardware.memory_gb=4", "search.max=8", "steps.timed=2",
        "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=30"]


def sweep(tmp: Path, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "zero_bench", "maxbatch", "-m", *GRID, f"hydra.sweep.dir={tmp / 'sweep'}"]
    return subprocess.Popen(cmd, stdout=open(tmp / "sweep.log", "a"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=ROOT)


def trials(db: Path) -> list:
    try:
        with sqlite3.connect(db) as c:
            return c.execute("SELECT id, search_key, micro, mode, status FROM trials").fetchall()
    except sqlite3.OperationalError:
        return []


def lock_holder(lock: Path) -> int | None:
    try:
        text = lock.read_text()
    except OSError:
        return None
    return int(text.split(":")[0].split()[1]) if text.startswith("pid ") else None


def test_killed_job_resumes_and_the_merged_report_has_every_configuration(tmp_path):
    lock = tmp_path / "machine.lock"
    env = {**os.environ, "ZERO_BENCH_LOCK": str(lock)}
    stores = [tmp_path / "sweep" / str(n) / JOB_STORE for n in (0, 1)]
    proc = sweep(tmp_path, env)
    # both jobs start at once; they take the machine in turn. Kill the one running trials once it has one.
    deadline, victim = time.time() + 600, None
    while time.time() < deadline and victim is None:
        holder = lock_holder(lock)
        if holder and any(len(trials(s)) >= 1 for s in stores) and psutil.pid_exists(holder):
            victim = holder
        assert proc.poll() is None, (tmp_path / "sweep.log").read_text()[-3000:]
        time.sleep(0.3)
    assert victim, "no job ran a trial"
    killed = next(s for s in stores if trials(s))
    os.kill(victim, signal.SIGKILL)
    before = {s: trials(s) for s in stores}
    # the sweep ends with an error for the killed job; the other job has finished or, if submitit
    # ended it with the sweep, is left part-way: either way nothing is done twice on the re-run
    proc.wait(timeout=900)
    rows = {r.num: r.state for r in sweep_status(tmp_path / "sweep")}
    assert len(rows) == 2 and set(rows.values()) <= {"done", "running", "failed"}, rows
    # the killed job's ranks notice within a second; its launcher sees them exit (it polls each 1 s)
    mine = str(killed.parent) + os.sep
    deadline = time.time() + 30
    while worker_processes(mine) and time.time() < deadline:
        time.sleep(0.5)
    assert not worker_processes(mine), "ranks outlived the killed job"

    proc = sweep(tmp_path, env)  # the same sweep again: finished job skipped, killed job resumed
    assert proc.wait(timeout=900) == 0, (tmp_path / "sweep.log").read_text()[-3000:]
    assert {r.state for r in sweep_status(tmp_path / "sweep")} == {"done"}
    for s in stores:
        assert set(before[s]) <= set(trials(s)), f"a finished trial of {s} was lost"
    finished = [(k, m, mode) for _, k, m, mode, st in trials(killed) if st in ("ok", "oom")]
    assert len(finished) == len(set(finished)), "a finished trial was run again"
    assert all(Store(s).searches()[-1].status == "done" for s in stores)

    out = tmp_path / "report.xlsx"
    subprocess.run([sys.executable, "-m", "zero_bench", "report", f"report.runs={tmp_path / 'sweep'}",
                    f"report.out={out}", f"hydra.run.dir={tmp_path / 'rep'}"], check=True, capture_output=True,
                   cwd=ROOT)
    summary = pd.read_excel(out, sheet_name="Details")
    assert sorted(summary["ZeRO stage"]) == [1, 2] and summary["Max Global BSZ"].notna().all()
