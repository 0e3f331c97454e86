"""How long a trial may go without progress before it is called hung: from the speed measured so far.

A fixed limit per batch size is wrong both ways: on a slow CPU (bf16 without native support, a
large micro-batch) a healthy step can take minutes, and a limit long enough for that makes a real
hang wait as long. So the runner watches progress instead: rank 0 writes a record after every
optimizer step (records.Event.STEP), and the time allowed until the next record is

    max(timeout_s, MARGIN x the expected step)      expected step = micro x grad_accum x pace

where the pace (seconds per sample on one rank) is the slowest one measured so far in the same
search, probes and trials alike, this launch's own steps included; before anything was measured,
the model's FLOPs per sample over the measured matmul rate at ASSUMED_EFFICIENCY (metrics.py).
timeout_s is the floor: a step expected to take a second still gets timeout_s. An entry's first step
gets FIRST_STEP x that, plus COLD_COMPILE_S where it compiles (compile=true, or megatron's jit
fusions on GPU: BenchConfig.fusions). The time from the start to a rank's first record (imports in a launch of its
own, the model, the engine) gets INIT_FACTOR x timeout_s. Pure arithmetic; launch.py applies it
(Limits.for_trial), search/maxbatch.py supplies the pace.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional

from zero_bench.config.schema import BenchConfig, Device
from zero_bench.devices import metrics
from zero_bench.devices.environment import machine_environment_cached
from zero_bench.models.flops import hardware_flops_per_seq
from zero_bench.records import Event, RankRecord, Status, TrialResult

# A step may take this many times the expected one: the profiled step (the CPU profiler records every
# allocation, ~1.5-2x a plain step here), another process on the same cores, the slowest-rank noise.
MARGIN = 4.0
# The first step of an entry allocates the new batch's activations and, in a fresh process, the
# optimizer states (lazily, at the first update); with compile=true it compiles.
FIRST_STEP = 3.0
# A GPU rank with megatron's jit fusions on (models/megatron.py jit_fused) compiles bias-dropout-add
# and the bias-activation in an entry's first step: megatron-core 0.16.1's jit_fuser is torch.compile
# (megatron/core/jit.py enable_jit_fuser), so dynamo, AOTAutograd's forward and backward graphs,
# inductor, and Triton's build of each kernel and of its CUDA launcher with the host's C compiler.
# Cold (nothing in the inductor / Triton caches: a fresh machine, another torch) that is tens of
# seconds per function; every rank of a node compiles at once on the same cores, and a forked pool
# child or a new batch size (automatic dynamic shapes) compiles again. An H100's expected step is
# near 0 s, so without this the first step would get the floor alone (timeout_s, 60 s by default).
# Not measured here (no GPU); generous, since a longer limit costs time only when a trial truly hangs.
COLD_COMPILE_S = 300.0
# Start-up to the first record, and from there to the first batch size: a launch of its own imports
# torch, deepspeed and megatron-core (~10 s on 2 CPU cores), then builds the model and the engine
# (a large model's initialisation takes minutes: timeout_s scales it).
INIT_FACTOR = 10.0
# Before anything was measured: FLOPs at a tenth of the matmul rate (small models on CPU reach
# 20-50 % of it; the margin above comes on top).
ASSUMED_EFFICIENCY = 0.1


@dataclass(frozen=True)
class Pace:
    """Seconds per sample on one rank, and where the figure comes from."""
    s_per_sample: float
    source: str  # "measured" (this search's steps) or "estimated" (FLOPs over the matmul rate)

    def slower(self, other: Optional["Pace"]) -> "Pace":
        """The slower of two measured paces; a measurement replaces an estimate either way (the
        estimate's efficiency is a guess, only meant to hold until the first step is seen)."""
        if other is None:
            return self
        if self.source != other.source:
            return self if self.source == "measured" else other
        return self if self.s_per_sample >= other.s_per_sample else other


def step_pace(rec: RankRecord, grad_accum: int) -> Optional[Pace]:
    """The pace one STEP (or END) record shows: its step's seconds over its samples."""
    secs = rec.step_seconds if rec.event == Event.STEP else max(rec.step_times, default=None)
    if not secs or not rec.micro:
        return None
    return Pace(secs / (rec.micro * grad_accum), "measured")


def measured_pace(trials: Iterable[TrialResult], grad_accum: int) -> Optional[Pace]:
    """The slowest pace of this search's finished trials, probes and measurements alike."""
    pace = None
    for t in trials:
        if t.status == Status.OK and t.time_per_step_s:
            pace = Pace(t.time_per_step_s / (t.micro * grad_accum), "measured").slower(pace)
    return pace


def estimated_pace(cfg: BenchConfig, flops_per_s: Optional[float]) -> Optional[Pace]:
    """Before any step ran: the model's FLOPs per sample on one rank (1/tp of them) at
    ASSUMED_EFFICIENCY of `flops_per_s`, one rank's measured matmul rate (None: unknown)."""
    if not flops_per_s:
        return None
    flops = hardware_flops_per_seq(cfg.model, cfg.recompute, cfg.recompute_layers) / cfg.parallel.tp
    return Pace(flops / (flops_per_s * ASSUMED_EFFICIENCY), "estimated")


def device_flops(cfg: BenchConfig) -> Optional[float]:
    """One rank's matmul rate at the trial's precision: on CPU measured once per machine and cached
    (metrics.cpu_peak_flops, ~0.5 s the first time); on GPU the datasheet's peak; None: unknown."""
    if cfg.hardware.device == Device.cpu:
        return metrics.cpu_peak_flops(str(cfg.precision))["flops"]
    return metrics.gpu_peak_flops(str(dict(machine_environment_cached()).get("gpu", "")), str(cfg.precision))


def cold_compile_s(cfg: BenchConfig) -> float:
    """Seconds an entry's first step may add for a compile: COLD_COMPILE_S where megatron's jit
    fusions run (models/megatron.py jit_fused's condition, GPU with fusions, written out so that the
    runner needs no torch; tests/unit/test_jit_fusions.py holds the two together) or compile=true
    compiles the whole model (GPT-mini's ZeRO-3 first step compiled for ~60 s on 2 CPU cores, past
    the 60 s floor: docs/verified.md, "torch.compile")."""
    fused = cfg.fusions and cfg.hardware.device != Device.cpu
    return COLD_COMPILE_S if fused or cfg.compile else 0.0


@dataclass(frozen=True)
class Limits:
    """The time allowed without progress, for one launch."""
    floor_s: float  # timeout_s
    grad_accum: int = 1
    pace: Optional[Pace] = None
    in_first_step: bool = False  # rank 0 began an entry and has not finished its first step
    compile_s: float = 0.0  # what an entry's first step may add for a compile (cold_compile_s)

    @classmethod
    def for_trial(cls, cfg: BenchConfig, pace: Optional[Pace]) -> "Limits":
        """The limits of a launch of `cfg` at `pace` (None: nothing measured or estimated)."""
        return cls(cfg.timeout_s, cfg.batch.grad_accum, pace, compile_s=cold_compile_s(cfg))

    def init_s(self) -> float:
        return INIT_FACTOR * self.floor_s

    def step_s(self, micro: int, first: bool = False) -> float:
        expected = (self.pace.s_per_sample if self.pace else 0.0) * micro * self.grad_accum
        if first:
            return max(self.floor_s, MARGIN * expected * FIRST_STEP) + self.compile_s
        return max(self.floor_s, MARGIN * expected)

    def after(self, rec: RankRecord) -> float:
        """Seconds allowed until rank 0's next record, given its latest one."""
        if rec.event in (Event.BEGIN, Event.END):  # after an END the next entry begins at once
            return self.step_s(rec.micro or 1, first=True)
        if rec.event == Event.STEP:
            return self.step_s(rec.micro or 1)
        return self.init_s()  # START: the model and the engine are being built

    def observe(self, rec: RankRecord) -> "Limits":
        """These limits once rank 0 wrote `rec`: its step's pace counts if it is the slowest so far,
        except an entry's first step (allocations, compile: FIRST_STEP allows for those)."""
        if rec.event == Event.BEGIN:
            return dataclasses.replace(self, in_first_step=True)
        if rec.event == Event.STEP and self.in_first_step:
            return dataclasses.replace(self, in_first_step=False)
        seen = step_pace(rec, self.grad_accum)
        return dataclasses.replace(self, pace=seen.slower(self.pace) if seen else self.pace, in_first_step=False)

    def describe(self) -> str:
        compiles = f", first step +{self.compile_s:g} s for a cold compile" if self.compile_s else ""
        if self.pace is None:
            return f"timeout_s={self.floor_s:g}{compiles}"
        return f"{self.pace.s_per_sample:.3g} s/sample {self.pace.source}, floor timeout_s={self.floor_s:g}{compiles}"
