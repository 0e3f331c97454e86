"""Stores -> one Row per configuration: a SearchResult, or a trial no search owns (`zero_bench run`)."""
from __future__ import annotations

import functools
import glob
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from zero_bench.config.schema import BenchConfig
from zero_bench.config.stored import stored_config
from zero_bench.estimate import Estimate, estimate
from zero_bench.models.description import describes
from zero_bench.records import Dimension, Mode, SearchResult, SearchStatus, Status, TrialResult
from zero_bench.store import Store


def find_stores(runs: str | Path) -> list[Path]:
    """A store file, a directory holding stores (searched recursively), or a glob."""
    p = Path(runs)
    if p.is_file():
        return [p]
    if p.is_dir():  # a sweep directory: every job's store (submitit's own folder holds none)
        return sorted(x for x in p.rglob("*.sqlite") if ".submitit" not in x.parts)
    return sorted(Path(m) for m in glob.glob(str(runs), recursive=True) if Path(m).is_file())


@dataclass
class Loaded:
    searches: list[tuple[SearchResult, str]] = field(default_factory=list)  # (result, source store)
    trials: list[tuple[TrialResult, str]] = field(default_factory=list)


def load(paths: list[Path], key: str = "report.runs") -> Loaded:
    out = Loaded()
    # per-job stores of a sweep share their file name: name them by their job directory too
    unique = len({p.name for p in paths}) == len(paths)
    for p in paths:
        store, src = Store(p, key=key), p.name if unique else f"{p.parent.name}/{p.name}"
        out.searches += [(s, src) for s in store.searches()]
        out.trials += [(t, src) for t in store.trials()]
    return out


@dataclass
class Row:
    """One configuration as the report sees it."""
    config: dict
    label: str
    key: str
    status: str
    note: str
    source: str
    measure: Optional[TrialResult] = None  # the full-step trial at the boundary
    repeats: list = field(default_factory=list)  # its time/step per repeat
    max_global_batch: Optional[int] = None
    max_micro: Optional[int] = None
    dimension: Dimension = Dimension.BATCH  # what the search grew (SEQ: max_micro is the batch.micro it ran)
    max_seq_len: Optional[int] = None  # SEQ: the longest sequence that fitted

    @property
    def bench(self) -> BenchConfig:
        """The stored config as a BenchConfig (bench_of)."""
        return bench_of(self.config)

    def estimate(self) -> Optional[Estimate]:
        """The estimate for this configuration, or None for a config an old store holds only in part."""
        try:
            return estimate(self.bench) if describes(self.bench.model) else None
        except Exception:  # noqa: BLE001 - an old or partial config: no estimate terms for it
            return None


def bench_of(config: dict) -> BenchConfig:
    """A stored config as every part of the report reads it: config.stored.stored_config, once per
    config (the schema takes milliseconds, and the report asks for each row's several times)."""
    return _read(json.dumps(config, sort_keys=True, default=str))


@functools.lru_cache(maxsize=4096)
def _read(stored: str) -> BenchConfig:
    # never changed by a reader: a BenchConfig is not changed after it is built (dataclasses.replace
    # makes a new one)
    return stored_config(json.loads(stored))


def rows_of(loaded: Loaded) -> list[Row]:
    """One row per configuration: where several stores hold the same search (a merged sweep, a
    job run twice), the newest finished one wins and its Notes name the others."""
    by_key: dict[str, list[tuple[SearchResult, str]]] = {}
    for s, src in loaded.searches:
        by_key.setdefault(s.search_key, []).append((s, src))
    rows = [_newest(group) for group in by_key.values()]
    lone = [(t, src) for t, src in loaded.trials if t.search_key not in by_key]
    return rows + _lone_rows(lone)


def _newest(group: list[tuple[SearchResult, str]]) -> Row:
    s, src = max(group, key=lambda x: (x[0].status.finished, x[0].created))
    row = _search_row(s, src)
    others = sorted(o for _, o in group if o != src)
    if len(group) > 1:
        dup = f"duplicate: also in {len(group) - 1} other store(s) ({', '.join(others) or src}); newest finished shown"
        row.note = f"{row.note}; {dup}" if row.note else dup
    return row


def _search_row(s: SearchResult, source: str) -> Row:
    measure = s.measure
    return Row(config=s.config, label=s.label, key=s.search_key, status=s.status, source=source,
               note=_note(s.status, s.note), measure=measure, max_global_batch=s.max_global_batch,
               max_micro=s.max_micro, repeats=list(s.repeats or []), dimension=s.dimension,
               max_seq_len=s.max_seq_len)


def _note(status: str, note: str) -> str:
    prefix = {SearchStatus.SKIPPED: "skipped: ", SearchStatus.ESTIMATED_OOM: "does not fit (estimated): "}.get(status, "")
    return prefix + (note or "") if prefix and not (note or "").startswith(prefix) else (note or "")


def _lone_rows(trials: list[tuple[TrialResult, str]]) -> list[Row]:
    """Trials of `zero_bench run` (no search): the latest one per trial key is a configuration.

    A search killed before its summary leaves probes only: one row says so, with the best batch seen.
    """
    latest: dict[tuple, tuple[TrialResult, str]] = {}
    probes: dict[tuple, list[TrialResult]] = {}
    for t, src in trials:
        if t.mode == Mode.MEASURE or t.status == Status.ESTIMATED_OOM:
            latest[(t.trial_key, src)] = (t, src)
        elif t.status != Status.NOT_RUN:
            probes.setdefault((t.search_key, src), []).append(t)
    rows = [_trial_row(t, src) for t, src in latest.values()]
    measured = {(t.search_key, src) for t, src in latest.values()}
    rows += [_incomplete_row(ts, src) for (key, src), ts in probes.items() if (key, src) not in measured]
    return rows


def _trial_row(t: TrialResult, source: str) -> Row:
    ok = t.status == Status.OK
    note = {Status.OK: "", Status.OOM: f"OOM at global batch {t.global_batch}",
            Status.ESTIMATED_OOM: "does not fit (estimated)", Status.TIMEOUT: "timeout",
            Status.ERROR: "error"}.get(t.status, str(t.status))
    if t.reason:
        note = f"{note}: {t.reason}" if note else t.reason
    return Row(config=t.config, label=t.label, key=t.search_key, status=t.status, note=note, source=source,
               measure=t if ok else None, max_global_batch=t.global_batch if ok else None,
               max_micro=t.micro if ok else None, repeats=[t.time_per_step_s] if ok else [])


def _incomplete_row(trials: list[TrialResult], source: str) -> Row:
    fits = [t for t in trials if t.status == Status.OK]
    best = max(fits, key=lambda t: t.micro) if fits else None
    return Row(config=trials[0].config, label=trials[0].label, key=trials[0].search_key, status=SearchStatus.INCOMPLETE,
               note=f"search stopped before its summary ({len(trials)} trials)", source=source,
               max_global_batch=best.global_batch if best else None, max_micro=best.micro if best else None)
