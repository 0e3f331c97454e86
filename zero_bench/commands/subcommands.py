"""The sub-commands: each takes the composed config and its `Invocation`, does its work, prints
its result and returns an exit code. `COMMANDS` is the table cli.py dispatches on.

Exit codes (also in `zero_bench --help`): 0 the command answered (for maxbatch and maxseq: a boundary, or
"does not fit" / "cannot initialize", which are answers); 2 bad input (one line names the key);
3 `run`: the trial did not fit (oom, or refused by the estimate); 4 a trial or search ended in
error, timeout, flaky or incomplete; 5 another zero_bench holds this machine's trial lock.
"""
from __future__ import annotations

import json
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from zero_bench.commands import calibrate as calibration_run
from zero_bench.commands.doctor import doctor_checks, prebuild_ops
from zero_bench.config import honoured
from zero_bench.config.configure import from_cfg, report_from_cfg, search_from_cfg
from zero_bench.config.hosts import with_slurm_hostfile
from zero_bench.config.schema import BenchConfig, ConfigError, Device, Precision, SearchConfig
from zero_bench.devices import cpu_features
from zero_bench.devices.capacity import marketed_gb_warning, with_cpu_budget
from zero_bench.devices.metrics import cpu_peak_flops
from zero_bench.estimate import seed_micro
from zero_bench.estimate.seq import seed_seq
from zero_bench.estimate.table import estimate_report
from zero_bench.records import Dimension, Entry, Mode, SearchResult, SearchStatus, Status, TrialResult
from zero_bench.report import write_reports
from zero_bench.search.dimension import Grow, check_positions, past_positions, seq_grid
from zero_bench.search.maxbatch import SearchOptions, answer, run_search
from zero_bench.search.preflight import preflight, skipped_search, validate_machine
from zero_bench.search.sweeps import JOB_STORE, Sweep, finished_elsewhere, format_status, sweep_status, under_submitit
from zero_bench.store import Store
from zero_bench.trial.launch import run_launch
from zero_bench.trial.machine import machine_lock
from zero_bench.units import MiB

OK, BAD_INPUT, DID_NOT_FIT, FAILED, BUSY = 0, 2, 3, 4, 5


@dataclass
class Invocation:
    """What a sub-command gets besides the config."""
    out: Path  # this job's Hydra output directory (its run dir)
    sweep: Optional[Sweep] = None  # the multirun this job belongs to; None: a single run
    explicit: frozenset = frozenset()  # keys the user set on the command line (estimate shows less then)
    said: set = field(default_factory=set)  # warnings printed: a sweep's jobs in one process share it


def warn_once(line: str, inv: Invocation) -> None:
    """`line` on stderr, once per command: a sweep's jobs would otherwise repeat it."""
    if line not in inv.said:
        inv.said.add(line)
        print(f"zero_bench: warning: {line}", file=sys.stderr, flush=True)


def warn_slow_bf16(bench: BenchConfig, inv: Invocation) -> None:
    """precision=bf16 on a CPU without native bf16 runs, at the speed measured here (the rates are
    cached per machine). precision=auto never picks it, so only an explicit bf16 gets here."""
    if bench.hardware.device != Device.cpu or bench.precision != Precision.bf16:
        return
    features = cpu_features.detect()
    if not features.bf16_native:
        fp32, bf16 = (cpu_peak_flops(p)["flops"] for p in ("fp32", "bf16"))
        warn_once(cpu_features.bf16_warning(features, fp32, bf16), inv)


def warn_unhonoured(bench: BenchConfig, inv: Invocation) -> None:
    """Keys this trial does not read, where ignoring them is harmless (config/honoured.py): one line each."""
    for line in honoured.check(bench):
        warn_once(line, inv)


def warn_marketed_gb(device: str, memory_gb: Optional[float], inv: Invocation) -> None:
    line = marketed_gb_warning(device, memory_gb)
    if line:
        warn_once(line, inv)


def bench_here(cfg: DictConfig, out: Path) -> BenchConfig:
    """The trial config, checked against this machine (devices, DeepSpeed's view of `ds`, hostfile)."""
    bench = with_slurm_hostfile(from_cfg(cfg), out)
    validate_machine(bench)
    return bench


def store_path(cfg: DictConfig, inv: Invocation) -> Path:
    """`store`; a job started by Hydra's submitit launcher writes its own store in its job directory
    (SQLite on a cluster's shared filesystem must not be written by many jobs), unless store= is given."""
    if under_submitit() and "store" not in inv.explicit:
        return inv.out / JOB_STORE
    return Path(cfg.store)


def result_row(r: TrialResult) -> str:
    peaks = " ".join(f"{d.kind}{d.id}={d.peak_bytes / MiB:.0f}" + (f"/{d.total_bytes / MiB:.0f}MiB" if d.total_bytes
                                                                    else "MiB") for d in r.devices)
    rss = " ".join(f"r{x.rank}:{(x.peak_rss_bytes or 0) / MiB:.0f}MiB" for x in r.ranks)
    perf = (f"time/it {r.time_per_step_s * 1e3:.1f} ms | {r.samples_per_s:.2f} samples/s | "
            f"{r.tokens_per_s:.0f} tokens/s | loss {r.loss:.4f}" if r.status == Status.OK and r.time_per_step_s
            else r.reason)
    return (f"{r.label} | global batch {r.global_batch} (micro {r.micro}) | {r.status} | {perf} | "
            f"peak RSS {rss} | sampled {peaks}")


def run(cfg: DictConfig, inv: Invocation) -> int:
    """One trial at the configured batch with full timed steps."""
    bench = bench_here(cfg, inv.out)
    warn_slow_bf16(bench, inv)
    warn_unhonoured(bench, inv)
    warn_marketed_gb(bench.hardware.device, bench.hardware.memory_gb, inv)
    store = Store(store_path(cfg, inv))
    refused = preflight(bench, force=cfg.force)
    if refused:
        print(refused.reason)
        store.add_trial(refused)
        return DID_NOT_FIT
    prebuild_ops(bench)
    print(f"zero_bench run: {bench.label()} micro={bench.batch.micro} -> {inv.out}", flush=True)
    (res,) = run_launch(bench, [Entry(bench.batch.micro, Mode.MEASURE)], inv.out)
    store.add_trial(res)
    print(result_row(res))
    return {Status.OK: OK, Status.OOM: DID_NOT_FIT}.get(res.status, FAILED)


def maxbatch(cfg: DictConfig, inv: Invocation) -> int:
    """The largest global batch that fits, decided in fresh processes."""
    return searched(cfg, inv, Grow(Dimension.BATCH))


def maxseq(cfg: DictConfig, inv: Invocation) -> int:
    """The longest model.seq_len that fits at batch.micro (1 unless given), decided in fresh processes."""
    return searched(cfg, inv, Grow(Dimension.SEQ))


def searched(cfg: DictConfig, inv: Invocation, grow: Grow) -> int:
    """maxbatch or maxseq (`grow`): the search, its sweep progress lines and its exit code."""
    if inv.sweep:
        print(inv.sweep.progress(f"model={cfg.model.name} {OmegaConf.to_container(cfg.parallel)} engine={cfg.engine} "
                                 f"zero={cfg.zero} offload={cfg.offload} precision={shown_precision(cfg)}",
                                 finished=False), flush=True)
    res = _search(cfg, inv, grow)
    if inv.sweep:
        print(inv.sweep.progress(f"{res.label}: {res.status} {answer(res)}", finished=True), flush=True)
    if res.status in (SearchStatus.ERROR, SearchStatus.TIMEOUT, SearchStatus.FLAKY, SearchStatus.INCOMPLETE):
        return FAILED
    return OK


def shown_precision(cfg: DictConfig) -> str:
    """The precision a sweep's job will run at, auto resolved; as given where the job's config is
    refused (the job records it as skipped)."""
    try:
        return str(from_cfg(cfg).precision)
    except ConfigError:
        return str(cfg.precision)


def _configured(cfg: DictConfig, inv: Invocation, grow: Grow) -> tuple[BenchConfig, SearchConfig]:
    """The trial config and the grid the search runs on; ConfigError for bad input (maxseq: the
    grid against tp x sp, learned positions against the range), before any launch."""
    spec = search_from_cfg(cfg)
    bench = with_cpu_budget(bench_here(cfg, inv.out), spec.cpu_budget_gb)
    if not grow.seq:
        return bench, spec
    if "batch.micro" not in inv.explicit:
        bench = bench.with_micro(1)  # long context: one sequence per rank unless batch.micro says otherwise
    grid = seq_grid(spec, bench.layout)
    check_positions(bench, grid)
    line = past_positions(bench, grid)
    if line:
        warn_once(line, inv)
    return bench, grid


def _search(cfg: DictConfig, inv: Invocation, grow: Grow) -> SearchResult:
    command = "maxseq" if grow.seq else "maxbatch"
    try:
        bench, spec = _configured(cfg, inv, grow)
    except ConfigError as exc:  # inside a grid, a bad combination is recorded, never fatal
        if inv.sweep is None:
            raise  # bad input alone: one line, nothing written
        res = skipped_search(OmegaConf.to_container(cfg, resolve=True), str(exc))
        if grow.seq:  # apart from the same entry's maxbatch skip, and a maxseq row in the report
            res.search_key, res.dimension = "seq-" + res.search_key, grow.kind
        Store(store_path(cfg, inv)).put_search(res)
        print(f"zero_bench {command}: skipped {res.label}: {exc}", file=sys.stderr)
        return res
    warn_slow_bf16(bench, inv)
    warn_unhonoured(bench, inv)
    warn_marketed_gb(bench.hardware.device, bench.hardware.memory_gb, inv)
    store = Store(store_path(cfg, inv))
    key = grow.key(bench)
    # the smallest size the search tries: if the estimate says even that cannot fit this host, nothing will
    refused = (preflight(grow.config(bench, spec.min), force=cfg.force) if grow.seq
               else preflight(bench, force=cfg.force, micro=spec.min))
    if refused:
        res = SearchResult(search_key=key, label=bench.label(), status=SearchStatus.ESTIMATED_OOM,
                           note=refused.reason, config=bench.to_dict(), dimension=grow.kind)
        store.put_search(res)
        print(refused.reason)
        return res
    prebuild_ops(bench)
    what = f"micro={bench.batch.micro} seq_len {spec.min}..{spec.max} step {spec.granularity}" if grow.seq else ""
    print(f"zero_bench {command}: {bench.label()} {what + ' ' if what else ''}strategy={spec.strategy} -> {inv.out}",
          flush=True)
    done = (finished_elsewhere(key, inv.sweep.dir, store.path)
            if inv.sweep and not cfg.force else None)
    if done is not None:
        print(f"zero_bench {command}: {done.label} finished in another store of this sweep: {done.status}, "
              f"{answer(done)} (force=true re-measures)", flush=True)
        return done
    seed = None
    if cfg.estimate_first:
        seed = seed_seq(bench, bench.batch.micro, spec) if grow.seq else seed_micro(bench)
    opts = SearchOptions(seed=seed, repeats=cfg.repeats, force=cfg.force, progress=lambda s: print(s, flush=True),
                         pools=inv.sweep.pools if inv.sweep else None, grow=grow)
    # the whole search: no other zero_bench may launch between its launches; jobs of one sweep on
    # one machine (submitit_local) wait for each other
    with machine_lock(wait=under_submitit()):
        res = run_search(bench, spec, store, inv.out, opts)
    if res.measure:
        print(result_row(res.measure))
    return res


def report(cfg: DictConfig, inv: Invocation) -> int:
    for p in write_reports(report_from_cfg(cfg), traced=bool(cfg.get("traced", False))):
        print(f"wrote {p}")
    return OK


def status(cfg: DictConfig, inv: Invocation) -> int:
    """`zero_bench status <sweep dir>`: per job of a sweep, done / running / failed / not started."""
    sweep_dir = Path(str(cfg.get("status_dir") or ""))
    if not sweep_dir.is_dir():
        raise ConfigError(f"status: {sweep_dir or '(none)'} is not a sweep directory; usage: zero_bench status "
                          "runs/multirun/DATE/TIME-maxbatch")
    rows = sweep_status(sweep_dir)
    print(f"zero_bench status {sweep_dir}")
    print(format_status(rows))
    return FAILED if any(r.state == "failed" for r in rows) else OK


def estimate(cfg: DictConfig, inv: Invocation) -> int:
    """`zero_bench estimate [overrides] [--json]`: predicted memory per rank, no launch."""
    warn_marketed_gb(cfg.hardware.device, cfg.hardware.memory_gb, inv)
    print(estimate_report(cfg, inv.explicit))
    return OK


def doctor(cfg: Any, inv: Optional[Invocation] = None) -> int:
    print(f"zero_bench doctor ({platform.node()}, {platform.system()} {platform.machine()}, {sys.executable})")
    for c in doctor_checks(cfg):
        print(c.line(), flush=True)
    return OK


def calibrate(cfg: DictConfig, inv: Invocation) -> int:
    """`zero_bench calibrate [overrides] [--json]`: this machine's fixed terms, measured in one short
    launch of the configuration and stored for the estimate (zero_bench.commands.calibrate)."""
    bench = bench_here(cfg, inv.out)
    prebuild_ops(bench)
    as_json = bool(cfg.get("json", False))
    print(f"zero_bench calibrate: {bench.label()} micro={bench.batch.micro} -> {inv.out}", flush=True,
          file=sys.stderr if as_json else sys.stdout)  # with --json stdout is the document alone
    try:
        cal, path = calibration_run.calibrate(bench, inv.out)
    except calibration_run.CalibrationFailed as exc:
        print(f"zero_bench calibrate: nothing stored: {exc}", file=sys.stderr)
        return FAILED
    print(json.dumps({**cal.to_dict(), "said": cal.said, "path": str(path)}, indent=2) if as_json
          else "\n".join(calibration_run.lines(cal, path)))
    return OK


COMMANDS: dict[str, Callable[[DictConfig, Invocation], int]] = {
    "run": run, "maxbatch": maxbatch, "maxseq": maxseq, "report": report, "estimate": estimate, "doctor": doctor, "status": status,
    "calibrate": calibrate}
