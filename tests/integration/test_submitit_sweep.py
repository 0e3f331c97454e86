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

from zero_bench import report
from zero_bench.config.schema import ReportConfig
from zero_bench.search.sweeps import JOB_STORE, sweep_status
from zero_bench.store import Store
from zero_bench.trial.machine import lock_path

from conftest import worker_processes

pytestmark = pytest.mark.slow
# precision=fp32: auto is bf16 on a CPU with native bf16 and fp32 elsewhere; this test is about the
# jobs, not the precision, and runs the same trials everywhere.
# Every size fits gpt-tiny in 4 GB (~420 MiB per rank at micro 8): the fit strategy would go straight
# to search.max, one trial, over before a kill could land in it. Doubling, one size per launch, runs
# SIZES, each a trial of its own, on any machine: a kill after the first or second leaves a search to
# resume (two trials' window for the poll to catch, on a slow machine too).
SIZES = (1, 2, 4, 8)
GRID = ["model=gpt-tiny", "precision=fp32", "zero=1,2", "hardware.memory_gb=4", f"search.max={SIZES[-1]}",
        "search.strategy=doubling", "search.multi=false", "steps.timed=2",
        "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=30"]


def sweep(tmp: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "zero_bench", "maxbatch", "-m", *GRID, f"hydra.sweep.dir={tmp / 'sweep'}"]
    return subprocess.Popen(cmd, stdout=open(tmp / "sweep.log", "a"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def query(db: Path, sql: str) -> list:
    """The rows; [] before the job created the store (any other error fails: a check of "nothing
    lost" must not pass on an unreadable store)."""
    if not db.exists():
        return []
    for attempt in range(50):
        try:
            with sqlite3.connect(db, timeout=10) as c:
                return c.execute(sql).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc) and "locked" not in str(exc) or attempt == 49:
                raise
            time.sleep(0.2)  # the job is creating its tables, or writing
    raise AssertionError("unreachable")


def trials(db: Path) -> list:
    return query(db, "SELECT id, search_key, micro, mode, status FROM trials")


def finished(db: Path) -> list:
    """The sizes of the trials that decided something (a killed trial leaves no row)."""
    return sorted(m for _, _, m, _, st in trials(db) if st in ("ok", "oom"))


def writer(db: Path) -> int | None:
    """The pid of the job writing the store's search (its claim), None when none is."""
    rows = query(db, "SELECT pid FROM claims")
    return rows[0][0] if rows else None


def lock_holder() -> int | None:
    """The pid holding the machine's (real) lock, from the text the holder writes into it."""
    try:
        text = lock_path().read_text()
    except OSError:
        return None
    return int(text.split(":")[0].split()[1]) if text.startswith("pid ") else None


def descends_from(pid: int, root: int) -> bool:
    try:
        return any(p.pid == root for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def skip_if_another_holds_the_machine(proc: subprocess.Popen, log: Path) -> None:
    """The sweep ended early because a zero_bench outside this test held the machine past the
    session's wait (the jobs exit 5): that is no failure of the product; skip naming the holder."""
    holder = lock_holder()
    if holder and psutil.pid_exists(holder) and not descends_from(holder, proc.pid):
        pytest.skip(f"machine busy, not tested: {lock_path().read_text()} held the lock; sweep: {log.read_text()[-300:]}")


def test_killed_job_resumes_and_the_merged_report_has_every_configuration(tmp_path):
    """On the machine's real lock (as a user's sweep runs): the jobs wait for each other, and for any
    other zero_bench, at most the session's wait (tests/conftest.py)."""
    stores = [tmp_path / "sweep" / str(n) / JOB_STORE for n in (0, 1)]
    log = tmp_path / "sweep.log"
    proc = sweep(tmp_path)
    # both jobs start at once; they take the machine in turn. Kill the one running trials once it has
    # finished one or more, with others to run (each takes a second or more; the poll 0.2 s): the holder of
    # the lock, a job of this sweep (not another zero_bench on the machine), the writer of its store.
    deadline, victim, killed = time.time() + 600, None, None
    while time.time() < deadline and victim is None:
        holder = lock_holder()
        mid = [s for s in stores if writer(s) == holder and 1 <= len(finished(s)) < len(SIZES)]
        if holder and mid and descends_from(holder, proc.pid) and psutil.pid_exists(holder):
            victim, (killed,) = holder, mid
        elif proc.poll() is not None:
            skip_if_another_holds_the_machine(proc, log)
            pytest.fail("the sweep ended before a job was seen mid-search (finished trials, not all) of "
                        f"{len(SIZES)}: {log.read_text()[-3000:]}")
        else:
            time.sleep(0.2)
    assert victim, "no job ran a trial"
    os.kill(victim, signal.SIGKILL)
    before = {s: trials(s) for s in stores}
    # the kill landed mid-search: trials stored (something to lose) and trials left (a resume to run)
    assert 1 <= len(finished(killed)) < len(SIZES), finished(killed)
    assert not query(killed, "SELECT status FROM searches"), "the killed job had ended its search"
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

    proc = sweep(tmp_path)  # the same sweep again: finished job skipped, killed job resumed
    if proc.wait(timeout=900) != 0:
        skip_if_another_holds_the_machine(proc, log)
        pytest.fail(log.read_text()[-3000:])
    assert {r.state for r in sweep_status(tmp_path / "sweep")} == {"done"}
    for s in stores:
        assert set(before[s]) <= set(trials(s)), f"a finished trial of {s} was lost"
    done = [(k, m, mode) for _, k, m, mode, st in trials(killed) if st in ("ok", "oom")]
    assert len(done) == len(set(done)), "a finished trial was run again"
    # the resumed search ran the sizes left, each once, and counts the stored ones as its own
    assert finished(killed) == list(SIZES), trials(killed)
    assert Store(killed).searches()[-1].trials == len(SIZES)
    assert all(Store(s).searches()[-1].status == "done" for s in stores)

    # the report in this process (what `zero_bench report report.runs=<sweep dir>` runs): an
    # interpreter's imports less; the command's own key is tests/unit/test_config.py's
    (out, *_) = report.write_reports(ReportConfig(runs=tmp_path / "sweep", out=tmp_path / "report.xlsx"))
    summary = pd.read_excel(out, sheet_name="Details")
    assert sorted(summary["ZeRO Stage"]) == [1, 2] and summary["Max Global BSZ"].notna().all()
