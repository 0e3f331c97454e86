"""Test-only faults in a real trial: a TrialSpec may carry a `Fault` (tests pass one through
launch.LaunchOptions / search.SearchOptions; no user config key reaches it). Production pays one
`if` per trial: the rank's step is wrapped only when the spec has a fault."""
from __future__ import annotations

import os
import signal
import time

from zero_bench.records import Fault, FaultKind


def inject(rank, fault: Fault) -> None:
    """Wrap `rank.step(micro)` so that, on fault.rank, entries with micro >= fault.min_micro fail as asked."""
    if rank.rank != fault.rank:
        return
    step = rank.step

    def faulty_step(micro: int):
        if micro >= fault.min_micro:
            fail(rank, fault.kind)
        return step(micro)

    rank.step = faulty_step


def fail(rank, kind: FaultKind) -> None:
    if kind == FaultKind.RAISE:
        raise RuntimeError(f"injected fault on rank {rank.rank}")
    if kind == FaultKind.OOM:  # a real allocator failure, as an oversized batch would cause
        rank.torch.empty(1 << 60, dtype=rank.torch.uint8, device=rank.device)
    if kind == FaultKind.KILL:  # what the kernel's OOM killer does
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == FaultKind.HANG:  # a rank stuck in a collective that never completes
        time.sleep(1e6)
