"""What trains the model and shards its states: the engine. The worker runs its plan on an `Engine`
and does not know which library is behind it; each engine builds the model (models/), runs one
optimizer step, and counts its own exact model states.

deepspeed.py: DeepSpeed ZeRO 0-3, CPU offload, DeepSpeed's activation checkpointing.
fsdp2.py: PyTorch FSDP2 (fully_shard per layer and root; zero 2/3, bf16, CPU offload, megatron's recompute).
Both are imported in every rank, whichever runs: a pool's forked child and a freshly launched rank
then hold the same libraries (megatron-core imports torch's FSDP anyway; deepspeed adds ~21 MiB RSS),
so the engines' memory figures differ by what they do, not by what they import.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from zero_bench.config import BenchConfig, EngineName
from zero_bench.engines import deepspeed, fsdp2
from zero_bench.records import TrialSpec

# One micro-batch: (input tokens, position ids, labels).
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Engine(Protocol):
    zero_init: bool
    """The parameters were partitioned as the model was built (no rank ever held the whole model)."""

    def step(self, batches: list[Batch], mask: torch.Tensor, marks: Callable[[str], None]) -> list[float]:
        """One optimizer step over the micro-batches (gradient accumulation); their losses. Calls
        marks("forward"), marks("backward"), marks("step") as it goes."""

    def was_step_applied(self) -> bool:
        """False when the last step was skipped (fp16 overflow)."""

    def loss_scale(self) -> Optional[float]:
        """fp16's dynamic loss scale now; None without one."""

    def grad_norm(self) -> Optional[float]:
        """The global gradient norm the last step clipped with (all ranks, the whole model)."""

    def model_states(self) -> dict:
        """Exact bytes of this rank's model states: params, master, optimizer, grads (+ numel_local)."""

    def compile(self) -> None:
        """torch.compile the model (lazily, at the first step of each shape)."""

    def offloaded(self) -> dict:
        """What the library itself holds off the device, as its own objects say (not as asked):
        {"optimizer": bool, "params": bool}."""


def init_distributed(cfg: BenchConfig, on_cpu: bool) -> None:
    """torch.distributed's process group, the way the trial's engine wants it."""
    if cfg.engine == EngineName.fsdp2:
        fsdp2.init_distributed(cfg, on_cpu)
    else:
        deepspeed.init_distributed()


def build_engine(spec: TrialSpec, on_cpu: bool) -> Engine:
    """The engine a trial spec asks for, with megatron's parallel groups set up and the model built."""
    if spec.config.engine == EngineName.fsdp2:
        return fsdp2.Fsdp2Engine(spec, on_cpu)
    return deepspeed.DeepSpeedEngine(spec, on_cpu)
