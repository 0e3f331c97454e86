"""Sweeps: a real Hydra multirun grid, SIGKILLed part-way, resumed, then reported.

The grid runs against a per-rank budget calibrated with two fresh ZeRO-1 trials to fall midway
between micro 2 and 3 (gpt-mini at seq 512: ~64 MiB of RSS per sample, so ~32 MiB of margin either
side), so every search ends on a real boundary below search.max (b fits, b + 1 fails). The search
the kill interrupts is ZeRO-1's (the grid's third job, after ZeRO-0's and the skipped entry): resumed,
it must find what the calibration says an uninterrupted one finds, micro 2. ZeRO-0 (~10-20 MiB more)
and ZeRO-1 + offload (~37 MiB more on CPU) sit closer to the budget: their boundaries are real but
not pinned.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from zero_bench import report
from zero_bench.config.schema import HardwareConfig, ReportConfig
from zero_bench.records import Entry
from zero_bench.store import Store
from zero_bench.trial.launch import LaunchOptions, run_launch
from zero_bench.trial.pool import PoolSlot

from conftest import cpu_cfg, model, worker_processes

pytestmark = pytest.mark.slow

MODEL = dataclasses.replace(model("gpt-mini"), seq_len=512)
GRID = ["model=gpt-mini", "model.seq_len=512", "precision=fp32", "zero=0,1", "offload=false,true", "search.max=8",
        "steps.warmup=1", "steps.timed=1"]
EXPECTED_MICRO = 2  # the calibrated boundary (search.max=8 is far above it)


def calibrated_budget_gb(tmp: Path) -> float:
    """Midway between the per-rank RSS peaks of fresh trials at micro 2 and 3 (ZeRO-1, the grid's middle).
    Both are children of one pool, as the sweep's own trials are (a forked child peaks as a launch of
    its own does: tests/integration/test_pool_cpu.py), for one launch's start-up instead of two; the
    pool is closed before the sweep starts (it holds the machine lock the sweep takes)."""
    peaks = []
    with PoolSlot(tmp / "pool") as pools:
        for m in (EXPECTED_MICRO, EXPECTED_MICRO + 1):
            cfg = cpu_cfg(model=MODEL, zero=1, hardware=HardwareConfig(device="cpu", memory_gb=100.0))
            (t,) = run_launch(cfg, [Entry(m)], tmp / f"calibrate{m}", LaunchOptions(pools=pools))
            assert t.status == "ok", t.reason
            peaks.append(max(r.peak_rss_bytes for r in t.ranks))
    assert peaks[1] - peaks[0] > 48 * 2**20, peaks  # a sample is worth a margin on either side
    return (peaks[0] + peaks[1]) / 2 / 2**30


def sweep(tmp: Path, budget_gb: float, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "zero_bench", "maxbatch", "-m", *GRID, f"hardware.memory_gb={budget_gb!r}",
           f"store={tmp / 'store.sqlite'}", f"hydra.sweep.dir={tmp / 'sweep'}", *extra]
    return subprocess.Popen(cmd, stdout=open(tmp / "sweep.log", "a"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=Path(__file__).resolve().parents[2])


def shm_of(tmp: Path) -> set[str]:
    """DeepSpeed's /dev/shm buffers of this test's launches (named after their master ports, which
    the launches' command lines and pool requests under `tmp` record); others' are not looked at."""
    ports = set()
    for f in tmp.rglob("*"):
        if f.is_file() and f.suffix in (".txt", ".json", ".log") and f.stat().st_size < 1 << 20:
            text = f.read_text(errors="replace")
            ports |= set(re.findall(r"master_port[= ](\d+)", text)) | set(re.findall(r'"port": (\d+)', text))
    return {p.name for p in Path("/dev/shm").glob("deepspeed_*") if any(f"_{port}_" in p.name for port in ports)}


def rows(db: Path, sql: str) -> list:
    if not db.exists():
        return []
    with sqlite3.connect(db) as c:
        try:
            return c.execute(sql).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):  # the sweep has not created them yet
                return []
            raise  # anything else would make "nothing lost" pass on an empty list


def test_killed_sweep_resumes_without_losing_or_repeating(tmp_path):
    db = tmp_path / "store.sqlite"
    budget = calibrated_budget_gb(tmp_path / "calibration")
    proc = sweep(tmp_path, budget)
    # Kill once one search has finished and the next one has recorded trials of its own.
    deadline = time.time() + 600
    while time.time() < deadline:
        done_keys = {k for (k,) in rows(db, "SELECT search_key FROM searches WHERE status='done'")}
        labels = {k: json.loads(body)["label"] for k, body in rows(db, "SELECT search_key, body FROM trials")}
        open_keys = set(labels) - done_keys
        if done_keys and open_keys:
            break
        assert proc.poll() is None, (tmp_path / "sweep.log").read_text()[-3000:]
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_shm = shm_of(tmp_path)  # what the killed launches had in /dev/shm, if anything
    before = rows(db, "SELECT id, search_key, micro, mode, status FROM trials")
    deadline = time.time() + 15  # ranks notice their parent is gone within a second, the launcher then
    while worker_processes(str(tmp_path)) and time.time() < deadline:  # sees them exit (it polls each 1 s)
        time.sleep(0.5)
    assert not worker_processes(str(tmp_path)), "ranks outlived the killed sweep"

    proc = sweep(tmp_path, budget)
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
    # every answer a real boundary; the search killed part-way finds what an uninterrupted one does
    # (the calibration's): a trial killed with the sweep is no evidence of a misfit
    answers = {s.label: (s.status, s.max_micro, s.first_fail_micro) for s in searches if s.status != "skipped"}
    assert [labels[k] for k in open_keys] == ["GPT-mini tp1 dp2 zero1 fp32"], [labels[k] for k in open_keys]
    assert answers["GPT-mini tp1 dp2 zero1 fp32"] == ("done", EXPECTED_MICRO, EXPECTED_MICRO + 1), answers
    for status, b, fail in answers.values():  # b fits and b + 1 fails, both below the search's cap
        assert status == "done" and 1 <= b and fail == b + 1 and fail <= 8, answers
    # DeepSpeed's buffers of the killed launches were unlinked (by the resumed sweep's lock or the
    # launches' own cleanup), and the resumed sweep left none of its own
    assert not (killed_shm & {p.name for p in Path("/dev/shm").glob("deepspeed_*")}), killed_shm
    assert not shm_of(tmp_path), shm_of(tmp_path)

    # the report in this process: `zero_bench report store=...` as a command is
    # test_fsdp2_trials.py's (its sweep's store), and saves an interpreter's imports here
    (out, *_) = report.write_reports(ReportConfig(runs=db, out=tmp_path / "report.xlsx"))
    summary = pd.read_excel(out, sheet_name="Details")
    assert len(summary) == 4
    assert summary["Notes"].astype(str).str.contains("offload=true").sum() == 1
