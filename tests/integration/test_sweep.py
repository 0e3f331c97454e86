"""Sweeps: a real Hydra multirun grid, SIGKILLed part-way, resumed, then reported."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from zero_bench.store import Store

from conftest import worker_processes

pytestmark = pytest.mark.slow

GRID = ["model=gpt-tiny", "zero=0,1", "offload=false,true", "hardware.memory_gb=4", "search.max=8"]


def sweep(tmp: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "zero_bench", "maxbatch", "-m", *GRID, f"store={tmp / 'store.sqlite'}",
           f"hydra.sweep.dir={tmp / 'sweep'}", *extra]
    return subprocess.Popen(cmd, stdout=open(tmp / "sweep.log", "a"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=Path(__file__).resolve().parents[2])


def rows(db: Path, sql: str) -> list:
    if not db.exists():
        return []
    with sqlite3.connect(db) as c:
        try:
            return c.execute(sql).fetchall()
        except sqlite3.OperationalError:  # tables not created yet
            return []


def test_killed_sweep_resumes_without_losing_or_repeating(tmp_path):
    db = tmp_path / "store.sqlite"
    proc = sweep(tmp_path)
    # Kill once one search has finished and the next one has recorded trials of its own.
    deadline = time.time() + 600
    while time.time() < deadline:
        done_keys = {k for (k,) in rows(db, "SELECT search_key FROM searches WHERE status='done'")}
        open_keys = {k for (k,) in rows(db, "SELECT DISTINCT search_key FROM trials")} - done_keys
        if done_keys and open_keys:
            break
        assert proc.poll() is None, (tmp_path / "sweep.log").read_text()[-3000:]
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = rows(db, "SELECT id, search_key, micro, mode, status FROM trials")
    deadline = time.time() + 15  # ranks notice their parent is gone within a second, the launcher then
    while worker_processes(str(tmp_path)) and time.time() < deadline:  # sees them exit (it polls each 1 s)
        time.sleep(0.5)
    assert not worker_processes(str(tmp_path)), "ranks outlived the killed sweep"

    proc = sweep(tmp_path)
    assert proc.wait(timeout=900) == 0, (tmp_path / "sweep.log").read_text()[-3000:]
    after = rows(db, "SELECT id, search_key, micro, mode, status FROM trials")
    assert set(before) <= set(after), "a finished trial was lost"
    finished = [(k, m, mode) for _, k, m, mode, st in after if st in ("ok", "oom")]
    assert len(finished) == len(set(finished)), "a finished trial was run again"

    searches = Store(db).searches()
    assert len(searches) == 4 and len({s.label for s in searches}) == 4
    # the ranks were launched once per sweep process (the killed one and the resumed one), not per search
    assert sorted(p.name for p in (tmp_path / "sweep" / "pool").iterdir()) == ["pool01", "pool02"]
    skipped = [s for s in searches if s.status == "skipped"]
    assert len(skipped) == 1 and "offload=true" in skipped[0].note
    assert all(s.max_global_batch == 16 for s in searches if s.status == "done")

    out = tmp_path / "report.xlsx"
    subprocess.run([sys.executable, "-m", "zero_bench", "report", f"store={db}", f"report.out={out}",
                    f"hydra.run.dir={tmp_path / 'rep'}"], check=True, capture_output=True)
    summary = pd.read_excel(out, sheet_name="Details")
    assert len(summary) == 4
    assert summary["Notes"].astype(str).str.contains("offload=true").sum() == 1
