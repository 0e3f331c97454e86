"""DeepSpeed's buffers beyond the model states, sized from the ds_config a trial runs with
(zero_bench.engines.ds_config.build), and deepspeed.initialize's own peak."""
from __future__ import annotations

from typing import Mapping, Optional

from zero_bench.config.schema import BenchConfig, Device
from zero_bench.engines import ds_config
from zero_bench.estimate import zeropp
from zero_bench.estimate.prediction import Buffer, Phase
from zero_bench.estimate.states import master_bytes
from zero_bench.units import BYTES

# DeepSpeed defaults for keys the ds_config leaves out (deepspeed/runtime/zero/config.py, engine.py).
DS_DEFAULTS = {
    "reduce_bucket_size": int(5e8),
    "allgather_bucket_size": int(5e8),
    "stage3_prefetch_bucket_size": int(5e7),
    "stage3_max_live_parameters": int(1e9),
    "stage3_param_persistence_threshold": int(1e5),
    "overlap_comm_stage3": True,  # stage 3 turns overlap_comm on unless told otherwise
}
ZERO0_ALLREDUCE_ELEMENTS = 500_000_000  # engine.MEMORY_OPT_ALLREDUCE_SIZE: flat copy of the grads


def _zero_cfg(bench: BenchConfig) -> dict:
    return ds_config.build(bench).get("zero_optimization") or {}


def deepspeed_buffers(bench: BenchConfig, ds: Optional[Mapping] = None) -> list[Buffer]:
    """Bytes of the buffers DeepSpeed (and the optimizer) allocate beyond the model states, per rank.

    Each a Buffer with the phases it is alive in: act (forward and the start of the backward pass,
    with the activations), bwd_end (gradients complete, being reduced), step (the optimizer step).
    Sizes come from the ds_config (`ds`: its zero_optimization section; default
    zero_bench.engines.ds_config.build(bench)) and DeepSpeed's defaults for keys it leaves out.
    - ZeRO-0: the engine all-reduces the gradients through a flat copy of up to 5e8 elements.
    - ZeRO-1/2: the contiguous-gradient reduce bucket (reduce_bucket_size elements, two with
      overlap_comm); ZeRO-1 reduces into an fp32 gradient partition (4P/dp) while the full
      gradients are alive; at the step both flatten the gradient partition into a new fp32 tensor
      (4P/dp). allgather_bucket_size is not allocated: DeepSpeed all-gathers the updated
      partitions in place (all_gather_into_tensor), listed as 0.
    - ZeRO-3: the reduce bucket; the gathered (live) parameters: the largest parameter plus the
      prefetch bucket, capped by stage3_max_live_parameters (never below one whole parameter) -- on
      CPU the whole shard, as measured (see the comment below); the
      parameters below stage3_param_persistence_threshold that every rank keeps whole; ZeRO++'s
      secondary partition and quantized buffers (estimate/zeropp.py).
    - fp16 at ZeRO-0: DeepSpeed's FP16_Optimizer builds fp32 copies of the gradients at the step (8P).
    - torch's (non-fused) Adam, which the CPU ds_config selects (torch_adam), makes one temporary
      the size of the fp32 partition it updates (sqrt of the second moment); fused/CPU Adam: none.
    - Expert parallelism (parallel.ep > 1): P is the rank's local parameters (the dense ones and its
      E/ep experts); the routed experts are their own param group, partitioned over the dp/ep
      expert-data-parallel ranks (partitions: RankLayout.zero_partitions). ZeRO-1's fp32 gradient partition
      holds every group's; the step flattens, updates and frees one group at a time
      (stage_1_and_2.py step: _optimizer_step(i), then the group's fp32 .grad = None), so the flat
      gradient and torch Adam's temporary are the largest group's.
    """
    zc = dict(_zero_cfg(bench) if ds is None else ds)
    full = ds_full(bench) if ds is None else {}
    stage, layout = bench.zero, bench.layout
    b = BYTES[bench.precision]
    P = layout.held_params
    get = lambda k: int(float(zc.get(k, DS_DEFAULTS[k])))  # noqa: E731
    mb = master_bytes(bench.states)  # the "fp32" partitions below are bf16 with states=bf16
    groups = layout.zero_partitions if stage >= 1 else [P]
    part, part_max = sum(groups), max(groups)
    out: dict[str, tuple[int, tuple, str]] = {}  # name -> (bytes, phases, what sizes it)
    if stage == 0:
        out["allreduce_flat"] = (min(P, ZERO0_ALLREDUCE_ELEMENTS) * b, ("bwd_end",),
                                 "engine.MEMORY_OPT_ALLREDUCE_SIZE elements at most")
        if bench.precision == "fp16":
            # FP16_Optimizer.step (runtime/fp16/fused_optimizer.py) casts every fp16 gradient to
            # fp32 in a list, then flattens the list into the master's .grad: 4P + 4P at once.
            out["fp32_grads"] = (8 * P, ("step",), "FP16_Optimizer.step (fp16 at ZeRO-0)")
    elif stage in (1, 2):
        n = 2 if zc.get("overlap_comm") else 1
        red_b = mb if stage == 1 else b  # ZeRO-1 stages the fp32 accumulator
        bucket = n * get("reduce_bucket_size") * red_b if zc.get("contiguous_gradients", True) else 0
        out["reduce_bucket"] = (bucket, ("act", "bwd_end"),
                                "reduce_bucket_size" + (" x2 (overlap_comm)" if n == 2 else ""))
        out["allgather_bucket"] = (0, ("step",), "allgather_bucket_size: not allocated (all-gathered in place)")
        if stage == 1 and not bench.offload:
            out["grad_partition_fp32"] = (mb * part, ("bwd_end", "step"), "ZeRO-1's gradient partition (P/dp)")
        out["grad_flat_fp32"] = (mb * part_max, ("step",), "the step's flat gradient partition (largest group)")
    else:
        out["reduce_bucket"] = (get("reduce_bucket_size") * b, ("act", "bwd_end"), "reduce_bucket_size")
        numels = [p.numel for p in layout.params]
        largest = max(numels)
        live = max(largest, min(get("stage3_max_live_parameters"), largest + get("stage3_prefetch_bucket_size")))
        live_from = "stage3_max_live_parameters, stage3_prefetch_bucket_size"
        if bench.hardware.device == Device.cpu:
            # Measured on CPU (GPT-small, DP=2): the forward/backward peak holds about one whole
            # copy of the parameters, not the max_live/prefetch bound (module not built under zero.Init).
            live, live_from = P, "one whole copy of the parameters (measured on CPU)"
        out["live_params"] = (min(live, P) * b, ("act",), live_from)
        if bench.zeropp.active:
            out.update(zeropp.buffers(bench, min(live, P), get))
        thr = get("stage3_param_persistence_threshold")
        out["persistent_params"] = (sum(x for x in numels if x <= thr) * b, ("act", "bwd_end", "step"),
                                    "stage3_param_persistence_threshold")
    torch_adam = bool(((full.get("optimizer") or {}).get("params") or {}).get("torch_adam"))
    if ds is None and torch_adam:
        out["adam_temp"] = (mb * part_max, ("step",), "torch Adam's sqrt(v) of the largest partition")
    return [Buffer(k, int(v), tuple(Phase(p) for p in ph), src) for k, (v, ph, src) in out.items()]


def ds_full(bench: BenchConfig) -> dict:
    return ds_config.build(bench)


def init_peak(bench: BenchConfig) -> int:
    """Bytes deepspeed.initialize holds at its peak: the model plus its flat (ZeRO-1/2) copy. ZeRO-3
    builds the model under deepspeed.zero.Init, which partitions each module's parameters as soon
    as the module is built: its partition plus the largest parameter, whole, while it is initialised
    (on the host instead with offload_param). P: the parameters the rank holds (RankLayout.held_params).
    With ep > 1 ZeRO-1/2 flatten one param group at a time (the dense one, the experts'), each
    group's parameters moving into its flat buffer: the model plus the larger group."""
    b, layout = BYTES[bench.precision], bench.layout
    P = layout.held_params
    if bench.zero == 3:
        whole = b * max(p.numel for p in layout.params)
        # zero.Init gives every parameter its hpZ copy as it partitions it (kept until the first step)
        secondary = zeropp.buffers(bench, 0, lambda k: 0).get("hpz_secondary", (0,))[0]
        return whole + (0 if bench.offload_param and bench.hardware.device != Device.cpu else b * P // layout.dp) + secondary
    if bench.zero == 0:
        return b * P
    largest = P if layout.ep == 1 else max(layout.dense_params, layout.held_expert_params)
    return b * P + b * largest
