"""Run one trial's rank processes (one or more batch sizes) and hand on one TrialResult per entry.

The ranks are a deepspeed launch of their own (`Ranks`) or, in a search, children forked from the
search's pool (zero_bench.trial.pool). The launch: DeepSpeed's own launcher (`python -m
deepspeed.launcher.runner`, so hostfiles and multi-node launchers work unchanged) in its own
process group, with a free master port, a timeout per batch size, a memory sampler beside it, and
the whole tree killed afterwards whatever happened (the command line, environment and kill:
zero_bench.trial.launcher, shared with the pool).
What the ranks wrote becomes results in zero_bench.trial.outcome; the machine lock (zero_bench.trial.machine)
keeps two zero_bench processes from launching on one machine at once.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

import psutil

from zero_bench.config.configure import resolve
from zero_bench.config.hosts import local_ranks
from zero_bench.config.schema import BenchConfig, Device
from zero_bench.devices.capacity import capacity_bytes
from zero_bench.devices.environment import machine_environment_cached
from zero_bench.devices.gpu import DEVICES_ENV
from zero_bench.engines import ds_config as dsc
from zero_bench.engines.specs import spec as engine_spec
from zero_bench.records import Entry, Event, Fault, RankRecord, RankStatus, Status, TrialResult, TrialSpec
from zero_bench.trial.launcher import free_port, kill_tree, launch_env, launcher_cmd
from zero_bench.trial.machine import machine_lock, remove_shm_buffers
from zero_bench.trial.outcome import LaunchEnd, Logs, classify, finished_prefix, gpu_devices
from zero_bench.trial.pool import PoolSlot
from zero_bench.trial.sampler import Sampler, summarize
from zero_bench.trial.swap import make_swap_folder, remove_swap_folder
from zero_bench.trial.time_limits import Limits, Pace, device_flops, estimated_pace

__all__ = ["Entry", "LaunchOptions", "RunningRanks", "run_launch", "read_rank_logs"]

# After a rank recorded a failure, how long its peers may take to end before the launch is ended.
FAILURE_GRACE_S = 5.0


@dataclass
class LaunchOptions:
    """How a launch runs beyond its config and plan, and what the caller wants to hear meanwhile."""
    on_result: Optional[Callable[[TrialResult], None]] = None  # each entry the moment it is final
    on_event: Optional[Callable[[RankRecord], None]] = None  # rank 0's records as they appear
    sample_interval: float = 0.05  # seconds between memory samples; 0 turns the sampler off
    pools: Optional[PoolSlot] = None  # fork the ranks from this search's pool; None: a launch of its own
    fault: Optional[Fault] = None  # tests only: a fault the ranks inject into this trial (zero_bench.trial.faults)
    pace: Optional[Pace] = None  # the slowest seconds per sample measured so far (None: estimated)
    calibrate: bool = False  # `zero_bench calibrate`: GPU ranks also measure their fixed terms


class RunningRanks(Protocol):
    """The rank processes of a trial while it runs: a launch of its own (Ranks) or children forked
    from a pool (pool.PoolTrial). The runner waits for, samples and ends them through this."""
    root_pid: int  # the process whose descendants are the ranks (the sampler walks from it)
    forked: bool  # the ranks are a pool's children: the sampler counts them, not their parents
    marker: Optional[str]  # multi-node: text in the command line of ranks sshd started on this host

    def wait(self, timeout: float) -> bool:
        """True once every rank has ended."""

    def kill(self) -> None:
        """End the ranks now (over budget)."""

    def end(self, known: list[psutil.Process]) -> None:
        """Whatever happened, nothing of the trial is left running."""

    @property
    def rc(self) -> Optional[int]:
        """The exit code the launcher would report."""

    def log_tail(self) -> str:
        """The end of the ranks' stderr and stdout."""


def read_rank_logs(out_dir: Path) -> Logs:
    logs: Logs = {}
    for f in sorted(out_dir.glob("rank*.jsonl")):
        recs = []
        for line in f.read_text().splitlines():
            try:
                recs.append(RankRecord.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue  # a line cut by a kill
        if recs:
            logs[recs[0].rank] = recs
    return logs


def first_failure(logs: Logs) -> Optional[float]:
    """When the first rank recorded a failure (an entry ended oom/error, or init failed), if any."""
    times = [r.time for recs in logs.values() for r in recs
             if r.event == Event.INIT_FAILED or (r.event == Event.END and r.status in (RankStatus.OOM, RankStatus.ERROR))]
    return min(times) if times else None


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


_launch_ids = itertools.count(int(time.time() * 1000))


@dataclass
class _Launch:
    """One deepspeed launch in flight: its files, process, sampler and the results handed on."""
    cfg: BenchConfig
    plan: list[Entry]
    run_dir: Path
    opts: LaunchOptions
    cap: Optional[int] = None
    ds: dict = field(default_factory=dict)
    cmd_text: str = ""
    emitted: list[TrialResult] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    hung: str = ""  # why the runner ended the launch as hung (time_limits.py)
    swap: Optional[Path] = None  # offload_device=nvme: this launch's swap folder (trial/swap.py)
    launch_id: int = field(default_factory=lambda: next(_launch_ids))
    t0: float = field(default_factory=time.time)

    def prepare(self, port: int) -> tuple[list[str], dict]:
        """Write ds_config.json (engine=deepspeed), trial.json, the env file and cmd.txt; return (command,
        environment)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for old in self.run_dir.glob("rank*.jsonl"):
            old.unlink()
        ds_path = ""  # engine=fsdp2 reads no DeepSpeed config
        if engine_spec(self.cfg.engine).reads_ds_config:
            self.swap = make_swap_folder(self.cfg, self.run_dir, self.launch_id)
            self.ds = dsc.write(self.cfg, self.run_dir / "ds_config.json", str(self.swap) if self.swap else None)
            ds_path = str((self.run_dir / "ds_config.json").resolve())
        self.cap = capacity_bytes(self.cfg)
        # absolute: a pool's ranks run in the pool's working directory, not this job's
        spec = TrialSpec(config=self.cfg, ds_config=ds_path,
                         out_dir=str(self.run_dir.resolve()), plan=self.plan, capacity_bytes=self.cap,
                         fault=self.opts.fault, calibrate=self.opts.calibrate)
        self.spec_path.write_text(spec.to_json())
        cmd = launcher_cmd(self.cfg, self.spec_path, port)
        env, self.cmd_text = launch_env(self.cfg, self.run_dir, cmd)
        return cmd, env

    @property
    def spec_path(self) -> Path:
        return self.run_dir / "trial.json"

    def emit(self, results: list[TrialResult], sampler: Sampler, logs: Logs) -> None:
        """Hand each entry's result on the moment it is final (the store writes it at once)."""
        marks = {rank: [m for r in recs for m in r.marks] for rank, recs in logs.items()}
        for r in results[len(self.emitted):]:
            r.launch, r.run_dir, r.cmd, r.ds_config, r.capacity_bytes = (self.launch_id, str(self.run_dir),
                                                                         self.cmd_text, self.ds, self.cap)
            r.env = dict(machine_environment_cached())
            r.duration_s = round(time.time() - self.t0, 2)
            if r.status in (Status.OK, Status.OOM, Status.TIMEOUT):
                sampled = _window(sampler, r, marks) or summarize(sampler.samples, marks)
                r.devices = gpu_devices(r.ranks, sampled, self.cap)
            if sampler.error:
                r.reason = (r.reason + "; " if r.reason else "") + sampler.error
            self.emitted.append(r)
            if self.opts.on_result:
                self.opts.on_result(r)

    def over_budget(self, ranks: RunningRanks, msg: str) -> None:
        """Stop early: past the budget the batch cannot fit."""
        self.stopped.append(msg)
        ranks.kill()

    def limits(self) -> Limits:
        """The time allowed without progress: from the search's measured pace, else estimated."""
        pace = self.opts.pace or estimated_pace(self.cfg, device_flops(self.cfg))
        return Limits.for_trial(self.cfg, pace)

    def wait(self, ranks: RunningRanks, sampler: Sampler) -> bool:
        """Wait for the launch; True if it hung: no record from rank 0 (a step, an entry's begin or
        end) within the time time_limits.py allows after its latest one. Meanwhile rank 0's new
        records go to on_event and finished entries are handed on."""
        limits, seen, last = self.limits(), 0, None
        allowed, since = limits.init_s(), time.time()
        while True:
            if ranks.wait(0.5):
                return False
            logs = read_rank_logs(self.run_dir)
            recs = logs.get(0, [])
            for rec in recs[seen:]:
                if self.opts.on_event and rec.event != Event.STEP:
                    self.opts.on_event(rec)
                limits, last = limits.observe(rec), rec
            if len(recs) > seen:
                seen, since, allowed = len(recs), time.time(), limits.after(last)
            done = finished_prefix(self.plan, logs, self.cfg.parallel.world_size)
            if done > len(self.emitted):
                self.emit(classify(self.cfg, self.plan[:done], logs, LaunchEnd(cap=self.cap)), sampler, logs)
            if time.time() - since > allowed:
                self.hung = hung_reason(last, allowed, limits)
                return True
            failed = first_failure(logs)
            if failed is not None and time.time() - failed > FAILURE_GRACE_S:
                # A rank recorded an OOM or error and left; peers on other nodes may wait in a
                # collective until NCCL's timeout. The failure is known: end the launch now.
                return False


def hung_reason(last: Optional[RankRecord], allowed: float, limits: Limits) -> str:
    """One line: what did not happen within how long, and where that limit came from."""
    if last is None or last.event == Event.START:
        return f"no batch size began within {allowed:.0f} s of the start ({limits.describe()})"
    return f"no step finished within {allowed:.0f} s (micro={last.micro}; {limits.describe()})"


class Ranks:
    """The rank processes of one launch: the deepspeed launcher's, started for this launch alone."""

    def __init__(self, cfg: BenchConfig, cmd: list[str], env: dict, run_dir: Path):
        self.multi_node = bool(cfg.hardware.hostfile)
        self.run_dir = run_dir
        with open(run_dir / "stdout.log", "w") as out, open(run_dir / "stderr.log", "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=os.getcwd(),
                                         start_new_session=True)
        self.root_pid, self.forked = self.proc.pid, False
        # ranks that sshd started on this host carry the spec path in their command line
        self.marker = str(run_dir / "trial.json") if self.multi_node else None

    def wait(self, timeout: float) -> bool:
        """True once every rank has ended."""
        try:
            self.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def end(self, known: list[psutil.Process]) -> None:
        """Whatever happened, nothing of the launch is left running."""
        kill_tree(self.proc, known, multi_node=self.multi_node)

    @property
    def rc(self) -> Optional[int]:
        return self.proc.returncode

    def log_tail(self) -> str:
        return _tail(self.run_dir / "stderr.log") + _tail(self.run_dir / "stdout.log")


def run_launch(cfg: BenchConfig, plan: list[Entry], run_dir: Path,
               opts: Optional[LaunchOptions] = None) -> list[TrialResult]:
    """Run `plan` (ascending micro sizes) in fresh rank processes, return one TrialResult per entry:
    children forked from the search's pool when opts.pools has one, else a deepspeed launch of its own.
    A config built by hand (not by configure.from_cfg) has its "auto" values resolved here."""
    with machine_lock():
        return _run(_Launch(resolve(cfg, here=False), plan, run_dir, opts or LaunchOptions()))


def _run(launch: _Launch) -> list[TrialResult]:
    cfg, run_dir, opts = launch.cfg, launch.run_dir, launch.opts
    pool = opts.pools.get(cfg) if opts.pools is not None else None  # a new pool starts while we prepare
    port = free_port()
    cmd, env = launch.prepare(port)
    if pool is not None:
        ranks, launch.cmd_text = pool.submit(launch.spec_path, run_dir, port)
    else:
        ranks = Ranks(cfg, cmd, env, run_dir)
    sampler, timed_out = _watch(launch, ranks, env, port)
    refused = pool.refused() if pool is not None else None
    if refused is not None and not launch.emitted:
        # No child ran: the same trial again, in a launch of its own (and every later one too).
        opts.pools.refuse(refused)
        launch.t0 = time.time()
        return _run(launch)
    sampler.write_csv(run_dir / "memory_timeline.csv")
    end = LaunchEnd(cap=launch.cap, rc=ranks.rc, timed_out=timed_out, hung=launch.hung,
                    stopped=launch.stopped[0] if launch.stopped else None, log_tail=ranks.log_tail())
    logs = read_rank_logs(run_dir)
    launch.emit(classify(cfg, launch.plan, logs, end), sampler, logs)
    return launch.emitted


def _watch(launch: _Launch, ranks: RunningRanks, env: dict, port: int) -> tuple[Sampler, bool]:
    """Sample and wait for the ranks, then end whatever is left; (sampler, timed out)."""
    cfg = launch.cfg
    sampler = Sampler(ranks.root_pid, launch.opts.sample_interval,
                      gpus=env.get(DEVICES_ENV, ",".join(map(str, range(local_ranks(cfg)))))
                      if cfg.hardware.device == Device.gpu else None,
                      budget=launch.cap if cfg.hardware.device == Device.cpu else None,
                      on_over=lambda msg: launch.over_budget(ranks, msg),
                      marker=ranks.marker, forked=ranks.forked, expect=local_ranks(cfg), disk=launch.swap)
    sampler.start()
    timed_out = False
    try:
        timed_out = launch.wait(ranks, sampler)
    finally:
        sampler.stop()
        ranks.end(list(sampler.procs.values()))
        remove_shm_buffers(port)
        remove_swap_folder(launch.swap)
    return sampler, timed_out


def _window(sampler: Sampler, r: TrialResult, marks: dict) -> list:
    """Device peaks over the time this entry ran (entries of one launch run one after another)."""
    lo = r.ranks[0].t_begin if r.ranks else None
    if lo is None:
        return []
    hi = r.ranks[0].t_end or 1e18
    return summarize([s for s in sampler.samples if lo <= s.t <= hi], marks)
