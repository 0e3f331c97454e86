"""`zero_bench maxbatch`: the largest micro-batch per rank that fits, confirmed at the boundary.

The arithmetic (what to try next, when to stop) is pure: `next_plan` reads what is known and
returns the next launch's ascending batch sizes. `run_search` drives launches, writes every trial
to the store the moment it is known, and resumes from the store.

Strategies:
- doubling: the baseline. Grow x2 until a failure, then bisect (about 2 log2 N trials).
- fit: grow x2 too, but stop bisecting as soon as two measurements give memory per sample:
  predict the last fitting batch b from the capacity, and try b and b + granularity together.
  An analytic estimate or a previous result seeds the first guess.
With `multi`, one launch probes several ascending sizes (a size over capacity ends the launch
cleanly; a real OOM ends it too and later sizes are tried in fresh processes).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from zero_bench.config import BenchConfig
from zero_bench.launch import Entry, capacity_bytes, run_launch
from zero_bench.results import SearchResult, Store, TrialResult


@dataclass
class SearchSpec:
    min: int = 1
    max: int = 4096
    granularity: int = 1
    max_trials: int = 24
    strategy: str = "fit"  # fit | doubling
    multi: bool = True


@dataclass
class Known:
    """What the trials of this search have shown so far."""
    fits: dict[int, bool] = field(default_factory=dict)
    peak: dict[int, int] = field(default_factory=dict)  # micro -> measured per-rank peak bytes

    @classmethod
    def from_trials(cls, trials: list[TrialResult]) -> "Known":
        k = cls()
        for t in trials:
            if t.status in ("ok", "oom", "timeout"):
                k.fits[t.micro] = t.status == "ok"
                p = measured_peak(t)
                if p:
                    k.peak[t.micro] = p
        return k

    @property
    def lo(self) -> Optional[int]:
        ok = [m for m, f in self.fits.items() if f]
        return max(ok) if ok else None

    @property
    def hi(self) -> Optional[int]:
        lo = self.lo or 0
        bad = [m for m, f in self.fits.items() if not f and m > lo]
        return min(bad) if bad else None


def measured_peak(t: TrialResult) -> Optional[int]:
    """Per-rank peak compared with capacity: RSS on CPU, torch's reserved bytes on GPU."""
    vals = [r.get("torch_peak_reserved") or r.get("peak_rss_bytes") or 0 for r in t.ranks]
    return max(vals) if vals and max(vals) > 0 else None


def snap(m: float, spec: SearchSpec) -> int:
    """Round down onto the grid min, min+g, min+2g, ... within [min, max]."""
    g = spec.granularity
    k = max(0, math.floor((m - spec.min) / g))
    return min(spec.min + k * g, spec.max)


def done(known: Known, spec: SearchSpec) -> bool:
    lo, hi = known.lo, known.hi
    if lo is None:
        return known.fits.get(spec.min) is False  # even the smallest batch fails
    return (hi is not None and hi - lo <= spec.granularity) or lo >= spec.max


def predict(known: Known, cap: Optional[int], spec: SearchSpec) -> Optional[int]:
    """Last fitting batch, extrapolated linearly from two fitting measurements far apart.

    Neighbouring batch sizes differ by less than RSS's own noise, so the slope is taken between
    the largest fitting batch and the largest one at most half of it.
    """
    pts = sorted((m, p) for m, p in known.peak.items() if known.fits.get(m))
    if cap is None or len(pts) < 2:
        return None
    m2, p2 = pts[-1]
    m1, p1 = max((pt for pt in pts[:-1] if pt[0] <= m2 / 2), default=pts[0])
    slope = (p2 - p1) / (m2 - m1)
    if slope <= 0:
        return None
    return snap(m2 + (cap - p2) / slope, spec)


def next_plan(known: Known, spec: SearchSpec, cap: Optional[int], seed: Optional[int] = None,
              allow_fit: bool = True) -> list[Entry]:
    """The next launch: ascending micro sizes, empty when the boundary is confirmed.

    `allow_fit` is cleared by the caller after two predictions that did not close the bracket:
    from then on plain bisection guarantees the end.
    """
    if done(known, spec):
        return []
    fit = spec.strategy == "fit" and allow_fit
    guess = predict(known, cap, spec) if fit else None
    if guess is None and fit and seed and not known.fits:
        return _from_seed(snap(seed, spec), spec)
    if guess is not None:
        return _around(guess, known, spec)
    return _grow_or_bisect(known, spec)


def _from_seed(guess: int, spec: SearchSpec) -> list[Entry]:
    """First launch from an estimate: the smallest batch and half the seed (so an overshooting
    seed still leaves two points to fit a line through), then the seed and its neighbour."""
    guess = max(guess, spec.min)
    if not spec.multi:
        return [Entry(guess, "measure")]
    below = sorted({spec.min, snap(guess / 2, spec)} - {guess})
    above = [Entry(guess + spec.granularity)] if guess + spec.granularity <= spec.max else []
    return [Entry(m) for m in below] + [Entry(guess, "measure")] + above


def _around(guess: int, known: Known, spec: SearchSpec) -> list[Entry]:
    """The predicted boundary, measured in full, and the size above it (to confirm it fails)."""
    g, lo, hi = spec.granularity, known.lo, known.hi
    guess = max(lo + g if lo is not None else spec.min, min(guess, hi - g if hi is not None else spec.max))
    plan = [Entry(guess, "measure")]
    if spec.multi and guess + g < (hi if hi is not None else spec.max + 1):
        plan.append(Entry(guess + g))
    return plan


def _grow_or_bisect(known: Known, spec: SearchSpec) -> list[Entry]:
    """Doubling until a failure (all in one launch when `multi`), then bisection."""
    g, lo, hi = spec.granularity, known.lo, known.hi
    if hi is not None:
        return [Entry(max(snap((lo + hi) / 2, spec), lo + g))]
    start = spec.min if lo is None else max(min(snap(lo * 2, spec), spec.max), lo + g)
    if not spec.multi:
        return [Entry(start)]
    plan, m = [], start
    while m <= spec.max and len(plan) < spec.max_trials:
        plan.append(Entry(m))
        m = max(snap(m * 2, spec), m + g)
    return plan


Progress = Callable[[str], None]


def _fmt_mib(b: Optional[int]) -> str:
    return f"{b / 2**20:.0f}" if b else "?"


def run_search(cfg: BenchConfig, spec: SearchSpec, store: Store, run_dir: Path, force: bool = False,
               repeats: int = 1, fault: Optional[dict] = None, seed: Optional[int] = None,
               progress: Progress = print) -> SearchResult:
    key = cfg.search_key()
    if force:
        store.forget(key)
    prev = store.search(key)
    if prev and prev.status in ("done", "cannot_initialize", "does_not_fit"):
        progress(f"[{cfg.label()}] already measured: max global batch {prev.max_global_batch} (force=true re-measures)")
        return prev
    t0 = time.time()
    trials = store.trials(key)
    if trials:
        progress(f"[{cfg.label()}] resuming from {len(trials)} stored trials")
    cap = capacity_bytes(cfg)
    launches = fit_launches = 0

    def record(t: TrialResult) -> None:
        store.add_trial(t)
        trials.append(t)
        if t.status == "not_run":
            return
        known = Known.from_trials(trials)
        progress(f"[{cfg.label()}] trial {sum(x.status != 'not_run' for x in trials)}: micro={t.micro} "
                 f"(global {t.global_batch}) -> {t.status}"
                 f"{' (' + t.reason + ')' if t.status != 'ok' and t.reason else ''} | peak "
                 f"{_fmt_mib(measured_peak(t))}/{_fmt_mib(cap)} MiB | elapsed {time.time() - t0:.0f}s | "
                 f"best so far {known.lo if known.lo else '-'}")

    def live(rec: dict) -> None:
        if rec.get("event") == "begin":
            progress(f"[{cfg.label()}]   launch {launches}: running micro={rec['micro']} ({rec['mode']}) "
                     f"| elapsed {time.time() - t0:.0f}s")

    error = None
    while True:
        known = Known.from_trials(trials)
        n_trials = sum(t.status != "not_run" for t in trials)
        plan = [e for e in next_plan(known, spec, cap, seed, allow_fit=fit_launches < 2)
                if e.micro not in known.fits]
        if not plan or n_trials >= spec.max_trials:
            break
        launches += 1
        fit_launches += any(e.mode == "measure" for e in plan)  # only predicted launches measure
        results = run_launch(cfg.with_micro(plan[0].micro), plan, run_dir / f"launch{launches:02d}",
                             fault=fault, on_result=record, on_event=live)
        errs = [r for r in results if r.status == "error"]
        if errs:  # a bigger batch will not fix it
            error = errs[0]
            break
    return _finish(cfg, spec, store, trials, run_dir, launches, t0, error, repeats, fault, progress)


def _finish(cfg, spec, store, trials, run_dir, launches, t0, error, repeats, fault, progress) -> SearchResult:
    key = cfg.search_key()
    known = Known.from_trials(trials)
    lo, hi = known.lo, known.hi
    res = SearchResult(search_key=key, label=cfg.label(), status="done", strategy=spec.strategy,
                       config=cfg.to_dict(), launches=launches)
    if error is not None:
        res.status, res.note = "error", f"error at micro={error.micro}: {error.reason}"
    elif lo is None and known.fits.get(spec.min) is False:
        first = next(t for t in trials if t.micro == spec.min and t.status != "not_run")
        res.status = "cannot_initialize" if first.phase == "init" else "does_not_fit"
        res.note = ("cannot even initialize model" if first.phase == "init"
                    else f"batch {spec.min * cfg.parallel.dp} does not fit") + f" ({first.reason})"
        res.first_fail_micro = spec.min
    elif not done(known, spec):
        res.status, res.note = "incomplete", f"max_trials={spec.max_trials} reached between {lo} and {hi}"
    if lo is not None and res.status in ("done", "incomplete"):
        res.max_micro, res.first_fail_micro = lo, hi
        res.max_global_batch = lo * cfg.batch.grad_accum * cfg.parallel.dp
        if hi is not None:
            res.note = res.note or f"OOM at global batch {hi * cfg.batch.grad_accum * cfg.parallel.dp}"
        elif lo >= spec.max:
            res.note = res.note or f"search.max={spec.max} reached"
        res.measure, res.repeats, extra = _measure(cfg, store, trials, lo, repeats, run_dir, fault, progress)
        res.launches = launches + extra
    res.trials = sum(t.status != "not_run" for t in trials)
    res.wall_s = round(time.time() - t0, 1)
    store.put_search(res)
    progress(f"[{cfg.label()}] {res.status}: max global batch {res.max_global_batch} "
             f"(micro {res.max_micro} x dp {cfg.parallel.dp}) | {res.note} | "
             f"{res.trials} trials, {res.wall_s:.0f}s")
    return res


def _measured(trials: list[TrialResult], micro: int) -> list[TrialResult]:
    return [t for t in trials if t.micro == micro and t.mode == "measure" and t.status == "ok"]


def _measure(cfg, store, trials, micro, repeats, run_dir, fault, progress):
    """Full timed steps at the found batch, `repeats` times in all (fresh launches).

    Returns (the median run as a dict, time/step of every run, launches made here)."""
    got = _measured(trials, micro)
    i = 0
    while len(got) < repeats:
        i += 1
        progress(f"[{cfg.label()}] measuring micro={micro} (repeat {len(got) + 1}/{repeats})")
        res = run_launch(cfg.with_micro(micro), [Entry(micro, "measure")], run_dir / f"measure{i:02d}",
                         fault=fault, on_result=store.add_trial)
        if res[0].status != "ok":
            progress(f"[{cfg.label()}] measurement at micro={micro} failed: {res[0].status} {res[0].reason}")
            break
        trials.append(res[0])
        got.append(res[0])
    if not got:
        return None, [], i
    best = sorted(got, key=lambda t: t.time_per_step_s)[len(got) // 2]  # the median run
    return best.__dict__, [t.time_per_step_s for t in got], i
