"""Test-only faults in a real trial: a TrialSpec may carry a `Fault` (tests pass one through
launch.LaunchOptions / search.SearchOptions; no user config key reaches it). Production pays one
`if` per trial: the rank's step is wrapped only when the spec has a fault."""
from __future__ import annotations

import os
import signal
import time

from zero_bench.records import Fault, FaultKind


def inject(rank, fault: Fault) -> None:
    """Wrap `rank.step(micro)` so that, on fault.rank, entries with micro >= fault.min_micro fail as asked
    (SLOW: the engine's step, so that the time is inside the timed step)."""
    if rank.rank != fault.rank:
        return
    if fault.kind == FaultKind.SLOW:
        slow_engine(rank.engine, fault)
        return
    step = rank.step

    def faulty_step(micro: int):
        if micro >= fault.min_micro:
            fail(rank, fault.kind)
        return step(micro)

    rank.step = faulty_step


def slow_engine(engine, fault: Fault) -> None:
    """Every step of `engine` first sleeps fault.seconds per sample: inside the timed step, as a
    slower machine's compute would be (the peers wait for it in the step's collectives)."""
    step = engine.step

    def slow_step(batches, mask, marks):
        micro = batches[0][0].shape[0]
        if micro >= fault.min_micro:
            time.sleep(fault.seconds * micro)
        return step(batches, mask, marks)

    engine.step = slow_step


def fail(rank, kind: FaultKind) -> None:
    if kind == FaultKind.RAISE:
        raise RuntimeError(f"injected fault on rank {rank.rank}")
    if kind == FaultKind.OOM:  # a real allocator failure, as an oversized batch would cause
        rank.torch.empty(1 << 60, dtype=rank.torch.uint8, device=rank.device)
    if kind == FaultKind.KILL:  # what the kernel's OOM killer does
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == FaultKind.HANG:  # a rank stuck in a collective that never completes
        time.sleep(1e6)
