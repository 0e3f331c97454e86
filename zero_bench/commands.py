"""The sub-commands, each: composed Hydra config + its output dir -> work -> printed result."""
from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from zero_bench.config import BenchConfig, ConfigError, from_cfg, validate_machine
from zero_bench.results import SearchResult, Store, TrialResult


def _store(cfg: DictConfig) -> Store:
    return Store(cfg.store)


def _fault(cfg: DictConfig):
    return OmegaConf.to_container(cfg.fault) if cfg.fault else None


def _bench(cfg: DictConfig) -> BenchConfig:
    bench = from_cfg(cfg)
    validate_machine(bench)
    return bench


def result_row(r: TrialResult) -> str:
    peaks = " ".join(f"{k}={v['peak_bytes'] / 2**20:.0f}/{v['total_bytes'] / 2**20:.0f}MiB"
                     for k, v in sorted(r.devices.items()))
    rss = " ".join(f"r{x['rank']}:{x.get('peak_rss_bytes', 0) / 2**20:.0f}MiB" for x in r.ranks)
    perf = (f"time/it {r.time_per_step_s * 1e3:.1f} ms | {r.samples_per_s:.2f} samples/s | "
            f"{r.tokens_per_s:.0f} tokens/s | loss {r.loss:.4f}" if r.status == "ok" else r.reason)
    return (f"{r.label} | global batch {r.global_batch} (micro {r.micro}) | {r.status} | {perf} | "
            f"peak RSS {rss} | sampled {peaks}")


def run(cfg: DictConfig, out: Path) -> TrialResult:
    """One trial at the configured batch with full timed steps."""
    from zero_bench.launch import Entry, run_launch
    from zero_bench.preflight import preflight

    bench = _bench(cfg)
    refused = preflight(bench, force=cfg.force)
    if refused:
        print(refused.reason)
        _store(cfg).add_trial(refused)
        return refused
    print(f"zero_bench run: {bench.label()} micro={bench.batch.micro} -> {out}", flush=True)
    (res,) = run_launch(bench, [Entry(bench.batch.micro, "measure")], out, fault=_fault(cfg),
                        on_result=_store(cfg).add_trial)
    print(result_row(res))
    return res


def search_spec(cfg: DictConfig):
    from zero_bench.search import SearchSpec

    d = OmegaConf.to_container(cfg.search)
    d.pop("cpu_budget_gb", None)
    return SearchSpec(**d)


def with_cpu_budget(bench: BenchConfig, cfg: DictConfig) -> BenchConfig:
    """On CPU a search needs a per-rank budget; the host's whole RAM would take hours to fill."""
    import dataclasses

    if bench.hardware.device != "cpu" or bench.hardware.memory_gb:
        return bench
    hw = dataclasses.replace(bench.hardware, memory_gb=cfg.search.cpu_budget_gb)
    return dataclasses.replace(bench, hardware=hw)


def maxbatch(cfg: DictConfig, out: Path) -> SearchResult:
    """Largest global batch for one configuration (Hydra -m sweeps call this once per config)."""
    sweep_progress(f"model={cfg.model.name} {OmegaConf.to_container(cfg.parallel)} zero={cfg.zero} "
                   f"offload={cfg.offload}", finished=False)
    res = _maxbatch(cfg, out)
    sweep_progress(f"{res.label}: {res.status} max global batch {res.max_global_batch}", finished=True)
    return res


def _maxbatch(cfg: DictConfig, out: Path) -> SearchResult:
    from zero_bench.preflight import preflight, skipped_search
    from zero_bench.search import run_search

    store = _store(cfg)
    try:
        bench = with_cpu_budget(_bench(cfg), cfg)
    except ConfigError as exc:  # inside a grid, a bad combination is recorded, never fatal
        res = skipped_search(cfg, str(exc))
        store.put_search(res)
        print(f"zero_bench maxbatch: skipped {res.label}: {exc}", file=sys.stderr)
        return res
    refused = preflight(bench, force=cfg.force, micro=cfg.search.min)
    if refused:
        res = SearchResult(search_key=bench.search_key(), label=bench.label(), status="estimated_oom",
                           note=refused.reason, config=bench.to_dict())
        store.put_search(res)
        print(refused.reason)
        return res
    from zero_bench.estimate import seed_micro

    spec = search_spec(cfg)
    print(f"zero_bench maxbatch: {bench.label()} strategy={spec.strategy} -> {out}", flush=True)
    res = run_search(bench, spec, store, out, force=cfg.force, repeats=cfg.repeats, fault=_fault(cfg),
                     seed=seed_micro(bench) if cfg.estimate_first else None,
                     progress=lambda s: print(s, flush=True))
    if res.measure:
        print(result_row(TrialResult(**res.measure)))
    return res


def sweep_progress(label: str, finished: bool) -> None:
    """Under multirun: which config of how many, elapsed, and an estimate of the time left."""
    import os
    import time

    from hydra.core.hydra_config import HydraConfig

    total = int(os.environ.get("ZERO_BENCH_SWEEP_TOTAL", 0))
    if not total:
        return
    num = HydraConfig.get().job.num
    elapsed = time.time() - float(os.environ["ZERO_BENCH_SWEEP_T0"])
    done = num + 1 if finished else num
    left = f" | ~{elapsed / done * (total - done) / 60:.1f} min left" if done else ""
    state = "done" if finished else "starting"
    print(f"[sweep] config {num + 1}/{total} {state}: {label} | {done}/{total} done | "
          f"elapsed {elapsed / 60:.1f} min{left}", flush=True)


def report(cfg: DictConfig, out: Path):
    from zero_bench.report import write_reports

    paths = write_reports(runs=cfg.report.runs or cfg.store, out=cfg.report.out, compare=cfg.report.compare)
    for p in paths:
        print(f"wrote {p}")
    return paths


def estimate(cfg: DictConfig, out: Path):
    from zero_bench.estimate import estimate_command

    return estimate_command(cfg)


def doctor(cfg: DictConfig, out: Path):
    from zero_bench.doctor import doctor_command

    return doctor_command(cfg)
