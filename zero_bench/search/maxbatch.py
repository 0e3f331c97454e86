"""`zero_bench maxbatch` and `maxseq`: the largest micro-batch per rank, or the longest sequence at
batch.micro, that fits, decided in fresh processes. `Search` drives launches and the store; the
boundary procedure is search/boundary.py's, one for both dimensions (search/dimension.py says
what a size means to a trial).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from zero_bench.config.configure import resolve
from zero_bench.config.schema import BenchConfig, Device, SearchConfig
from zero_bench.devices.capacity import search_capacity, trial_peak
from zero_bench.records import (Dimension, Entry, Event, Fault, Mode, RankRecord, SearchResult, SearchStatus, Seed,
                                Status, TrialResult)
# the procedure's names stay importable from here, where the search has always been
from zero_bench.search.boundary import (FIT_LAUNCHES, SEED_HEDGE, Known, bracketed, next_plan, predict,  # noqa: F401
                                        snap, verdict)
from zero_bench.search.dimension import Grow
from zero_bench.store import Store
from zero_bench.trial.launch import LaunchOptions, run_launch
from zero_bench.trial.pool import PoolSlot
from zero_bench.units import MiB


@dataclass
class SearchOptions:
    """How one invocation runs a search (beyond the config and the search keys)."""
    seed: Optional[Seed] = None  # first guess of the size and its bytes per unit of it (the analytic estimate)
    repeats: int = 1  # fresh full-step measurements at the answer (median reported)
    force: bool = False  # forget stored trials and measure again
    progress: Callable[[str], None] = print
    pools: Optional[PoolSlot] = None  # a pool shared with other searches (a sweep's); None: its own
    fault: Optional[Fault] = None  # tests only: injected into every trial (zero_bench.trial.faults)
    grow: Grow = field(default_factory=Grow)  # what the search grows: the micro-batch, or model.seq_len


def _mib(b: Optional[int]) -> str:
    return f"{b / MiB:.0f}" if b else "?"


class Search:
    """One search (max batch or max sequence): its trials (stored and new), launches, and the store
    it writes. `spec` is the grid the procedure runs on (for maxseq: dimension.seq_grid's)."""

    def __init__(self, cfg: BenchConfig, spec: SearchConfig, store: Store, run_dir: Path,
                 opts: Optional[SearchOptions] = None):
        # a config built by hand (not by configure.from_cfg) has its "auto" values resolved here
        self.cfg, self.spec, self.store, self.run_dir = resolve(cfg, here=False), spec, store, run_dir
        self.opts = opts or SearchOptions()
        self.grow = self.opts.grow
        self.key, self.label = self.grow.key(self.cfg), self.cfg.label()
        # what peaks are compared with, here and in the estimate (a bare GPU: its CUDA total)
        self.cap = search_capacity(self.cfg)
        self.trials: list[TrialResult] = []
        self.new_trials = self.launches = self.fit_launches = 0
        self.running = 0  # the size the current launch runs first (maxseq: its sequence length)
        self.error: Optional[TrialResult] = None
        # the ranks are started once for this search (or once for the sweep that passes its own)
        self.pools = (self.opts.pools or PoolSlot(run_dir / "pool")) if spec.pool else None
        self.t0 = time.time()

    def say(self, text: str) -> None:
        self.opts.progress(f"[{self.label}] {text}")

    def known(self) -> Known:
        return Known.from_trials(self.trials, self.cfg.hardware.device, self.grow.size)

    # -- driving launches -------------------------------------------------------------------------
    def run(self) -> SearchResult:
        if self.opts.force:
            self.store.forget(self.key)
        prev = self.store.search(self.key)
        if prev and prev.status.finished:
            self.say(f"already measured: {prev.status}, {answer(prev)} (force=true re-measures)")
            return prev
        self.store.claim(self.key, self.label)
        try:
            self.trials = self.store.trials(self.key)
            if self.trials:
                self.say(f"resuming from {len(self.trials)} stored trials")
                self.update_cap()
            while self.error is None and self.new_trials < self.spec.max_trials:
                plan = self.plan()
                if not plan:
                    break
                self.launch(plan)
            return self.finish()
        finally:
            if self.pools is not None and self.pools is not self.opts.pools:
                self.pools.close()
            self.store.release(self.key)

    def plan(self) -> list[Entry]:
        known = self.known()
        plan = next_plan(known, self.spec, self.cap, self.opts.seed, allow_fit=self.fit_launches < FIT_LAUNCHES)
        if not plan and verdict(known, self.spec) == SearchStatus.DONE:
            done = sum(1 for t in self.trials if self.grow.size(t) == known.lo and t.fresh
                       and t.mode == Mode.MEASURE and t.status == Status.OK)
            if done < self.opts.repeats:
                plan = [Entry(known.lo, Mode.MEASURE)]
        return plan

    def launch(self, plan: list[Entry]) -> None:
        known = self.known()
        self.launches += 1
        # after a launch placed by prediction that did not close the bracket, bisect: peaks grow
        # faster than linearly past small batches (the step's buffers hide the first samples), so a
        # second straight-line guess tends to overshoot again (docs/demo.md: the demo's searches)
        per_sample = self.opts.seed.per_sample if self.opts.seed else None
        self.fit_launches += not bracketed(known, self.spec) and predict(known, self.cap, self.spec,
                                                                           per_sample) is not None
        name = f"launch{self.launches:02d}"
        if len(plan) == 1:
            self.say(f"launch {self.launches}: {self.grow.name}={plan[0].micro} fresh ({plan[0].mode})")
        cfg, self.running = self.grow.config(self.cfg, plan[0].micro), plan[0].micro
        results = run_launch(cfg, self.grow.entries(cfg, plan), self.run_dir / name,
                             LaunchOptions(on_result=self.record, on_event=self.live, pools=self.pools,
                                           fault=self.opts.fault, pace=self.grow.pace(self.trials, cfg)))
        errs = [r for r in results if r.status == Status.ERROR]
        if errs:  # a bigger batch will not fix it
            self.error = errs[0]

    def update_cap(self) -> None:
        """On a bare GPU the ranks report the card's CUDA total: the capacity from then on."""
        if self.cfg.hardware.device == Device.gpu:
            self.cap = search_capacity(self.cfg, [r for t in self.trials for r in t.ranks])

    def record(self, t: TrialResult) -> None:
        t.search_key = self.key  # maxseq's trials each ran a config of their own sequence length
        self.store.add_trial(t)
        self.trials.append(t)
        if t.status == Status.NOT_RUN:
            return
        self.update_cap()
        self.new_trials += 1
        known = self.known()
        why = f" ({t.reason})" if t.status != Status.OK and t.reason else ""
        # a launch stopped over budget has no rank record: its sampled peak says how far it got
        peak = trial_peak(t.ranks, self.cfg.hardware.device) or max((d.peak_bytes for d in t.devices), default=None)
        what = f"seq_len={self.grow.size(t)}" if self.grow.seq else f"micro={t.micro} (global {t.global_batch})"
        self.say(f"trial {self.new_trials}: {what}{' fresh' if t.fresh else ''}"
                 f" -> {t.status}{why} | peak {_mib(peak)}/{_mib(self.cap)} MiB | elapsed "
                 f"{time.time() - self.t0:.0f}s | best so far {known.lo or '-'}")

    def live(self, rec: RankRecord) -> None:
        if rec.event == Event.BEGIN:
            what = f"seq_len={self.running} at micro={rec.micro}" if self.grow.seq else f"micro={rec.micro}"
            self.say(f"  launch {self.launches}: running {what} ({rec.mode}) "
                     f"| elapsed {time.time() - self.t0:.0f}s")

    # -- the answer ---------------------------------------------------------------------------------
    def finish(self) -> SearchResult:
        known = self.known()
        res = SearchResult(search_key=self.key, label=self.label, status=SearchStatus.INCOMPLETE,
                           strategy=self.spec.strategy, config=self.cfg.to_dict(), launches=self.launches,
                           dimension=self.grow.kind)
        status = verdict(known, self.spec)
        name = self.grow.name
        if self.error is not None:
            res.status, res.note = SearchStatus.ERROR, f"error at {name}={self.grow.size(self.error)}: {self.error.reason}"
        elif status is not None:
            res.status = status
        else:
            res.note = f"max_trials={self.spec.max_trials} reached between {known.lo} and {known.hi}"
        self._fill(res, known)
        res.trials = sum(t.status != Status.NOT_RUN for t in self.trials)
        res.wall_s = round(time.time() - self.t0, 1)
        self.store.put_search(res)
        self.say(f"{res.status}: {answer(res)} | {res.note} | {res.trials} trials, {self.launches} launches, "
                 f"{res.wall_s:.0f}s")
        return res

    def _fill(self, res: SearchResult, known: Known) -> None:
        lo, hi, name, size = known.lo, known.hi, self.grow.name, self.grow.size
        if res.status == SearchStatus.TIMEOUT:
            m = min(m for m, n in known.timeouts.items() if n >= 2 and m not in known.fresh)
            last = next(t for t in reversed(self.trials) if size(t) == m and t.status == Status.TIMEOUT)
            res.note = f"{name}={m} timed out twice: {last.reason}"
        if res.status == SearchStatus.FLAKY:
            res.note = (f"{name}={known.contradiction} failed twice while {name}={lo} fitted twice, "
                        "each in fresh processes: memory use is not repeatable here")
        if res.status == SearchStatus.DOES_NOT_FIT:
            first = next(t for t in reversed(self.trials) if size(t) == self.spec.min and t.fresh
                         and t.status == Status.OOM)
            init = first.failed_initializing
            res.status = SearchStatus.CANNOT_INITIALIZE if init else SearchStatus.DOES_NOT_FIT
            res.note = ("cannot even initialize model" if init else f"{self._said(self.spec.min)} does not fit") + \
                f" ({first.reason})"
            if not self.grow.seq:
                res.first_fail_micro = self.spec.min
            else:
                res.first_fail_seq_len = self.spec.min
        if lo is None or res.status in (SearchStatus.CANNOT_INITIALIZE, SearchStatus.DOES_NOT_FIT):
            return
        if self.grow.seq:
            res.max_seq_len, res.first_fail_seq_len = lo, hi
            res.config = self.grow.config(self.cfg, lo).to_dict()  # the report's row: the answer's config
            res.max_micro, res.max_global_batch = self.cfg.batch.micro, self.cfg.global_batch
        else:
            res.max_micro, res.first_fail_micro = lo, hi
            res.max_global_batch = self.cfg.with_micro(lo).global_batch  # micro x grad_accum x dp / sp (dp per stage)
        if res.status == SearchStatus.DONE:
            res.note = (f"OOM at {self._said(hi)} (fresh)" if hi is not None
                        else f"search.{'seq_max' if self.grow.seq else 'max'}={self.spec.max} reached")
        elif res.status == SearchStatus.ERROR:
            res.note += f"; before it, {name} {lo} fitted{'' if lo in known.measured else ' (not confirmed fresh)'}"
        got = [t for t in self.trials if size(t) == lo and t.fresh and t.mode == Mode.MEASURE and t.status == Status.OK]
        if got:
            # a repeat without time/it (fp16: every timed step overflowed) sorts last
            got.sort(key=lambda t: (t.time_per_step_s is None, t.time_per_step_s or 0.0))
            res.measure = got[len(got) // 2]  # the median run
            res.repeats = [t.time_per_step_s for t in got]

    def _said(self, size: int) -> str:
        """A size as the notes name it: a global batch, or a sequence length."""
        if self.grow.seq:
            return f"seq_len {size}"
        return f"global batch {self.cfg.with_micro(size).global_batch}"


def answer(res: SearchResult) -> str:
    """A search's answer in a few words, for the progress lines."""
    if res.dimension == Dimension.SEQ:
        return f"max seq len {res.max_seq_len}" + (f" (micro {res.max_micro})" if res.max_micro else "")
    if res.max_micro is None:
        return f"max global batch {res.max_global_batch}"
    dp = res.config.get("parallel", {}).get("dp", "?")
    return f"max global batch {res.max_global_batch} (micro {res.max_micro} x dp {dp})"


def run_search(cfg: BenchConfig, spec: SearchConfig, store: Store, run_dir: Path,
               opts: Optional[SearchOptions] = None) -> SearchResult:
    return Search(cfg, spec, store, run_dir, opts).run()
