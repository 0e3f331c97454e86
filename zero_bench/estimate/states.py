"""Model states per rank: parameters, gradients, master weights and Adam's moments, as each ZeRO
stage partitions them and where offload puts them.

Source: the ZeRO paper (Rajbhandari et al. 2020), mixed-precision Adam, K = 12; fp32 follows what
DeepSpeed allocates (checked against the worker's exact counts, see model_states_bytes)."""
from __future__ import annotations

import math

from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import BenchConfig
from zero_bench.models.params import num_params, routed_expert_params
from zero_bench.records import ModelStates
from zero_bench.units import BYTES


def moment_bytes(numel: float, states: str = "mixed", dtype_bytes: int = 4) -> float:
    """AdamW's two moments of `numel` values: in `dtype_bytes` each, or (adam8bit) torchao's
    AdamW8bit: int8 values with an fp32 scale per block of 256 (torchao/optim/subclass_8bit.py)."""
    if states == "adam8bit":
        return 2 * (numel + 4 * math.ceil(numel / ADAM8BIT_BLOCK))
    return 2 * dtype_bytes * numel


ADAM8BIT_BLOCK = 256


def master_bytes(states: str = "mixed") -> int:
    """Bytes per value of what the optimizer updates: the fp32 master, or bf16 with states=bf16."""
    return 2 if states == "bf16" else 4


def model_states_bytes(num_params: float, zero_stage: int, layout: RankLayout, precision: str = "bf16",
                       offload_optimizer: bool = False, offload_param: bool = False, states: str = "mixed",
                       expert_params: float = 0) -> ModelStates:
    """Bytes of model states per rank for Adam, split as ZeRO partitions them over the layout's dp
    ranks (config.layout.RankLayout: dp, and with ep > 1 the experts' own group).

    num_params: parameters of ONE tensor-parallel shard, P (megatron's exact shard, whose LayerNorms
    and row biases are replicated: layout.tp_shard_params; the paper's P = the whole model's / tp).

    Mixed precision (bf16/fp16; 2-byte params and grads, fp32 master + Adam m, v: K = 12), the ZeRO
    paper:
        stage 0: params 2P,    grads 2P,    optimizer 12P        = 16P
        stage 1: params 2P,    grads 2P,    optimizer 12P/dp     = 4P + 12P/dp
        stage 2: params 2P,    grads 2P/dp, optimizer 12P/dp     = 2P + 14P/dp
        stage 3: params 2P/dp, grads 2P/dp, optimizer 12P/dp     = 16P/dp
    fp32 (4-byte params and grads; what DeepSpeed allocates, checked with the worker's counts):
        stage 0: params 4P,    grads 4P,    optimizer 8P (m, v; the params are the master) = 16P
        stage 1: params 4P,    grads 4P,    optimizer 12P/dp (stage 1/2 clone an fp32 master
                                            partition even when the params are fp32)    = 8P + 12P/dp
        stage 2: params 4P,    grads 4P/dp, optimizer 12P/dp                           = 4P + 16P/dp
        stage 3: params 4P/dp, grads 4P/dp, optimizer 12P/dp (DeepSpeed 0.19 clones the fp32
                                            partition as master here too)              = 20P/dp
    Measured (worker's exact counts after the first step, GPT-small, P = 69,385,728, DP=2; the
    gradients are freed by then, so params + master + moments): stage 0: 12P, stage 1/2: 4P + 12P/2,
    stage 3: 16P/2 -- equal to these formulas to the byte (+4 bytes per Adam step counter).
    (The field notes' 77.7M-parameter figures, 889 / 741 / 445 MiB, match stages 0-2; their stage-3
    figure, 6P, predates the master clone seen here.)

    states=bf16 (precision bf16; DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states,
    ZeRO 1-3): the master partition, the gradient partition and the moments in bf16: master 2P/dp,
    moments 4P/dp. states=adam8bit: the moments int8 with an fp32 scale per 256 (~2.03P/dp), the
    master fp32.

    Offload (stages 1-3): offload_optimizer moves the optimizer part (master + moments) to the host,
    together with the gradient partition the host optimizer reads, kept in fp32 (4P/dp; stage 1
    still holds its full gradients on the device); offload_param (stage 3) moves the parameter
    partition to the host too.

    Expert parallelism (layout.ep > 1; DeepSpeed runs it at ZeRO 1-2): expert_params is the routed
    experts' share of num_params (all E experts of every MoE layer: layout.tp_shard_expert_params).
    A rank holds the other (dense) parameters and 1/ep of the experts whole (layout.held_whole),
    which the parts held whole count (the 16-bit params; ZeRO-0 everything; ZeRO-1 the gradients).
    DeepSpeed keeps the experts in their own optimizer param group, flattened and partitioned over
    the dp/ep ranks that hold the same experts (the expert-data-parallel group), the dense group
    over all dp: each rank's partition is dense/dp + (experts/ep)/(dp/ep) = num_params/dp
    (layout.zero_groups), which the sharded parts count (the master, the moments; ZeRO-2 the
    gradients). DeepSpeed's flat-buffer padding (each group to a multiple of 2 x its ranks) is left
    out, as at ep 1. ep=1: the formulas above, unchanged.

    Returns one rank's ModelStates: params, grads, master, moments wherever they live (optimizer:
    master + moments), host: the bytes of them in host memory (device: the rest).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage}: allowed 0, 1, 2, 3")
    if precision not in BYTES:
        raise ValueError(f"precision={precision}: allowed {', '.join(BYTES)}")
    if not 0 <= expert_params <= num_params:
        raise ValueError(f"expert_params={expert_params}: must be in [0, num_params={num_params}]")
    P = layout.held_whole(num_params, expert_params)  # the dense part and 1/ep of the experts
    # each optimizer param group's partition: the dense group over dp ranks, the experts' over dp / ep
    groups = layout.zero_groups(num_params, expert_params)
    part = sum(groups)  # num_params / dp whatever ep
    b = BYTES[precision]
    mixed = b == 2
    params = b * (part if zero_stage == 3 else P)
    grads = b * (part if zero_stage >= 2 else P)
    mb = master_bytes(states)
    moments = (sum(moment_bytes(g, states, mb) for g in groups) if zero_stage >= 1
               else moment_bytes(P, states, mb))
    if mixed:
        master = mb * (part if zero_stage >= 1 else P)
    elif zero_stage >= 1:
        master = 4 * part
    else:
        master = 0.0
    host = 0.0  # device = the rest (ModelStates.device)
    if offload_optimizer and zero_stage >= 1:
        host += master + moments
        # the host optimizer reads an fp32 gradient partition; stage 2-3 keep none on the device
        # (only the reduce buckets), stage 1 still holds its full 16-bit gradients there
        grads = 4 * part if zero_stage >= 2 else b * P + 4 * part
        host += 4 * part
    if offload_param and zero_stage == 3:
        host += params
    params, master, moments, grads, host = (int(round(v)) for v in (params, master, moments, grads, host))
    return ModelStates(params=params, master=master, moments=moments, grads=grads, host=host)


def stored_states(s: BenchConfig) -> ModelStates:
    """model_states_bytes for a stored config as the report reads it (config.stored.stored_config):
    the deepspeed spec's stored_states, so the report asks the engine's spec, not its name. The
    paper's P: the whole model's parameters / tp; under a pipeline the largest stage's tp shard
    (RankLayout.largest_stage)."""
    layout = s.layout
    experts = routed_expert_params(s.model, 1) if layout.ep > 1 else 0  # ep > 1 runs at tp 1
    P = num_params(s.model) / layout.tp if layout.pp == 1 else layout.largest_stage.held_params
    return model_states_bytes(P, s.zero, layout, precision=s.precision,
                              offload_optimizer=s.offload, offload_param=s.offload_param, states=s.states,
                              expert_params=experts)
