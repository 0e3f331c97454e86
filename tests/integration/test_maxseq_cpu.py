"""A real `maxseq` search on CPU: Llama-tiny (RoPE, sdpa) on one rank at micro 1 against a small
per-rank budget, seeded by the estimate, one sequence length per fresh trial (forked from the pool).
The budget puts the boundary near 2K tokens, where a step takes about a second on 2 cores: the
search takes ~3 trials and under a minute here."""
from __future__ import annotations

import dataclasses
import time

import pytest

from zero_bench.config.schema import HardwareConfig, ParallelConfig, SearchConfig, StepsConfig
from zero_bench.devices.capacity import trial_peak
from zero_bench.estimate.seq import seed_seq
from zero_bench.records import Dimension, Mode, SearchStatus, Status
from zero_bench.search.boundary import SEED_HEDGE, snap
from zero_bench.search.dimension import Grow, seq_grid
from zero_bench.search.maxbatch import SearchOptions, run_search
from zero_bench.store import Store

from conftest import cpu_cfg

pytestmark = pytest.mark.slow
BUDGET_GB = 0.66  # ~676 MiB per rank: Llama-tiny's rank peaks ~615 MiB at 1,536 tokens and ~690 at 2,304 here


def test_real_maxseq_search_confirms_the_longest_sequence_fresh(no_leftovers):
    tmp = no_leftovers
    # one timed step: the peak is steady from the first optimizer step on (docs/verified.md, "Probe
    # length"), and a step at ~2K tokens takes about a second here
    cfg = cpu_cfg("llama-tiny", zero=1, parallel=ParallelConfig(tp=1, dp=1),
                  steps=StepsConfig(warmup=1, timed=1)).with_micro(1)
    cfg = dataclasses.replace(cfg, hardware=HardwareConfig(device="cpu", memory_gb=BUDGET_GB))
    grid, grow = seq_grid(SearchConfig(), cfg.layout), Grow(Dimension.SEQ)
    seed = seed_seq(cfg, 1, grid)
    assert seed is not None and seed.micro % 256 == 0
    store, lines = Store(tmp / "s.sqlite"), []
    t0 = time.time()
    res = run_search(cfg, grid, store, tmp / "search", SearchOptions(seed=seed, progress=lines.append, grow=grow))
    took = time.time() - t0
    print(f"maxseq: {res.max_seq_len} fits, {res.first_fail_seq_len} fails, {res.trials} trials, {took:.0f} s")

    assert res.status == SearchStatus.DONE and res.dimension == Dimension.SEQ, (res.status, res.note, lines)
    s = res.max_seq_len
    assert s % 256 == 0 and res.first_fail_seq_len == s + 256 and res.max_micro == 1
    trials = store.trials(res.search_key)
    assert trials and all(t.micro == 1 and t.fresh for t in trials)  # one length a launch: every trial fresh
    assert grow.size(trials[0]) == max(snap(SEED_HEDGE * seed.micro, grid), grid.min)  # seeded by the estimate
    at = [t for t in trials if grow.size(t) == s and t.status == Status.OK and t.mode == Mode.MEASURE]
    over = [t for t in trials if grow.size(t) == s + 256]
    assert at and over and all(t.status == Status.OOM for t in over)
    assert trial_peak(at[-1].ranks, "cpu") <= BUDGET_GB * 2**30
    m = res.measure
    assert m.time_per_step_s > 0 and m.tokens_per_s == pytest.approx(m.samples_per_s * s)
    assert res.config["model"]["seq_len"] == s
    assert res.trials <= 8 and took < 180, lines

    again = run_search(cfg, grid, store, tmp / "again", SearchOptions(progress=lambda x: None, grow=grow))
    assert again.max_seq_len == s and len(store.trials(res.search_key)) == len(trials)  # resumed: no new trial
