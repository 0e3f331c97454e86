"""maxbatch arithmetic (pure): what to try next, and when fresh evidence decides the answer.

A simulated memory model stands in for launches: peak(m) = base + m * per_sample, plus `leftover`
bytes for every entry that is not the first of its launch (memory earlier sizes left behind, as
measured on CPU: ~15 MiB). Real searches: tests/integration/test_search_cpu.py.
"""
from __future__ import annotations

import pytest

from zero_bench.config.schema import BenchConfig, HardwareConfig, ParallelConfig, SearchConfig
from zero_bench.devices import capacity
from zero_bench.devices.capacity import compared_peak
from zero_bench.estimate import estimate
from zero_bench.records import RankRecord, SearchStatus, Seed, Status, TrialResult
from zero_bench.search.maxbatch import FIT_LAUNCHES, Known, Search, next_plan, predict, snap, verdict
from zero_bench.store import Store

from conftest import model

MiB, GiB = 2**20, 2**30


def result(micro: int, status: Status, fresh: bool, mode: str = "probe", peak: int = 0) -> TrialResult:
    return TrialResult(search_key="k", trial_key=f"t{micro}", label="sim", micro=micro, global_batch=2 * micro,
                       status=status, mode=mode, fresh=fresh,
                       ranks=[RankRecord(rank=0, event="end", peak_rss_bytes=peak)] if peak else [])


class Sim:
    """Runs next_plan against the memory model; records trials as the runner would."""

    def __init__(self, boundary: int, spec: SearchConfig, leftover: int = 0, seed=None,
                 base=400 * MiB, per_sample=30 * MiB):
        self.spec, self.leftover, self.base, self.per = spec, leftover, base, per_sample
        self.seed = Seed(seed, per_sample) if seed else None  # the estimate's guess and its slope
        self.cap = base + boundary * per_sample + per_sample // 2
        self.trials: list[TrialResult] = []
        self.launches = 0

    def peak(self, micro: int, position: int) -> int:
        return self.base + micro * self.per + (self.leftover if position else 0)

    def run(self, max_launches: int = 100) -> Known:
        for _ in range(max_launches):
            known = Known.from_trials(self.trials)
            plan = next_plan(known, self.spec, self.cap, self.seed, allow_fit=self.launches < FIT_LAUNCHES + 1)
            if not plan:
                return known
            self.launches += 1
            for i, e in enumerate(plan):  # a launch ends at its first failure, as the worker does
                p = self.peak(e.micro, i)
                ok = p <= self.cap
                self.trials.append(self.result(e.micro, Status.OK if ok else Status.OOM, i == 0, e.mode, p))
                if not ok:
                    break
        raise AssertionError(f"no answer after {max_launches} launches: {[(t.micro, t.status) for t in self.trials]}")


    def result(self, micro: int, status: Status, fresh: bool, mode: str, peak: int) -> TrialResult:
        return result(micro, status, fresh, mode, peak)


class FloorSim(Sim):
    """The demo's ZeRO-0 on CPU: the optimizer step's temporaries hold the RSS peak at a floor the
    batch does not move (931 MiB at micro 15 and 17) until the forward pass's activations pass it.
    RSS keeps a constant distance to the live tensors in every phase; with `phases` the ranks
    report the profiled step's live peak per phase, as the worker does."""

    def __init__(self, boundary: int, seed: int, phases: bool, floor=509 * MiB, gap=422 * MiB, **kw):
        super().__init__(boundary, SearchConfig(), leftover=20 * MiB, seed=seed, base=gap + 270 * MiB, **kw)
        self.floor, self.gap, self.phases = floor, gap, phases

    def live(self, micro: int) -> int:
        return self.base - self.gap + micro * self.per

    def peak(self, micro: int, position: int) -> int:
        return self.gap + max(self.floor, self.live(micro)) + (self.leftover if position else 0)

    def result(self, micro: int, status: Status, fresh: bool, mode: str, peak: int) -> TrialResult:
        t = result(micro, status, fresh, mode, peak)
        if status == Status.OK:
            fwd = self.live(micro)
            t.ranks[0].peak_live_bytes = max(self.floor, fwd)
            if self.phases:
                t.ranks[0].phase_live_bytes = {"forward": fwd, "backward": fwd, "step": self.floor}
        return t


def test_a_flat_step_phase_does_not_hide_the_boundary():
    """Seeded 6 samples below the boundary, inside the step's flat floor: the forward phase's own
    peak places the next trial on the boundary (3 fresh trials: the seed, b, b + 1); extrapolating
    the flat RSS peak instead takes more."""
    per_phase = FloorSim(21, seed=15, phases=True, per_sample=13 * MiB)
    assert answer(per_phase) == (SearchStatus.DONE, 21, 22)
    assert per_phase.launches == 3, [(t.micro, t.status, t.fresh) for t in per_phase.trials]
    flat = FloorSim(21, seed=15, phases=False, per_sample=13 * MiB)
    assert answer(flat) == (SearchStatus.DONE, 21, 22)
    assert flat.launches > 3


def answer(sim: Sim) -> tuple:
    known = sim.run()
    return verdict(known, sim.spec), known.lo, known.hi


@pytest.mark.parametrize("boundary", [1, 2, 7, 9, 33, 100, 1000])
@pytest.mark.parametrize("strategy", ["fit", "doubling"])
def test_search_confirms_the_boundary(boundary, strategy):
    assert answer(Sim(boundary, SearchConfig(max=4096, strategy=strategy))) == (SearchStatus.DONE, boundary,
                                                                               boundary + 1)


@pytest.mark.parametrize("multi", [True, False])
@pytest.mark.parametrize("seed", [None, 5, 10, 40])
def test_leftover_memory_cannot_change_the_answer(multi, seed):
    """Later entries of a launch peak higher (leftovers): probes say 10 fails, fresh says it fits.
    The answer is the fresh boundary whatever the grouping, the seed or search.multi."""
    spec = SearchConfig(strategy="fit", multi=multi)
    sim = Sim(10, spec, leftover=20 * MiB, seed=seed)
    assert answer(sim) == (SearchStatus.DONE, 10, 11)
    fresh = {t.micro: t.status for t in sim.trials if t.fresh}
    assert fresh[10] == Status.OK and fresh[11] == Status.OOM
    assert any(t.micro == 10 and t.fresh and t.mode == "measure" for t in sim.trials)  # the measurement is fresh


def test_answer_needs_fresh_evidence_on_both_sides():
    spec = SearchConfig()
    trials = [result(1, Status.OK, True), result(4, Status.OK, False), result(5, Status.OOM, False)]
    known = Known.from_trials(trials)
    assert verdict(known, spec) is None and [(e.micro, e.mode) for e in next_plan(known, spec, None)] == [(5, "measure")]
    known = Known.from_trials(trials + [result(5, Status.OOM, True, "measure")])
    assert verdict(known, spec) is None and [(e.micro, e.mode) for e in next_plan(known, spec, None)] == [(4, "measure")]
    known = Known.from_trials(trials + [result(5, Status.OOM, True), result(4, Status.OK, True, "measure")])
    assert verdict(known, spec) == SearchStatus.DONE and next_plan(known, spec, None) == []


def test_fresh_evidence_wins_over_probes_of_the_same_size():
    k = Known.from_trials([result(10, Status.OOM, False), result(10, Status.OK, True), result(10, Status.OOM, False)])
    assert k.fits[10] is True and k.fresh[10] == [True]


def test_unseeded_single_size_search_survives_an_overshooting_seed():
    """search.multi=false with a seed above the boundary used to crash (lo=None + granularity)."""
    assert answer(Sim(3, SearchConfig(multi=False), seed=50)) == (SearchStatus.DONE, 3, 4)


def test_fit_needs_fewer_trials_than_doubling():
    def trials(strategy):
        return sum(len(s.trials) for s in [Sim(b, SearchConfig(strategy=strategy)) for b in (9, 33, 100, 1000)]
                   if s.run())
    assert trials("fit") < trials("doubling")


def test_seeded_search_needs_few_launches():
    sim = Sim(57, SearchConfig(strategy="fit"), seed=57)
    assert answer(sim)[:2] == (SearchStatus.DONE, 57) and sim.launches <= 3


def test_granularity_and_bounds():
    spec = SearchConfig(min=4, max=64, granularity=4, strategy="doubling")
    assert snap(13, spec) == 12 and snap(1000, spec) == 64
    assert answer(Sim(30, spec)) == (SearchStatus.DONE, 28, 32)
    assert answer(Sim(5000, spec))[:2] == (SearchStatus.DONE, 64)  # everything fits: stop at search.max


def test_nothing_fits_is_an_answer():
    sim = Sim(0, SearchConfig())
    assert answer(sim) == (SearchStatus.DOES_NOT_FIT, None, 1) and len(sim.trials) == 1


def test_contradiction_is_retested_then_flaky():
    spec = SearchConfig()
    base = [result(4, Status.OOM, True), result(8, Status.OK, True, "measure"), result(9, Status.OOM, True)]
    known = Known.from_trials(base)
    assert known.contradiction == 4 and verdict(known, spec) is None
    assert [e.micro for e in next_plan(known, spec, None)] == [4]
    known = Known.from_trials(base + [result(4, Status.OK, True)])  # the re-test fits: no contradiction
    assert known.contradiction is None and verdict(known, spec) == SearchStatus.DONE
    again = base + [result(4, Status.OOM, True)]
    assert [e.micro for e in next_plan(Known.from_trials(again), spec, None)] == [8]
    known = Known.from_trials(again + [result(8, Status.OK, True, "measure")])
    assert verdict(known, spec) == SearchStatus.FLAKY and next_plan(known, spec, None) == []


def test_timeout_is_retried_once_fresh_then_reported():
    spec = SearchConfig()
    trials = [result(1, Status.OK, True), result(2, Status.TIMEOUT, False)]
    known = Known.from_trials(trials)
    assert 2 not in known.fits and [(e.micro, e.mode) for e in next_plan(known, spec, None)] == [(2, "measure")]
    known = Known.from_trials(trials + [result(2, Status.TIMEOUT, True, "measure")])
    assert verdict(known, spec) == SearchStatus.TIMEOUT and next_plan(known, spec, None) == []


def test_timeout_of_the_fresh_confirmation_ends_the_search():
    """A probe said 5 fails; its fresh confirmation times out twice: the search ends, it does not loop."""
    spec = SearchConfig()
    trials = [result(1, Status.OK, True), result(4, Status.OK, False), result(5, Status.OOM, False),
              result(5, Status.TIMEOUT, True, "measure")]
    assert [(e.micro, e.mode) for e in next_plan(Known.from_trials(trials), spec, None)] == [(5, "measure")]
    known = Known.from_trials(trials + [result(5, Status.TIMEOUT, True, "measure")])
    assert verdict(known, spec) == SearchStatus.TIMEOUT and next_plan(known, spec, None) == []


def test_predict_ignores_neighbour_noise():
    k = Known(fits={64: True, 127: True, 128: True},
              peak={64: 400 * MiB, 127: 463 * MiB, 128: 470 * MiB})  # 1 MiB/sample, +6 MiB noise
    assert predict(k, 500 * MiB, SearchConfig()) == pytest.approx(158, abs=3)


@pytest.mark.parametrize("pool", [True, False])
def test_a_seeded_search_measures_the_estimates_guess_first(pool):
    """With the estimate's guess the first launch measures SEED_HEDGE of it fresh and probes the size
    above; an exact guess and slope then take 3 fresh trials in all (the hedge, b, b + 1). Without a
    guess, a pool's first launch only explores (doubling, its first size probed: a fresh start
    costs a second)."""
    spec = SearchConfig(pool=pool)
    first = next_plan(Known(), spec, None, seed=Seed(20, 30 * MiB))
    assert [(e.micro, e.mode) for e in first] == [(17, "measure"), (18, "probe")]
    unseeded = next_plan(Known(), spec, None)
    assert [e.micro for e in unseeded][:4] == [1, 2, 4, 8] and unseeded[0].mode == ("probe" if pool else "measure")
    sim = Sim(20, spec, leftover=20 * MiB, seed=20)
    assert answer(sim) == (SearchStatus.DONE, 20, 21) and sim.launches == 3
    assert any(t.micro == 20 and t.fresh and t.mode == "measure" for t in sim.trials)


@pytest.mark.parametrize("boundary", [12, 30, 80])
@pytest.mark.parametrize("error", [-0.3, -0.2, -0.1, 0.0, 0.1, 0.2, 0.3])
@pytest.mark.parametrize("slope_error", [-0.1, 0.0, 0.1])
def test_fresh_trials_per_search_with_an_estimate_off_either_way(boundary, error, slope_error):
    """The estimate's guess 0-30 % off either way and its bytes per sample exact or 10 % off, with
    ~0.7 sample of leftovers in every probe: 3 fresh trials (the hedge below the guess, b, b + 1) from
    30 % low to 10 % high with an exact slope, at most 4 up to 30 % high, at most 5 with the slope
    10 % off (the measured slope takes over once two fresh peaks lie far enough apart)."""
    sim = Sim(boundary, SearchConfig(), leftover=20 * MiB, seed=round(boundary * (1 + error)))
    sim.seed = Seed(sim.seed.micro, int(sim.per * (1 + slope_error)))
    assert answer(sim) == (SearchStatus.DONE, boundary, boundary + 1)
    most = 5 if slope_error else (3 if error <= 0.1 else 4)
    assert sim.launches <= most, [(t.micro, t.status, t.fresh) for t in sim.trials]


def test_predict_starts_from_the_largest_fresh_peak_and_falls_back_to_the_estimates_slope():
    k = Known()
    k.add(20, True, True, 700 * MiB)
    assert predict(k, 800 * MiB, SearchConfig()) is None  # one point and no slope
    assert predict(k, 800 * MiB, SearchConfig(), per_sample=10 * MiB) == 30
    k.add(24, True, False, 760 * MiB)  # a probe after other sizes: higher than fresh would be
    assert predict(k, 800 * MiB, SearchConfig(), per_sample=10 * MiB) == 30  # from the fresh 20
    k.add(8, True, True, 580 * MiB)  # a fresh peak far below: the measured slope, 10 MiB/sample
    assert predict(k, 800 * MiB, SearchConfig(), per_sample=99 * MiB) == 30


def test_bare_gpu_search_predicts_with_the_card(monkeypatch, tmp_path):
    """hardware=gpu without memory_mib: the card decides, and the search predicts with the same
    capacity the estimate sizes against (CUDA's total, from NVML here; from the ranks once they
    reported it), instead of falling back to doubling."""
    cfg = BenchConfig(model=model("gpt-tiny"), parallel=ParallelConfig(tp=1, dp=2), precision="bf16",
                      hardware=HardwareConfig(device="gpu"))
    assert capacity.capacity_bytes(cfg) is None  # no launch cap: the card itself
    monkeypatch.setattr(capacity, "card_totals", lambda c: [80 * GiB, 79 * GiB])
    s = Search(cfg, SearchConfig(pool=False), Store(tmp_path / "s.sqlite"), tmp_path)
    assert s.cap == 79 * GiB == estimate(cfg).capacity
    known = Known()
    known.add(2, True, True, 10 * GiB)
    known.add(4, True, True, 20 * GiB)
    assert predict(known, s.cap, SearchConfig()) == snap(4 + (79 * GiB - 20 * GiB) / (5 * GiB), SearchConfig())
    # once the ranks reported CUDA's total, that is the capacity
    s.trials = [result(1, Status.OK, True)]
    s.trials[0].ranks = [RankRecord(rank=0, event="end", cuda_total_bytes=78 * GiB)]
    s.update_cap()
    assert s.cap == 78 * GiB


def test_gpu_peak_compared_is_the_device_peak():
    rec = RankRecord(rank=0, event="end", torch_peak_reserved=30 * MiB, device_peak_bytes=40 * MiB,
                     peak_rss_bytes=5 * MiB)
    assert compared_peak(rec, "gpu") == 40 * MiB and compared_peak(rec, "cpu") == 5 * MiB
    old = RankRecord(rank=0, event="end", torch_peak_reserved=30 * MiB)  # a record from before device peaks
    assert compared_peak(old, "gpu") == 30 * MiB
