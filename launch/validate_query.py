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
  validate_query.py STORE ulysses [TOL]  per Ulysses trial (parallel.sp > 1, `zero_bench run`): its losses
                                        and gradient norms at every step beside the same run's at sp = 1
                                        (its label without sp=N, the same sequence), PASS within TOL percent
                                        (default 1: bf16 kernels differ in rounding with the shapes); and
                                        its device peak beside the estimate, as `terms` says it

The figures are the report's, computed by the same code, so the pack cannot disagree with the workbook
it writes. A store with no search prints one FAIL line (`ulysses`: with no Ulysses trial).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's zero_bench
sys.path.insert(0, str(Path(__file__).resolve().parent))  # smoke_query, beside this script

from smoke_query import POOL_REQUEST  # noqa: E402
from zero_bench.records import Dimension, Mode, RankRecord, SearchStatus, Status, TrialResult  # noqa: E402
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
    if r.status == SearchStatus.DONE and r.dimension == Dimension.SEQ:
        return f"PASS search {r.label}: max seq len {r.max_seq_len} (micro {r.max_micro}){where}"
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


def ulysses_lines(store: str, tol: float) -> list[str]:
    """Per measured Ulysses trial: PASS when its losses and gradient norms at every step are within
    tol percent of the sp = 1 trial's of the same configuration (INFO where there is none: the pack
    ran out of time for it), then its peak beside the estimate (term_lines)."""
    trials = [t for t in Store(store).trials() if t.status == Status.OK and t.mode == Mode.MEASURE]
    split = [t for t in trials if _sp(t) > 1]
    if not split:
        return ["FAIL ulysses no measured trial with parallel.sp > 1 in " + store]
    out = []
    for t in split:
        want = " ".join(w for w in t.label.split() if w != f"sp={_sp(t)}")
        refs = [r for r in trials if _sp(r) == 1 and r.label == want and _seq(r) == _seq(t)]
        mine = _steps(t)
        if not refs:
            out.append(f"INFO ulysses {t.label} seq {_seq(t)}: ran {len(mine[0])} steps, last loss "
                       f"{mine[0][-1] if mine[0] else '-'}; no sp=1 trial of it to compare with")
            continue
        out.append(_compare(t, refs[-1], mine, _steps(refs[-1]), tol))
    labels = {t.label for t in split}
    rows = [r for r in rows_of(load([Path(store)])) if r.label in labels and r.status == Status.OK]
    return out + term_lines(rows, 15.0)


def _compare(t: TrialResult, ref: TrialResult, mine: tuple, theirs: tuple, tol: float) -> str:
    """One verdict: every step's loss and gradient norm within tol percent of sp = 1's; the global
    batch halved (a sample of a sequence group is one sequence)."""
    head = f"ulysses {t.label} seq {_seq(t)} vs sp=1"
    if len(mine[0]) < 2 or len(mine[0]) != len(theirs[0]) or len(mine[1]) != len(theirs[1]):
        return (f"FAIL {head}: {len(mine[0])} losses / {len(mine[1])} gradient norms against "
                f"{len(theirs[0])} / {len(theirs[1])}")
    loss, norm = _worst(mine[0], theirs[0]), _worst(mine[1], theirs[1])
    batch = t.global_batch * _sp(t) == ref.global_batch
    ok = loss <= tol and norm <= tol and batch
    return (f"{'PASS' if ok else 'FAIL'} {head}: {len(mine[0])} steps, losses within {loss:.3g} %, gradient norms "
            f"within {norm:.3g} % (tolerance {tol:g} %); global batch {t.global_batch} against {ref.global_batch}"
            f"{'' if batch else f' (want {ref.global_batch // _sp(t)})'}; last loss {mine[0][-1]:.5g} vs {theirs[0][-1]:.5g}")


def _sp(t: TrialResult) -> int:
    return int((t.config.get("parallel") or {}).get("sp", 1))


def _seq(t: TrialResult) -> int:
    return int((t.config.get("model") or {}).get("seq_len", 0))


def _steps(t: TrialResult) -> tuple[list, list]:
    """Rank 0's losses and gradient norms (every rank of a sequence group reports the group's)."""
    ends: list[RankRecord] = sorted((r for r in t.ranks if r.losses), key=lambda r: r.rank)
    return (list(ends[0].losses), list(ends[0].grad_norms)) if ends else ([], [])


def _worst(a: list, b: list) -> float:
    """The largest relative difference over the steps, in percent (inf where sp = 1's is 0)."""
    return max((abs(x - y) / abs(y) * 100 if y else (0.0 if x == y else float("inf")) for x, y in zip(a, b)),
               default=0.0)


def _mib(v) -> str:
    return "-" if v is None or v != v else f"{v:.0f} MiB"


def main(argv: list[str]) -> int:
    store, what = argv[1], argv[2]
    if what == "ulysses":
        print("\n".join(ulysses_lines(store, float(argv[3]) if len(argv) > 3 else 1.0)))
        return 0
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
        print(f"unknown query {what!r}: searches, terms, pools, all, ulysses", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
