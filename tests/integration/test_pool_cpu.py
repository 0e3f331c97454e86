"""Trials forked from a pool (zero_bench.trial.pool): the same figures as a launch of their own, and a
child that crashes, is killed or hangs ends alone while the pool serves the next trial. Both tests
run on the session's pool (conftest.pools), as a search's trials do: one pool start (~9 s here) for
the module, none where the module before it left the pool up; each checks that its trials were
children of one pool, the forked child never the pool's first."""
from __future__ import annotations

import dataclasses
import re

import pytest

from zero_bench.records import Entry, Fault
from zero_bench.trial.launch import LaunchOptions, run_launch

from conftest import cpu_cfg, worker_processes

pytestmark = pytest.mark.slow


def test_failed_children_end_alone_and_the_pool_goes_on(no_leftovers, pools):
    """An exception, a SIGKILL (as the OOM killer sends) and a hang, each followed by a trial that
    fits: every outcome classified as in a launch of its own, all served by one pool."""
    base = cpu_cfg()
    faults = [("raise", ["ok", "error"]), ("kill", ["ok", "oom"]), ("hang", ["ok", "timeout"])]
    served = []  # (the pool's folder, the request) of each trial, from its command line
    for kind, expected in faults:
        # the hang is caught after timeout_s (the floor: a gpt-tiny step takes milliseconds);
        # the start-up and the healthy micro 1 get their own, longer limits (time_limits.py)
        cfg = dataclasses.replace(base, timeout_s=3.0) if kind == "hang" else base
        res = run_launch(cfg, [Entry(1), Entry(2)], no_leftovers / kind,
                         LaunchOptions(pools=pools, fault=Fault(kind=kind, rank=1, min_micro=2)))
        assert [r.status for r in res] == expected, (kind, [r.reason for r in res])
        if kind == "hang":
            assert res[1].reason.startswith("no step finished within") and "micro=2" in res[1].reason, res[1].reason
        (ok,) = run_launch(base, [Entry(1)], no_leftovers / f"after_{kind}", LaunchOptions(pools=pools))
        assert ok.status == "ok", (kind, ok.reason)
        # a trial over within a second is sampled too: every rank's child was found in time
        assert sorted(d.id for d in ok.devices if d.kind == "rank") == [0, 1], (kind, ok.devices)
        served += [re.search(r"--pool (\S+) .*# request (\d+):", r.cmd).groups() for r in (res[0], ok)]
    assert "injected fault on rank 1" in (no_leftovers / "raise" / "rank1.jsonl").read_text()
    first = int(served[0][1])
    assert served == [(served[0][0], str(k)) for k in range(first, first + 6)]  # one pool, one request each
    # between trials only the pool's parents are left: no child outlived its trial (a forked
    # child's command line is its parent's, which names the pool's folder)
    assert len([p for p in worker_processes(str(pools.pool.dir)) if "--pool" in " ".join(p.cmdline())
                and "deepspeed.launcher" not in " ".join(p.cmdline())]) == 2


def test_forked_child_peak_equals_a_fresh_launch(tmp_path, gpt_mini_fresh, pools):
    """Same trial (gpt-mini ZeRO-2, micro 6) in a launch of its own (the session's, shared with the
    search test's calibration) and as a later child of the pool: peak RSS per rank within 1 %, live
    tensors within 0.1 %, model states and losses identical."""
    base, fresh_runs = gpt_mini_fresh
    cfg, fresh = base.with_micro(6), fresh_runs[6]
    if pools.pool is None or not pools.pool.alive() or not pools.pool.n:
        # not a pool's first child: the module's test above (its failed children too) served its
        # first trials; run alone, this test gives the pool one
        (first,) = run_launch(cfg.with_micro(1), [Entry(1)], tmp_path / "first", LaunchOptions(pools=pools))
        assert first.status == "ok", first.reason
    started, n = pools.started, pools.pool.n
    (forked,) = run_launch(cfg, [Entry(6)], tmp_path / "forked", LaunchOptions(pools=pools))
    assert n >= 1 and (pools.started, pools.pool.n) == (started, n + 1)  # a later child of a serving pool
    assert fresh.status == forked.status == "ok"
    assert forked.fresh and f"request {n + 1}:" in forked.cmd
    for a, b in zip(fresh.ranks, forked.ranks):
        assert a.rank == b.rank
        assert abs(b.peak_rss_bytes - a.peak_rss_bytes) <= 0.01 * a.peak_rss_bytes, (a.peak_rss_bytes, b.peak_rss_bytes)
        # a few KiB apart at most (the profiler's allocation events; 6 KiB in one CI run)
        assert abs(b.peak_live_bytes - a.peak_live_bytes) <= 0.001 * a.peak_live_bytes
        assert b.model_states == a.model_states
        assert b.losses == a.losses
    # the sampler saw the children, one per rank, not the pool's parents
    assert sorted(d.id for d in forked.devices if d.kind == "rank") == [0, 1]
    for d in forked.devices:
        rank = next(r for r in forked.ranks if r.rank == d.id)
        assert d.peak_bytes <= 1.01 * rank.peak_rss_bytes
