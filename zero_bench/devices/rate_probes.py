"""This CPU's rates for the time prediction, measured in-process on one rank's threads (what `zero_bench
calibrate` stores beside the matmul rate, devices/calibration.py): the memory bandwidth memory-bound
ops run at, and DeepSpeed's CPU Adam per parameter. Each is the best of a few timed repeats (the
first call, which allocates and loads kernels, left out), as metrics.matmul_flops times the matmul."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, fields
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


# -- the ranks' own rates: every rank of the machine busy at once ------------------------------------
# A trial's ranks compute together on the machine's cores and talk over gloo: the rates they see are
# measured with `ranks` processes doing the same thing at once, behind a barrier, and the collectives
# between them over gloo, as the trial's ranks talk. On this 2-vCPU EPYC a quiet machine's both-ranks
# bf16 F.linear 1024^2 ran at 201.7 GFLOP/s against ~210 alone; other processes beside a run moved it
# to 33-115 (2026-11-28): the figure is the machine's state as much as its hardware, and is best
# measured right beside the trials it predicts (benchmarks/time_vs_cpu_trials.py does).
PROBE_SIDE = 1024  # the matmul: metrics.matmul_flops' 1024^2 F.linear
ELEMENTWISE_ROWS, ELEMENTWISE_WIDTH = 1024, 1024  # the memory-bound mix: [tokens, width] activations
COLLECTIVE_ELEMENTS = 4_000_000  # 16 MB of fp32: a gradient bucket's order
ADAM_TENSORS, ADAM_SMALL = 64, 1024  # the per-tensor cost: many small tensors
SUSTAIN_S = 1.0  # each probe keeps every rank busy this long
MIN_CALLS = 3
COLLECTIVE_CALLS = 15


@dataclass(frozen=True)
class RankRates:
    """What one of `ranks` ranks measured with all of them running the probe at once (medians)."""
    ranks: int
    threads: int
    precision: str
    matmul_flops: float
    """F.linear 1024^2 in `precision`, every rank multiplying at once."""
    elementwise_bytes_per_s: float
    """The layer's memory-bound ops (layer norm, GeLU, softmax, residual add, forward and backward) in
    `precision` on [1024, 1024] activations: bytes as compute.py counts them (read + written forward,
    2 x that backward) per second."""
    scores_bytes_per_s: float
    """Unfused attention's mask and softmax on [4, 4, 256, 256] `precision` scores, forward and
    backward: bytes as compute.py counts them (4 elements read + written forward, 2 x backward) per s."""
    loss_bytes_per_s: float
    """The loss on [256, 4, 8192] `precision` logits ([s, b, v], as megatron's output layer gives
    them): upcast to fp32, cross-entropy, forward and backward; compute.py's 10 bytes per logit
    forward, 2 x backward, per second."""
    all_reduce_bytes_per_s: Optional[float]
    """gloo all-reduce bus bandwidth (2 (n-1)/n x bytes / s) of 16 MB fp32; None with one rank."""
    all_gather_bytes_per_s: Optional[float]
    """gloo all-gather bus bandwidth ((n-1)/n x the gathered bytes / s)."""
    collective_latency_s: Optional[float]
    """A one-element gloo all-reduce: what every collective call costs before its bytes."""
    adam_params_per_s: float
    """torch.optim.AdamW (fp32, as ds_configs/cpu.json's torch_adam and FSDP2 step) on one 4M tensor."""
    adam_per_tensor_s: float
    """What each more tensor adds to a torch AdamW step (its per-tensor loop: ~10 small ops)."""
    op_overhead_s: float
    """One tiny ATen op's dispatch (an 8-element add)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _median(run: Callable[[], object], sync: Callable[[], None], seconds: Optional[float] = None,
            calls: Optional[int] = None) -> float:
    """Median seconds of `run`, called over and over for `seconds` after one untimed call, started on
    every rank at once behind `sync` (a barrier): the ranks stay busy together the whole window, as a
    trial's ranks do through a step (a median over many calls, not a best-of burst)."""
    run()
    sync()
    times = []
    end = time.perf_counter() + (SUSTAIN_S if seconds is None else seconds)
    # a collective: a fixed number of calls (every rank must make as many)
    while (len(times) < calls) if calls else (time.perf_counter() < end or len(times) < MIN_CALLS):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _elementwise_mix(dtype) -> tuple[Callable[[], object], float]:
    """The layer's memory-bound ops forward and backward, and the bytes compute.py counts for them."""
    import torch

    x = torch.randn(ELEMENTWISE_ROWS, ELEMENTWISE_WIDTH, dtype=dtype, requires_grad=True)
    res = torch.randn(ELEMENTWISE_ROWS, ELEMENTWISE_WIDTH, dtype=dtype)
    norm = torch.nn.LayerNorm(ELEMENTWISE_WIDTH).to(dtype)
    grad = torch.randn(ELEMENTWISE_ROWS, ELEMENTWISE_WIDTH, dtype=dtype)

    def run():
        y = torch.softmax(torch.nn.functional.gelu(norm(x)), dim=-1) + res
        y.backward(grad)
        x.grad = None

    # forward: norm (read + write), GeLU (read + write), softmax (read + write), add (2 reads + write)
    elements = (2 + 2 + 2 + 3) * x.numel()
    itemsize = x.element_size()
    return run, 3 * elements * itemsize  # backward moves 2 x forward's bytes (compute.py BACKWARD_FACTOR)


SCORES_SHAPE = (4, 4, 256, 256)  # [b, a, s, s]: gpt-mini's at micro 4
LOGITS_SHAPE = (256, 4, 8192)  # [s, b, v]


def _scores_mix(dtype) -> tuple[Callable[[], object], float]:
    """Unfused attention's mask + softmax forward and backward, and compute.py's bytes for them."""
    import torch

    x = torch.randn(*SCORES_SHAPE, dtype=dtype, requires_grad=True)
    mask = torch.ones(SCORES_SHAPE[-2:], dtype=torch.bool).triu(1)
    grad = torch.randn(*SCORES_SHAPE, dtype=dtype)

    def run():
        torch.softmax(x.masked_fill(mask, -10000.0), dim=-1).backward(grad)
        x.grad = None

    return run, 3 * 4 * x.numel() * x.element_size()


def _loss_mix(dtype) -> tuple[Callable[[], object], float]:
    """The logits upcast and cross-entropy forward and backward, and compute.py's bytes for them."""
    import torch

    s, b, v = LOGITS_SHAPE
    x = torch.randn(s, b, v, dtype=dtype, requires_grad=True)
    target = torch.randint(0, v, (b, s))

    def run():
        logits = x.transpose(0, 1).float()  # megatron's loss reads [s, b, v]; the batch-first view upcast
        torch.nn.functional.cross_entropy(logits.reshape(-1, v), target.reshape(-1)).backward()
        x.grad = None

    return run, 3 * (2 + 4 + 4) * x.numel()


def _adam_seconds(tensors: list) -> Callable[[], object]:
    import torch

    params = [torch.nn.Parameter(t) for t in tensors]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    return opt.step


def _rank_probe(rank: int, ranks: int, threads: int, precision: str, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    sync = (lambda: None)
    if ranks > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
        sync = dist.barrier
    try:
        a, w = torch.randn(PROBE_SIDE, PROBE_SIDE, dtype=dtype), torch.randn(PROBE_SIDE, PROBE_SIDE, dtype=dtype)
        mm = 2 * PROBE_SIDE ** 3 / _median(lambda: torch.nn.functional.linear(a, w), sync)
        mix, mix_bytes = _elementwise_mix(dtype)
        elementwise = mix_bytes / _median(mix, sync)
        scores, scores_bytes = _scores_mix(dtype)
        scores_rate = scores_bytes / _median(scores, sync)
        loss, loss_bytes = _loss_mix(dtype)
        loss_rate = loss_bytes / _median(loss, sync)
        big = _adam_seconds([torch.zeros(ADAM_PARAMS)])
        adam = ADAM_PARAMS / _median(big, sync)
        small = _adam_seconds([torch.zeros(ADAM_SMALL) for _ in range(ADAM_TENSORS)])
        per_tensor = max(0.0, (_median(small, sync) - ADAM_TENSORS * ADAM_SMALL / adam) / ADAM_TENSORS)
        tiny = torch.randn(8)
        op = _median(lambda: [tiny.add(tiny) for _ in range(1000)], sync) / 1000
        ar = ag = lat = None
        if ranks > 1:
            t = torch.randn(COLLECTIVE_ELEMENTS)
            nbytes = t.numel() * t.element_size()
            ar = 2 * (ranks - 1) / ranks * nbytes / _median(lambda: dist.all_reduce(t), sync, calls=COLLECTIVE_CALLS)
            part = torch.randn(COLLECTIVE_ELEMENTS // ranks)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13's name
            out = torch.empty(part.numel() * ranks)
            ag = (ranks - 1) / ranks * nbytes / _median(lambda: gather(out, part), sync,
                                                         calls=COLLECTIVE_CALLS)
            one = torch.zeros(1)
            lat = _median(lambda: [dist.all_reduce(one) for _ in range(20)], sync, calls=COLLECTIVE_CALLS) / 20
        got = RankRates(ranks, threads, precision, mm, elementwise, scores_rate, loss_rate, ar, ag, lat, adam, per_tensor,
                        op)
        # every rank's figures: the slowest rank sets a lockstep trial's pace
        gathered = [None] * ranks
        if ranks > 1:
            dist.all_gather_object(gathered, got)
        else:
            gathered = [got]
        if rank == 0:
            queue.put(gathered)
    finally:
        if ranks > 1:
            dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slowest(got: list[RankRates]) -> RankRates:
    """One figure per rate from the ranks' own: the slowest rank's (lockstep ranks wait for it)."""
    first = got[0]
    pick = {}
    for f in fields(RankRates):
        values = [getattr(r, f.name) for r in got]
        if f.name in ("ranks", "threads", "precision") or values[0] is None:
            pick[f.name] = getattr(first, f.name)
        elif f.name in ("collective_latency_s", "adam_per_tensor_s", "op_overhead_s"):
            pick[f.name] = max(values)
        else:
            pick[f.name] = min(values)
    return RankRates(**pick)


def rank_rates(ranks: int = 2, threads: int = 1, precision: str = "bf16", timeout: float = 300.0) -> RankRates:
    """The rates of one of `ranks` CPU ranks (`threads` threads each) all busy at once, measured in
    spawned processes (a few seconds of probing after torch's import in each)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_probe, args=(r, ranks, threads, precision, port, queue), daemon=True)
             for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        got = queue.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return slowest(got)
