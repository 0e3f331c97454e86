"""Communication of one rank's optimizer step: one entry per collective an engine issues, with its
group, bytes, algorithm factor, link and whether it overlaps compute.

Algorithm factors (nccl-tests doc/PERFORMANCE.md, bus bandwidth): a ring all-reduce of B bytes over n
ranks moves 2 (n-1)/n B per rank; an all-gather or a reduce-scatter whose whole (gathered) tensor is
B bytes, and an all-to-all of B bytes per rank, move (n-1)/n B. time = moved / bus bandwidth. A group
whose ranks all sit on one node runs at the intra-node bus bandwidth, one that spans nodes at the
per-GPU inter-node bandwidth (the ring's slowest link). Ranks are laid out tp fastest, then dp
(megatron's order): a group of k ranks at stride s spans k x s consecutive ranks.

What each engine issues, as DeepSpeed 0.19.8, torch 2.13 and megatron-core 0.16.1 do:
- DeepSpeed ZeRO-0 (BF16_Optimizer / FP16 engine): one all-reduce of every gradient at the
  accumulation boundary (engine.allreduce_gradients -> buffered_allreduce_fallback; bf16's
  accumulation buffers are fp32: bf16_optimizer.py grad_acc_dtype).
- ZeRO-1: the gradient buckets all-reduced at the boundary only (use_multi_rank_bucket_allreduce:
  stage_1_and_2.py average_tensor -> allreduce_and_scatter), after backward: exposed; the updated
  16-bit partitions all-gathered after the step (all_gather_dp_groups).
- ZeRO-2: the same all-reduce at every micro-step (engine.py: "ZeRO stage >= 2 communicates during
  non gradient accumulation boundaries as well"), inside backward: overlapped only with
  overlap_comm, which resolves to False below stage 3 (zero/config.py overlap_comm_valid).
- ZeRO-3: parameters all-gathered in forward and again in backward, every micro-step (those under
  stage3_param_persistence_threshold elements stay resident), gradients reduce-scattered every
  micro-step; overlap_comm resolves to True: prefetched and overlapped. hpZ gathers backward's
  parameters from the secondary partition within its group; qwZ gathers int8 (1 byte, the scales
  left out); qgZ (across nodes only, stage3.py) reduces gradients by an int4 all-to-all within,
  then across nodes (ZeRO++, arXiv:2306.10209, sec. 3).
- Gradients travel in the communication data type: the 16-bit one (engine.communication_data_type),
  fp32 with sequence_parallel_size > 1 (seq_parallel_communication_data_type).
- FSDP2 (fully_shard per layer and the root): all-gather per forward (and per backward at zero=3:
  reshard_after_forward), reduce-scatter per micro-step (no no_sync in the worker), HSDP all-reduces
  the shard across replicas; MixedPrecisionPolicy gathers bf16 and reduces fp32; implicit prefetch
  overlaps them with compute.
- megatron TP: with sequence parallelism 2 all-gathers + 2 reduce-scatters of [b, s, h] per layer in
  forward and as many in backward, without it 2 all-reduces each way; one more each way for the
  embedding and the output layer. Not overlapped (tp_comm_overlap needs Transformer Engine).
- Ulysses (DistributedAttention): q, k, v and the output all-to-all'd per layer each way; key/value
  heads fewer than sp are replicated to sp (ulysses_sp.py).
- Experts (megatron's alltoall dispatcher): dispatch and combine all-to-alls per MoE layer each way,
  k copies of each token.
Recompute (full, block) re-runs its layers' forward collectives (TP, Ulysses, experts) in backward.
"""
from __future__ import annotations

from zero_bench.config.hosts import local_ranks
from zero_bench.config.schema import BenchConfig, Precision, States
from zero_bench.devices.rates import HardwareRates, Rate
from zero_bench.engines.specs import load, spec
from zero_bench.estimate.time.compute import recompute_fraction
from zero_bench.estimate.time.record import TimeTerm
from zero_bench.units import BYTES

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = "all-reduce", "all-gather", "reduce-scatter", "all-to-all"
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (zero/config.py)
NCCL = "nccl-tests PERFORMANCE.md bus bandwidth"


def moved_fraction(kind: str, n: int) -> float:
    """Bytes each rank moves per byte of the collective's tensor (nccl-tests' busbw factors)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == ALL_REDUCE else (n - 1) / n


def link(bench: BenchConfig, rates: HardwareRates, span: int) -> Rate:
    """The bandwidth of a group spanning `span` consecutive ranks: intra-node where they fit on one node."""
    return rates.intra_node_bytes_per_s if span <= local_ranks(bench) else rates.inter_node_bytes_per_s


def collective(bench: BenchConfig, rates: HardwareRates, name: str, kind: str, nbytes: float, n: int, span: int,
               exposed: bool, source: str, calls: float = 1) -> TimeTerm:
    """One collective (or the sum of a step's `calls` collectives of one cause): nbytes of tensor over
    n ranks, each call paying the measured latency where there is one (CPU: gloo's)."""
    bw = link(bench, rates, span)
    where = "intra-node" if bw is rates.intra_node_bytes_per_s else "inter-node"
    if where == "intra-node" and kind != ALL_REDUCE and rates.gather_bytes_per_s is not None:
        bw = rates.gather_bytes_per_s
    seconds = nbytes * moved_fraction(kind, n) / bw.value
    lat = rates.collective_latency_s
    if lat is not None and n > 1:
        seconds += calls * lat.value
        source += f"; + {calls:g} call(s) x {lat.source}"
    return TimeTerm(name, seconds, exposed, f"{source}; {kind} over {n} ranks {where} at {bw.source}")


def param_bytes(bench: BenchConfig) -> int:
    """Bytes per parameter the engine gathers: the 16-bit compute copy, 4 in fp32."""
    return BYTES[bench.precision]


def grad_bytes(bench: BenchConfig) -> int:
    """Bytes per gradient element on DeepSpeed's wire."""
    ds = bench.ds.get("communication_data_type") if bench.ds else None
    if ds:
        return {"fp32": 4, "fp16": 2, "bf16": 2}.get(str(ds), 4)
    if bench.parallel.sp > 1 or (bench.zero == 0 and bench.precision == Precision.bf16):
        return 4
    return BYTES[bench.precision]


def groups(bench: BenchConfig) -> list[tuple[str, float, int, int]]:
    """(name, parameters, ranks, span) of each group the states are partitioned over: the dense
    parameters over the dp (or shard) group, the experts over the dp / ep ranks holding them."""
    layout = bench.layout
    spans = layout.spans
    if layout.ep > 1:
        return [("dense", layout.dense_params, layout.dp, spans["dp"]),
                ("experts", layout.held_expert_params, layout.expert_data_parallel, spans["expert_dp"])]
    return [("", layout.held_params, layout.shard_size, spans["shard" if layout.hybrid else "dp"])]


def overlap_comm(bench: BenchConfig) -> bool:
    """DeepSpeed's overlap_comm as it resolves: the ds config's value, else True only at stage 3."""
    from zero_bench.estimate.buffers import ds_full

    got = (ds_full(bench).get("zero_optimization") or {}).get("overlap_comm")
    return bench.zero == 3 if got is None else bool(got)


def _gathered(bench: BenchConfig) -> list[int]:
    from zero_bench.estimate.buffers import ds_full

    zo = ds_full(bench).get("zero_optimization") or {}
    threshold = zo.get("stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD)
    return [p.numel for p in bench.layout.params if p.numel >= threshold]


def gathered_params(bench: BenchConfig) -> float:
    """ZeRO-3: the parameters all-gathered per pass: all but those under the persistence threshold."""
    return sum(_gathered(bench))


def gathered_calls(bench: BenchConfig) -> int:
    """ZeRO-3: all-gather calls per pass, at most one per gathered parameter (the coordinator fetches
    each module's parameters as it is entered, coalescing a module's; an upper bound on calls)."""
    return len(_gathered(bench))


# -- DeepSpeed ------------------------------------------------------------------------------------------

def deepspeed_terms(bench: BenchConfig, rates: HardwareRates) -> list[TimeTerm]:
    """ZeRO 0-3's gradient and parameter collectives of one optimizer step."""
    return zero3_terms(bench, rates) if bench.zero == 3 else zero012_terms(bench, rates)


def zero012_terms(bench: BenchConfig, rates: HardwareRates) -> list[TimeTerm]:
    z, ga = bench.zero, bench.batch.grad_accum
    times = ga if z == 2 else 1
    hidden = z == 2 and overlap_comm(bench)
    when = "every micro-step" if z == 2 else "at the accumulation boundary"
    out = []
    for name, n_params, n, span in groups(bench):
        tag = f" ({name})" if name else ""
        out.append(collective(bench, rates, f"gradient all-reduce{tag}", ALL_REDUCE,
                              times * n_params * grad_bytes(bench), n, span, not hidden,
                              f"ZeRO-{z}: {grad_bytes(bench)} B/grad {when}"
                              + (", overlap_comm" if hidden else "")))
        if z >= 1:
            out.append(collective(bench, rates, f"parameter all-gather after the step{tag}", ALL_GATHER,
                                  n_params * param_bytes(bench), n, span, True,
                                  "ZeRO-1/2: the updated 16-bit partitions (all_gather_dp_groups)"))
    return out


def zero3_terms(bench: BenchConfig, rates: HardwareRates) -> list[TimeTerm]:
    ga, zpp, dp, tp = bench.batch.grad_accum, bench.zeropp, bench.layout.dp, bench.parallel.tp
    span = bench.layout.spans["dp"]
    hidden = overlap_comm(bench)
    gathered, calls = gathered_params(bench), ga * gathered_calls(bench)
    fwd_b = 1 if zpp.qwz else param_bytes(bench)
    out = [collective(bench, rates, "parameter all-gather (forward)", ALL_GATHER, ga * gathered * fwd_b, dp, span,
                      not hidden, f"ZeRO-3: every micro-step, {fwd_b} B/param" + (" (qwZ int8)" if zpp.qwz else ""),
                      calls=calls)]
    if zpp.hpz > 1:
        out.append(collective(bench, rates, "parameter all-gather (backward)", ALL_GATHER,
                              ga * gathered * param_bytes(bench), zpp.hpz, tp * zpp.hpz, not hidden,
                              f"hpZ: backward gathers the secondary partition within {zpp.hpz} ranks", calls=calls))
    else:
        out.append(collective(bench, rates, "parameter all-gather (backward)", ALL_GATHER, ga * gathered * fwd_b, dp,
                              span, not hidden, "ZeRO-3: re-gathered for backward, every micro-step", calls=calls))
    held = bench.layout.held_params
    nodes = bench.hardware.num_nodes
    if zpp.qgz and nodes > 1:
        local = local_ranks(bench)
        out += [collective(bench, rates, "gradient all-to-all (qgZ, intra-node)", ALL_TO_ALL, ga * held * 0.5, local,
                           local, not hidden, "qgZ: int4 gradients, first hop within the node"),
                collective(bench, rates, "gradient all-to-all (qgZ, inter-node)", ALL_TO_ALL, ga * held * 0.5 / local,
                           nodes, bench.parallel.world_size, not hidden, "qgZ: second hop across nodes, 1/local of it")]
    else:
        out.append(collective(bench, rates, "gradient reduce-scatter", REDUCE_SCATTER, ga * held * grad_bytes(bench), dp,
                              span, not hidden, f"ZeRO-3: every micro-step, {grad_bytes(bench)} B/grad"))
    return out


# -- FSDP2 ----------------------------------------------------------------------------------------------

def fsdp2_grad_bytes(bench: BenchConfig) -> int:
    """Bytes per gradient element FSDP2 reduces: MixedPrecisionPolicy's reduce_dtype, fp32 beside bf16
    compute on fp32 states."""
    return 4 if (bench.precision == Precision.bf16 and bench.states == States.mixed) else BYTES[bench.precision]


def fsdp2_terms(bench: BenchConfig, rates: HardwareRates) -> list[TimeTerm]:
    """fully_shard's all-gathers and reduce-scatters (HSDP: + the replicas' all-reduce), prefetched."""
    ga, layout, tp = bench.batch.grad_accum, bench.layout, bench.parallel.tp
    pb = BYTES[bench.precision]  # MixedPrecisionPolicy's param_dtype (bf16), or the fp32 parameters themselves
    passes = 2 if bench.zero == 3 else 1
    units = bench.model.num_layers + 1  # fully_shard on every transformer layer and the root: one call each
    out = []
    for name, n_params, n, span in groups(bench):
        tag = f" ({name})" if name else ""
        out += [collective(bench, rates, f"parameter all-gather{tag}", ALL_GATHER, passes * ga * n_params * pb, n, span,
                           False, f"FSDP2 zero={bench.zero}: {passes} per micro-step (reshard_after_forward="
                           f"{bench.zero == 3}), {pb} B/param, prefetched", calls=passes * ga * units),
                collective(bench, rates, f"gradient reduce-scatter{tag}", REDUCE_SCATTER,
                           ga * n_params * fsdp2_grad_bytes(bench), n, span, False,
                           f"FSDP2: every micro-step, {fsdp2_grad_bytes(bench)} B/grad (reduce_dtype)",
                           calls=ga * units)]
    if layout.hybrid:
        out.append(collective(bench, rates, "gradient all-reduce across replicas", ALL_REDUCE,
                              ga * layout.held_params / layout.shard_size * fsdp2_grad_bytes(bench), layout.replicas,
                              layout.spans["replicate"], False, "HSDP: the shard's gradients across replicate groups"))
    return out


# -- model parallelism ------------------------------------------------------------------------------------

def passes(bench: BenchConfig) -> float:
    """Forward + backward + what recompute re-runs of a layer's forward collectives."""
    return 2 + recompute_fraction(bench)


def tensor_parallel_calls(bench: BenchConfig) -> float:
    """megatron's TP collective calls of one optimizer step: 2L+1 points per pass (2 per layer, 1 for
    the embedding / output layer), each an all-reduce, or with sequence parallelism an all-gather one
    way and a reduce-scatter the other (2 calls); 0 at tp 1."""
    p, m = bench.parallel, bench.model
    if p.tp == 1:
        return 0.0
    points = (2 * m.num_layers + 1) * passes(bench) * bench.batch.grad_accum
    return 2 * points if p.sequence_sharded else points


def ulysses_calls(bench: BenchConfig) -> float:
    """DistributedAttention's all-to-all calls of one optimizer step: q, k, v and the output per layer
    per pass; 0 at sp 1."""
    if bench.parallel.sp == 1:
        return 0.0
    return 4 * bench.model.num_layers * passes(bench) * bench.batch.grad_accum


def tensor_parallel_terms(bench: BenchConfig, rates: HardwareRates, micro: int) -> list[TimeTerm]:
    """megatron's TP collectives over the tp group (exposed)."""
    p, m = bench.parallel, bench.model
    if p.tp == 1:
        return []
    act = micro * m.seq_len / p.sp * m.hidden_size * BYTES[bench.precision]
    count = (2 * m.num_layers + 1) * passes(bench) * bench.batch.grad_accum
    if p.sequence_sharded:  # each of the 2L+1 points is an all-gather one way, a reduce-scatter the other
        return [collective(bench, rates, "tensor-parallel all-gather/reduce-scatter", ALL_GATHER, 2 * count * act,
                           p.tp, p.tp, True, "megatron SP: 2 all-gathers + 2 reduce-scatters of [b, s, h] per layer "
                           "each way, +1 for the embedding / output layer", calls=tensor_parallel_calls(bench))]
    return [collective(bench, rates, "tensor-parallel all-reduce", ALL_REDUCE, count * act, p.tp, p.tp, True,
                       "megatron TP: 2 all-reduces of [b, s, h] per layer each way, +1 for the embedding / output",
                       calls=tensor_parallel_calls(bench))]


def ulysses_terms(bench: BenchConfig, rates: HardwareRates, micro: int) -> list[TimeTerm]:
    """Ulysses' all-to-alls around attention over the sp group (exposed)."""
    p, m = bench.parallel, bench.model
    if p.sp == 1:
        return []
    tokens = micro * m.seq_len / p.sp
    kv = max(m.query_groups // p.tp, p.sp)  # replicated up to sp where fewer
    heads = 2 * m.num_heads // p.tp + 2 * kv  # q and the output, k and v
    nbytes = tokens * heads * m.kv_channels * BYTES[bench.precision] * m.num_layers * passes(bench)
    return [collective(bench, rates, "Ulysses all-to-all", ALL_TO_ALL, bench.batch.grad_accum * nbytes, p.sp,
                       bench.layout.spans["sp"], True, "DistributedAttention: q, k, v in and the output out per layer each way",
                       calls=ulysses_calls(bench))]


def expert_terms(bench: BenchConfig, rates: HardwareRates, micro: int) -> list[TimeTerm]:
    """The MoE dispatcher's all-to-alls over the ep group (exposed)."""
    p, m = bench.parallel, bench.model
    if p.ep == 1 or not m.is_moe:
        return []
    tokens = micro * m.seq_len / p.sp * m.moe_router_topk
    nbytes = 2 * tokens * m.hidden_size * BYTES[bench.precision] * m.num_moe_layers * passes(bench)
    return [collective(bench, rates, "expert all-to-all", ALL_TO_ALL, bench.batch.grad_accum * nbytes, p.ep,
                       bench.layout.spans["ep"], True, "megatron alltoall dispatcher: dispatch + combine per MoE layer each way",
                       calls=2 * m.num_moe_layers * passes(bench) * bench.batch.grad_accum)]


def comm_terms(bench: BenchConfig, rates: HardwareRates, micro: int) -> list[TimeTerm]:
    """Every collective of one optimizer step."""
    engine = load(spec(bench.engine).step_comm)(bench, rates)
    engine = [t for t in engine if t.seconds > 0 or bench.layout.dp > 1]
    return (engine + tensor_parallel_terms(bench, rates, micro) + ulysses_terms(bench, rates, micro)
            + expert_terms(bench, rates, micro))
