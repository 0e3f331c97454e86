"""What a GPU rank needs besides its tensors, each term named with its source.

Nothing here is fitted to the reference table the estimate is scored on (benchmarks/seed_table.py):
every figure is a published measurement (shared/README.md, "GPU memory: published figures", lists
them with their sources). Where a published range is wide, both ends are kept, and the estimate
states the max micro-batch at both (Estimate.max_micro_range); it sizes against the high end.

A rank's device memory, as nvidia-smi shows it:
    outside torch's allocator: the CUDA context and loaded kernels + NCCL's buffers per communicator
    inside it (reserved):      the allocator's peak x the fragmentation factor of the ZeRO family
                               (+ cuBLAS's workspace, allocated through it)
"""
from __future__ import annotations

from dataclasses import dataclass

from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import DEFAULT_ENGINE
from zero_bench.engines.specs import spec
from zero_bench.units import MiB

MB = 10**6  # NCCL's reports are in decimal megabytes

# The CUDA context and the kernels loaded into it, outside torch's allocator (low, high), bytes.
# Lazy module loading (the default since CUDA 11.7 with torch 1.13): 274-481 MiB at start, growing as
# kernels load (PyTorch forum threads on "CUDA context memory"; PyTorch maintainers: ~300 MB lazy).
# Eager loading (before CUDA 11.7 / torch 1.13, or CUDA_MODULE_LOADING=EAGER): 922-942 MiB on an
# A100-80GB with torch 1.13 / 2.1, 1271 MiB on a V100-32GB, ~1573 MiB on an A100-40GB and 1823 MiB
# on an A100-80GB with torch 1.10 (pytorch/pytorch issues on CUDA_MODULE_LOADING, forum threads).
# Newer: 426 MiB for a bare lazy context with torch 2.10 + CUDA 13.0 on an RTX 6000 Ada
# (unslothai/unsloth-zoo PR #1053). No figure for an H100 with torch 2.13 is published; Hopper's larger
# kernel images may put it above 481 MiB: `zero_bench calibrate` measures it on the machine itself.
CUDA_CONTEXT = {"lazy": (274 * MiB, 481 * MiB), "eager": (922 * MiB, 1823 * MiB)}

# NCCL's buffers, outside the allocator, per communicator a rank belongs to, after its first
# collective: 544 MB for a 2-rank group, 688 MB for a larger one (4 x A100 with NVLink; NVIDIA/nccl
# issues #964 and #864). NCCL_BUFFSIZE is 4 MiB per channel per peer connection.
NCCL_COMMUNICATOR = {2: 544 * MB, "more": 688 * MB}

# cuBLAS's workspace, allocated through torch's allocator, per handle: 4 MiB (torch 1.x), 8.125 MiB
# (torch 2.x before Hopper), 32 MiB on sm90 (torch's CUDABlas workspace sizes). The larger is taken.
# A training step has two handles on a device: torch hands each thread its own (the cuBLAS handle
# pool, ATen/cuda/CublasHandlePool.cpp, keys workspaces by handle and stream), and autograd runs
# backward on its own device thread, so forward's matmuls and backward's each hold a workspace.
CUBLAS_WORKSPACE = 32 * MiB
CUBLAS_HANDLES = 2  # the main thread's and autograd's device thread's

# The caching allocator rounds requests (512 B in 2 MiB segments up to 1 MiB, 20 MiB segments up to
# 10 MiB, larger ones to 2 MiB) and caches freed blocks: reserved / allocated at the peak, per ZeRO
# family. Megatron fp16 / bf16 and DeepSpeed stage 0 at OOM: 1.04-1.06; ZeRO-1/2
# (stage_1_and_2.py): 1.09; ZeRO-3: ~1.23 (DeepSpeed issue #3734: one report, rough).
FRAGMENTATION = {0: 1.05, 1: 1.09, 2: 1.09, 3: 1.23}


@dataclass(frozen=True)
class OutsideAllocator:
    """Device bytes outside torch's allocator, by term, at one end of their published ranges."""
    cuda_context: int
    nccl: int

    @property
    def total(self) -> int:
        return self.cuda_context + self.nccl


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank joins: its group's name, its ranks, and whether its traffic is
    all-to-all (point-to-point connections to every peer) rather than rings and trees."""
    name: str
    ranks: int
    all_to_all: bool = False


# The groups whose collectives are all-to-alls: Ulysses' heads-for-sequence exchange
# (deepspeed/sequence/layer.py) and the MoE dispatcher's tokens (megatron's ep group).
ALL_TO_ALL_GROUPS = ("sp", "ep")


def communicator_groups(layout: RankLayout, hpz: int = 1) -> list[Communicator]:
    """The NCCL communicators a rank joins in a trial, of the layout's groups: the world
    (zero_bench's barriers and its over-capacity all-reduce, DeepSpeed's world collectives), the
    data-parallel group (ZeRO's reduce-scatter and all-gather; a group of its own even when it spans
    the world), with tp > 1 the tensor-parallel group (megatron's all-reduces), with sp > 1 the
    Ulysses group (attention's all-to-alls), with ep > 1 the expert-parallel group (the dispatcher's
    all-to-alls) and the expert-data-parallel group (the experts' reduce-scatters and all-gathers),
    and with ZeRO++ hpz > 1 hpZ's group of hpz consecutive ranks (backward's all-gathers of the
    second partition; utils/groups.py _create_zero_param_parallel_group), with pp > 1 the pipeline
    group (the stages' sends and receives: torch.distributed.pipelining's P2POps over it). A group
    of one rank needs no buffers.

    These are the groups that run collectives, so the ones whose buffers the published figures
    measure. More communicators exist: DeepSpeed 0.19.8 binds device_id in init_process_group
    (comm/torch.py), and with a bound device torch creates every later group eagerly, split from the
    world's (distributed_c10d._new_process_group_helper, eager_connect_single_device), so each of
    megatron's groups gets its own (17 NCCL groups for a rank at world 8, tp 2 in megatron-core
    0.16.1's initialize_model_parallel, most of them never used). NCCL 2.22+ connects the
    per-peer buffers at a communicator's first collective, so those idle ones hold only their
    base structures, for which no figure is published: `zero_bench calibrate` measures them, as part
    of the outside-the-allocator bytes its context term is derived from. Not counted: hybrid
    sharding's shard and replicate groups (FSDP2's 2-D mesh; the GPU terms do not model that mesh)
    and qgZ's per-node and cross-node all-to-all groups (utils/groups.py _get_local_all_to_all_group)."""
    g = {**layout.groups, "hpz": hpz}
    names = ("world", "dp", "tp", "sp", "ep", "expert_dp", "hpz", "pp")
    return [Communicator(n, g[n], n in ALL_TO_ALL_GROUPS) for n in names if g.get(n, 1) > 1]


def communicators(layout: RankLayout, hpz: int = 1) -> list[int]:
    """The sizes of communicator_groups(layout, hpz), in its order."""
    return [c.ranks for c in communicator_groups(layout, hpz)]


def communicator_bytes(n: int) -> int:
    """NCCL's published bytes for one communicator of `n` ranks."""
    return NCCL_COMMUNICATOR[2] if n == 2 else NCCL_COMMUNICATOR["more"]


def nccl_bytes(layout: RankLayout, hpz: int = 1) -> int:
    return sum(communicator_bytes(n) for n in communicators(layout, hpz))


def outside_allocator(module_loading: str, layout: RankLayout, end: int = 1, hpz: int = 1) -> OutsideAllocator:
    """The terms at the low (end=0) or high (end=1) end of the context's published range."""
    return OutsideAllocator(cuda_context=CUDA_CONTEXT[module_loading][end], nccl=nccl_bytes(layout, hpz))


def fragmentation(zero: int, engine: str = DEFAULT_ENGINE) -> float:
    """The allocator's reserved / allocated at the peak. FSDP2: no published ratio, so none is applied
    (the estimate then sizes its allocated bytes only, and says so in its terms)."""
    return FRAGMENTATION[zero] if spec(engine).published_fragmentation else 1.0
