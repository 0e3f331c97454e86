"""What an engine's estimate returns: one typed record per configuration (Prediction), the same
shape for every engine, so zero_bench.estimate.Estimate adds the fixed terms and the capacity to it
without knowing which engine made it. estimate/deepspeed.py and estimate/fsdp2.py each fill one
(their spec's `predict`); the phases each engine names are members of one Phase enum."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

from zero_bench.estimate.nvme import NvmeSplit
from zero_bench.records import ModelStates


class Phase(StrEnum):
    """The moments of a step whose memory the estimate adds up; the peak is the largest of them.
    Each engine uses its own (its phases keep the order it lists them in: a tie keeps the first)."""
    act = "act"
    """DeepSpeed: forward and the start of backward, with the activations."""
    bwd_end = "bwd_end"
    """DeepSpeed: gradients complete, being reduced."""
    forward_end = "forward_end"
    """FSDP2: the loss computed, inside the root's forward: every activation, the loss's transient
    logits, the last layer's all-gather output not yet freed."""
    loss_backward = "loss_backward"
    """FSDP2, torch's losses (loss=bf16 / fp32): the cross entropy differentiated, its gradients
    beside the log-softmax it kept."""
    backward_start = "backward_start"
    """FSDP2: the output layer's backward, its unsharded weight gradient made beside the logits'
    gradient and every layer's activations."""
    layer_last = "layer_last"
    """FSDP2: the pre-backward of the top layer (which prefetches the one below)."""
    layer_next = "layer_next"
    """FSDP2: the pre-backward of the layer below the top one."""
    layer_first = "layer_first"
    """FSDP2: the pre-backward of layer 1."""
    layer_recomputed_top = "layer_recomputed_top"
    """FSDP2, recompute=block: the pre-backward of the top recomputed layer (recompute_layers - 1)."""
    layer_kept_lowest = "layer_kept_lowest"
    """FSDP2, recompute=block: the pre-backward of the lowest layer that keeps everything (recompute_layers)."""
    layer_chunk_lowest = "layer_chunk_lowest"
    """FSDP2, recompute=full with recompute_layers k > 1: the pre-backward of the lowest layer of the top
    checkpoint (L - k), the rebuilt chunk's other layers freed."""
    layer_first_chunk_top = "layer_first_chunk_top"
    """FSDP2, recompute=full with recompute_layers k > 1: the pre-backward of the top layer of the
    lowest checkpoint (k - 1), its whole chunk rebuilt."""
    pipeline_backward = "pipeline_backward"
    """FSDP2 under a pipeline: a micro-batch's backward after the stage's first one, beside the unsharded
    gradients the backwards before it accumulated (estimate/pipeline.py)."""
    pipeline_reduce = "pipeline_reduce"
    """FSDP2 under a pipeline (parallel.pp > 1): the reduce-scatter after the last micro-batch's
    backward, the unsharded parameters and gradients beside the sharded gradients (estimate/pipeline.py)."""
    step = "step"
    """Both: the optimizer step."""


@dataclass(frozen=True)
class Buffer:
    """Memory an engine allocates beyond the model states and the activations, per rank."""
    name: str
    """As `zero_bench estimate json=true` lists it (buffers_detail)."""
    bytes: int
    phases: tuple[Phase, ...]
    """The phases it is alive in."""
    source: str = ""
    """What sizes it (a ds_config key, DeepSpeed's default, a measurement): for the reader."""

    def as_dict(self) -> dict:
        """As `zero_bench estimate json=true` prints it (buffers_detail)."""
        return {"bytes": self.bytes, "phases": [str(p) for p in self.phases]}


@dataclass(frozen=True)
class PhaseBytes:
    """One phase's share of the peak, beside the persistent states and the buffers alive in it."""
    grads: int
    """Gradient bytes counted in this phase (in the memory the capacity is about): fixed."""
    per_sample: int = 0
    """Activation bytes one sample of the micro-batch adds in this phase."""


@dataclass
class Prediction:
    """One rank's memory as an engine's estimate predicts it, without the fixed terms (the runtime,
    the CUDA context) that zero_bench.estimate adds the same way for every engine."""
    states: ModelStates
    """The model states, split device / host (estimate/states.py, estimate/fsdp2.py)."""
    buffers: list[Buffer]
    """Each with the phases it is alive in (a phase the engine names: tests/unit/test_prediction.py)."""
    phases: dict[Phase, PhaseBytes]
    """The engine's phases, in its order: each one's gradients and activation bytes per sample."""
    activations: dict
    """activation_bytes_per_sample's terms (estimate/activations.py), for the JSON output."""
    act_per_sample: int
    """The activation bytes per sample the table shows (calibrated for the device)."""
    init_peak: int
    """The peak while the engine builds the model (deepspeed.initialize, FSDP2's fully_shard)."""
    phase_grads: int
    """The gradient bytes of the states in the memory the capacity is about that the phases count
    (not persistent through the step): the rest of the states persists."""
    held_across_micro_batches: int = 0
    """Gradient bytes the phases of a micro-batch hold from the ones before it (FSDP2 with grad_accum
    > 1 accumulates into its sharded gradients); 0 where grad_accum changes nothing."""
    nvme: Optional[NvmeSplit] = None
    """offload_device=nvme: the states in swap files and the swappers' pinned host buffers."""

    def buffer(self, name: str) -> Buffer:
        """The buffer called `name` (KeyError where the engine has none by that name)."""
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def buffer_bytes(self, phase: Phase) -> int:
        """The bytes of the buffers alive in `phase`."""
        return sum(b.bytes for b in self.buffers if phase in b.phases)

    def buffers_detail(self) -> dict:
        """name -> {"bytes", "phases"}: the JSON output's buffers_detail."""
        return {b.name: b.as_dict() for b in self.buffers}


def causal_mask(model, phases) -> list[Buffer]:
    """The causal mask a trial's step hands the model (models/sdpa.py causal_mask, which the worker
    and the traced step call): unfused attention masks its scores with one [1, 1, s, s] bool
    tensor, s^2 bytes per rank whatever tp, sp or the micro-batch (the mask broadcasts), alive from
    the first forward on; sdpa takes is_causal and gets none. Both engines list it."""
    if model.attention == "sdpa":
        return []
    return [Buffer("causal_mask", model.seq_len ** 2, tuple(phases), "unfused attention's [1, 1, s, s] bool mask")]
