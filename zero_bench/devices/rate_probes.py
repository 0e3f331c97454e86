"""This CPU's rates for the time prediction, measured in-process on one rank's threads (what `zero_bench
calibrate` stores beside the matmul rate, devices/calibration.py): the memory bandwidth memory-bound
ops run at, and DeepSpeed's CPU Adam per parameter. Each is the best of a few timed repeats (the
first call, which allocates and loads kernels, left out), as metrics.matmul_flops times the matmul."""
from __future__ import annotations

import time
from typing import Callable, Optional

MEMORY_ELEMENTS = 16_000_000  # 64 MB per fp32 tensor: past this CPU's caches
ADAM_PARAMS = 4_000_000


def best_seconds(run: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls after one untimed one."""
    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def with_threads(threads: int, probe: Callable[[], float]) -> float:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return probe()
    finally:
        torch.set_num_threads(before)


def memory_bytes_per_s(threads: int = 1, n: int = MEMORY_ELEMENTS) -> float:
    """Bytes per second an elementwise add moves (2 reads + 1 write of n fp32 elements)."""
    import torch

    def probe() -> float:
        a, b = torch.randn(n), torch.randn(n)
        c = torch.empty_like(a)
        return 3 * 4 * n / best_seconds(lambda: torch.add(a, b, out=c))

    return with_threads(threads, probe)


def cpu_adam_params_per_s(threads: int = 1, n: int = ADAM_PARAMS) -> Optional[float]:
    """Parameters per second DeepSpeedCPUAdam steps (fp32 master and moments); None where its op does
    not load here (the first load JIT-builds it: minutes)."""
    import torch

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 - the op is optional: the rate stays the stated default
        return None

    def probe() -> float:
        p = torch.nn.Parameter(torch.zeros(n))
        p.grad = torch.randn(n)
        opt = DeepSpeedCPUAdam([p], lr=1e-3)
        return n / best_seconds(opt.step)

    try:
        return with_threads(threads, probe)
    except Exception:  # noqa: BLE001 - a build failure reads as "not measured", not as a crash
        return None
