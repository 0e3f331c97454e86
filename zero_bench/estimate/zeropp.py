"""ZeRO++ (zeropp.*, DeepSpeed ZeRO-3): the memory it adds to a rank, and the communication it saves.

Memory, from DeepSpeed 0.19.8's code:
- hpZ: each parameter gets a second partition, over hpz ranks instead of dp, in the parameters'
  dtype (runtime/zero/partition_parameters.py `_partition_param_sec`: torch.empty(aligned numel /
  hpz, dtype=param.dtype, device=remote_device), so with offload_param it is host memory). It is
  made as a module is released after its gathers (`_partition`), so from the second step on it
  appears in backward, and freed at the end of the optimizer step (stage3.py `step` ->
  `invalidate_secondary_tensor`): alive at the end of backward and through the step, not at the
  activations' peak of forward. Persistent parameters (stage3_param_persistence_threshold) stay
  gathered, so get none after the first step. deepspeed.zero.Init makes one for every parameter as
  the model is built, freed at the first step. Trainable parameters' copies are never quantized (only
  zero_quantized_nontrainable_weights quantizes them).
- qwZ: an all-gather fetches int8 partitions and one fp32 scale per group (CUDAQuantizer: groups
  of at most target_group_size elements), then dequantizes into the parameter: an int8 copy of
  what is gathered at once (the live parameters), alive in forward and backward.
- qgZ: across nodes only (stage3.py: `num_nodes > 1`); all_to_all_quant_reduce
  (runtime/comm/coalesced_collectives.py), one gradient at a time: its int4 copy and the
  all-to-all's receive buffer (half a byte per element each), the node's reduction of both
  (1 / ranks-per-node of it, twice) and its dequantized output (fp16, the same 1 / ranks-per-node).

Communication, from the paper (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective
Communication for Giant Model Training", arXiv:2306.10209, section 3 and its Table 2): ZeRO-3 moves
3M per step across nodes (M: the model in fp16 bytes; forward all-gather M, backward all-gather M,
gradient reduce-scatter M); qwZ all-gathers in int8 (0.5M each); hpZ keeps backward's all-gather
inside the node (0 across nodes); qgZ reduces gradients in int4 (0.25M). All three: 0.75M, 4x less.
"""
from __future__ import annotations

import math
from typing import Callable

from zero_bench.config.hosts import local_ranks
from zero_bench.config.schema import BenchConfig, Device
from zero_bench.units import BYTES

PAPER = "Wang et al. 2023, ZeRO++ (arXiv:2306.10209), sec. 3"
QUANT_GROUP = 8000  # CUDAQuantizer.target_group_size (partition_parameters.py): elements per fp32 scale
FP32_SCALE = 4
INT4 = 0.5  # bytes per element of qgZ's 4-bit gradients
FP16 = 2  # qgZ's dequantized output: the quantizer kernel writes half precision


def buffers(bench: BenchConfig, live_numel: int, get: Callable[[str], int]) -> dict:
    """deepspeed_buffers' entries ({name: (bytes, phases, source)}) for the ZeRO++ parts switched on.
    live_numel: the parameters gathered at once (estimate/buffers.py's live_params)."""
    z, layout = bench.zeropp, bench.layout
    b = BYTES[bench.precision]
    out: dict[str, tuple[int, tuple, str]] = {}
    if z.hpz > 1:
        off_device = bench.offload_param and bench.hardware.device != Device.cpu  # remote_device: the host
        # persistent parameters (at most stage3_param_persistence_threshold elements) stay gathered
        # after the first step: never released, they get no new copy (init_peak counts them all: thr 0)
        thr = get("stage3_param_persistence_threshold")
        out["hpz_secondary"] = (0 if off_device else b * sum(_aligned(p.numel, layout.dp) // z.hpz
                                                              for p in layout.params if p.numel > thr),
                                ("bwd_end", "step"), "zero_hpz_partition_size: zero.Init's aligned partitions / hpz")
    if z.qwz:
        out["qwz_int8_gather"] = (live_numel + FP32_SCALE * math.ceil(live_numel / QUANT_GROUP), ("act",),
                                  "zero_quantized_weights: the int8 gathered copy and its fp32 scales")
    if z.qgz and bench.hardware.num_nodes > 1:
        n, node = min(max(p.numel for p in bench.layout.params), get("reduce_bucket_size")), local_ranks(bench)
        out["qgz_int4_reduce"] = (int(2 * INT4 * n + (2 * INT4 + FP16) * n / node), ("act", "bwd_end"),
                                  "zero_quantized_gradients: the int4 buffers of one bucket")
    return out


def _aligned(numel: int, dp: int) -> int:
    """A parameter's numel padded to a multiple of dp, as zero.Init pads it (`_aligned_size`)."""
    return math.ceil(numel / dp) * dp


def communication(bench: BenchConfig) -> dict:
    """Per step, each collective's cross-node volume in units of M (the model in fp16 bytes), as the
    paper counts it, and their sum against ZeRO-3's 3M."""
    z = bench.zeropp
    multi_node = bench.hardware.num_nodes > 1
    forward = 0.5 if z.qwz else 1.0
    backward = 0.0 if z.hpz > 1 else forward  # DeepSpeed quantizes every fetch with qwZ, backward's too
    grads = 0.25 if z.qgz and multi_node else 1.0
    total = forward + backward + grads
    return {"forward_allgather_M": forward, "backward_allgather_M": backward, "grad_reduce_scatter_M": grads,
            "total_M": total, "vs_zero3": total / 3.0, "source": PAPER}


def line(bench: BenchConfig, buffers_detail: dict) -> str:
    """The estimate's ZeRO++ line: its buffers per rank and the communication against ZeRO-3's."""
    from zero_bench.units import MiB

    c = communication(bench)
    mem = ", ".join(f"{k} {buffers_detail[k]['bytes'] / MiB:,.1f} MiB ({'/'.join(buffers_detail[k]['phases'])})"
                    for k in ("hpz_secondary", "qwz_int8_gather", "qgz_int4_reduce") if k in buffers_detail)
    qgz_note = ("; qgZ: one node reduce-scatters as ZeRO-3 (DeepSpeed quantizes gradients only across nodes)"
                if bench.zeropp.qgz and bench.hardware.num_nodes == 1 else "")
    where = ("cross-node communication" if bench.hardware.num_nodes > 1 else
             "on one node every collective stays inside it; across nodes the paper counts")
    return (f"ZeRO++ {bench.zeropp.tag()}: {mem or 'no buffers'} per rank; {where} per step "
            f"{c['forward_allgather_M']:g}M + {c['backward_allgather_M']:g}M + {c['grad_reduce_scatter_M']:g}M = "
            f"{c['total_M']:g}M, x{c['vs_zero3']:.2f} of ZeRO-3's 3M ({c['source']}){qgz_note}")
