"""Stores -> one Row per configuration: a SearchResult, or a trial no search owns (`zero_bench run`)."""
from __future__ import annotations

import glob
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from zero_bench.records import SearchResult, TrialResult
from zero_bench.results import Store

def find_stores(runs: str | Path) -> list[Path]:
    """A store file, a directory holding stores (searched recursively), or a glob."""
    p = Path(runs)
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(p.rglob("*.sqlite"))
    return sorted(Path(m) for m in glob.glob(str(runs), recursive=True) if Path(m).is_file())


@dataclass
class Loaded:
    searches: list[tuple[SearchResult, str]] = field(default_factory=list)  # (result, source store)
    trials: list[tuple[TrialResult, str]] = field(default_factory=list)


def load(paths: list[Path], key: str = "report.runs") -> Loaded:
    out = Loaded()
    for p in paths:
        store = Store(p, key=key)
        out.searches += [(s, p.name) for s in store.searches()]
        out.trials += [(t, p.name) for t in store.trials()]
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


def rows_of(loaded: Loaded) -> list[Row]:
    searched = {(s.search_key, src) for s, src in loaded.searches}
    rows = [_search_row(s, src) for s, src in loaded.searches]
    lone = [(t, src) for t, src in loaded.trials if (t.search_key, src) not in searched]
    return rows + _lone_rows(lone)


def _search_row(s: SearchResult, source: str) -> Row:
    measure = s.measure
    return Row(config=s.config, label=s.label, key=s.search_key, status=s.status, source=source,
               note=_note(s.status, s.note), measure=measure, max_global_batch=s.max_global_batch,
               max_micro=s.max_micro, repeats=list(s.repeats or []))


def _note(status: str, note: str) -> str:
    prefix = {"skipped": "skipped: ", "estimated_oom": "does not fit (estimated): "}.get(status, "")
    return prefix + (note or "") if prefix and not (note or "").startswith(prefix) else (note or "")


def _lone_rows(trials: list[tuple[TrialResult, str]]) -> list[Row]:
    """Trials of `zero_bench run` (no search): the latest one per trial key is a configuration.

    A search killed before its summary leaves probes only: one row says so, with the best batch seen.
    """
    latest: dict[tuple, tuple[TrialResult, str]] = {}
    probes: dict[tuple, list[TrialResult]] = {}
    for t, src in trials:
        if t.mode == "measure" or t.status == "estimated_oom":
            latest[(t.trial_key, src)] = (t, src)
        elif t.status != "not_run":
            probes.setdefault((t.search_key, src), []).append(t)
    rows = [_trial_row(t, src) for t, src in latest.values()]
    measured = {(t.search_key, src) for t, src in latest.values()}
    rows += [_incomplete_row(ts, src) for (key, src), ts in probes.items() if (key, src) not in measured]
    return rows


def _trial_row(t: TrialResult, source: str) -> Row:
    ok = t.status == "ok"
    note = {"ok": "", "oom": f"OOM at global batch {t.global_batch}", "estimated_oom": "does not fit (estimated)",
            "timeout": "timeout", "error": "error"}.get(t.status, t.status)
    if t.reason:
        note = f"{note}: {t.reason}" if note else t.reason
    return Row(config=t.config, label=t.label, key=t.search_key, status=t.status, note=note, source=source,
               measure=t if ok else None, max_global_batch=t.global_batch if ok else None,
               max_micro=t.micro if ok else None, repeats=[t.time_per_step_s] if ok else [])


def _incomplete_row(trials: list[TrialResult], source: str) -> Row:
    fits = [t for t in trials if t.status == "ok"]
    best = max(fits, key=lambda t: t.micro) if fits else None
    return Row(config=trials[0].config, label=trials[0].label, key=trials[0].search_key, status="incomplete",
               note=f"search stopped before its summary ({len(trials)} trials)", source=source,
               max_global_batch=best.global_batch if best else None, max_micro=best.micro if best else None)
