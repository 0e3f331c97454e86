"""One rank of a trial: the plan's entries on one engine in this process, each ending in a RankRecord.

The spec (records.TrialSpec, written by launch.py) holds the config and a plan: micro-batch sizes
in ascending order, each a probe (reach steady peak memory: steps.probe optimizer steps, then one
profiled step) or a measure (warm-up + timed steps + the profiled step). One engine serves the
whole plan: model, optimizer states and buckets do not depend on the batch (memory earlier sizes
leave behind can inflate later peaks, which is why the search decides its answer with fresh
launches). After each entry every rank appends a RankRecord to rank{R}.jsonl (fsync'ed), so
whatever happens later, finished entries are kept. Ranks agree on "over capacity" with an
all-reduce at the entry boundary, where no collective is in flight; a real allocation failure
instead ends this process (exit code OOM_EXIT) and the launch.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import resource
import statistics
import time
import traceback
from pathlib import Path
from typing import NoReturn, Optional

import torch

from zero_bench.config.schema import Device
from zero_bench.devices.calibration import FixedTermsProbe
from zero_bench.devices.capacity import compared_peak, over_capacity
from zero_bench.devices.gpu import RankGpu, baseline, near_full
from zero_bench.engines.base import Engine, build_engine, init_distributed
from zero_bench.engines.storages import storage_bytes
from zero_bench.models import ulysses
from zero_bench.records import OOM_EXIT, Event, Mode, ModelStates, RankRecord, RankStatus, TrialSpec
from zero_bench.trial.faults import inject
from zero_bench.trial.oom import is_oom

PHASES = ("init", "forward", "backward", "step", "idle")
# An fp16 run that overflows this often in a row is broken (DeepSpeed halves the scale each time
# after the hysteresis: 2**16 reaches 1 in about 17 steps).
MAX_SKIPPED_STEPS = 40
COMPILE_WARMUP_STEPS = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Marks:
    """Phase timeline of this rank: (unix time, phase) pairs, joined later with memory samples."""

    def __init__(self):
        self.marks = [(time.time(), "init")]

    def __call__(self, phase: str) -> None:
        self.marks.append((time.time(), phase))


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage Python can reach, each storage once."""
    return sum(storage_bytes(obj for obj in gc.get_objects() if _on_cpu(obj)).values())


def _on_cpu(obj) -> bool:
    try:
        return isinstance(obj, torch.Tensor) and obj.device.type == "cpu"
    except Exception:  # objects that fail even this (proxies and the like): not a tensor to count
        return False


def append_record(path: Path, record: RankRecord, sync: bool = True) -> None:
    """One JSON line, fsync'ed: whatever happens to the process next, this record is kept. A STEP
    record is only flushed (the runner on this host reads it from the page cache; losing it to a
    crash loses nothing of the results)."""
    with open(path, "a") as f:
        f.write(json.dumps(record.to_dict()) + "\n")
        f.flush()
        if sync:
            os.fsync(f.fileno())


def failure_record(rank: int, exc: BaseException, event: Event, near_full: bool = False, **kw) -> RankRecord:
    status = RankStatus.OOM if is_oom(exc, near_full) else RankStatus.ERROR
    return RankRecord(rank=rank, event=event, status=status, error=f"{type(exc).__name__}: {exc}"[:2000],
                      traceback=traceback.format_exc()[-4000:], **kw)


def device_near_full(gpu: Optional[RankGpu], cap: Optional[int] = None) -> bool:
    """Is this rank's GPU (or its emulated card) close to full, as a failure is recorded? Never
    starts CUDA and never raises: it only qualifies an error that already happened."""
    try:
        if gpu is not None:
            return gpu.near_full()
        if torch.cuda.is_initialized():
            return near_full(torch.cuda, torch.cuda.current_device(), cap)
    except Exception:  # noqa: BLE001 - the failure itself is what gets recorded
        pass
    return False


def start(spec: TrialSpec) -> "Rank":
    """This process as one rank of the trial: process group, GPU (emulated capacity), engine."""
    from deepspeed.accelerator import get_accelerator

    marks = Marks()
    on_cpu = spec.config.hardware.device == Device.cpu
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # What other processes hold on the GPU, read before this process's first CUDA call.
    base = None if on_cpu else baseline(local_rank)
    # calibrate: CUDA starts here, before any communicator, so that its context is measured alone
    probe = FixedTermsProbe(torch, local_rank) if spec.calibrate and not on_cpu else None
    init_distributed(spec.config, on_cpu)
    rank = torch.distributed.get_rank()
    gpu = None
    if not on_cpu:
        # Emulate a smaller card: allocations past the fraction raise a real CUDA OOM.
        gpu = RankGpu(torch, local_rank, spec.capacity_bytes, base=base)
        gpu.emulate()
        gpu.serve_deepspeed(get_accelerator())
    runtime = gpu.outside_now() if gpu else rss_now()
    fixed = probe.measure(gpu, torch.distributed, DTYPES[spec.config.precision]) if probe else {}
    append_record(log_path(spec, rank), RankRecord(
        rank=rank, event=Event.START, pid=os.getpid(), host=os.uname().nodename, local_rank=local_rank,
        node_rank=int(os.environ.get("CROSS_RANK", 0)), runtime_bytes=runtime, **fixed,
        **(gpu.record() if gpu else {})))
    before = build_peak_reset(on_cpu)
    engine = build_engine(spec, on_cpu)
    built = build_peak(on_cpu) - before
    if gpu:
        gpu.emulate()  # again, now that NCCL's buffers exist
    if spec.config.compile:
        engine.compile()  # torch.compile runs lazily, in the first step of each new shape
    r = Rank(spec, engine, rank, marks, gpu)
    r.runtime_bytes, r.fixed_terms, r.build_bytes = runtime, fixed, built
    return r


def build_peak_reset(on_cpu: bool) -> int:
    """What the process holds before the model's build. GPU: torch's peak starts afresh here."""
    if on_cpu:
        return rss_now()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def build_peak(on_cpu: bool) -> int:
    """The high-water mark after the build. CPU: VmHWM, which the build may not have moved (a forked
    trial inherits its pool's mark; resetting it would change peak_rss_bytes), so the build's figure
    is an upper bound there: a build shown below a size stayed below it."""
    if on_cpu:
        return rss_high_water()
    return torch.cuda.max_memory_allocated()


def rss_high_water() -> int:
    """This process's peak resident set so far (VmHWM; ru_maxrss reads the same mark)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def reset_rss_high_water() -> bool:
    """VmHWM (and ru_maxrss) set back to the resident set now (Linux 4.0+, /proc/PID/clear_refs "5");
    False where the kernel refuses, the mark then stays where it was."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_now() -> int:
    """This process's resident set now (not its peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def log_path(spec: TrialSpec, rank: int) -> Path:
    return Path(spec.out_dir) / f"rank{rank}.jsonl"


class _EntrySteps:
    """The optimizer steps of one plan entry: losses, skipped (fp16 overflow) and timed steps."""

    def __init__(self, rank: "Rank", micro: int):
        self.rank, self.micro = rank, micro
        self.losses: list[float] = []
        self.grad_norms: list[Optional[float]] = []
        self.warm: list[float] = []
        self.times: list[float] = []
        self.skipped = 0

    def count(self, loss: float) -> None:
        self.losses.append(loss)
        self.grad_norms.append(self.rank.engine.grad_norm())
        self.skipped += not self.rank.applied

    def step(self) -> float:
        secs, loss = self.rank.step(self.micro)
        self.count(loss)
        if len(self.losses) == 1 and self.rank.gpu is not None:
            self.rank.gpu.refresh()  # what the first step added outside the allocator lowers the cap
        if self.rank.rank == 0:  # the runner's sign of progress (time_limits.py)
            append_record(self.rank.log_path, RankRecord(rank=0, event=Event.STEP, micro=self.micro,
                                                         step_seconds=round(secs, 4)), sync=False)
        return secs

    def timed(self, n: int) -> None:
        """Until `n` applied steps were timed: a skipped step (fp16 overflow) does no update and
        is no sample of time/it. Bounded: a scale that keeps overflowing leaves fewer samples."""
        tries = 0
        while len(self.times) < n and tries < n + MAX_SKIPPED_STEPS:
            secs = self.step()
            tries += 1
            if self.rank.applied:
                self.times.append(secs)


class Rank:
    """The plan of one trial on one rank, over an engine that is already built."""

    def __init__(self, spec: TrialSpec, engine: Engine, rank: int, marks: Marks, gpu: Optional[RankGpu] = None):
        self.spec, self.cfg, self.engine, self.rank, self.marks, self.gpu = (spec, spec.config, engine, rank,
                                                                             marks, gpu)
        self.torch = torch
        self.on_cpu = self.cfg.hardware.device == Device.cpu
        self.device = torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())
        self.log_path = log_path(spec, rank)
        self.steps_done = 0  # optimizer steps so far: seeds each step's tokens
        self.compile_s: Optional[float] = None
        self.states: Optional[ModelStates] = None
        self.applied = self.applied_any = False  # was the last / any optimizer step applied
        self.runtime_bytes: Optional[int] = None  # the process before the model was built (start())
        self.phase_live: dict = {}  # the last profiled step's live peak per phase (CPU)
        self.build_bytes: Optional[int] = None  # the build's peak above runtime_bytes (start())
        self.fixed_terms: dict = {}  # calibrate, GPU: FixedTermsProbe's figures (start()), on every END record
        self.rss_peak: Optional[int] = None  # CPU: the process's RSS peak through the profiled steps (profiled_step)
        self._mask = None

    def _emit(self, record: RankRecord) -> None:
        append_record(self.log_path, record)

    # -- one optimizer step ---------------------------------------------------------------------
    def _batch(self, micro: int):
        m = self.cfg.model
        g = torch.Generator().manual_seed(self.cfg.seed + self.steps_done)
        tokens = torch.randint(0, m.vocab_size, (micro, m.seq_len + 1), generator=g).to(self.device)
        pos = torch.arange(m.seq_len, device=self.device).unsqueeze(0).expand(micro, -1)
        # parallel.sp: the same sequences on the group's ranks, each keeping its block of tokens
        # (the causal mask stays whole: attention sees the whole sequence after its all-to-all)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        return tuple(ulysses.local_block(t) for t in (inputs, pos, labels))

    def _causal_mask(self):
        # megatron's default mask is built with device="cuda"; pass our own (True = masked out),
        # once; none for sdpa, which never reads it (models/sdpa.py causal_mask)
        if self._mask is None and self.cfg.model.attention != "sdpa":
            from zero_bench.models.sdpa import causal_mask

            self._mask = causal_mask(self.cfg.model.attention, self.cfg.model.seq_len, self.device)
        return self._mask

    def _sync(self) -> None:
        if not self.on_cpu:
            torch.cuda.synchronize()
        torch.distributed.barrier()

    def step(self, micro: int) -> tuple[float, float]:
        """One optimizer step (grad_accum micro-steps); returns (seconds, mean loss)."""
        self._sync()
        t0 = time.perf_counter()
        batches = [self._batch(micro) for _ in range(self.cfg.batch.grad_accum)]
        losses = self.engine.step(batches, self._causal_mask(), self.marks)
        self._sync()
        secs = time.perf_counter() - t0
        self.marks("idle")
        self.steps_done += 1
        # fp16: an overflow makes the engine skip the update and lower the loss scale.
        self.applied = self.engine.was_step_applied()
        self.applied_any = self.applied_any or self.applied
        # parallel.sp: the group's loss, reduced outside the timed step (a reporting collective)
        losses = ulysses.sequence_mean(losses, self.device)
        # parallel.pp: the last stage's losses, broadcast to its pipeline outside the timed step
        shared = getattr(self.engine, "shared_losses", None)
        if shared is not None:
            losses = shared(losses)
        return secs, sum(losses) / len(losses)

    # -- memory ---------------------------------------------------------------------------------
    def profiled_step(self, micro: int) -> tuple[float, float, int, str]:
        """A step whose peak live-tensor bytes are measured: (seconds, loss, peak bytes, phase).

        CPU: the live bytes at the start (gc walk) plus the largest net allocation the profiler's
        memory events show during the step; frees of blocks allocated before the profiler started
        are invisible to it, so this errs high, never low. The same peak per phase goes to
        `self.phase_live` (a search reads the phases that grow with the batch from it). GPU:
        torch's own peak counter.
        """
        self.phase_live = {}
        if not self.on_cpu:
            torch.cuda.reset_peak_memory_stats()
            secs, loss = self.step(micro)
            return secs, loss, torch.cuda.max_memory_allocated(), ""
        from torch.profiler import ProfilerActivity, profile

        base = live_tensor_bytes()
        first = len(self.marks.marks)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            secs, loss = self.step(micro)
            # The step's peak is in; what follows is the profiler's own: stopping it and reading
            # its events held 34 MiB above the step's RSS peak at 16K tokens with the tiled MLP
            # (256 tiles per layer: events in proportion; measured with VmHWM, issue 45)
            self.rss_peak = max(self.rss_peak or 0, rss_high_water())
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]")
        # Profiler clock and time.time() agree closely enough to name the phase of each event.
        marks = [(t * 1e9, ph) for t, ph in self.marks.marks[first:]]
        cur = peak = 0
        phase, i, by_phase = "forward", 0, {}
        for t, n in events:
            while i < len(marks) and marks[i][0] <= t:
                phase, i = marks[i][1], i + 1
            cur += n
            by_phase[phase] = max(by_phase.get(phase, 0), cur)
        if by_phase:
            phase = max(by_phase, key=by_phase.get)
            peak = by_phase[phase]
        self.phase_live = {ph: base + b for ph, b in by_phase.items()}
        del events, prof
        reset_rss_high_water()  # the next entry's peak starts from its own steps (rss_peak keeps this one's)
        return secs, loss, base + peak, phase

    def applied_profile(self, run: _EntrySteps, micro: int) -> tuple[float, int, str]:
        """The profiled step, again while it overflowed (fp16, bounded): a skipped step runs no
        optimizer step, so its peak would miss the update's temporaries, as time/it already leaves
        such steps out. (seconds, peak live bytes, phase) of the last one."""
        for _ in range(MAX_SKIPPED_STEPS + 1):
            secs, loss, peak_live, phase = self.profiled_step(micro)
            run.count(loss)
            if self.applied:
                break
        return secs, peak_live, phase

    def memory_now(self) -> dict:
        # CPU: the peak up to the end of the profiled step, not the profiler's bookkeeping after it
        rss = self.rss_peak if self.on_cpu and self.rss_peak else (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        out = {"peak_rss_bytes": rss, "host": os.uname().nodename}
        if not self.on_cpu:
            out["torch_peak_allocated"] = torch.cuda.max_memory_allocated()
            out["torch_peak_reserved"] = torch.cuda.max_memory_reserved()
            out.update(self.gpu.record(peak_reserved=out["torch_peak_reserved"]))
        return out

    # -- plan -----------------------------------------------------------------------------------
    def run_entry(self, micro: int, mode: Mode) -> RankRecord:
        steps = self.cfg.steps
        n_warm = steps.warmup if mode == Mode.MEASURE else steps.probe
        n_timed = steps.timed if mode == Mode.MEASURE else 0
        if self.cfg.compile and n_timed:
            # Compiled, the first two steps compile: the second recompiles once, because megatron's
            # scratch buffer (a guarded dict) exists only after the first.
            n_warm = max(n_warm, COMPILE_WARMUP_STEPS)
        if not self.on_cpu:
            torch.cuda.reset_peak_memory_stats()
            self.gpu.reset_peak()
        run = _EntrySteps(self, micro)
        for _ in range(n_warm):
            run.warm.append(run.step())
        run.timed(n_timed)
        if self.cfg.compile and run.times and self.compile_s is None:
            # What compiling cost: the warm-up's time beyond steady steps (first measured entry).
            steady = statistics.median(run.times)
            self.compile_s = sum(max(0.0, w - steady) for w in run.warm)
        # Optimizer state is allocated at the first update: with fp16, go on until one was applied.
        while not self.applied_any and run.skipped < MAX_SKIPPED_STEPS:
            run.step()
        if self.states is None:  # model states exist once the first optimizer step has run
            self.states = self.engine.model_states()
        secs, peak_live, phase = self.applied_profile(run, micro)
        if not n_timed and self.applied:  # a probe's time: its profiled step, if that was applied
            run.times.append(secs)
        note = "" if run.times else ("fp16: every timed step overflowed, no time/it from a skipped step" if n_timed
                                     else "fp16: the profiled step overflowed, no time/it from a skipped step")
        if not self.applied:
            note = "; ".join(filter(None, [note, "fp16: memory from a skipped step (no optimizer step in it)"]))
        return RankRecord(rank=self.rank, event=Event.END, status=RankStatus.OK, micro=micro, mode=mode,
                          loss=run.losses[-1], losses=run.losses, grad_norms=run.grad_norms, step_times=run.times,
                          time_per_step=statistics.median(run.times) if run.times else None, time_note=note,
                          peak_live_bytes=peak_live, peak_phase=phase, phase_live_bytes=self.phase_live,
                          stage=self.cfg.layout.stage_of(self.rank),
                          model_states=self.states.to_dict(),
                          loss_scale=self.engine.loss_scale(), skipped_steps=run.skipped, compile_s=self.compile_s,
                          zero_init=self.engine.zero_init, offloaded=self.engine.offloaded(),
                          hpz_secondary=self.engine.hpz_secondary,
                          runtime_bytes=self.runtime_bytes, build_bytes=self.build_bytes, marks=self.marks.marks,
                          **self.fixed_terms,
                          **self.memory_now())

    def over_capacity(self, rec: RankRecord) -> bool:
        """All ranks agree (max all-reduce) whether any rank's peak passed the capacity."""
        over = over_capacity(compared_peak(rec, self.cfg.hardware.device), self.spec.capacity_bytes)
        flag = torch.tensor([1.0 if over else 0.0], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def run(self) -> None:
        for entry in self.spec.plan:
            self._emit(RankRecord(rank=self.rank, event=Event.BEGIN, micro=entry.micro, mode=entry.mode))
            try:
                rec = self.run_entry(entry.micro, entry.mode)
            except BaseException as exc:  # noqa: BLE001 - every failure must be recorded
                failed = failure_record(self.rank, exc, Event.END, device_near_full(self.gpu), micro=entry.micro,
                                        mode=entry.mode, marks=self.marks.marks[-50:])
                self._emit(failed)
                # Peers may wait in a collective we will never join: leave, the launcher ends them.
                os._exit(OOM_EXIT if failed.status == RankStatus.OOM else 1)
            over = self.over_capacity(rec)
            self._emit(dataclasses.replace(rec, status=RankStatus.OVER_CAPACITY if over else RankStatus.OK))
            self.marks.marks = self.marks.marks[-1:]
            if over:
                break


def run_spec(spec: TrialSpec) -> NoReturn:
    """Run one trial's plan in this process and end it (a fresh launch, or a pool's forked child)."""
    try:
        rank = start(spec)
    except BaseException as exc:  # noqa: BLE001 - an init failure is a result ("cannot initialize")
        r = int(os.environ.get("RANK", "0"))
        on_gpu = spec.config.hardware.device != Device.cpu
        failed = failure_record(r, exc, Event.INIT_FAILED, on_gpu and device_near_full(None, spec.capacity_bytes))
        append_record(log_path(spec, r), failed)
        os._exit(OOM_EXIT if failed.status == RankStatus.OOM else 1)
    if spec.fault is not None:
        inject(rank, spec.fault)
    rank.run()
    rank._emit(RankRecord(rank=rank.rank, event=Event.DONE))
    # Skip interpreter teardown of process groups and threads: it can hang on gloo.
    os._exit(0)
