"""Each engine as the runner sees it: one EngineSpec per engine, registered by name in SPECS (as
torchtitan registers a TrainSpec per model). Everything outside zero_bench/engines/ that differs
by engine asks the spec instead of comparing the engine's name, so a third engine is this module's
entry plus its trainer module (and its refusals in engines/refusals.py).

Light by design: no torch, deepspeed or megatron here (the runner, configure and the estimate
import it); what the spec names of the heavy side (the trainer class, the estimate's parts, the
refusals, which read the config schema) is a "module:attribute" path, imported only by `load` when
used.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable


class Concern(StrEnum):
    """What `EngineSpec.validate` is asked about, each at the place configure.validate_static checks that
    concern's shared conditions (the parallel degrees: once config/layout.py's RankLayout holds them)."""
    engine = "engine"  # the engine's own limits (its ZeRO stages, precisions, configs)
    states = "states"  # the `states` key
    hybrid = "hybrid"  # parallel.dp_shard
    expert_parallel = "expert_parallel"  # parallel.ep > 1
    offload_param = "offload_param"
    offload_device = "offload_device"  # offload_device=nvme
    zeropp = "zeropp"  # zeropp.qwz / qgz / hpz
    ignored = "ignored"  # keys the engine accepts and then does not read
    pipeline = "pipeline"  # parallel.pp > 1


@dataclass(frozen=True)
class EngineSpec:
    name: str
    """The `engine=` value (config.EngineName)."""
    tag: str
    """How labels name the engine ("GPT-mini ... fp32 fsdp2", the estimate's "fsdp2 zero3"); "" keeps
    the labels DeepSpeed's runs had before there was a choice of engine."""
    title: str
    """The library's name in report sentences ("on FSDP2")."""
    trainer: str
    """"module:class" of the rank-side Engine (zero_bench.engines.base.Engine) that trains a trial."""
    init_distributed: str
    """"module:function" (cfg, on_cpu) forming torch.distributed's process group the engine's way."""
    predict: str
    """"module:function" (bench, ds) -> the engine's zero_bench.estimate.prediction.Prediction of one
    rank (states, buffers, phases, activations, init_peak), which zero_bench.estimate.Estimate wraps."""
    step_comm: str
    """"module:function" (bench, rates) -> the engine's own collectives of one optimizer step, as
    zero_bench.estimate.time.record.TimeTerms (estimate/time/comm.py)."""
    step_offload: str
    """"module:function" (bench, rates) -> the engine's host <-> device copies and host optimizer step
    of one optimizer step with offload (estimate/time/offload.py)."""
    stored_states: str
    """"module:function" (BenchConfig, as config.stored.stored_config reads a stored one) -> the
    estimate's model states of one rank of a stored config (a records.ModelStates, split device / host)."""
    refusals: str
    """"module:function" (BenchConfig, concern) raising ConfigError for what this engine cannot run
    of one Concern."""
    offload_param_follows: Callable[[int], bool]
    """Whether offload_param follows `offload` at this ZeRO stage when it is not given."""
    reads_ds_config: bool
    """A trial gets DeepSpeed's JSON (ds_config.json written, checked with DeepSpeed before launch);
    without it `ds.*` is refused."""
    builds_deepspeed_ops: bool
    """A run JIT-builds DeepSpeed ops (doctor lists them, prebuild builds them before the trials)."""
    runs_fp16: bool
    """precision=fp16 trains (dynamic loss scaling wired in): precision=auto may pick it on an old GPU."""
    published_fragmentation: bool
    """The GPU estimate applies estimate.gpu.FRAGMENTATION (DeepSpeed's reserved / allocated per
    stage); False: no published ratio, 1.0."""
    report_note: str = ""
    """A note the report adds when any row ran this engine ("" for none)."""
    tracer: str = ""
    """"module:function" (BenchConfig, micro) tracing one rank's step under FakeTensorMode (the traced
    prediction, `traced=true`); "" where the engine cannot be traced, and `untraced` says why."""
    untraced: str = ""
    """Why the engine cannot be traced, in words (the refusal's tail); "" where it can."""
    flat_optimizer_stages: tuple[int, ...] = ()
    """ZeRO stages at which the optimizer steps one flat fp32 partition per parameter group rather than
    each parameter (DeepSpeed ZeRO 1-3; ZeRO-0 and FSDP2's DTensor shards: one tensor per parameter):
    what the time estimate's per-tensor optimizer cost counts (estimate/time/compute.py)."""
    pipeline_trainer: str = ""
    """"module:class" of the rank-side Engine that trains a trial at parallel.pp > 1 (its stages
    under torch's pipeline schedules, engines/pipeline.py); "" where the engine has none."""

    def validate(self, b: Any, concern: Concern) -> None:
        """Raises ConfigError for what this engine cannot run of `concern` in BenchConfig `b`."""
        load(self.refusals)(b, concern)


def load(path: str):
    """The object a spec names by "module:attribute", imported now (the heavy side stays unimported
    until a rank or an estimate needs it)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


FSDP2_NOTE = ("engine=fsdp2: PyTorch FSDP2 (fully_shard on every layer and the root); zero=3 reshards "
              "after forward (FULL_SHARD), zero=2 keeps the gathered parameters until backward "
              "(SHARD_GRAD_OP); same model, data, optimizer and measurements as DeepSpeed; no DeepSpeed "
              "config (its ds_config cell is {}).")

# Tried in one process on a fake world of 2 (gpt-tiny, DeepSpeed 0.19.8, torch 2.13.0, 2026-11-26).
DEEPSPEED_UNTRACED = ("DeepSpeed 0.19.8's engine does not finish a step under FakeTensorMode (ZeRO 0-2: "
                      "deepspeed.initialize's module.to() cannot swap fake parameters; ZeRO-3 builds and runs "
                      "forward and backward, then its step reads the gradient norm on the host to test for "
                      "overflow); engine=fsdp2 is traced")

# In the order reports list the engines (baseline first).
SPECS: dict[str, EngineSpec] = {s.name: s for s in (
    EngineSpec(name="deepspeed", tag="", title="DeepSpeed",
               trainer="zero_bench.engines.deepspeed:DeepSpeedEngine",
               init_distributed="zero_bench.engines.deepspeed:init_distributed",
               predict="zero_bench.estimate.deepspeed:predict",
               step_comm="zero_bench.estimate.time.comm:deepspeed_terms",
               step_offload="zero_bench.estimate.time.offload:deepspeed_offload",
               stored_states="zero_bench.estimate.states:stored_states",
               refusals="zero_bench.engines.refusals:deepspeed", offload_param_follows=lambda zero: zero == 3,
               reads_ds_config=True, builds_deepspeed_ops=True, runs_fp16=True, published_fragmentation=True,
               flat_optimizer_stages=(1, 2, 3),
               untraced=DEEPSPEED_UNTRACED,
               pipeline_trainer="zero_bench.engines.deepspeed:DeepSpeedPipelineEngine"),
    EngineSpec(name="fsdp2", tag="fsdp2", title="FSDP2",
               trainer="zero_bench.engines.fsdp2:Fsdp2Engine",
               init_distributed="zero_bench.engines.fsdp2:init_distributed",
               predict="zero_bench.estimate.fsdp2:predict",
               step_comm="zero_bench.estimate.time.comm:fsdp2_terms",
               step_offload="zero_bench.estimate.time.offload:fsdp2_offload",
               stored_states="zero_bench.estimate.fsdp2:stored_states",
               # CPUOffloadPolicy moves parameters with the optimizer states: one key, `offload`
               refusals="zero_bench.engines.refusals:fsdp2", offload_param_follows=lambda zero: True,
               reads_ds_config=False, builds_deepspeed_ops=False, runs_fp16=False, published_fragmentation=False,
               report_note=FSDP2_NOTE, tracer="zero_bench.estimate.traced:trace_fsdp2",
               pipeline_trainer="zero_bench.engines.fsdp2:Fsdp2PipelineEngine"),
)}


def spec(name: str) -> EngineSpec:
    """The spec of engine `name` (an EngineName or its string); KeyError for an unknown one."""
    return SPECS[str(name)]


def tag(name: str) -> str:
    """How labels name engine `name`: its spec's tag, or the name itself for one no spec knows (a
    grid entry skipped for naming it is still labelled)."""
    known = SPECS.get(str(name))
    return known.tag if known else str(name)
