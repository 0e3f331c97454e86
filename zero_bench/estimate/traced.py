"""The traced prediction: one rank of the configured world, traced step by step in this process.

torch's memory tracker (torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker, a dispatch mode)
watches every tensor storage the real model, the real FSDP2 wrapping, forward, backward, clipping
and the optimizer step create and free, under FakeTensorMode (tensors with shapes and dtypes, no
memory, no arithmetic) and torch's "fake" process group (collectives that move nothing): a world of
N ranks is traced as its rank 0 (the rank holding the most: FSDP2 pads shards to rank 0's size) in
one CPU process in seconds, whatever N and the model's size. What it returns is the peak of the live
tensors per rank and what they were at that moment: parameters, gradients, optimizer states,
gathered parameters, activations and temporaries (the tracker's categories), the phase of the step
it fell in, and each FSDP2 unit's own forward and backward peak (the tracker's per-module view).

The model is built exactly as engines/fsdp2.py builds it (its compute_config, shard_options,
shard_layer, as_dtype, make_optimizer; models/megatron.py's build_gpt), on megatron's parallel state
over the fake world. The step is Fsdp2Engine.step without its host reads (loss.item(), the
gradient norm as a float): grad_accum micro-batches of batch.micro samples, clipping, AdamW,
gradients freed. The optimizer is primed first (one update on zero gradients) so that the traced
step is a steady one, as the worker's profiled step is (docs/measuring.md).

CPU tensors, whatever the configured device (fake "cuda" tensors abort a CPU-only torch): on a GPU
configuration megatron's fused functions (`fusions`) run eagerly, which saves what the compiled
ones save, and AdamW is the fused one; what still differs on a GPU is named in GPU_DIFFERS. On a
CPU configuration: gloo's second all-gather buffer (estimate/fsdp2.py) is gloo's own, not a tensor
the fake process group makes, so the trace does not see it.

Refused in one line each (ConfigError naming the key, exit 2; `refusal`): an engine whose spec names
no tracer (DeepSpeed: see engines/specs.py), a mixture of experts, compile=true, Ulysses (parallel.sp > 1), states=adam8bit,
offload on a GPU, a world above MAX_WORLD ranks, a torch other than TORCH_SERIES (the tracker's
namespace is private), and a process that already has a process group.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

from zero_bench.config.schema import BenchConfig, ConfigError, Device, Recompute, States
from zero_bench.engines.specs import load, spec
from zero_bench.units import MiB

TORCH_SERIES = "2.13."
"""The torch release series the tracer was written and measured against: torch.distributed._tools is
a private namespace (its categories, hooks and peak bookkeeping may change in any release)."""

MAX_WORLD = 16384
"""The largest world traced (tp x dp ranks). megatron's parallel_state creates every group of the
world in this process: measured here 0.03 s at 64 ranks, 1.5 s at 4,096, 3.9 s at 16,384 and 27 s
at 65,536 (tp 1); 16,384 is the largest GPU job published for one model (Llama 3 405B)."""

TERMS = ("params", "grads", "optimizer", "gathered params", "activations + temporaries")
"""The peak's terms the formula and the trace both name (compare())."""

WARN_RATIO = 0.10  # formula vs trace: a term off by more than this is a warning ...
WARN_SHARE = 0.01  # ... when the difference is also more than this share of the traced peak

GPU_DIFFERS = ("traced with CPU tensors and kernels; on a GPU: RMSNorm (torch's CPU composite keeps its input in "
               "fp32 and x * rsqrt beside it, 6h bytes per token and norm more than the fused CUDA kernel: about "
               "a fifth of Llama-3-8B's activations), the attention kernel (flash / memory-efficient; fp32 expands "
               "K/V to every head, dropout keeps no s x s mask), cuBLAS's workspaces, the caching allocator's "
               "512-byte blocks and fragmentation, the CUDA context and NCCL's buffers (the fixed terms and the "
               "fragmentation shown are the formula's)")
CPU_DIFFERS = ("traced with fake tensors and a fake process group: gloo's own second all-gather buffer "
               "(zero=3, one layer) is not seen")


@dataclass(frozen=True)
class Traced:
    """One traced step of one rank (bytes)."""
    label: str
    world: int  # ranks traced (tp x dp); this process was rank 0
    micro: int
    grad_accum: int
    peak_bytes: int  # the live tensors' peak over the step
    phase: str  # where the peak fell: forward, backward, clipping or optimizer step
    terms: dict  # TERMS -> bytes at the peak
    categories: dict  # FSDPMemTracker's own categories at the peak (name -> bytes)
    modules: dict = field(default_factory=dict)  # FSDP2 unit -> {"forward": peak, "backward": peak}
    seconds: float = 0.0  # build + trace, this process
    differs: str = ""  # what a real run measures that the trace cannot see

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Term:
    """One term of the peak, as the formula and the trace have it (bytes)."""
    name: str
    formula: int
    traced: int

    @property
    def error(self) -> Optional[float]:
        """(formula - traced) / traced, in %; None where the trace holds nothing of it."""
        return None if not self.traced else (self.formula - self.traced) / self.traced * 100


# -- what cannot be traced ------------------------------------------------------------------------

def refusal(bench: BenchConfig) -> Optional[str]:
    """The one line saying why `bench` cannot be traced (the key first), or None."""
    import torch

    if not torch.__version__.startswith(TORCH_SERIES):
        return (f"traced=true: torch {torch.__version__} is not the {TORCH_SERIES}x the tracer is pinned to "
                "(torch.distributed._tools is private; pip install torch==2.13.0)")
    s = spec(bench.engine)
    if not s.tracer:
        return f"engine={bench.engine}: traced=true cannot trace it: {s.untraced}"
    m = bench.model
    if m.is_moe:
        return (f"model.num_experts={m.num_experts}: traced=true cannot trace a mixture of experts: megatron's "
                "token dispatcher sizes each expert's rows from the routing (a data-dependent shape), which "
                "FakeTensorMode cannot run; the formula's column stands alone")
    if bench.compile:
        return "compile=true: traced=true traces the eager layers only (inductor's kernels are not traced)"
    if bench.parallel.pp > 1:
        return (f"parallel.pp={bench.parallel.pp}: traced=true traces one rank's whole-model step; a pipeline stage's "
                "schedule (torch.distributed.pipelining's sends between stages) is not traced; the formula's "
                "per-stage figures stand alone (allowed with traced=true: parallel.pp=1)")
    if bench.parallel.sp > 1:
        return (f"parallel.sp={bench.parallel.sp}: traced=true cannot trace Ulysses: DeepSpeed's DistributedAttention "
                "all-to-alls through deepspeed.comm, whose backend the fake process group does not set up; "
                "allowed with traced=true: parallel.sp=1")
    if bench.states == States.adam8bit:
        return "states=adam8bit: traced=true runs the optimizer, and torchao's AdamW8bit is not installed"
    if bench.offload and bench.hardware.device != Device.cpu:
        return ("offload=true: traced=true traces CPU tensors, where host and device memory are one; on a GPU "
                "the offloaded states would be counted on the device")
    if bench.tiled_mlp is not None:
        return (f"tiled_mlp={bench.tiled_mlp}: traced=true cannot trace it: torch's ModTracker hooks each module's "
                "inputs for their gradients, and inside TiledMLP's autograd.Function forward the MLP's inputs have "
                "no gradient function (torch 2.13 mod_tracker: 'Expected gradient function to be set')")
    if bench.recompute_offload and bench.hardware.device != Device.cpu:
        return ("recompute_offload=true: traced=true traces CPU tensors, where host and device memory are one; "
                "on a GPU the offloaded layer inputs would be counted on the device")
    world = bench.parallel.tp * bench.parallel.dp
    if world > MAX_WORLD:
        return (f"parallel.dp={bench.parallel.dp}: traced=true traces worlds of up to {MAX_WORLD:,} ranks "
                f"(tp x dp = {world:,}; megatron builds every group of the world in this process)")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "traced=true: this process already has a torch.distributed process group; the trace needs its own"
    return None


def check(bench: BenchConfig) -> None:
    """ConfigError (one line, exit 2) for what cannot be traced."""
    why = refusal(bench)
    if why:
        raise ConfigError(why)


# -- the trace ------------------------------------------------------------------------------------

def trace(bench: BenchConfig, micro: Optional[int] = None) -> Traced:
    """Trace one optimizer step of rank 0 of `bench`'s world at `micro` (default batch.micro)."""
    check(bench)
    micro = bench.batch.micro if micro is None else micro
    t0 = time.perf_counter()
    try:
        with _quiet():
            out = load(spec(bench.engine).tracer)(bench, micro)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - what the tracer cannot run is one line, not a traceback
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"traced=true: {bench.label()} could not be traced ({type(exc).__name__}: {first})") from exc
    return dataclasses.replace(out, seconds=round(time.perf_counter() - t0, 2))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The trace's imports and steps without Python's warnings (torch's deprecations, FSDP2's notes
    on fake tensors) or megatron's INFO lines on the command's output."""
    import logging
    import warnings as python_warnings

    log = logging.getLogger("megatron")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        with python_warnings.catch_warnings():
            python_warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def trace_fsdp2(bench: BenchConfig, micro: int) -> Traced:
    """engine=fsdp2's tracer (its spec's `tracer`): rank 0 of the fake world, one traced step."""
    with _fake_world(bench):
        return _traced_step(bench, micro)


@contextlib.contextmanager
def _fake_world(bench: BenchConfig) -> Iterator[None]:
    """torch's fake process group of tp x dp ranks (this process rank 0) and megatron's parallel state
    over it, with the CPU shims; everything put back afterwards (the process group, megatron's
    state, its RNG tracker and checkpoint function, torch's CPU generator, and the excepthook
    init_process_group installs, which would prefix every later traceback with "[rank0]:")."""
    import sys

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zero_bench.models.shims import install_cpu_checkpoint, install_cpu_shims, seed_cpu_rng

    tp, dp = bench.parallel.tp, bench.parallel.dp
    checkpoint, rng, hook = tensor_parallel.checkpoint, torch.get_rng_state(), sys.excepthook
    tracker = mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * dp)
    try:
        # no gloo side groups: the fake backend cannot make them (and nothing here reads them)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
        install_cpu_shims()
        seed_cpu_rng(bench.seed)
        if bench.recompute != Recompute.none:
            install_cpu_checkpoint()  # as Fsdp2Engine: torch's non-reentrant checkpoint
        yield
    finally:
        tensor_parallel.checkpoint = checkpoint
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker
        torch.set_rng_state(rng)
        sys.excepthook = hook
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()


def _traced_step(bench: BenchConfig, micro: int) -> Traced:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zero_bench.engines import fsdp2 as engine
    from zero_bench.models.megatron import build_gpt, fusion_args

    on_gpu = bench.hardware.device != Device.cpu
    mesh = engine.dp_mesh(True, bench.layout)  # real: it reads the group
    config = engine.compute_config(bench, on_cpu=True)  # CPU initialisation (the fake tensors' device)
    if on_gpu:  # megatron's jit fusions as a GPU rank runs them (run eagerly below: what they save)
        fused = fusion_args(bench.model, on_cpu=False, fusions=bench.fusions)
        config.bias_dropout_fusion = fused["bias_dropout_fusion"]
        config.bias_activation_fusion = fused["bias_activation_fusion"]
        config.attention_softmax_in_fp32 = fused["attention_softmax_in_fp32"]
    dtype = torch.bfloat16 if bench.states == States.bf16 else None
    with FakeTensorMode(), torch.compiler.set_stance("force_eager"):
        kw = engine.shard_options(mesh, bench, on_cpu=True)
        model = build_gpt(bench, config, True,
                          on_layer=lambda layer: engine.shard_layer(engine.as_dtype(layer, dtype), kw, None))
        engine.fully_shard(engine.as_dtype(model, dtype), **kw)
        optimizer, clip = engine.make_optimizer(model, on_cpu=not on_gpu)
        _prime(model, optimizer)
        tracker = _tracker_class()(model, optimizer)
        with _not_propagation(tracker), tracker:
            _step(bench, model, optimizer, clip, micro, tracker)
        moments = sum(_nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    cats = peak_categories(tracker.get_tracker_snapshot("peak"))
    return Traced(label=bench.label(), world=bench.parallel.tp * bench.parallel.dp, micro=micro,
                  grad_accum=bench.batch.grad_accum, peak_bytes=cats.get("Total", 0), phase=tracker.peak_phase,
                  terms=traced_terms(cats, moments), categories=cats,
                  modules=tracker.unit_peaks(), differs=GPU_DIFFERS if on_gpu else CPU_DIFFERS)


def peak_categories(snapshot: dict) -> dict:
    """The tracker's peak snapshot (device -> category -> bytes) -> its categories (name -> bytes).
    A snapshot with no device or no bytes means the tracker saw nothing (its hooks missed the step):
    an error, not a peak of 0 that fits any capacity."""
    first = next(iter(snapshot.values()), {})
    cats = {str(k.value if hasattr(k, "value") else k): int(v) for k, v in first.items()}
    if cats.get("Total", 0) <= 0:
        raise RuntimeError(f"the memory tracker recorded no peak (snapshot: {snapshot or 'empty'})")
    return cats


def _nbytes(t) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.untyped_storage().nbytes()


def _prime(model, optimizer) -> None:
    """AdamW's state made before the trace (one update on zero gradients, then none), so that the
    traced step finds it there, as every step after a trial's first does."""
    import torch

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _step(bench: BenchConfig, model, optimizer, clip: float, micro: int, tracker) -> None:
    """Fsdp2Engine.step on the worker's batches (trial/worker.py Rank._batch, _causal_mask), without
    reading any value back: grad_accum micro-batches, clipping, AdamW, gradients set to None."""
    import torch

    m = bench.model
    tracker.stage = "forward"
    from zero_bench.models.sdpa import causal_mask

    mask = causal_mask(m.attention, m.seq_len, "cpu")
    for i in range(bench.batch.grad_accum):
        if i:  # the tracker refuses a second root forward with its per-module stats kept (the peak stays)
            tracker.reset_mod_stats()
        tracker.stage = "forward"
        tokens = torch.randint(0, m.vocab_size, (micro, m.seq_len + 1))
        pos = torch.arange(m.seq_len).unsqueeze(0).expand(micro, -1)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        del tokens
        loss = model(inputs, pos, mask, labels=labels).float().mean()
        tracker.stage = "backward"
        (loss / bench.batch.grad_accum).backward()
        del loss, inputs, labels, pos
    tracker.stage = "clipping"
    _clip(bench, model, clip)
    tracker.stage = "optimizer step"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _clip(bench: BenchConfig, model, max_norm: float) -> None:
    """engines/fsdp2.clip_grad_norm's tensors without its float(): tp 1 torch's clip_grad_norm_ over
    the DTensor gradients; tp > 1 the local squares summed over the world, then one scale."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from zero_bench.engines.fsdp2 import local, tp_split_names

    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    if bench.parallel.tp == 1:
        torch.nn.utils.clip_grad_norm_([p for _, p in named], max_norm)
        return
    split, tp_rank = tp_split_names(bench), parallel_state.get_tensor_model_parallel_rank()
    sq = torch.zeros((), dtype=torch.float32)
    for n, p in named:
        if tp_rank == 0 or n in split:
            sq += local(p.grad).float().pow(2).sum()
    dist.all_reduce(sq)
    coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
    for _, p in named:
        local(p.grad).mul_(coef)


def traced_terms(categories: dict, moments: int) -> dict:
    """The tracker's categories at the peak -> TERMS. AdamW's state is counted exactly (`moments`);
    what the tracker files under its optimizer category beyond that is the step's temporaries."""
    c = lambda *names: sum(categories.get(n, 0) for n in names)  # noqa: E731
    opt = c("OptState")
    return {"params": c("Sharded Param", "Buffer"), "grads": c("Sharded Grad"), "optimizer": min(opt, moments),
            "gathered params": c("Unsharded Param", "All Gather"),
            "activations + temporaries": c("Activation", "Temp", "Inputs", "Unsharded Grad", "Reduce Scatter")
            + max(0, opt - moments)}


@contextlib.contextmanager
def _not_propagation(tracker) -> Iterator[None]:
    """DTensor's sharding propagation kept out of the trace. It derives an op's output shapes by
    running the op on fake copies of its arguments under the active fake mode, or a fresh one
    (torch/distributed/tensor/_sharding_prop.py _propagate_tensor_meta_non_cached: `detect_fake_mode()
    or FakeTensorMode()`): in a real run that costs no memory, but under the trace's FakeTensorMode the
    tracker sees the copies as allocations. FSDPMemTracker skips a nested fake mode only (its
    _fake_mode_on_entry test). Measured on GPT-small (fp32, zero=3, micro 2): clipping's
    _foreach_norm over every gradient put 266 MiB of copies at a peak of 796 MiB, where the
    measured live peak is 712."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def skipped(self, *args, **kwargs):
        tracker.propagating += 1
        try:
            return propagate(self, *args, **kwargs)
        finally:
            tracker.propagating -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = skipped
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate


def _tracker_class():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class Tracker(FSDPMemTracker):
        """FSDPMemTracker that also notes the step's stage whenever the peak rises
        (_update_peak_stats is where the tracker raises its peak)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.stage, self.peak_phase = "", ""
            self.propagating = 0  # inside DTensor's sharding propagation (_not_propagation)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.propagating:  # metadata only: no rank allocates it (see _not_propagation)
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state) -> None:
            before = sum(self._peak_mem.values())
            super()._update_peak_stats(peak_state)
            if sum(self._peak_mem.values()) > before:
                self.peak_phase = self.stage

        def unit_peaks(self) -> dict:
            """Each FSDP2 unit's peak in forward and in backward (bytes, over the whole step)."""
            out = {}
            for stats in self.memory_tracking.values():
                peaks = {}
                for phase, state in (("forward", "Peak Forward"), ("backward", "Peak Backward")):
                    snaps = [s for st, ss in stats.snapshots.items() if st.value == state for s in ss]
                    totals = [d.get("Total", 0) for snap in snaps for d in snap.values()]
                    if totals:
                        peaks[phase] = int(max(totals))
                out[stats.mod_fqn] = peaks
            return out

    return Tracker


# -- beside the formula ---------------------------------------------------------------------------

def formula_terms(est, micro: int) -> dict:
    """The formula's peak (Estimate.allocated_bytes) split into TERMS at its own peak phase."""
    s = est.states
    phase = max(est.phases, key=lambda ph: est.phase_bytes(ph) + micro * est.per_sample(ph))
    bufs = {b.name: b.bytes for b in est.prediction.buffers if phase in b.phases}
    gathered = sum(v for k, v in bufs.items() if "gathered" in k or "prefetched" in k or "allgather" in k)
    return {"params": s.params + s.master, "grads": est.prediction.phases[phase].grads, "optimizer": s.moments,
            "gathered params": gathered,
            "activations + temporaries": micro * est.per_sample(phase) + sum(bufs.values()) - gathered}


def compare(est, traced: Traced) -> list[Term]:
    """Each term and the total, formula beside trace."""
    f = formula_terms(est, traced.micro)
    terms = [Term(n, int(f[n]), int(traced.terms.get(n, 0))) for n in TERMS]
    return terms + [Term("peak (live tensors)", est.allocated_bytes(traced.micro), traced.peak_bytes)]


def warnings(label: str, terms: list[Term], peak: int) -> list[str]:
    """One line naming every term where the formula and the trace differ by more than WARN_RATIO
    of the trace's figure (and by more than WARN_SHARE of the traced peak, so that a small buffer on
    a large peak does not warn); [] where they agree."""
    off = []
    for t in terms:
        gap = abs(t.formula - t.traced)
        if gap > WARN_SHARE * peak and (not t.traced or gap > WARN_RATIO * t.traced):
            pct = f"{t.error:+.1f} %" if t.error is not None else "none traced"
            off.append(f"{t.name} {pct} ({t.formula / MiB:,.1f} vs {t.traced / MiB:,.1f} MiB)")
    if not off:
        return []
    return [f"warning: {label}: the formula differs from the trace by more than {WARN_RATIO:.0%} on "
            + "; ".join(off)]
