"""The sub-commands, each: composed Hydra config + its output dir -> work -> printed result + exit code.

Exit codes (also in `zero_bench --help`): 0 the command answered (for maxbatch: a boundary, or
"does not fit" / "cannot initialize", which are answers); 2 bad input (one line names the key);
3 `run`: the trial did not fit (oom, or refused by the estimate); 4 a trial or search ended in
error, timeout, flaky or incomplete; 5 another zero_bench holds this machine's trial lock.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from zero_bench.capacity import with_cpu_budget
from zero_bench.doctor import prebuild_ops
from zero_bench.config import (BenchConfig, ConfigError, cuda_available, from_cfg, integer, search_from_cfg,
                               validate_machine, validate_static)
from zero_bench.machine import machine_lock
from zero_bench.hosts import with_slurm_hostfile
from zero_bench.records import SearchResult, SearchStatus, Status, TrialResult
from zero_bench.results import Store
from zero_bench.sweeps import JOB_STORE, finished_elsewhere, format_status, sweep_status, under_submitit

OK, BAD_INPUT, DID_NOT_FIT, FAILED, BUSY = 0, 2, 3, 4, 5
MiB, GiB = 2**20, 2**30


def _bench(cfg: DictConfig, out: Path) -> BenchConfig:
    bench = with_slurm_hostfile(from_cfg(cfg), out)
    validate_machine(bench)
    return bench


def store_path(cfg: DictConfig, out: Path) -> Path:
    """`store`; a job started by Hydra's submitit launcher writes its own store in its job directory
    (SQLite on a cluster's shared filesystem must not be written by many jobs), unless store= is given."""
    if under_submitit() and "store" not in explicit_keys():
        return out / JOB_STORE
    return Path(cfg.store)


def _sweep_dir() -> Optional[Path]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    return Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None


def result_row(r: TrialResult) -> str:
    peaks = " ".join(f"{d.kind}{d.id}={d.peak_bytes / MiB:.0f}/{(d.total_bytes or 0) / MiB:.0f}MiB"
                     for d in r.devices)
    rss = " ".join(f"r{x.rank}:{(x.peak_rss_bytes or 0) / MiB:.0f}MiB" for x in r.ranks)
    perf = (f"time/it {r.time_per_step_s * 1e3:.1f} ms | {r.samples_per_s:.2f} samples/s | "
            f"{r.tokens_per_s:.0f} tokens/s | loss {r.loss:.4f}" if r.status == Status.OK else r.reason)
    return (f"{r.label} | global batch {r.global_batch} (micro {r.micro}) | {r.status} | {perf} | "
            f"peak RSS {rss} | sampled {peaks}")


# -- run ---------------------------------------------------------------------------------------------

def run(cfg: DictConfig, out: Path) -> int:
    """One trial at the configured batch with full timed steps."""
    from zero_bench.launch import Entry, run_launch
    from zero_bench.preflight import preflight

    bench = _bench(cfg, out)
    store = Store(store_path(cfg, out))
    refused = preflight(bench, force=cfg.force)
    if refused:
        print(refused.reason)
        store.add_trial(refused)
        return DID_NOT_FIT
    prebuild_ops(bench)
    print(f"zero_bench run: {bench.label()} micro={bench.batch.micro} -> {out}", flush=True)
    (res,) = run_launch(bench, [Entry(bench.batch.micro, "measure")], out)
    store.add_trial(res)
    print(result_row(res))
    return {Status.OK: OK, Status.OOM: DID_NOT_FIT}.get(res.status, FAILED)


# -- maxbatch ----------------------------------------------------------------------------------------

def maxbatch(cfg: DictConfig, out: Path) -> int:
    """Largest global batch for one configuration (Hydra -m sweeps call this once per config)."""
    sweep_progress(f"model={cfg.model.name} {OmegaConf.to_container(cfg.parallel)} zero={cfg.zero} "
                   f"offload={cfg.offload}", finished=False)
    res = _maxbatch(cfg, out)
    sweep_progress(f"{res.label}: {res.status} max global batch {res.max_global_batch}", finished=True)
    if res.status in (SearchStatus.ERROR, SearchStatus.TIMEOUT, SearchStatus.FLAKY, SearchStatus.INCOMPLETE):
        return FAILED
    return OK


def _maxbatch(cfg: DictConfig, out: Path) -> SearchResult:
    from zero_bench.estimate import seed_micro
    from zero_bench.preflight import preflight, skipped_search
    from zero_bench.search import SearchOptions, run_search

    spec = search_from_cfg(cfg)
    integer("repeats", cfg.repeats)
    store = Store(store_path(cfg, out))
    try:
        bench = with_cpu_budget(_bench(cfg, out), spec.cpu_budget_gb)
    except ConfigError as exc:  # inside a grid, a bad combination is recorded, never fatal
        if not os.environ.get("ZERO_BENCH_SWEEP_TOTAL"):
            raise
        res = skipped_search(OmegaConf.to_container(cfg, resolve=True), str(exc))
        store.put_search(res)
        print(f"zero_bench maxbatch: skipped {res.label}: {exc}", file=sys.stderr)
        return res
    refused = preflight(bench, force=cfg.force, micro=spec.min)
    if refused:
        res = SearchResult(search_key=bench.search_key(), label=bench.label(), status=SearchStatus.ESTIMATED_OOM,
                           note=refused.reason, config=bench.to_dict())
        store.put_search(res)
        print(refused.reason)
        return res
    prebuild_ops(bench)
    print(f"zero_bench maxbatch: {bench.label()} strategy={spec.strategy} -> {out}", flush=True)
    opts = SearchOptions(seed=seed_micro(bench) if cfg.estimate_first else None, repeats=cfg.repeats,
                         force=cfg.force, progress=lambda s: print(s, flush=True), pools=sweep_pools())
    sweep_dir = _sweep_dir()
    done = finished_elsewhere(bench.search_key(), sweep_dir, store.path) if sweep_dir and not cfg.force else None
    if done is not None:
        print(f"zero_bench maxbatch: {done.label} finished in another store of this sweep: {done.status}, "
              f"max global batch {done.max_global_batch} (force=true re-measures)", flush=True)
        return done
    # the whole search: no other zero_bench may launch between its launches; jobs of one sweep on
    # one machine (submitit_local) wait for each other
    with machine_lock(wait=under_submitit()):
        res = run_search(bench, spec, store, out, opts)
    if res.measure:
        print(result_row(res.measure))
    return res


_SWEEP_POOLS: dict = {}


def sweep_pools():
    """One pool for all searches of a multirun that runs its jobs in this process (Hydra's basic
    launcher): the ranks are launched once per sweep. Jobs in processes of their own (submitit)
    each start their own. cli.main closes it when the sweep ends."""
    from zero_bench.pool import PoolSlot

    sweep_dir = _sweep_dir()
    if sweep_dir is None or under_submitit():
        return None
    if "slot" not in _SWEEP_POOLS:
        _SWEEP_POOLS["slot"] = PoolSlot(sweep_dir.resolve() / "pool")
    return _SWEEP_POOLS["slot"]


def close_sweep_pools() -> None:
    slot = _SWEEP_POOLS.pop("slot", None)
    if slot is not None:
        slot.close()


def sweep_progress(label: str, finished: bool) -> None:
    """Under multirun: which config of how many, elapsed, and an estimate of the time left."""
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


# -- report ------------------------------------------------------------------------------------------

def report(cfg: DictConfig, out: Path) -> int:
    from omegaconf import OmegaConf

    from zero_bench.report import report_options, write_reports

    section = OmegaConf.to_container(cfg.report, resolve=True)
    paths = write_reports(report_options({**section, "runs": section.get("runs") or cfg.store}))
    for p in paths:
        print(f"wrote {p}")
    return OK


# -- status ------------------------------------------------------------------------------------------

def status(cfg: DictConfig, out: Optional[Path] = None) -> int:
    """`zero_bench status <sweep dir>`: per job of a sweep, done / running / failed / not started."""
    sweep_dir = Path(str(cfg.get("status_dir") or ""))
    if not sweep_dir.is_dir():
        raise ConfigError(f"status: {sweep_dir or '(none)'} is not a sweep directory; usage: zero_bench status "
                          "runs/multirun/DATE/TIME-maxbatch")
    rows = sweep_status(sweep_dir)
    print(f"zero_bench status {sweep_dir}")
    print(format_status(rows))
    return FAILED if any(r.state == "failed" for r in rows) else OK


# -- estimate ----------------------------------------------------------------------------------------

def bench_for_estimate(cfg: Any) -> BenchConfig:
    """A BenchConfig from the composed config, without checks against this machine.

    config.from_cfg refuses hardware.device=gpu where no GPU is visible; an estimate is for a
    machine one may not have yet, so it is built as device=cpu and the device put back afterwards
    (precision auto then resolves as it would there: bf16 on GPU, fp32 on CPU).
    """
    c = copy.deepcopy(OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg)
    device = c["hardware"].get("device", "auto")
    if device not in ("auto", "cpu", "gpu"):
        raise ConfigError(f"hardware.device={device}: allowed values are auto, cpu, gpu")
    if device == "auto":
        device = "gpu" if cuda_available() else "cpu"
    precision = c.get("precision", "auto")
    if precision == "auto":
        precision = "bf16" if device == "gpu" else "fp32"
    c["hardware"]["device"] = "cpu"
    c["precision"] = "fp32" if precision == "fp16" else precision
    bench = from_cfg(c)
    bench = dataclasses.replace(bench, hardware=dataclasses.replace(bench.hardware, device=device),
                                precision=precision)
    validate_static(bench)
    return bench


def explicit_keys() -> set[str]:
    """Keys the user set on the command line (Hydra's task overrides); empty outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = HydraConfig.get().overrides.task
    except Exception:  # noqa: BLE001 - called outside a Hydra app
        return set()
    return {ov.lstrip("~+").partition("=")[0] for ov in task}


def variants(bench: BenchConfig, explicit: set[str]) -> list[BenchConfig]:
    """The configurations to show: all stages x offload, or just the configured one when the user
    gave zero=... (offload=... alone pins the offload and shows every stage)."""
    stages = [bench.zero] if "zero" in explicit else [0, 1, 2, 3]
    offloads = [bench.offload_optimizer] if explicit & {"zero", "offload"} else [False, True]
    out = []
    for z in stages:
        for off in offloads:
            op = bench.offload_param if "offload_param" in explicit else (off and z == 3)
            v = dataclasses.replace(bench, zero=z, offload_optimizer=off, offload_param=op)
            try:
                validate_static(v)
            except ConfigError:
                continue  # e.g. ZeRO-0 with offload
            out.append(v)
    return out


def _measured(cfg: Any, bench: BenchConfig) -> Optional[int]:
    """max micro a finished search in the store found for this configuration, if any."""
    store = cfg.get("store") if hasattr(cfg, "get") else None
    if not store or not Path(store).exists():
        return None
    try:
        res = Store(store).search(bench.search_key())
    except ConfigError:  # the store is optional here
        return None
    return res.max_micro if res and res.status == SearchStatus.DONE else None


def _gib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def format_table(rows: list[dict]) -> str:
    import pandas as pd

    cols = {"config": "config", "params": "params GiB", "grads": "grads GiB", "optimizer": "optim GiB",
            "device_states": "states/dev GiB", "host_states": "host/rank GiB", "buffers": "buffers GiB",
            "act_per_sample": "act/sample MiB", "peak_micro1": "peak@micro1 GiB", "host_needed": "host/node GiB",
            "max_micro": "max micro", "max_global_batch": "max global", "measured_max_micro": "measured micro"}
    df = pd.DataFrame(rows)
    for k in ("params", "grads", "optimizer", "device_states", "host_states", "buffers", "peak_micro1",
              "host_needed"):
        df[k] = df[k].map(_gib)
    df["act_per_sample"] = df["act_per_sample"].map(lambda x: f"{x / MiB:.1f}")
    for k in ("max_micro", "max_global_batch", "measured_max_micro"):
        if k in df:
            df[k] = df[k].map(lambda x: "?" if x is None or (isinstance(x, float) and math.isnan(x))
                              else ("does not fit" if x == 0 else str(int(x))))
    keep = [k for k in cols if k in df]
    return df[keep].rename(columns=cols).to_string(index=False)


def estimate(cfg: DictConfig, out: Optional[Path] = None) -> list[dict]:
    """`zero_bench estimate [overrides] [--json]`: the table (or JSON) for the configured model."""
    from zero_bench.estimate import estimate as predict

    bench = bench_for_estimate(cfg)
    ests = [(v, predict(v)) for v in variants(bench, explicit_keys())]
    rows = [{**e.row(), "measured_max_micro": _measured(cfg, v)} for v, e in ests]
    first = ests[0][1] if ests else None
    if bool(cfg.get("json", False)) if hasattr(cfg, "get") else False:
        print(json.dumps({"model": bench.model.name, "num_params": bench.model.num_params,
                          "params_per_shard": bench.model.params_per_shard(bench.parallel.tp),
                          "tp": bench.parallel.tp, "dp": bench.parallel.dp, "device": bench.hardware.device,
                          "precision": bench.precision, "capacity_bytes": first.capacity if first else None,
                          "overhead_bytes": first.overhead if first else None,
                          "configs": [{**r, "buffers_detail": e.buffers, "activations": e.activations}
                                      for r, (_, e) in zip(rows, ests)]}, indent=2))
        return rows
    m = bench.model
    print(f"zero_bench estimate: {m.name} ({m.num_params / 1e9:.3f}B params, "
          f"{m.params_per_shard(bench.parallel.tp) / 1e9:.3f}B per TP shard) tp={bench.parallel.tp} "
          f"dp={bench.parallel.dp} on {bench.hardware.device} {bench.precision}, micro x grad_accum "
          f"{bench.batch.grad_accum}; capacity {_gib(first.capacity if first else None)} GiB per rank; fixed "
          f"overhead {(first.overhead if first else 0) / MiB:.0f} MiB per rank")
    print(format_table(rows))
    print("states/dev: params+grads+optimizer on the device; host/rank: offloaded states per rank "
          "(on CPU the same memory); peak@micro1 includes overhead and buffers; max micro: predicted "
          "largest micro-batch per rank for the capacity ('?' when no capacity is known).")
    return rows


# -- doctor ------------------------------------------------------------------------------------------

def doctor(cfg: DictConfig, out: Optional[Path] = None) -> list:
    from zero_bench.doctor import doctor_checks

    print(f"zero_bench doctor ({platform.node()}, {platform.system()} {platform.machine()}, {sys.executable})")
    checks = doctor_checks(cfg)
    for c in checks:
        print(c.line(), flush=True)
    return checks
