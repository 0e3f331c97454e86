"""The rank side of the engines: the Engine protocol the worker runs its plan on, and the engine a
trial spec asks for, found through the registry (specs.SPECS). Every registered trainer module is
imported here, whichever runs (the package's docstring says why)."""
from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from zero_bench.config.schema import BenchConfig
from zero_bench.engines.specs import SPECS, load, spec
from zero_bench.records import ModelStates, TrialSpec

# One micro-batch: (input tokens, position ids, labels).
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

TRAINERS = {name: load(s.trainer) for name, s in SPECS.items()}  # imports every engine now


class Engine(Protocol):
    zero_init: bool
    """The parameters were partitioned as the model was built (no rank ever held the whole model)."""
    hpz_secondary: dict
    """ZeRO++ hpZ's second partitions in the last step, bytes: {"bwd_end", "after_step"}; {} without hpZ."""

    def step(self, batches: list[Batch], mask: Optional[torch.Tensor], marks: Callable[[str], None]) -> list[float]:
        """One optimizer step over the micro-batches (gradient accumulation); their losses. Calls
        marks("forward"), marks("backward"), marks("step") as it goes."""

    def was_step_applied(self) -> bool:
        """False when the last step was skipped (fp16 overflow)."""

    def loss_scale(self) -> Optional[float]:
        """fp16's dynamic loss scale now; None without one."""

    def grad_norm(self) -> Optional[float]:
        """The global gradient norm the last step clipped with (all ranks, the whole model)."""

    def model_states(self) -> ModelStates:
        """Exact bytes of this rank's model states (after the first applied optimizer step)."""

    def compile(self) -> None:
        """torch.compile the model (lazily, at the first step of each shape)."""

    def offloaded(self) -> dict:
        """What the library itself holds off the device, as its own objects say (not as asked):
        {"optimizer": bool, "params": bool}."""


def init_distributed(cfg: BenchConfig, on_cpu: bool) -> None:
    """torch.distributed's process group, the way the trial's engine wants it."""
    load(spec(cfg.engine).init_distributed)(cfg, on_cpu)


def build_engine(trial: TrialSpec, on_cpu: bool) -> Engine:
    """The engine a trial spec asks for, with megatron's parallel groups set up and the model built
    (parallel.pp > 1: this rank's pipeline stages, by the spec's pipeline_trainer)."""
    if trial.config.parallel.pp > 1:
        return load(spec(trial.config.engine).pipeline_trainer)(trial, on_cpu)
    return TRAINERS[str(trial.config.engine)](trial, on_cpu)
