"""NVMe offload (offload_device=nvme, DeepSpeed's ZeRO-Infinity at ZeRO-3): what leaves host memory
for the disk, and the pinned host buffers DeepSpeed's swappers keep to move it, per rank.

From DeepSpeed 0.19.8's code (deepspeed/runtime/...):
- What is swapped: stage3.py groups the rank's parameter partitions, in order, into sub-groups that
  close once they reach sub_group_size elements (_create_fp16_sub_groups); a sub-group whose
  partition holds at least MIN_AIO_BYTES (swap_tensor/utils.py: 1 MiB) of fp32 is swappable
  (_swappable_optimizer_subgroup -> OptimizerSwapper.is_swappable_tensor): its fp32 master and
  AdamW's two moments live in files (swap_tensor/optimizer_utils.py), and so does its fp32 gradient
  partition once backward has made it (partitioned_optimizer_swapper.py swap_out_gradients), but
  for the last sub-group, which the step reads first while still in memory (measured: gpt-mini at
  hidden 512, 2 ranks: the swap files held 0.5 % less than the gradients of all sub-groups but the
  last, tests/integration/test_nvme_offload.py). With offload_param, each
  parameter partition of at least MIN_AIO_BYTES is a file too (partitioned_param_swapper.py
  swappable_tensor), but stage3.py keeps a pinned flat host copy of the rank's partitions up to
  offload_param.max_in_cpu elements (1e9; _create_param_groups_fp16_flat_cpu_memory): only what
  lies beyond it leaves host memory (measured: at 17 M parameters, parameter NVMe offload freed
  nothing and added its buffers). Where a sub-group has no flat copy, the swapper reserves a pinned
  buffer of that largest sub-group's whole parameters (reserve_partitioned_swap_space, ds_numel).
- The buffers, pinned (page-locked) host memory allocated at initialize and kept: the optimizer
  swapper's SwapBufferManager, offload_optimizer.buffer_count (4) x the largest sub-group's
  partition (optimizer_utils.py __init__: largest_numel), in the master's dtype; the parameter
  swapper's offload_param.buffer_count (5) x buffer_size elements (partitioned_param_swapper.py
  _configure_aio), in the model's dtype. Sizes are rounded up to DeepSpeed's I/O alignment
  (1 KiB x intra_op_parallelism), left out here (< 1 KiB per buffer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from zero_bench.config.schema import BenchConfig
from zero_bench.units import BYTES

MIN_AIO_BYTES = 1024 ** 2  # swap_tensor/utils.py
# DeepSpeed 0.19.8's defaults for keys the JSON leaves out (runtime/zero/offload_config.py, config.py)
OPTIMIZER_BUFFER_COUNT = 4
PARAM_BUFFER_COUNT = 5
PARAM_BUFFER_SIZE = int(1e8)
SUB_GROUP_SIZE = int(1e9)
MAX_IN_CPU = int(1e9)


@dataclass(frozen=True)
class NvmeSplit:
    """One rank's NVMe offload: bytes in swap files and the pinned host buffers that move them."""
    optimizer_on_disk: int
    """fp32 master + AdamW moments (+ the fp32 gradients but the last's) of the swappable sub-groups."""
    params_on_disk: int
    """The swappable parameter partitions (offload_param)."""
    params_freed: int
    """Of those, the bytes beyond the pinned flat host copy (max_in_cpu), which leave host memory."""
    optimizer_buffers: int
    param_buffers: int

    @property
    def on_disk(self) -> int:
        return self.optimizer_on_disk + self.params_on_disk

    @property
    def freed(self) -> int:
        """Bytes that leave host memory for the disk."""
        return self.optimizer_on_disk + self.params_freed

    @property
    def buffers(self) -> int:
        return self.optimizer_buffers + self.param_buffers


def sub_group_members(partitions: list[int], size: int) -> list[list[int]]:
    """The parameters (indices) of each sub-group, as stage3.py _create_fp16_sub_groups closes them."""
    if size >= sum(partitions):
        return [list(range(len(partitions)))]
    out, group, acc = [], [], 0
    for i, n in enumerate(partitions):
        group.append(i)
        acc += n
        if acc >= size or i == len(partitions) - 1:
            out.append(group)
            group, acc = [], 0
    return out


def sub_groups(partitions: list[int], size: int) -> list[int]:
    """Elements of each sub-group's partition."""
    return [sum(partitions[i] for i in g) for g in sub_group_members(partitions, size)]


def nvme_split(bench: BenchConfig, zero: Mapping) -> Optional[NvmeSplit]:
    """The split for a config with offload_device=nvme (None otherwise); zero: the JSON's
    zero_optimization section (engines/ds_config.build)."""
    if not bench.nvme or bench.zero != 3:
        return None
    dp, b = bench.layout.dp, BYTES[bench.precision]
    parts = [-(-p.numel // dp) for p in bench.layout.params]  # DeepSpeed pads each partition up
    master = 2 if bench.states == "bf16" else 4
    groups = sub_groups(parts, int(float(zero.get("sub_group_size", SUB_GROUP_SIZE))))
    swapped = [g for g in groups if g * 4 >= MIN_AIO_BYTES]
    opt = zero.get("offload_optimizer") or {}
    optimizer_buffers = int(opt.get("buffer_count", OPTIMIZER_BUFFER_COUNT)) * max(groups) * master
    params_on_disk = params_freed = param_buffers = 0
    if bench.offload_param:
        par = zero.get("offload_param") or {}
        params_on_disk = sum(n * b for n in parts if n * b >= MIN_AIO_BYTES)
        beyond = max(0, sum(parts) - int(float(par.get("max_in_cpu", MAX_IN_CPU))))
        params_freed = min(params_on_disk, beyond * b)
        param_buffers = (int(par.get("buffer_count", PARAM_BUFFER_COUNT))
                         * int(float(par.get("buffer_size", PARAM_BUFFER_SIZE))) * b)
        if beyond:  # some sub-group without a flat copy: the swap-out buffer of the largest one, whole
            whole = [p.numel for p in bench.layout.params]
            sizes = sub_group_members(parts, int(float(zero.get("sub_group_size", SUB_GROUP_SIZE))))
            largest = max(sizes, key=lambda idx: sum(parts[i] for i in idx))
            param_buffers += sum(whole[i] for i in largest) * b
    grads = 4 * (sum(swapped) - (swapped[-1] if swapped and swapped[-1] == groups[-1] else 0))
    return NvmeSplit(optimizer_on_disk=sum(swapped) * 3 * master + grads, params_on_disk=params_on_disk,
                     params_freed=params_freed,
                     optimizer_buffers=optimizer_buffers, param_buffers=param_buffers)
