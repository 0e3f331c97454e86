"""Compute terms of one rank's optimizer step: the matmuls at the achieved matmul rate, the
memory-bound work at the memory bandwidth.

FLOPs are models/flops.py's (the formula MFU divides by), split over the ranks that share a
micro-batch's tokens: tp splits every matmul, sp (Ulysses) splits the sequence. Forward once,
backward twice the forward (the input and the weight gradient: the convention's 3 passes), what
recompute re-runs from flops.hardware_flops_per_seq, less the 3 passes. Causal attention kernels
(sdpa: flash / memory-efficient) skip the masked half of the s x s square the convention counts;
unfused attention computes all of it.

The memory-bound work is counted in elements read + written per token, from the ops megatron-core's
layer runs beside its matmuls (norm_elements), at the activations' width in bytes; backward moves
about twice what forward does (reads the saved input and the incoming gradient, writes the outgoing
one). The optimizer step reads and writes the rank's partition of the states (optimizer_bytes).
"""
from __future__ import annotations

from typing import Optional

from zero_bench.config.schema import BenchConfig, Recompute, States
from zero_bench.devices.rates import HardwareRates, Rate
from zero_bench.estimate.time.record import TimeTerm
from zero_bench.models.flops import (attention_flops_per_seq, dense_flops_per_seq, hardware_flops_per_seq,
                                     model_flops_per_seq)
from zero_bench.units import BYTES

BACKWARD_FACTOR = 2  # input gradient + weight gradient, each a forward's matmuls (models/flops.py's 3 passes)
CAUSAL_FRACTION = 0.5  # a causal flash kernel computes the lower triangle of the s x s square


def sequences_per_rank(bench: BenchConfig, micro: int) -> float:
    """Sequences' worth of tokens one rank computes per micro-step: micro, split by tp (each rank a
    slice of every matmul) and sp (each rank seq_len / sp tokens)."""
    return micro / (bench.parallel.tp * bench.parallel.sp)


def attention_hw_flops(bench: BenchConfig) -> float:
    """Forward FLOPs of QK^T and attention x V per sequence that the kernel computes."""
    full = attention_flops_per_seq(bench.model)
    return full * (CAUSAL_FRACTION if bench.model.attention == "sdpa" else 1.0)


def forward_flops(bench: BenchConfig, micro: int) -> float:
    """One rank's forward FLOPs per micro-step."""
    return sequences_per_rank(bench, micro) * (dense_flops_per_seq(bench.model) + attention_hw_flops(bench))


def recompute_flops(bench: BenchConfig, micro: int) -> float:
    """What recompute re-runs per micro-step on one rank (models/flops.py hardware_flops_per_seq's
    policies): full the forward, block recompute_layers / L of it, selective the core attention once
    more, op the matmuls its policy does not keep."""
    m, r = bench.model, bench.recompute
    if r == Recompute.selective:
        per = attention_hw_flops(bench)
    elif r == Recompute.op:
        per = hardware_flops_per_seq(m, r) - model_flops_per_seq(m)
    else:
        per = recompute_fraction(bench) * (dense_flops_per_seq(m) + attention_hw_flops(bench))
    return sequences_per_rank(bench, micro) * per


def recompute_fraction(bench: BenchConfig) -> float:
    """Of the forward, the share recompute re-runs (its memory-bound ops and its communication too)."""
    r = bench.recompute
    if r == Recompute.full:
        return 1.0
    if r == Recompute.block:
        return min(bench.recompute_layers, bench.model.num_layers) / bench.model.num_layers
    return 0.0


def norm_elements(bench: BenchConfig, scores: bool = True) -> float:
    """Elements read + written per token per layer by a layer's memory-bound ops on one rank: two
    norms (read h, write h), two residual adds (read 2h, write h), RoPE on q and k (read + write
    each), the MLP's activation (SwiGLU: read 2 f, write f; GeLU: read f, write f), unfused
    attention's softmax (read + write a x s scores, twice: mask and softmax; scores=False leaves
    them out). The hidden-sized ones are split over tp with sequence parallelism, the head- and
    ffn-sized ones over tp always."""
    m, p = bench.model, bench.parallel
    h, d = m.hidden_size, m.kv_channels
    seq_shard = p.tp if p.sequence_sharded else 1
    mlp = (3 if m.gated else 2) * m.ffn
    if m.is_moe:  # a token passes k experts (and the shared one) in the MoE layers
        moe = (3 if m.gated else 2) * (m.moe_router_topk * m.moe_ffn + (m.moe_shared_expert_intermediate_size or 0))
        mlp = (mlp * (m.num_layers - m.num_moe_layers) + moe * m.num_moe_layers) / m.num_layers
    rope = 2 * (m.num_heads + m.query_groups) * d if m.position_embedding == "rope" else 0
    return 10 * h / seq_shard + (rope + mlp + (score_elements(bench) if scores else 0)) / p.tp


def score_elements(bench: BenchConfig) -> float:
    """Unfused attention's mask and softmax per token per layer (all heads): read + write a x s
    scores twice; 0 for sdpa (the kernel keeps them)."""
    m = bench.model
    return 4 * m.num_heads * m.seq_len / bench.parallel.sp if m.attention == "unfused" else 0.0


def memory_bound_parts(bench: BenchConfig, micro: int) -> dict[str, float]:
    """Forward memory-bound bytes per micro-step on one rank, by the kind of op: "layers" (norms,
    residuals, RoPE, activation), "scores" (unfused attention's mask and softmax), "loss" (the
    logits read, an fp32 softmax written and read: 2 + 4 + 4 bytes per vocabulary entry)."""
    m, p = bench.model, bench.parallel
    tokens = micro * m.seq_len / p.sp
    width = BYTES[bench.precision]
    return {"layers": tokens * m.num_layers * norm_elements(bench, scores=False) * width,
            "scores": tokens * m.num_layers * score_elements(bench) / p.tp * width,
            "loss": tokens * m.padded_vocab(p.tp) / p.tp * (2 + 4 + 4)}


def memory_bound_bytes(bench: BenchConfig, micro: int) -> float:
    """Forward memory-bound bytes per micro-step on one rank (memory_bound_parts, summed)."""
    return sum(memory_bound_parts(bench, micro).values())


def optimizer_bytes(bench: BenchConfig) -> float:
    """Bytes the GPU optimizer step moves per parameter of the rank's partition: Adam reads the master
    weight, the gradient and both moments and writes the weight and the moments, then the 16-bit copy
    of the weight is written (mixed precision: 4 + 4 + 8 read, 12 + 2 written); pure bf16 moves each
    in 2 bytes with no copy."""
    if bench.states == States.bf16:
        return 2 * 4 + 2 * 3
    b = BYTES[bench.precision]
    return 4 + 4 + 8 + 12 + (b if b != 4 else 0)


def partition_params(bench: BenchConfig) -> float:
    """Parameters of the rank's optimizer partition: everything it holds at ZeRO-0, else its 1/dp
    share (the experts' over dp / ep), as ZeRO and FSDP2 partition them."""
    layout = bench.layout
    if bench.zero == 0:  # DeepSpeed's ZeRO-0 (FSDP2 refuses zero 0)
        return layout.held_params
    if layout.hybrid:  # FSDP2's HSDP: sharded within dp_shard ranks
        return layout.tp_shard_params / layout.shard_size
    return sum(layout.zero_groups(layout.tp_shard_params, layout.tp_shard_expert_params))


# -- the terms ---------------------------------------------------------------------------------------

def compute_terms(bench: BenchConfig, rates: HardwareRates, micro: int) -> list[TimeTerm]:
    """Forward, backward, recompute and the memory-bound work of one optimizer step (grad_accum
    micro-steps), and the GPU optimizer step where it runs on the device."""
    ga, flops = bench.batch.grad_accum, rates.flops(str(bench.precision))
    fwd = ga * forward_flops(bench, micro) / flops.value
    parts, rate = memory_bound_parts(bench, micro), elementwise_rates(rates)
    fwd_mem = ga * sum(parts[k] / rate[k].value for k in parts)
    layer_mem = ga * (parts["layers"] / rate["layers"].value + parts["scores"] / rate["scores"].value)
    said = "; ".join(f"{k} {parts[k] / 1e6:,.1f} MB at {rate[k].source}" for k in parts if parts[k])
    share = recompute_fraction(bench)
    terms = [
        TimeTerm("forward matmuls", fwd, True, f"models/flops.py FLOPs / (tp x sp) at {flops.source}"),
        TimeTerm("backward matmuls", BACKWARD_FACTOR * fwd, True, "2 x forward (input and weight gradients)"),
        TimeTerm("forward memory-bound ops", fwd_mem, True, f"norms, residuals, RoPE, activation, scores, loss: {said}"),
        TimeTerm("backward memory-bound ops", BACKWARD_FACTOR * fwd_mem, True, "2 x forward's bytes"),
    ]
    if bench.recompute != Recompute.none:  # the layers' ops re-run, not the loss's
        re = ga * recompute_flops(bench, micro) / flops.value + share * layer_mem
        terms.append(TimeTerm(f"recompute ({bench.recompute})", re, True,
                              "models/flops.py's re-run per policy, + the re-run share of the forward's memory-bound ops"))
    return terms


def elementwise_rates(rates: HardwareRates) -> dict[str, Rate]:
    """What each kind of memory-bound op (memory_bound_parts) runs at: the rate measured for it where
    there is one (CPU: rate_probes.rank_rates), else the layers' measured op mix, else the device's
    memory bandwidth."""
    layers = rates.elementwise_bytes_per_s or rates.memory_bytes_per_s
    return {"layers": layers, "scores": rates.scores_bytes_per_s or layers, "loss": rates.loss_bytes_per_s or layers}


def optimizer_tensors(bench: BenchConfig) -> int:
    """Tensors the optimizer steps one by one on a rank: DeepSpeed's ZeRO-0 (BF16_Optimizer, the fp16
    / fp32 engine) and FSDP2 (a DTensor shard per parameter) one per parameter; ZeRO 1-3 flatten the
    partition into one fp32 tensor per parameter group (one group here; ZeRO-3's sub_group_size 1e9:
    one sub-group below a billion parameters)."""
    from zero_bench.engines.specs import spec

    return 1 if bench.zero in spec(bench.engine).flat_optimizer_stages else len(bench.layout.params)


def measured_optimizer(bench: BenchConfig, rates: HardwareRates, name: str) -> Optional[TimeTerm]:
    """The optimizer step at the measured torch AdamW rate (CPU: ds_configs/cpu.json's torch_adam, FSDP2's
    AdamW): per parameter of the partition and per tensor it loops over; None where not measured (GPU)."""
    rate, per_tensor = rates.optimizer_params_per_s, rates.optimizer_per_tensor_s
    if rate is None:
        return None
    n, k = partition_params(bench), optimizer_tensors(bench)
    seconds = n / rate.value + k * (per_tensor.value if per_tensor else 0.0)
    return TimeTerm(name, seconds, True, f"{n:,.0f} params at {rate.source}"
                    + (f"; + {k} tensor(s) x {per_tensor.source}" if per_tensor else ""))


def optimizer_terms(bench: BenchConfig, rates: HardwareRates) -> list[TimeTerm]:
    """The device's optimizer step (none where the optimizer runs on the host: offload.py) and the
    gradient norm (gradient_clipping: one read of the rank's gradient partition)."""
    mem, n = rates.memory_bytes_per_s, partition_params(bench)
    out = [TimeTerm("gradient norm", n * 4 / mem.value, True, f"one read of the fp32 gradient partition at {mem.source}")]
    if not bench.offload:
        measured = measured_optimizer(bench, rates, "optimizer step (device)")
        out.append(measured or TimeTerm("optimizer step (device)", n * optimizer_bytes(bench) / mem.value, True,
                                        f"Adam's reads and writes of the partition ({optimizer_bytes(bench):g} B/param) "
                                        f"at {mem.source}"))
    return out
