"""maxbatch: the next-batch arithmetic (pure), then real searches on CPU against a per-rank budget."""
from __future__ import annotations

import dataclasses

import pytest

from zero_bench.config import HardwareConfig
from zero_bench.launch import Entry, run_launch
from zero_bench.results import Store
from zero_bench.search import Known, SearchSpec, done, next_plan, predict, run_search, snap

from conftest import cpu_cfg

MiB = 2**20


def simulate(boundary: int, spec: SearchSpec, base=400 * MiB, per_sample=30 * MiB, seed=None):
    """Drive next_plan against a memory model peak(m) = base + m * per_sample; count trials."""
    cap = base + boundary * per_sample + per_sample // 2
    known, trials, launches = Known(), 0, 0
    while True:
        plan = [e for e in next_plan(known, spec, cap, seed, allow_fit=launches < 2) if e.micro not in known.fits]
        if not plan:
            return known, trials, launches
        launches += 1
        for e in plan:  # a launch ends at its first failure, as the worker does
            trials += 1
            peak = base + e.micro * per_sample
            known.fits[e.micro] = peak <= cap
            known.peak[e.micro] = peak
            if not known.fits[e.micro]:
                break


@pytest.mark.parametrize("boundary", [1, 2, 7, 9, 33, 100, 1000])
@pytest.mark.parametrize("strategy", ["fit", "doubling"])
def test_search_confirms_the_boundary(boundary, strategy):
    spec = SearchSpec(max=4096, strategy=strategy)
    known, trials, _ = simulate(boundary, spec)
    assert known.lo == boundary and known.hi == boundary + 1


def test_fit_needs_fewer_trials_than_doubling():
    fit = sum(simulate(b, SearchSpec(strategy="fit"))[1] for b in (9, 33, 100, 1000))
    dbl = sum(simulate(b, SearchSpec(strategy="doubling"))[1] for b in (9, 33, 100, 1000))
    assert fit < dbl


def test_seeded_search_confirms_in_one_launch():
    known, trials, launches = simulate(57, SearchSpec(strategy="fit"), seed=57)
    assert (known.lo, known.hi, launches) == (57, 58, 1)


def test_granularity_and_bounds():
    spec = SearchSpec(min=4, max=64, granularity=4, strategy="doubling")
    assert snap(13, spec) == 12 and snap(1000, spec) == 64
    known, _, _ = simulate(30, spec)
    assert (known.lo, known.hi) == (28, 32)
    known, _, _ = simulate(5000, spec)  # everything fits: stop at search.max
    assert known.lo == 64 and done(known, spec)


def test_nothing_fits_is_an_answer():
    known, trials, _ = simulate(0, SearchSpec())
    assert known.lo is None and known.fits == {1: False} and trials == 1


def test_predict_ignores_neighbour_noise():
    k = Known(fits={64: True, 127: True, 128: True},
              peak={64: 400 * MiB, 127: 463 * MiB, 128: 470 * MiB})  # 1 MiB/sample, +6 MiB noise
    assert predict(k, 500 * MiB, SearchSpec()) == pytest.approx(158, abs=3)


# -- real searches ------------------------------------------------------------------------------

def budget_cfg(gb: float, **kw):
    cfg = cpu_cfg("gpt-mini", **kw)
    return dataclasses.replace(cfg, hardware=HardwareConfig(device="cpu", memory_gb=gb))


@pytest.mark.slow
def test_real_search_boundary_holds_in_independent_trials(tmp_path, no_leftovers):
    """Budget placed between two batch sizes by measuring first; then the search must find a
    boundary b that fits, b + 1 that does not - each re-run as its own fresh trial."""
    probe = run_launch(budget_cfg(100.0), [Entry(2), Entry(6)], tmp_path / "calibrate")
    peaks = [max(r["peak_rss_bytes"] for r in t.ranks) for t in probe]
    slope = (peaks[1] - peaks[0]) / 4
    budget = peaks[1] + 2.5 * slope  # midway between micro 8 and 9 on the measured line
    cfg = budget_cfg(budget / 2**30)
    res = run_search(cfg, SearchSpec(max=64), Store(tmp_path / "s.sqlite"), tmp_path / "search")
    assert res.status == "done" and res.max_micro and res.first_fail_micro == res.max_micro + 1
    assert res.max_global_batch == res.max_micro * 2
    assert res.measure and res.measure["time_per_step_s"] > 0
    b = res.max_micro
    (fits,) = run_launch(cfg.with_micro(b), [Entry(b)], tmp_path / "again_b")
    (fails,) = run_launch(cfg.with_micro(b + 1), [Entry(b + 1)], tmp_path / "again_b1")
    assert fits.status == "ok" and fails.status == "oom", (fits.reason, fails.reason)


@pytest.mark.slow
def test_cannot_initialize_is_reported(tmp_path, no_leftovers):
    cfg = budget_cfg(0.25)  # less than a rank needs for torch + deepspeed + the model
    res = run_search(cfg, SearchSpec(max=8), Store(tmp_path / "s.sqlite"), tmp_path / "search")
    assert res.status == "cannot_initialize" and res.max_global_batch is None
    assert "cannot even initialize" in res.note


@pytest.mark.slow
def test_killed_rank_is_oom_and_the_search_goes_on(tmp_path, no_leftovers):
    """Rank 1 is SIGKILLed (as by the kernel's OOM killer) from micro 5 on: boundary 4."""
    cfg = cpu_cfg(hardware=HardwareConfig(device="cpu", memory_gb=4.0))
    store = Store(tmp_path / "s.sqlite")
    res = run_search(cfg, SearchSpec(max=16, strategy="doubling"), store, tmp_path / "search",
                     fault={"rank": 1, "kind": "kill", "min_micro": 5})
    assert (res.status, res.max_micro, res.first_fail_micro) == ("done", 4, 5)
    statuses = {t.micro: t.status for t in store.trials(cfg.search_key()) if t.status != "not_run"}
    assert statuses[5] == "oom" and statuses[4] == "ok"


@pytest.mark.slow
def test_rank_error_stops_the_search_with_its_message(tmp_path, no_leftovers):
    cfg = cpu_cfg(hardware=HardwareConfig(device="cpu", memory_gb=4.0))
    res = run_search(cfg, SearchSpec(max=16, strategy="doubling"), Store(tmp_path / "s.sqlite"),
                     tmp_path / "search", fault={"rank": 1, "kind": "raise", "min_micro": 4})
    assert res.status == "error" and "injected fault on rank 1" in res.note
    assert res.max_global_batch is None


@pytest.mark.slow
def test_finished_search_is_not_repeated(tmp_path):
    cfg = cpu_cfg(hardware=HardwareConfig(device="cpu", memory_gb=4.0))
    store = Store(tmp_path / "s.sqlite")
    first = run_search(cfg, SearchSpec(max=2), store, tmp_path / "a")
    n = len(store.trials(cfg.search_key()))
    again = run_search(cfg, SearchSpec(max=2), store, tmp_path / "b")
    assert again.max_micro == first.max_micro == 2 and len(store.trials(cfg.search_key())) == n
