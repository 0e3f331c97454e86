"""A finished (or still running) launch's rank records -> one TrialResult per plan entry. Pure.

An entry every rank ended "ok" fits. Any rank "over_capacity" or "oom" -> oom. An entry that
began but did not end on some rank failed with the launch: oom if the sampler stopped it over
budget, the logs show an allocation failure, a rank was SIGKILLed by someone other than
zero_bench (the kernel's OOM killer) or exited with OOM_EXIT; timeout if the clock ran out;
error for everything else - an abort, a segfault, an exception - with its meaningful line (a
crash is no memory boundary, and a search must not take it for one).
"""
from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Optional

from zero_bench.config.schema import BenchConfig
from zero_bench.devices.capacity import trial_peak
from zero_bench.trial.oom import oom_in_log
from zero_bench.records import (OOM_EXIT, DeviceMemStats, Entry, Event, MemoryKind, RankRecord, RankStatus, Status,
                                TrialResult)
from zero_bench.units import MiB

# Lines that are never why a trial failed: warnings every start prints (megatron's "Apex is not
# installed", torch's and DeepSpeed's deprecations), the launcher's info lines, traceback frames.
NOISE = re.compile(r"warn|apex|deprecat|\[INFO\]|^File \"|^\^+$|^Traceback", re.I)
# A Python exception's own line ("RuntimeError: ..."), or a process's death as a shell or C++ says it.
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b|Killed|Segmentation fault|Aborted|terminate called")

# What a crashing process leaves in its log: C++'s std::terminate, Python's fatal error handler, a shell.
CRASHED = re.compile(r"terminate called|^\s*what\(\):|Fatal Python error|Segmentation fault|Bus error|"
                     r"Aborted|core dumped", re.M)
# DeepSpeed's launcher on the rank it saw end first (launcher/launch.py sigkill_handler).
LAUNCHER_EXIT = re.compile(r"exits with return code = (-\d+)")

# What peers of a dead rank raise: consequences, not causes.
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote worker|NCCL communicator was aborted",
                       re.I)


@dataclass
class LaunchEnd:
    """How a launch ended, as far as the runner saw it."""
    cap: Optional[int] = None  # per-rank capacity the launch enforced
    rc: Optional[int] = None  # the launcher's exit code (None: still running)
    timed_out: bool = False
    hung: str = ""  # the runner's reason for ending it as hung (time_limits.py)
    stopped: Optional[str] = None  # the sampler's reason for stopping it over budget
    log_tail: str = ""


Logs = dict[int, list[RankRecord]]


def end_of(logs: Logs, rank: int, micro: int) -> Optional[RankRecord]:
    return next((x for x in logs.get(rank, []) if x.event == Event.END and x.micro == micro), None)


def finished_prefix(plan: list[Entry], logs: Logs, world: int) -> int:
    """How many leading entries every rank has ended "ok" (final whatever happens next)."""
    n = 0
    for entry in plan:
        ends = [end_of(logs, r, entry.micro) for r in range(world)]
        if not all(e is not None and e.status == RankStatus.OK for e in ends):
            break
        n += 1
    return n


def classify(cfg: BenchConfig, plan: list[Entry], logs: Logs, end: LaunchEnd) -> list[TrialResult]:
    """Per entry: ok / oom / error / timeout / not_run, from every rank's records and the exit."""
    results: list[TrialResult] = []
    for i, entry in enumerate(plan):
        if results and results[-1].status != Status.OK:
            results.append(trial(cfg, entry, i, Status.NOT_RUN, reason="launch ended earlier"))
        else:
            results.append(_entry(cfg, entry, i, logs, end))
    return results


def trial(cfg: BenchConfig, entry: Entry, index: int, status: Status, **kw) -> TrialResult:
    c = cfg.with_micro(entry.micro)
    return TrialResult(search_key=cfg.search_key(), trial_key=c.trial_key(), label=cfg.label(), micro=entry.micro,
                       global_batch=c.global_batch, status=status, mode=entry.mode, fresh=index == 0,
                       config=c.to_dict(), **kw)


def _entry(cfg: BenchConfig, entry: Entry, index: int, logs: Logs, end: LaunchEnd) -> TrialResult:
    world = cfg.parallel.world_size
    ends = {r: end_of(logs, r, entry.micro) for r in range(world)}
    done = [e for e in ends.values() if e]
    statuses = {e.status for e in done}
    if len(done) == world and statuses == {RankStatus.OK}:
        return _ok(cfg, entry, index, done)
    if len(done) == world and statuses <= {RankStatus.OK, RankStatus.OVER_CAPACITY}:
        peak = trial_peak(done, cfg.hardware.device) or 0
        cap = f"{end.cap / MiB:.0f}" if end.cap else "?"
        return trial(cfg, entry, index, Status.OOM, phase="step", ranks=[e.summary() for e in done],
                     reason=f"peak {peak / MiB:.0f} MiB > capacity {cap} MiB per rank")
    inits = [x for recs in logs.values() for x in recs if x.event == Event.INIT_FAILED]
    begun = any(x.event == Event.BEGIN and x.micro == entry.micro for recs in logs.values() for x in recs)
    # Earliest first: a rank's crash makes its peers fail next ("Connection closed by peer").
    errs = sorted([e for e in done if e.status in (RankStatus.OOM, RankStatus.ERROR)] + inits, key=lambda e: e.time)
    silent = [r for r in range(world) if not ends.get(r) and not any(x.event == Event.INIT_FAILED
                                                                        for x in logs.get(r, []))]
    status, reason = _failure(errs, end, silent)
    return trial(cfg, entry, index, status, reason=reason, phase="init" if (inits or not begun) else "step")


def _failure(errs: list[RankRecord], end: LaunchEnd, silent: list[int]) -> tuple[Status, str]:
    if end.stopped:
        return Status.OOM, f"stopped early: {end.stopped}"
    oom = [e for e in errs if e.status == RankStatus.OOM]
    if oom:
        return Status.OOM, f"rank {oom[0].rank}: {oom[0].error}"
    peers_lost = bool(errs) and all(PEER_LOST.search(e.error) for e in errs)
    if end.timed_out and peers_lost:
        # our own kill at the timeout: a peer that lost the killed rank is a consequence of it
        return Status.TIMEOUT, _timeout_reason(end)
    sign = oom_in_log(end.log_tail)
    if sign:  # before the signal: a C++ allocation failure aborts (SIGABRT) with this in its log
        return Status.OOM, "allocation failure in the logs: " + sign
    # after a timeout, the SIGKILL is ours
    died = None if end.timed_out else (death_signal(end.rc) or logged_signal(end.log_tail))
    who = f"rank {silent[0]}" if silent else "a rank"
    peers = f"; peers: {errs[0].error[:200]}" if errs else ""
    if died == signal.SIGKILL:
        # Every exception a rank raises is recorded; a rank that vanished by SIGKILL that zero_bench
        # did not send was killed by the kernel's OOM killer, the one other sender of SIGKILL to a
        # process that outgrows the memory (its record, dmesg or memory.events, is rarely readable
        # inside a container: docs/measuring.md).
        return Status.OOM, f"{who} was killed (SIGKILL, as the kernel's OOM killer sends){peers}"
    if died is not None:
        # An abort, a segfault, a bus error: a crash, whatever the peers lost by it.
        return Status.ERROR, f"{who} died of {signal.Signals(died).name}: {meaningful_line(end.log_tail) or '(no output)'}"
    if end.rc in (OOM_EXIT, 256 - OOM_EXIT):
        return Status.OOM, f"a rank ran out of memory (launcher exit {end.rc})"
    if silent and peers_lost and not end.timed_out:
        if CRASHED.search(end.log_tail):
            return Status.ERROR, (f"{who} died without a result (exit {end.rc}): "
                                  f"{meaningful_line(end.log_tail) or '(no output)'}{peers}")
        # No signal known (its parent's exit code was a peer's) and nothing in the log: a process
        # that crashes says so (C++'s terminate, Python's fatal error handler, the shell), one the
        # kernel's OOM killer ends says nothing.
        return Status.OOM, f"{who} died without a result or a word (as the kernel's OOM killer leaves it){peers}"
    if errs:
        return Status.ERROR, f"rank {errs[0].rank}: {errs[0].error}"
    if end.timed_out:
        return Status.TIMEOUT, _timeout_reason(end)
    return Status.ERROR, f"launcher exit {end.rc}: {meaningful_line(end.log_tail) or '(no output)'}"


def logged_signal(log: str) -> Optional[int]:
    """The signal DeepSpeed's launcher logged a rank's end with ("... exits with return code = -6")."""
    m = LAUNCHER_EXIT.search(log)
    return death_signal(int(m.group(1))) if m else None


def death_signal(rc: Optional[int]) -> Optional[int]:
    """The signal that ended the first failed rank, from an exit code as the ranks' parent reports it:
    -N from a pool's waitpid or Popen, 128 + N from a shell, 256 - N from DeepSpeed's launcher
    (launch.py sys.exit(-N), which the OS reports modulo 256). None: an exit, not a signal."""
    if rc is None or rc == 0:
        return None
    for n in (-rc, rc - 128, 256 - rc):
        if n in _SIGNALS:
            return n
    return None


# The signals a rank dies of by a fault or a kill (not exit codes 1-127 a program chooses).
_SIGNALS = {int(s) for s in (signal.SIGKILL, signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL,
                             signal.SIGFPE, signal.SIGTERM)}


def _timeout_reason(end: LaunchEnd) -> str:
    return end.hung or "no progress within the time allowed"


def meaningful_line(log: str) -> str:
    """The line of a log that says why it failed: the last exception, else the last line the launcher
    flags [ERROR], else the last line that is no warning; never a library's start-up warning."""
    lines = [x.strip() for x in log.splitlines() if x.strip()]
    for pick in (lambda x: x.startswith("what():"), lambda x: EXCEPTION_LINE.search(x) and not PEER_LOST.search(x),
                 lambda x: EXCEPTION_LINE.search(x), lambda x: "[ERROR]" in x, lambda x: True):
        found = [x for x in lines if pick(x) and not NOISE.search(x)]
        if found:
            return found[-1][:500]
    return ""


def _ok(cfg: BenchConfig, entry: Entry, index: int, done: list[RankRecord]) -> TrialResult:
    # The slowest rank sets the pace of a synchronous step; a rank without an applied step to time
    # (fp16: all overflowed) leaves time/it empty rather than taking a skipped step's time.
    untimed = [e for e in done if e.time_per_step is None]
    tps = None if untimed else max(e.time_per_step for e in done)
    samples = cfg.with_micro(entry.micro).global_batch / tps if tps else None
    first = min(done, key=lambda e: e.rank)
    notes = [f"rank {untimed[0].rank}: {untimed[0].time_note or 'no time/it'}"] if untimed else []
    shared = sorted(e.rank for e in done if e.gpu_shared)
    if shared:
        notes.append(f"GPU of rank(s) {', '.join(map(str, shared))} shared with other processes: "
                     "NVML's per-GPU figures include theirs")
    return trial(cfg, entry, index, Status.OK, time_per_step_s=tps, samples_per_s=samples,
                 tokens_per_s=samples * cfg.model.seq_len if samples else None, loss=first.loss,
                 loss_scale=first.loss_scale, skipped_steps=max((e.skipped_steps or 0) for e in done),
                 compile_s=first.compile_s, reason="; ".join(notes),
                 ranks=[e.summary() for e in sorted(done, key=lambda e: e.rank)])


def gpu_devices(ranks: list[RankRecord], sampled: list[DeviceMemStats], cap: Optional[int]) -> list[DeviceMemStats]:
    """The devices a trial reports: each rank's own GPU (identity and NVML peak from its record, so
    every node's GPUs are there) where the ranks recorded them, else what the runner sampled on
    its node. Against an emulated smaller card, total_bytes is that capacity (card_bytes the real one)."""
    gpus = [DeviceMemStats(kind=MemoryKind.gpu, id=r.rank, peak_bytes=r.nvml_peak_bytes, total_bytes=r.nvml_total_bytes,
                           phase=r.peak_phase, uuid=r.gpu_uuid, name=r.gpu_name, host=r.host)
            for r in ranks if r.nvml_peak_bytes is not None]
    out = [d for d in sampled if d.kind != MemoryKind.gpu or not gpus] + gpus
    for d in out:
        if d.kind == MemoryKind.gpu and cap and d.total_bytes and cap < d.total_bytes:
            d.card_bytes, d.total_bytes = d.total_bytes, cap
    return out
