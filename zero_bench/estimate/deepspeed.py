"""DeepSpeed's memory per rank (engine=deepspeed): the Prediction of ZeRO 0-3 with its offloads.

Its parts: the model states as the ZeRO paper partitions them (states.py), megatron's activations
(activations.py), DeepSpeed's buffers sized from the ds_config (buffers.py). Three phases:
  act:     gradients allocated up front + buffers alive in forward/backward + micro x act/sample
           (the first gradient of the backward pass, the tied embedding's, whole: ZeRO-2/3 beside
           their partition)
  bwd_end: all gradients + the reduction buffers
  step:    the gradients the optimizer reads + the step's temporaries
and at least the peak of deepspeed.initialize (the model plus its flat / partitioned copy).
"""
from __future__ import annotations

from typing import Mapping, Optional

from zero_bench.config.schema import BenchConfig, Device, Loss
from zero_bench.estimate.activations import bench_activations, loss_chunk_bytes
from zero_bench.estimate.buffers import deepspeed_buffers, ds_full, init_peak
from zero_bench.estimate.nvme import nvme_split
from zero_bench.estimate.prediction import Buffer, Phase, PhaseBytes, Prediction, causal_mask
from zero_bench.estimate.states import model_states_bytes
from zero_bench.records import ModelStates
from zero_bench.units import BYTES

# Per-sample activation memory of a CPU rank's RSS relative to the formula's peak (which matches live
# tensor bytes within 5 %), fitted on model=gpt-mini (2 ranks, fp32, ZeRO-2 micro 2/4/8: 31.7 MiB/sample
# of RSS vs 29.8 by the formula). gpt-small ZeRO-3 micro 1->2 gave 75 MiB/sample vs 63.9 (1.17):
# glibc's arenas reuse freed blocks unevenly, so the factor is a CPU fit, not a law.
CPU_ACTIVATION_FACTOR = 1.065
GPU_ACTIVATION_FACTOR = 1.0


def predict(bench: BenchConfig, ds: Optional[Mapping] = None) -> Prediction:
    """engine=deepspeed's prediction for one rank (its spec's `predict`). ds: the trial's DeepSpeed
    JSON where the caller has it (its buffers read it), else the composed one's."""
    m, layout = bench.model, bench.layout
    P = layout.held_params
    on_cpu = bench.hardware.device == Device.cpu
    states = model_states_bytes(layout.tp_shard_params, bench.zero, layout, bench.precision, bench.offload,
                                bench.offload_param and bench.zero == 3, states=bench.states,
                                expert_params=layout.tp_shard_expert_params)
    act = bench_activations(bench)  # the composed JSON's activation_checkpointing (`ds` is its zero section)
    factor = CPU_ACTIVATION_FACTOR if on_cpu else GPU_ACTIVATION_FACTOR
    per_sample = int((act["total"] + (act["host"] if on_cpu else 0)) * factor)  # on CPU the host is the device
    b = BYTES[bench.precision]
    grads = states.grads
    if not on_cpu and bench.offload:  # the host part of the gradients is not on the device
        grads = 0 if bench.zero >= 2 else b * P
    # The backward pass starts with the (output) embedding's gradient, whole: ZeRO-0/1 keep it; ZeRO-2/3
    # hold it beside their gradient partition until its reduce. Measured on CPU (GPT-zero-demo, fp32,
    # micro 17-25): the backward's live peak stood 64 MiB above the forward's at every stage, the
    # embedding's 61 MiB fp32 gradient; ZeRO-3's estimate without it ran 50 MiB (9 %) low.
    first = b * max(p.numel for p in layout.params)
    phases = {Phase.act: PhaseBytes(int(first if bench.zero <= 1 else grads + first), per_sample),
              Phase.bwd_end: PhaseBytes(int(grads)),
              Phase.step: PhaseBytes(int(0 if bench.zero == 1 and not bench.offload else grads))}
    buffers = deepspeed_buffers(bench, ds)
    buffers += causal_mask(m, phases)
    if bench.loss == Loss.chunked:
        buffers.append(Buffer("loss_chunk", loss_chunk_bytes(m, bench.precision), (Phase.act,),
                              "loss=chunked: one chunk's logits"))
    nvme = nvme_split(bench, (ds_full(bench).get("zero_optimization") or {}) if ds is None else ds)
    if nvme is not None and on_cpu:  # host memory, pinned at initialize and kept: on CPU, the rank's own
        buffers.append(Buffer("swap_buffers", nvme.buffers, tuple(phases),
                              "the NVMe swappers' pinned buffers (estimate/nvme.py)"))
    return Prediction(states=states, buffers=buffers, phases=phases, activations=act, act_per_sample=per_sample,
                      init_peak=init_peak(bench), phase_grads=_phase_grads(bench, states, on_cpu), nvme=nvme)


def _phase_grads(bench: BenchConfig, states: ModelStates, on_cpu: bool) -> int:
    """The gradients of the states on the rank that the phases count. On CPU all of them (the host
    is the device); on a GPU with offload_optimizer ZeRO-2/3 keep none there, ZeRO-1 its 16-bit
    gradients (the fp32 partition the host optimizer reads is on the host)."""
    if on_cpu or not bench.offload:
        return states.grads
    layout = bench.layout
    # with ep > 1 the ZeRO partitions split the dense parameters and all E experts
    partitioned = layout.tp_shard_params if layout.ep > 1 else layout.held_params
    return 0 if bench.zero >= 2 else states.grads - 4 * partitioned // layout.dp
