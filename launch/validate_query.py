"""What launch/gpu_validate.sh checks, read from its store: one line per check, "PASS|FAIL|INFO name text".

  validate_query.py STORE searches      per search: is its boundary confirmed (b fits, b + g fails, fresh)?
  validate_query.py STORE terms [TOL]   per search at its boundary: the estimate's terms beside what was
                                        measured (report/predicted.py, the report's own comparison); the
                                        device peak passes within TOL percent (default 15), the other
                                        terms are INFO: they say which term is off, not whether it is
  validate_query.py STORE pools [MIB]   per search that ran trials, what the smoke test's CUDA-OOM search
                                        checked: every trial forked from the search's pool, none launched
                                        on its own; with MIB (a GPU's emulated card) the memory reported
                                        against MIB and, where a boundary was found, a real CUDA OOM
                                        (the allocator's "out of memory") among its failures; "-": no GPU
  validate_query.py STORE all [MIB|-] [TOL]   the three above, in one process (the pack's budget)

The figures are the report's, computed by the same code, so the pack cannot disagree with the workbook
it writes. A store with no search prints one FAIL line.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's zero_bench
sys.path.insert(0, str(Path(__file__).resolve().parent))  # smoke_query, beside this script

from smoke_query import POOL_REQUEST  # noqa: E402
from zero_bench.records import SearchStatus, Status  # noqa: E402
from zero_bench.report.predicted import predicted_frame  # noqa: E402
from zero_bench.report.rows import Row, load, rows_of  # noqa: E402
from zero_bench.store import Store  # noqa: E402

DEVICE_PEAK = "device peak"  # the term the capacity is compared with (GPU: NVML used; CPU: "peak RSS")
CPU_PEAK = "peak RSS"
MiB = 2**20


def search_rows(store: str) -> list[Row]:
    return [r for r in rows_of(load([Path(store)])) if r.status in set(SearchStatus)]


def search_line(r: Row) -> str:
    """PASS for a confirmed boundary (or an answered "does not fit" / "cannot initialize")."""
    m = r.measure
    peak = max((d.peak_bytes for d in (m.devices if m else []) if d.peak_bytes), default=0)
    where = f", device peak {peak // MiB} MiB" if peak else ""
    if r.status == SearchStatus.DONE:
        return f"PASS search {r.label}: max micro {r.max_micro} (global {r.max_global_batch}){where}"
    if r.status in (SearchStatus.DOES_NOT_FIT, SearchStatus.CANNOT_INITIALIZE):
        return f"PASS search {r.label}: {r.status} ({r.note})"
    return f"FAIL search {r.label}: {r.status}: {r.note}"


def term_lines(rows: list[Row], tol: float) -> list[str]:
    frame = predicted_frame(rows)
    out = []
    for rec in frame.to_dict("records"):
        err = rec["error (%)"]
        text = (f"{rec['config']} micro {rec['micro batch']}: {rec['term']}: predicted "
                f"{_mib(rec['predicted MiB'])}, measured {_mib(rec['measured MiB'])}"
                + ("" if err is None or err != err else f" ({err:+.1f} %)"))
        peak = rec["term"].startswith((DEVICE_PEAK, CPU_PEAK))
        verdict = "INFO" if not peak or err is None or err != err else ("PASS" if abs(err) <= tol else "FAIL")
        out.append(f"{verdict} estimate {text}")
    return out or ["FAIL estimate no search reached a boundary to compare with"]


def pool_lines(store: str, capacity_mib: Optional[int]) -> list[str]:
    """Per search with trials: forked from its pool (pool.Pool.submit's command text) or launched on
    their own; on a GPU the emulated card's size it reported and its real CUDA OOMs."""
    db = Store(store)
    trials = db.trials()
    out = []
    for s in db.searches():
        mine = [t for t in trials if t.search_key == s.search_key]
        if not mine:
            continue
        forked = sum(POOL_REQUEST in (t.cmd or "") for t in mine)
        launched = len(mine) - forked
        real = sum(t.status == Status.OOM and "out of memory" in (t.reason or "").lower() for t in mine)
        gpus = s.measure.devices_of("gpu") if s.measure else []
        total = (gpus[0].total_bytes or 0) // MiB if gpus else 0
        text = f"{s.label}: {forked} trial(s) forked from its pool, {launched} launched on their own"
        ok = forked >= 1 and launched == 0
        if capacity_mib is not None:
            text += f", {real} real CUDA OOM(s), reported against {total} MiB"
            ok = ok and total == capacity_mib and (real >= 1 or s.status != SearchStatus.DONE)
        out.append(f"{'PASS' if ok else 'FAIL'} pool {text}")
    return out


def _mib(v) -> str:
    return "-" if v is None or v != v else f"{v:.0f} MiB"


def main(argv: list[str]) -> int:
    store, what = argv[1], argv[2]
    rows = search_rows(store)
    if not rows:
        print(f"FAIL searches no search in {store}")
        return 0
    capacity = None if len(argv) < 4 or argv[3] == "-" or what not in ("pools", "all") else int(argv[3])
    if what == "searches":
        print("\n".join(search_line(r) for r in rows))
    elif what == "terms":
        print("\n".join(term_lines(rows, float(argv[3]) if len(argv) > 3 else 15.0)))
    elif what == "pools":
        print("\n".join(pool_lines(store, capacity)))
    elif what == "all":
        lines = [search_line(r) for r in rows] + pool_lines(store, capacity)
        print("\n".join(lines + term_lines(rows, float(argv[4]) if len(argv) > 4 else 15.0)))
    else:
        print(f"unknown query {what!r}: searches, terms, pools, all", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
