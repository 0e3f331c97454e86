"""Memory per device before launching anything: model states, activations, DeepSpeed's buffers.

`zero_bench estimate` prints, per ZeRO stage x offload (or the one stage given with zero=...), the
bytes one rank needs and the largest micro-batch the capacity allows. The same arithmetic seeds the
max-batch search (`seed_micro`) and lets the pre-flight refuse a trial the host cannot hold.

Sources
- Model states: the ZeRO paper (Rajbhandari et al. 2020), mixed-precision Adam, K = 12:
  stage 0: 16P, stage 1: 4P + 12P/dp, stage 2: 2P + 14P/dp, stage 3: 16P/dp.
  fp32 training follows what DeepSpeed allocates (checked against the worker's exact counts):
  stage 0: 16P, stage 1: 8P + 12P/dp, stage 2: 4P + 16P/dp, stage 3: 20P/dp (see model_states_bytes).
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", generalised to what megatron-core keeps for the description (SwiGLU, GQA, RMSNorm, RoPE,
  dropout, sdpa vs unfused attention) on this device, for recompute none / selective / full: see
  activations.py.
- Buffers: DeepSpeed's own, sized from the ds_config a trial runs with (zero_bench.engines.ds_config.build).
One module each: states.py, activations.py (its attention terms in attention.py), buffers.py; deepspeed.py puts them together into
engine=deepspeed's Prediction (prediction.py: the one record every engine returns: its states,
typed buffers, and a Phase -> gradients and activation bytes per sample). engine=fsdp2 has its own
states and phases (fsdp2.py: PyTorch FSDP2's memory model) in the same record. This module adds the
fixed terms and the capacity (Estimate), whose peak is the largest phase whatever the engine.
gpu.py adds what a GPU rank holds beyond its tensors (CUDA context, NCCL, allocator rounding); table.py is `zero_bench estimate`'s output.
nvme.py is NVMe offload's split (states on disk, the swappers' pinned host buffers).
zeropp.py is ZeRO++'s terms (hpZ's second partition, qwZ's and qgZ's quantized buffers, the paper's
communication ratio).
seq.py is the predicted longest sequence at a micro-batch (the same estimate at each length; maxseq's seed).
ulysses.py is what Ulysses' all-to-all changes in a layer's activations at parallel.sp > 1 (activations.py adds it).
pipeline.py is pipeline parallelism (parallel.pp > 1): each stage's prediction (the engine's on the
stage's layout) with the micro-batches in flight per schedule and the p2p buffers; the Estimate of
a pipeline holds each stage's, its peak the largest stage's (the stage named), its max micro-batch
the smallest.
time/ is the time per optimizer step beside the memory (compute, communication, offload terms, each
with its source; the rates in zero_bench/devices/rates.py): Estimate.time_at(micro).
traced.py is the traced prediction beside the formula (`traced=true`): the real engine's step
traced under FakeTensorMode on a fake world, with torch's FSDPMemTracker.

A rank's peak, as the search compares it with the capacity (RSS on CPU, reserved bytes on GPU):
  fixed overhead + model states (incl. gradients) + max(buffers alive in backward + activations(micro),
  buffers of the optimizer step), and at least the peak of deepspeed.initialize.
On CPU, everything (offloaded states too) lives in the same host memory, in the run's precision
(precision=auto: bf16 where the CPU computes it natively, else fp32).

How close this is to measurements on CPU: docs/verified.md, "Measured on this machine" (one place, so
the figures cannot drift); tests/integration/test_estimate_vs_measured.py checks them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Optional

from zero_bench.config.hosts import local_ranks
from zero_bench.config.schema import DEFAULT_ENGINE, BenchConfig, Device
from zero_bench.devices import calibration
from zero_bench.devices.calibration import BUILT_IN_CPU, PUBLISHED, Calibration
from zero_bench.devices.capacity import search_capacity
from zero_bench.engines.specs import load, spec, tag
from zero_bench.estimate.activations import activation_bytes_per_sample
from zero_bench.estimate.buffers import deepspeed_buffers
from zero_bench.estimate.deepspeed import CPU_ACTIVATION_FACTOR
from zero_bench.estimate.gpu import (CUBLAS_HANDLES, CUBLAS_WORKSPACE, communicator_bytes, communicator_groups,
                                     fragmentation, outside_allocator)
from zero_bench.estimate.pipeline import pipelined, stage_bench, stage_name
from zero_bench.estimate.prediction import Phase, Prediction
from zero_bench.estimate.states import model_states_bytes
from zero_bench.estimate.time import TimeModel, TimePrediction
from zero_bench.records import ModelStates, Seed
from zero_bench.models import param_numels
from zero_bench.models.params import num_params
from zero_bench.units import BYTES, GiB, MiB

__all__ = ["BYTES", "CPU_ACTIVATION_FACTOR", "Estimate", "GiB", "MiB", "activation_bytes_per_sample",
           "deepspeed_buffers", "estimate", "model_states_bytes", "param_numels", "seed_micro"]

# Fixed cost of one CPU rank before any model tensor: python + torch + deepspeed + megatron imports,
# gloo, allocator arenas (RSS of a GPT-tiny rank on this machine: ~410 MiB). On GPU the fixed cost is
# the named terms of estimate/gpu.py (the CUDA context, NCCL's buffers), each with its source.
CPU_RANK_OVERHEAD = 410 * MiB


@dataclass
class Estimate:
    """Everything predicted for one configuration, per rank (bytes): the engine's Prediction (its
    states, buffers and phases: estimate/deepspeed.py, estimate/fsdp2.py) with what every engine
    shares around it, the fixed terms and the capacity.

    Peak model: overhead + persistent states (params, master, moments) + the largest phase (its
    gradients, the buffers alive in it, micro x its activation bytes per sample), and at least the
    peak while the engine builds the model (Prediction.init_peak).
    """
    label: str
    device: str
    precision: str
    zero: int
    offload_optimizer: bool
    offload_param: bool
    dp: int
    tp: int
    num_params: int
    params_per_shard: int
    prediction: Prediction
    overhead: int  # outside the tensors: CPU the process's runtime; GPU outside the allocator, high end
    local_ranks: int = 1
    capacity: Optional[int] = None
    engine: str = DEFAULT_ENGINE
    ep: int = 1  # expert-parallel degree: params_per_shard holds the rank's num_experts / ep experts
    sp: int = 1  # Ulysses' degree: sp data-parallel ranks share each sequence (dp / sp sequences a micro-step)
    zeropp: str = ""  # ZeroppConfig.tag(): "" without ZeRO++
    overhead_low: Optional[int] = None  # GPU: outside the allocator at the low end of the published ranges
    fragmentation: float = 1.0  # GPU: reserved / allocated at the peak (the caching allocator)
    terms: dict = dataclasses.field(default_factory=dict)  # the named fixed terms (bytes), for the report
    calibration: str = PUBLISHED  # where the fixed terms come from: "calibrated on <device>, <date>" or
    # the published ranges (GPU) / the built-in figure (CPU): zero_bench.devices.calibration
    fragmentation_calibrated: bool = False  # GPU: the factor was measured here, for this model and stage
    time: Optional[TimeModel] = None  # the time prediction beside the memory one (estimate/time/): time_at(micro)
    pp: int = 1  # pipeline stages (parallel.pp)
    grad_accum: int = 1  # micro-batches per optimizer step (batch.grad_accum; a pipeline's micro-batches)
    stage: Optional[int] = None  # pp > 1: the stage this estimate is of (the whole pipeline's: its peak stage)
    stage_layers: str = ""  # pp > 1: the stage's layers ("0-19")
    stages: tuple = ()  # pp > 1, the whole pipeline's estimate: each stage's Estimate (estimate/pipeline.py);
    # its own fields are the peak stage's, and the peaks and max micro are the largest / smallest over them

    def stage_at(self, micro: int) -> "Estimate":
        """The stage whose predicted peak at `micro` is the largest (itself without a pipeline)."""
        if not self.stages:
            return self
        return max(self.stages, key=lambda e: (e.peak_bytes(micro), -(e.stage or 0)))

    @property
    def stage_name(self) -> str:
        """"stage 0 of 4" (estimate/pipeline.py stage_name); "" without a pipeline."""
        return stage_name(self.stage, self.pp)

    def time_at(self, micro: int) -> Optional[TimePrediction]:
        """The predicted optimizer step at `micro` per rank (None: no rates for this hardware, or micro 0)."""
        return self.time.at(micro) if self.time is not None else None

    @property
    def states(self) -> ModelStates:
        """One rank's model states, split device / host."""
        return self.prediction.states

    @property
    def act_per_sample(self) -> int:
        """The activation bytes per sample the table shows (calibrated for the device)."""
        return self.prediction.act_per_sample

    @property
    def activations(self) -> dict:
        """activation_bytes_per_sample's terms (estimate/activations.py)."""
        return self.prediction.activations

    @property
    def nvme_bytes(self) -> int:
        """offload_device=nvme: this rank's states in swap files (estimate/nvme.py); else 0."""
        return self.prediction.nvme.on_disk if self.prediction.nvme else 0

    @property
    def nvme_freed(self) -> int:
        """Of nvme_bytes, those no longer also held in memory (the optimizer's; parameters beyond max_in_cpu)."""
        return self.prediction.nvme.freed if self.prediction.nvme else 0

    @property
    def swap_buffer_bytes(self) -> int:
        """offload_device=nvme: the swappers' pinned host buffers (on CPU also among the buffers)."""
        return self.prediction.nvme.buffers if self.prediction.nvme else 0

    @property
    def phases(self) -> list[Phase]:
        return list(self.prediction.phases)

    def per_sample(self, phase: Phase) -> int:
        """Activation bytes one sample adds in `phase`."""
        got = self.prediction.phases.get(phase)
        return got.per_sample if got else 0

    @property
    def states_on_rank(self) -> int:
        """Model-state bytes in the memory the capacity is about (CPU: device + host; GPU: device)."""
        return self.states.total - self.nvme_freed if self.device == Device.cpu else self.states.device

    @property
    def persistent(self) -> int:
        """States that live through the whole step: everything but the gradients the phases count."""
        return self.states_on_rank - self.prediction.phase_grads

    def phase_bytes(self, phase: Phase) -> int:
        """Gradients + buffers of one phase (no activations, no persistent states)."""
        return self.prediction.phases[phase].grads + self.prediction.buffer_bytes(phase)

    @property
    def buffers_total(self) -> int:
        """The buffers of the phase with the most (what the table shows)."""
        return max(self.prediction.buffer_bytes(ph) for ph in self.phases)

    def fixed_bytes(self) -> int:
        """Per-rank peak without activations."""
        return self.peak_bytes(0)

    def allocated_bytes(self, micro: int) -> int:
        """The tensors' peak at this micro-batch (torch's max allocated on GPU): the persistent states
        plus the largest phase (its gradients, buffers and activations); under a pipeline the largest
        stage's."""
        if self.stages:
            return max(e.allocated_bytes(micro) for e in self.stages)
        steady = self.persistent + max(self.phase_bytes(ph) + micro * self.per_sample(ph) for ph in self.phases)
        return max(steady, self.prediction.init_peak)

    def peak_bytes(self, micro: int, overhead: Optional[int] = None) -> int:
        """Predicted per-rank peak at this micro-batch (RSS on CPU, device memory as nvidia-smi shows it
        on GPU): the fixed part (`overhead`, default the high end) + the allocator's reserve."""
        if self.stages:
            return max(e.peak_bytes(micro, overhead) for e in self.stages)
        fixed = self.overhead if overhead is None else overhead
        return fixed + int(self.fragmentation * self.allocated_bytes(micro))

    def cannot_initialize(self, capacity: Optional[int] = None) -> bool:
        """The model states alone (or deepspeed.initialize's peak) exceed the capacity."""
        cap = capacity if capacity is not None else self.capacity
        return bool(cap) and self.fixed_bytes() > cap

    def max_micro(self, capacity: Optional[int] = None, overhead: Optional[int] = None) -> Optional[int]:
        """Largest micro-batch whose predicted peak fits `capacity` (0: not even one sample)."""
        cap = capacity if capacity is not None else self.capacity
        if self.stages:  # the largest micro-batch at which every stage fits
            each = [e.max_micro(cap, overhead) for e in self.stages]
            return None if any(x is None for x in each) else min(each)
        grows = [ph for ph in self.phases if self.per_sample(ph) > 0]
        if cap is None or not grows:
            return None
        fixed = self.overhead if overhead is None else overhead
        if self.peak_bytes(1, fixed) > cap:
            return 0
        room = (cap - fixed) / self.fragmentation - self.persistent
        return max(1, int(min((room - self.phase_bytes(ph)) // self.per_sample(ph) for ph in grows)))

    def max_micro_range(self, capacity: Optional[int] = None) -> tuple[Optional[int], Optional[int]]:
        """The max micro-batch at the high and at the low end of the fixed terms' published ranges."""
        return self.max_micro(capacity), self.max_micro(capacity, self.overhead_low)

    def at_micro(self, micro: int) -> dict:
        """The predicted peak per rank at this micro-batch (bytes), as a run would measure it, and
        whether it fits the capacity (None: no capacity known). GPU: torch's max allocated, the
        allocator's reserved (x fragmentation) and the device's peak as nvidia-smi shows it (reserved
        + the fixed terms at their high end, peak_bytes); CPU: the peak live tensors and the peak RSS.
        grad_accum enters only with FSDP2 (its phases hold the sharded gradients of the micro-batches
        before): DeepSpeed's micro-batches reuse the same memory."""
        allocated, peak = self.allocated_bytes(micro), self.peak_bytes(micro)
        figures = ({"live_tensors_bytes": allocated, "peak_rss_bytes": peak} if self.device == Device.cpu else
                   {"allocated_bytes": allocated, "reserved_bytes": int(self.fragmentation * allocated),
                    "device_peak_bytes": peak})
        return {"micro": micro, **figures, "capacity_bytes": self.capacity,
                "fits": None if self.capacity is None else peak <= self.capacity,
                **({"peak_stage": self.stage_at(micro).stage} if self.stages else {})}

    def host_bytes(self, micro: int = 1) -> int:
        """Host memory one node (all its ranks) needs: the offloaded states (with NVMe offload, what is
        not in the swap files, plus the swappers' pinned buffers), and on GPU the activations kept on
        the host (recompute_offload, DeepSpeed's cpu_checkpointing) at `micro`."""
        acts = self.activations.get("host", 0) * micro if self.device != Device.cpu else 0
        return (self.states.host - self.nvme_freed + self.swap_buffer_bytes + acts) * self.local_ranks

    def disk_bytes(self) -> int:
        """NVMe bytes the swap files of one node's ranks hold (offload_device=nvme)."""
        return self.nvme_bytes * self.local_ranks

    def row(self) -> dict:
        s = self.states
        m = self.max_micro()
        return {
            "config": (f"{tag(self.engine)} " if tag(self.engine) else "") + f"zero{self.zero}"
                      + (("+nvme" if self.swap_buffer_bytes else "+offload") if self.offload_optimizer else "")
                      + ("+param" if self.offload_param else "") + (f" {self.zeropp}" if self.zeropp else ""),
            "params": s.params, "grads": s.grads, "optimizer": s.optimizer,
            "device_states": s.device, "host_states": self.host_bytes() // self.local_ranks,
            "buffers": self.buffers_total, "act_per_sample": self.act_per_sample,
            "overhead": self.overhead, "peak_micro1": self.peak_bytes(1),
            "host_needed": self.host_bytes(m or 1), "capacity": self.capacity,
            "max_micro": m, "max_global_batch": None if m is None else m * self.grad_accum * self.dp // self.sp,
            "max_micro_low_overhead": self.max_micro_range()[1] if self.overhead_low is not None else None,
            **({"nvme_states": self.nvme_bytes, "disk_needed": self.disk_bytes()} if self.swap_buffer_bytes else {}),
            **({"peak_stage": self.stage_name} if self.stages else {}),
        }

    def stage_rows(self) -> list[dict]:
        """Under a pipeline, one line per stage (the JSON's `stages`): its layers, parameters per rank,
        micro-batches in flight, states, peak at micro 1 and max micro (estimate/pipeline.py)."""
        out = []
        for e in self.stages:
            s = e.states
            out.append({"stage": e.stage, "layers": e.stage_layers,
                        "params_per_rank": e.params_per_shard, "in_flight": e.activations.get("pipeline_in_flight"),
                        "params": s.params, "grads": s.grads, "optimizer": s.optimizer, "device_states": s.device,
                        "buffers": e.buffers_total, "act_per_sample": e.act_per_sample,
                        "p2p_per_sample": e.activations.get("p2p_buffers"), "peak_micro1": e.peak_bytes(1),
                        "max_micro": e.max_micro()})
        return out


def estimate(bench: BenchConfig, capacity: Optional[int] = None, ds: Optional[Mapping] = None) -> Estimate:
    """The prediction for one BenchConfig (its device, precision, stage, offload and layout: tp, dp, ep):
    its engine's Prediction (the spec's `predict`; `ds`: the trial's DeepSpeed JSON where the caller
    has it) with the fixed terms and the capacity."""
    layout = bench.layout
    if layout.pp > 1 and layout.stage is None:  # each stage's estimate; the pipeline's is its peak stage's
        per = tuple(estimate(stage_bench(bench, s), capacity, ds) for s in range(layout.pp))
        return dataclasses.replace(binding_stage(per, bench.batch.micro), stages=per)
    prediction = load(spec(bench.engine).predict)(bench, ds)
    if layout.pp > 1:
        prediction = pipelined(bench, prediction)
    return Estimate(label=bench.label(), device=bench.hardware.device, precision=bench.precision, zero=bench.zero,
                    offload_optimizer=bench.offload, offload_param=bench.offload_param, dp=layout.dp, tp=layout.tp,
                    num_params=num_params(bench.model), params_per_shard=layout.held_params, prediction=prediction,
                    local_ranks=local_ranks(bench), engine=bench.engine, zeropp=bench.zeropp.tag(),
                    capacity=capacity if capacity is not None else search_capacity(bench), ep=layout.ep, sp=layout.sp,
                    time=TimeModel(bench if layout.stage is None else whole_pipeline(bench)), pp=layout.pp,
                    grad_accum=bench.batch.grad_accum, stage_layers=layers_text(layout),
                    stage=layout.stage, **fixed_terms(bench))


def layers_text(layout) -> str:
    """A stage's layers as the per-stage table shows them: "0-19", "0-71 (2 chunks)"; "" at pp 1."""
    if layout.pp == 1 or layout.stage is None:
        return ""
    held = layout.stage_layers()
    return f"{held[0]}-{held[-1]}" + (f" ({layout.vpp} chunks)" if layout.vpp > 1 else "")


def binding_stage(stages: tuple, micro: int) -> Estimate:
    """The stage that sets the pipeline's max micro-batch (the smallest; a tie, or no capacity: the
    largest peak at `micro`, the earlier stage first)."""
    def key(e: Estimate) -> tuple:
        m = e.max_micro()
        return (m if m is not None else float("inf"), -e.peak_bytes(m or micro), e.stage or 0)
    return min(stages, key=key)


def whole_pipeline(bench: BenchConfig) -> BenchConfig:
    """A stage's config with the whole pipeline's layout again (the time prediction takes its slowest stage itself)."""
    out = dataclasses.replace(bench)
    out.__dict__.pop("layout", None)
    return out


def fixed_terms(bench: BenchConfig) -> dict:
    """The Estimate's fields for what a rank holds besides its model's tensors: this machine's
    calibration where the configuration is about this machine (calibration.for_bench), else the
    built-in CPU figure or the GPU terms' published ranges."""
    cal = calibration.for_bench(bench)
    if bench.hardware.device == Device.cpu:
        if cal is None or cal.overhead_bytes is None:
            return {"overhead": CPU_RANK_OVERHEAD, "terms": {"runtime (measured on CPU)": CPU_RANK_OVERHEAD},
                    "calibration": BUILT_IN_CPU}
        return {"overhead": cal.overhead_bytes, "terms": {"runtime (calibrated)": cal.overhead_bytes},
                "calibration": cal.said}
    if cal is not None and cal.context_bytes is not None:
        return calibrated_gpu_terms(bench, cal)
    loading, layout = bench.hardware.cuda_module_loading, bench.layout
    hpz = bench.zeropp.hpz
    high, low = outside_allocator(loading, layout, 1, hpz), outside_allocator(loading, layout, 0, hpz)
    # cuBLAS's workspaces live inside the allocator but are there from the first matmul on, whatever
    # the batch: they are counted with the fixed terms
    ws = CUBLAS_HANDLES * CUBLAS_WORKSPACE
    return {"overhead": high.total + ws, "overhead_low": low.total + ws,
            "fragmentation": fragmentation(bench.zero, bench.engine), "calibration": PUBLISHED,
            "terms": {f"CUDA context ({loading} loading)": high.cuda_context, "NCCL buffers": high.nccl,
                      f"cuBLAS workspaces ({CUBLAS_HANDLES} handles)": ws}}


def calibrated_gpu_terms(bench: BenchConfig, cal: Calibration) -> dict:
    """The GPU terms as measured here (low = high): the context with its kernels, NCCL per
    communicator of each size calibrated (an all-to-all group: the all-to-all group of its size
    where one was measured; a size not calibrated: its published figure), cuBLAS's workspaces, and
    the fragmentation where the calibration ran this model and stage."""
    nccl = {"calibrated": 0, "published": 0}
    for c in communicator_groups(bench.layout, bench.zeropp.hpz):
        got = (c.all_to_all and cal.nccl_all_to_all_bytes.get(str(c.ranks))) or cal.nccl_bytes.get(str(c.ranks))
        nccl["published" if got is None else "calibrated"] += communicator_bytes(c.ranks) if got is None else got
    ws = CUBLAS_HANDLES * CUBLAS_WORKSPACE if cal.cublas_workspace_bytes is None else cal.cublas_workspace_bytes
    terms = {"CUDA context and kernels (calibrated)": cal.context_bytes}
    terms.update({f"NCCL buffers ({k})": v for k, v in nccl.items() if v or k == "calibrated"})
    terms["cuBLAS workspace" + ("" if cal.cublas_workspace_bytes is None else " (calibrated)")] = ws
    frag = cal.fragmentation_for(bench)
    total = sum(terms.values())
    return {"overhead": total, "overhead_low": total, "terms": terms, "calibration": cal.said,
            "fragmentation": frag or fragmentation(bench.zero, bench.engine), "fragmentation_calibrated": bool(frag)}


def seed_micro(bench: BenchConfig) -> Optional[Seed]:
    """First guess for the max-batch search: the predicted largest micro-batch for the capacity, and
    what one more sample adds to the predicted peak there (the search's slope until it has measured
    two fresh peaks far enough apart).

    None when the estimate cannot say (no capacity known, or not even micro=1 predicted to fit:
    the search then starts from its minimum).
    """
    try:
        e = estimate(bench)
        m = e.max_micro()
    except Exception:  # noqa: BLE001 - a first guess must never stop a search
        return None
    step = e.peak_bytes(m + 1) - e.peak_bytes(m)
    if e.device == Device.cpu:
        # Near the boundary a CPU rank's RSS grows by the live bytes a sample adds, not more: the
        # demo's searches measured 13.1-13.25 MiB per sample between fresh trials against 13.3 live
        # by the formula (ZeRO 0, 1, 3); the factor, fitted at micro 2-8, put ZeRO-1's second trial
        # a sample short of the boundary.
        step = int(step / CPU_ACTIVATION_FACTOR)
    return Seed(m, max(1, step)) if m else None
