"""The choices a key of the schema takes (config/schema.py): one StrEnum per key, so the schema
types its fields with them and code compares members, not strings. Re-exported by config.schema."""
from __future__ import annotations

from enum import StrEnum


class Device(StrEnum):
    auto = "auto"  # CUDA when torch sees a GPU, else DeepSpeed's CPU accelerator
    cpu = "cpu"  # DeepSpeed's CPU accelerator, gloo
    gpu = "gpu"  # CUDA, NCCL, NVML sampling


class Precision(StrEnum):
    auto = "auto"  # CPU: bf16 where native (zero_bench/devices/cpu_features.py), else fp32; GPU: bf16, else fp16
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"  # GPU only: dynamic loss scaling, skipped steps recorded


class Recompute(StrEnum):
    none = "none"
    selective = "selective"  # core attention
    full = "full"  # each layer's input kept, the layer recomputed in backward
    block = "block"  # the first recompute_layers layers as full, the others keep everything
    op = "op"  # torchtitan's per-op selective policy: odd matmuls and attention kernels kept


class PipelineSchedule(StrEnum):
    gpipe = "gpipe"  # all forwards, then all backwards: every micro-batch's activations in flight
    one_f_one_b = "1f1b"  # PipeDream-Flush: at most pp - stage micro-batches in flight on a stage
    interleaved_1f1b = "interleaved_1f1b"  # parallel.vpp virtual stages per rank (Megatron's interleaving)


class States(StrEnum):
    mixed = "mixed"  # fp32 master weights, fp32 AdamW moments (what precision=bf16/fp16 trained before)
    bf16 = "bf16"  # pure bf16: weights, gradients and AdamW moments in bf16, no fp32 copy
    adam8bit = "adam8bit"  # 8-bit AdamW moments (torchao's AdamW8bit); estimate only


class Loss(StrEnum):
    megatron = "megatron"  # megatron's vocab-parallel cross entropy, fp32 inside
    bf16 = "bf16"  # torch's cross entropy on the logits as made (16-bit with bf16)
    fp32 = "fp32"  # logits upcast to fp32, then torch's cross entropy (Hugging Face, torchtitan)
    chunked = "chunked"  # output layer + loss a chunk of tokens at a time, checkpointed (Liger, torchtune)


class EngineName(StrEnum):
    deepspeed = "deepspeed"  # DeepSpeed ZeRO 0-3 (deepspeed.initialize)
    fsdp2 = "fsdp2"  # PyTorch FSDP2 (torch.distributed.fsdp.fully_shard), ZeRO 2/3 semantics


# The engine a config without `engine` runs: its configs keep the keys and labels they had before
# there was a choice. What else differs by engine: zero_bench/engines/specs.py.
DEFAULT_ENGINE = EngineName.deepspeed


class Launcher(StrEnum):
    pdsh = "pdsh"
    openmpi = "openmpi"
    mvapich = "mvapich"
    slurm = "slurm"
    mpich = "mpich"
    impi = "impi"


class ModuleLoading(StrEnum):
    lazy = "lazy"  # CUDA >= 11.7 with torch >= 1.13: kernels load when first used (the default)
    eager = "eager"  # every kernel at start, as before CUDA 11.7 (the reference table's software)


class OffloadDevice(StrEnum):
    none = "none"  # every state on the device
    cpu = "cpu"  # host memory (what offload=true has always meant)
    nvme = "nvme"  # files under nvme_path through DeepSpeed's async_io swapper (ZeRO-Infinity), ZeRO-3


class Strategy(StrEnum):
    fit = "fit"  # grow by measured memory per sample
    doubling = "doubling"  # plain doubling + bisection
