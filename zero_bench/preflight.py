"""Before any launch: refuse what cannot fit this host, and label grid entries that are invalid."""
from __future__ import annotations

import hashlib
import json
from typing import Optional

import psutil

from zero_bench.capacity import device_capacity, local_ranks
from zero_bench.config import BenchConfig, make_label
from zero_bench.outcome import Entry, trial
from zero_bench.records import SearchResult, SearchStatus, Status, TrialResult

GiB = 2**30


def preflight(bench: BenchConfig, force: bool = False, micro: Optional[int] = None) -> Optional[TrialResult]:
    """A TrialResult with status "estimated_oom" when the estimate says the host cannot hold it.

    CPU: the predicted per-rank peak (zero_bench.estimate, at `micro`, default bench.batch.micro)
    times the ranks on this host, against the host's available memory. GPU: the device's fixed
    part (overhead + model states + buffers) against the per-device capacity ("cannot initialize
    (estimated)"), and offloaded states times the local ranks against the host's available memory.
    Multi-node (hostfile) skips the host checks: the ranks' hosts are not this one.
    None when it fits, when force=true, or when the estimate cannot be made.
    """
    from zero_bench.estimate import estimate

    if force:
        return None
    try:
        est = estimate(bench, capacity=device_capacity(bench))
    except Exception:  # noqa: BLE001 - no estimate: let the launch decide
        return None
    micro = micro or bench.batch.micro
    ranks, avail = local_ranks(bench), psutil.virtual_memory().available
    reason = ""
    if bench.hardware.device == "cpu":
        need = est.peak_bytes(micro)
        if not bench.hardware.hostfile and need * ranks > avail:
            reason = (f"does not fit (estimated): {need / GiB:.1f} GiB per rank x {ranks} ranks > "
                      f"{avail / GiB:.1f} GiB available on this host (micro={micro}); force=true launches anyway")
    else:
        fixed, cap = est.fixed_bytes(), est.capacity
        if cap and fixed > cap:
            reason = (f"cannot initialize (estimated): model states + buffers {fixed / GiB:.1f} GiB per device > "
                      f"capacity {cap / GiB:.1f} GiB; force=true launches anyway")
        elif not bench.hardware.hostfile and est.host_bytes() > avail:
            reason = (f"does not fit (estimated): offloaded states {est.states['cpu'] / GiB:.1f} GiB per rank x "
                      f"{ranks} ranks > {avail / GiB:.1f} GiB available on this host; force=true launches anyway")
    if not reason:
        return None
    return trial(bench, Entry(micro), 0, Status.ESTIMATED_OOM, reason=reason, phase="init",
                 capacity_bytes=est.capacity)


def skipped_search(c: dict, reason: str) -> SearchResult:
    """A grid entry that failed validation (`c`: the composed config as a dict), recorded with its
    reason and shown in the report."""
    m, p = c["model"], c["parallel"]
    label = make_label(m["name"], p["tp"], p["dp"], c["zero"], c["offload"], c["precision"])
    key = "skip-" + hashlib.sha256(json.dumps({k: c[k] for k in ("model", "parallel", "zero", "offload",
                                                                    "precision", "batch")},
                                              sort_keys=True, default=str).encode()).hexdigest()[:12]
    return SearchResult(search_key=key, label=label, status=SearchStatus.SKIPPED, note=reason, config=c)
