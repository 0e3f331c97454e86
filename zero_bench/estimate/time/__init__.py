"""Time per optimizer step before launching anything: one TimeTerm per cause, each naming its source,
built from the model description, the RankLayout and models/flops.py, the same the memory estimate
and MFU read.

compute.py  the matmuls (forward, backward = 2 x forward, what recompute re-runs) at the achieved
            matmul rate; the memory-bound ops and the device's optimizer step at memory bandwidth
comm.py     one entry per collective an engine issues (ZeRO 0-3, ZeRO++, FSDP2, TP/SP, Ulysses,
            experts), its algorithm factor, intra- or inter-node bandwidth, overlapped or exposed
engine.py   the engine's own time (hooks, casts, fetches, waits) per tensor and parameter, measured
            on a calibration model (gpt-tiny) per engine and ZeRO stage; beside it what tp and
            Ulysses cost per collective call and another layer architecture per token-layer,
            each measured on calibration points of its own; CPU only
offload.py  PCIe copies, the optimizer step on the host's cores, NVMe reads and writes; the
            checkpointed layer inputs kept on the host (recompute_offload, cpu_checkpointing)
pipeline.py parallel.pp > 1: the slowest stage's share of the work, the bubble, the stages' sends
record.py   the typed records: TimeTerm (name, seconds, exposed, source), TimePrediction
table.py    `zero_bench estimate`'s time sheet and the JSON's `time`
The rates: zero_bench/devices/rates.py (each with its published source, or marked assumed).

The step is the exposed terms' sum. Overlapped terms (ZeRO-3's and FSDP2's prefetched collectives,
ZeRO-2's with overlap_comm) hide behind the step's compute; what they exceed it by is one more
exposed term ("communication beyond compute"). On CPU the rates are the ranks' own, measured with
every rank busy at once (devices/rate_probes.rank_rates, `zero_bench calibrate`): the matmul, the
memory-bound ops by kind, gloo's bandwidth and a latency per collective call, torch AdamW per
parameter and per tensor, and the engine's time beyond the kernels (engine.py, from timed gpt-tiny
trials). Not modelled: kernel efficiency by GEMM shape (every matmul at MAMF on GPU), the
framework's time outside kernels on GPU (the assumed 10 ms step overhead stands for it), GPU
collective latency, stragglers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Optional

from zero_bench.config.schema import BenchConfig, Device
from zero_bench.devices.rates import EnginePoint, HardwareRates, rates_for
from zero_bench.estimate.time.comm import comm_terms, tensor_parallel_calls, ulysses_calls
from zero_bench.estimate.time.compute import compute_terms, optimizer_terms
from zero_bench.estimate.time.engine import cause_terms, engine_key, engine_size, engine_term, layer_arch
from zero_bench.estimate.time.offload import checkpoint_terms, offload_terms
from zero_bench.estimate.time.pipeline import pipeline_terms, slowest_stage
from zero_bench.estimate.time.record import TimePrediction, TimeTerm
from zero_bench.models.flops import model_flops_per_seq

__all__ = ["TimeModel", "TimePrediction", "TimeTerm", "calibration_point", "predict_time"]

COMPUTE_PREFIXES = ("forward", "backward", "recompute")  # what overlapped communication hides behind


def overlap_term(terms: list[TimeTerm]) -> TimeTerm:
    """What the overlapped terms exceed the compute they hide behind by (exposed)."""
    hidden = sum(t.seconds for t in terms if not t.exposed)
    compute = sum(t.seconds for t in terms if t.exposed and t.name.startswith(COMPUTE_PREFIXES))
    return TimeTerm("communication beyond compute", max(0.0, hidden - compute), True,
                    f"overlapped terms ({hidden:.3g} s) beyond forward + backward + recompute ({compute:.3g} s)")


def peak_flops(bench: BenchConfig, rates: HardwareRates) -> Optional[float]:
    """The peak MFU divides by: metrics.PEAK_FLOPS by card on GPU, the measured matmul rate on CPU."""
    from zero_bench.devices.metrics import gpu_peak_flops

    if bench.hardware.device == Device.cpu:
        return rates.flops(str(bench.precision)).value
    return gpu_peak_flops(bench.hardware.card or "", str(bench.precision))


def predict_time(bench: BenchConfig, micro: int, rates: Optional[HardwareRates] = None) -> Optional[TimePrediction]:
    """One rank's optimizer step at `micro` per rank and bench.batch.grad_accum; None where the
    hardware's rates are unknown (a GPU without a card in devices/rates.py)."""
    rates = rates or rates_for(bench)
    if rates is None or micro < 1:
        return None
    staged = slowest_stage(bench)  # pp > 1: the slowest stage's layout (pipeline.py); bench itself at pp 1
    terms = (compute_terms(staged, rates, micro) + optimizer_terms(staged, rates) + comm_terms(staged, rates, micro)
             + offload_terms(staged, rates) + checkpoint_terms(staged, rates, micro))
    terms = pipeline_terms(bench, rates, micro, terms)  # pp > 1: the stage's share, the bubble, the sends
    terms.append(overlap_term(terms))
    # the engine's measured time around the kernels (engine.py) holds the step's overhead; else the assumed
    engine = engine_term(staged, rates.engine_points, micro)
    terms.append(engine or TimeTerm("step overhead", rates.step_overhead_s.value, True, rates.step_overhead_s.source))
    if engine is not None:  # what tp, Ulysses and another layer cost beyond the stage's points
        terms += cause_terms(staged, rates.engine_points, micro)
    step = sum(t.seconds for t in terms if t.exposed)
    p = bench.parallel
    sequences = micro * bench.batch.grad_accum * p.dp / p.sp  # per optimizer step, all ranks
    tokens = sequences * bench.model.seq_len / (step * p.world_size)
    peak = peak_flops(bench, rates)
    mfu = model_flops_per_seq(bench.model) * sequences / step / (p.world_size * peak) if peak else None
    return TimePrediction(tuple(terms), step, tokens, mfu, micro, bench.batch.grad_accum, rates.name)


@dataclass(frozen=True)
class TimeModel:
    """A configuration's time prediction at any micro-batch (what Estimate holds beside the memory
    Prediction): built for free, computed when asked (at(micro)), its rates looked up once."""
    bench: BenchConfig

    @cached_property  # writes the instance's __dict__, which a frozen dataclass allows
    def rates(self) -> Optional[HardwareRates]:
        return rates_for(self.bench)

    def at(self, micro: int) -> Optional[TimePrediction]:
        """The prediction at `micro` per rank (None: rates unknown, or micro 0: nothing fits)."""
        return predict_time(self.bench, micro, self.rates) if self.rates is not None else None


def calibration_point(bench: BenchConfig, micro: int, measured_s: float, rates) -> EnginePoint:
    """The EnginePoint of a timed trial of `bench` at `micro`: its time/it against what the kernel
    terms predict at `rates` (with no engine points, less the assumed step overhead)."""
    bare = replace(rates, engine_points=())
    bare_prediction = predict_time(bench, micro, bare)
    kernels = bare_prediction.step_s - bare_prediction.seconds("step overhead")
    tensors, params, token_layers = engine_size(bench, micro)
    par = bench.parallel
    return EnginePoint(engine_key(bench), bench.model.name, tensors, params, measured_s, kernels, token_layers, micro,
                       par.tp, par.sp, layer_arch(bench.model), tensor_parallel_calls(bench) + ulysses_calls(bench),
                       bench.batch.grad_accum)
