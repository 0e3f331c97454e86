"""The boundary procedure every search runs (search/maxbatch.py's Search drives it): integer sizes on
a grid min, min + g, ..., max, whatever they mean to a trial (a micro-batch, a sequence length:
search/dimension.py). Pure arithmetic: `Known` reads the trials' outcomes per size, `next_plan`
returns the next launch's sizes and `verdict` says when the search has an answer.

Two kinds of evidence. A *probe* is any entry of a launch; a launch may run several ascending
sizes in one engine (`search.multi`), which finds the bracket quickly but lets memory left by
earlier sizes inflate later peaks. A *fresh* trial is the first entry of its launch: nothing ran
in its processes before it. The answer b is final only when b fitted fresh (with full timed
steps: it is also the measurement) and b + granularity failed fresh; if b + g fits fresh, the
search goes on upward. Where fresh and probe evidence disagree on a size, the latest fresh one
wins, so the answer is the same whether the search ran in one go, was resumed, or ran with
`search.multi=false`.

Strategies for the bracket:
- doubling: grow x2 until a failure, then bisect.
- fit: start at SEED_HEDGE of the analytic estimate's guess, measured fresh, with the size above as
  a probe; from the largest fresh peak predict the boundary from the capacity (the slope from two
  measurements far apart, else the estimate's bytes per unit of size) and try it with the size above.
  Without an estimate, grow x2 until a prediction is possible. FIT_LAUNCHES predicted launches,
  then bisection. (A sequence's peak grows faster than linearly where attention keeps s x s
  tensors: the straight line overshoots, the failure it meets closes the bracket from above.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from zero_bench.config.schema import SearchConfig
from zero_bench.devices.capacity import growing_peak, trial_peak
from zero_bench.records import Entry, Mode, SearchStatus, Seed, Status, TrialResult


@dataclass
class Known:
    """What the trials of this search have shown so far."""
    fits: dict[int, bool] = field(default_factory=dict)  # latest fresh outcome, else any probe's
    fresh: dict[int, list[bool]] = field(default_factory=dict)  # fresh outcomes per size, in order
    measured: set[int] = field(default_factory=set)  # sizes with a fresh, fitting, full-step trial
    peak: dict[int, int] = field(default_factory=dict)  # size -> per-rank peak of the phases that grow
    # with it (fresh preferred; capacity.growing_peak): what predictions extrapolate
    timeouts: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_trials(cls, trials: list[TrialResult], device: str = "cpu",
                    size: Callable[[TrialResult], int] = lambda t: t.micro) -> "Known":
        """`size`: the grown dimension's value of a trial (Grow.size); the micro-batch by default."""
        k = cls()
        for t in trials:
            n = size(t)
            if t.status == Status.TIMEOUT:
                k.timeouts[n] = k.timeouts.get(n, 0) + 1
            if not t.status.decides_fit:
                continue
            k.add(n, t.status == Status.OK, t.fresh, trial_peak(t.ranks, device, growing_peak))
            if t.fresh and t.status == Status.OK and t.mode == Mode.MEASURE:
                k.measured.add(n)
        return k

    def add(self, micro: int, ok: bool, fresh: bool, peak: Optional[int] = None) -> None:
        if fresh:
            self.fresh.setdefault(micro, []).append(ok)
        if fresh or micro not in self.fresh:
            self.fits[micro] = ok
            if peak:
                self.peak[micro] = peak
        if fresh and not ok:
            self.measured.discard(micro)

    @property
    def lo(self) -> Optional[int]:
        ok = [m for m, f in self.fits.items() if f]
        return max(ok) if ok else None

    @property
    def hi(self) -> Optional[int]:
        lo = self.lo or 0
        bad = [m for m, f in self.fits.items() if not f and m > lo]
        return min(bad) if bad else None

    @property
    def fresh_hi(self) -> Optional[int]:
        """The smallest size above lo that failed in fresh processes (probes' failures aside)."""
        lo = self.lo or 0
        bad = [m for m, runs in self.fresh.items() if not runs[-1] and m > lo]
        return min(bad) if bad else None

    @property
    def contradiction(self) -> Optional[int]:
        """The smallest size that failed fresh below one that fitted. (A probe that failed below a
        fresh fit is no contradiction: sizes earlier in its process left memory behind.)"""
        lo = self.lo or 0
        bad = [m for m, f in self.fits.items() if not f and m < lo and m in self.fresh]
        return min(bad) if bad else None


def snap(m: float, spec: SearchConfig) -> int:
    """Round down onto the grid min, min+g, min+2g, ... within [min, max]."""
    g = spec.granularity
    k = max(0, math.floor((m - spec.min) / g))
    return min(spec.min + k * g, spec.max)


def bracketed(known: Known, spec: SearchConfig) -> bool:
    """The probes (and fresh trials) put the boundary within one granularity step."""
    lo, hi = known.lo, known.hi
    if lo is None:
        return known.fits.get(spec.min) is False
    return (hi is not None and hi - lo <= spec.granularity) or lo >= spec.max


def verdict(known: Known, spec: SearchConfig) -> Optional[SearchStatus]:
    """The search's answer once the evidence decides it, else None."""
    if any(n >= 2 and m not in known.fresh for m, n in known.timeouts.items()):
        return SearchStatus.TIMEOUT
    c, lo = known.contradiction, known.lo
    if c is not None:
        return SearchStatus.FLAKY if len(known.fresh.get(c, [])) >= 2 and len(known.fresh.get(lo, [])) >= 2 else None
    if not bracketed(known, spec):
        return None
    hi = known.hi
    if lo is None:
        return SearchStatus.DOES_NOT_FIT if spec.min in known.fresh else None
    if hi is not None and hi not in known.fresh:
        return None
    return SearchStatus.DONE if lo in known.measured else None


def predict(known: Known, cap: Optional[int], spec: SearchConfig, per_sample: Optional[int] = None) -> Optional[int]:
    """Last fitting batch, extrapolated linearly from the largest fitting measurement.

    It starts from the largest size that fitted fresh where there is one (a probe after other sizes
    in the same process peaks higher: leftovers). The slope is measured between it and the largest
    fitting size a quarter of it (at least 4 steps) below (neighbouring sizes differ by less than
    RSS's own noise); where no such pair exists, `per_sample` (the estimate's bytes per sample near
    its guess), else the nearest pair there is.
    """
    pts = sorted((m, p) for m, p in known.peak.items() if known.fits.get(m))
    if cap is None or not pts:
        return None
    fresh = [pt for pt in pts if known.fresh.get(pt[0], [False])[-1]]
    m2, p2 = (fresh or pts)[-1]
    far = [pt for pt in pts if pt[0] <= m2 - max(4 * spec.granularity, m2 / 4)]
    if far:
        m1, p1 = far[-1]
        slope = (p2 - p1) / (m2 - m1)
    elif per_sample:
        slope = per_sample
    elif len(pts) >= 2:
        m1, p1 = next(pt for pt in reversed(pts) if pt[0] != m2)
        slope = (p2 - p1) / (m2 - m1)
    else:
        return None
    if slope <= 0:
        return None
    return snap(m2 + (cap - p2) / slope, spec)


def next_plan(known: Known, spec: SearchConfig, cap: Optional[int], seed: Optional[Seed] = None,
              allow_fit: bool = True) -> list[Entry]:
    """The next launch: ascending micro sizes; empty when `verdict` has the answer.

    The first size of every launch runs fresh, so it runs full steps: if it turns out to be the
    boundary, its measurement is already there. With a pool (`search.pool`) a fresh start costs
    about a second, not a launch: a first launch that only explores (doubling's ascending sizes,
    without a seed) then probes its first size too. `allow_fit` is cleared by the
    caller after a prediction that did not close the bracket: from then on plain bisection
    guarantees the end.
    """
    plan = _next(known, spec, cap, seed, allow_fit)
    if not plan or (spec.pool and _exploring(known, plan, seed)):
        return plan
    return [Entry(plan[0].micro, Mode.MEASURE)] + plan[1:]


def _exploring(known: Known, plan: list[Entry], seed: Optional[Seed]) -> bool:
    """The first launch of a search without a seed: doubling before anything is known."""
    return len(plan) > 1 and not known.fits and seed is None


def _next(known: Known, spec: SearchConfig, cap: Optional[int], seed: Optional[Seed], allow_fit: bool) -> list[Entry]:
    if verdict(known, spec) is not None:
        return []
    retry = [m for m, n in known.timeouts.items() if n == 1 and m not in known.fresh]
    if retry:  # a timeout is retried once, fresh
        return [Entry(min(retry), Mode.MEASURE)]
    if known.contradiction is not None:
        return _retest(known)
    fit = spec.strategy == "fit" and allow_fit
    guess = predict(known, cap, spec, seed.per_sample if seed else None) if fit else None
    lo, failed = known.lo, known.fresh_hi
    if guess is not None and lo is not None and failed is not None and guess >= failed:
        # fresh processes refuted this prediction already (its slope is too low): hedge below the failure
        guess = snap(lo + SEED_HEDGE * (failed - lo), spec)
    if guess is not None and _past_a_probe(known, guess):
        return _around(guess, known, spec, ignore_probes=True)
    if bracketed(known, spec):
        return _confirm(known)
    if guess is None and fit and seed and known.lo is None:
        guess = _from_seed(known, spec, seed)
    if guess is not None:
        return _around(guess, known, spec)
    return _grow_or_bisect(known, spec)


def _retest(known: Known) -> list[Entry]:
    """A smaller size failed where a larger one fitted: test each once more, fresh."""
    c, lo = known.contradiction, known.lo
    if len(known.fresh.get(c, [])) < 2:
        return [Entry(c, Mode.PROBE)]
    return [Entry(lo, Mode.MEASURE)]


def _confirm(known: Known) -> list[Entry]:
    """The bracket is closed: decide it fresh. The size above first (full steps: if it fits after
    all, it is the next candidate and already measured), then the candidate itself."""
    lo, hi = known.lo, known.hi
    if hi is not None and hi not in known.fresh:
        return [Entry(hi, Mode.MEASURE)]
    return [Entry(lo, Mode.MEASURE)]


def _from_seed(known: Known, spec: SearchConfig, seed: Seed) -> Optional[int]:
    """Nothing fitted yet: SEED_HEDGE of the estimate's guess, measured fresh; where that failed, a
    fifth below it. From the first fresh peak, the slope places the next trial."""
    hi = known.hi
    if hi is None:
        return max(snap(SEED_HEDGE * seed.micro, spec), spec.min)
    below = snap(hi - max(spec.granularity, 0.2 * hi), spec)
    return below if below >= spec.min and known.fits.get(below) is None else None


def _past_a_probe(known: Known, guess: int) -> bool:
    """The largest fit is fresh and its peak leaves room up to `guess`, at or past a size that
    failed only as a probe (after other sizes in its process: leftovers inflate such peaks)."""
    lo, hi = known.lo, known.hi
    return (lo is not None and hi is not None and hi not in known.fresh and known.fresh.get(lo, [False])[-1]
            and guess >= hi)


def _around(guess: int, known: Known, spec: SearchConfig, ignore_probes: bool = False) -> list[Entry]:
    """The predicted boundary and the size above it (to see it fail), below the smallest size
    known to fail (ignore_probes: known to fail fresh)."""
    g, lo, hi = spec.granularity, known.lo, known.fresh_hi if ignore_probes else known.hi
    guess = max(lo + g if lo is not None else spec.min, min(guess, hi - g if hi is not None else spec.max))
    plan = [Entry(guess)]
    if spec.multi and guess + g < (hi if hi is not None else spec.max + 1):
        plan.append(Entry(guess + g))
    return plan


def _grow_or_bisect(known: Known, spec: SearchConfig) -> list[Entry]:
    """Doubling until a failure (all in one launch when `multi`), then bisection."""
    g, lo, hi = spec.granularity, known.lo, known.hi
    if hi is not None:
        base = lo if lo is not None else spec.min - g
        return [Entry(max(snap((base + hi) / 2, spec), base + g))]
    start = spec.min if lo is None else max(min(snap(lo * 2, spec), spec.max), lo + g)
    if not spec.multi:
        return [Entry(start)]
    plan, m = [], start
    while m <= spec.max and len(plan) < spec.max_trials:
        plan.append(Entry(m))
        m = max(snap(m * 2, spec), m + g)
    return plan


# The first trial of a seeded search, as a fraction of the estimate's guess: the estimate ran 24-31 %
# high on the CPU demo's models and within a few % on others (docs/estimate.md); a trial below the
# boundary still gives the fresh peak the next prediction needs, one above it only a failure.
SEED_HEDGE = 0.85
# Launches placed by prediction before the search bisects: the estimate's guess, then from the
# measured peaks (the estimate's slope, then the measured one); peaks grow faster than linearly past
# small batches, so straight-line guesses beyond that tend to overshoot again.
FIT_LAUNCHES = 3
