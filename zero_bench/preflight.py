"""Before any launch: refuse what cannot fit this host, and label grid entries that are invalid."""
from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig, OmegaConf

from zero_bench.config import BenchConfig
from zero_bench.results import SearchResult, TrialResult


def preflight(bench: BenchConfig, force: bool = False, micro: Optional[int] = None) -> Optional[TrialResult]:
    """A TrialResult with status "estimated_oom" when the estimate says the host cannot hold it.

    CPU: the predicted per-rank peak (zero_bench.estimate, at `micro`, default bench.batch.micro)
    times the ranks on this host, against the host's available memory. GPU: the device's fixed
    part (overhead + model states + buffers) against the per-device capacity ("cannot initialize
    (estimated)"), and offloaded states times the local ranks against the host's available memory.
    Multi-node (hostfile) skips the host checks: the ranks' hosts are not this one.
    None when it fits, when force=true, or when the estimate cannot be made.
    """
    if force:
        return None
    import psutil

    from zero_bench.estimate import GiB, device_capacity, estimate, local_ranks

    try:
        est = estimate(bench, capacity=device_capacity(bench))
    except Exception:  # noqa: BLE001 - no estimate: let the launch decide
        return None
    micro = micro or bench.batch.micro
    ranks = local_ranks(bench)
    avail = psutil.virtual_memory().available
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
    c = bench.with_micro(micro)
    return TrialResult(search_key=bench.search_key(), trial_key=c.trial_key(), label=bench.label(), micro=micro,
                       global_batch=c.global_batch, status="estimated_oom", mode="probe", reason=reason,
                       phase="init", capacity_bytes=est.capacity, config=c.to_dict())


def skipped_search(cfg: DictConfig, reason: str) -> SearchResult:
    """A grid entry that failed validation: recorded with its reason, shown in the report."""
    c = OmegaConf.to_container(cfg, resolve=True)
    m, p = c["model"], c["parallel"]
    label = f"{m['name']} tp{p['tp']} dp{p['dp']} zero{c['zero']}{'+offload' if c['offload'] else ''} {c['precision']}"
    import hashlib, json

    key = "skip-" + hashlib.sha256(json.dumps({k: c[k] for k in ("model", "parallel", "zero", "offload",
                                                                    "precision", "batch")},
                                              sort_keys=True).encode()).hexdigest()[:12]
    return SearchResult(search_key=key, label=label, status="skipped", note=reason, config=c)
