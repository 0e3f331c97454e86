"""Each engine as the runner sees it: one EngineSpec per engine, registered by name in SPECS (as
torchtitan registers a TrainSpec per model). Everything outside zero_bench/engines/ that differs
by engine asks the spec instead of comparing the engine's name, so a third engine is this module's
entry plus its trainer module.

Light by design: no torch, deepspeed or megatron here (the runner, configure and the estimate
import it); what the spec names of the heavy side (the trainer class, the estimate's parts) is a
"module:attribute" path, imported only by `load` when used.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from zero_bench.errors import ConfigError

if TYPE_CHECKING:
    from zero_bench.config import BenchConfig

CONCERNS = ("engine", "states", "hybrid", "expert_parallel", "offload_param")
"""What `EngineSpec.validate` is asked about, each at the place configure.validate_static checks that
concern's shared conditions, so that a config wrong in two ways keeps the message it had."""


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
    estimate_parts: str
    """"module:function" (bench, ds) -> the engine-specific fields of zero_bench.estimate.Estimate
    (states, buffers, activations, act_per_sample, init_peak, grads_phase)."""
    stored_states: str
    """"module:function" (report.tables.Setup) -> the estimate's model states of one rank of a stored
    config (a dict with gpu, cpu, grads bytes)."""
    validate: Callable[["BenchConfig", str], None]
    """Raises ConfigError for what this engine cannot run of one concern (CONCERNS)."""
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


def load(path: str):
    """The object a spec names by "module:attribute", imported now (the heavy side stays unimported
    until a rank or an estimate needs it)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _deepspeed_validate(b: "BenchConfig", concern: str) -> None:
    """DeepSpeed's limits on shared features (its own ZeRO 0-3 and fp16 need no refusal)."""
    if concern == "states" and b.states == "bf16":
        if b.zero == 0:
            raise ConfigError("states=bf16: DeepSpeed keeps bf16 master weights and optimizer states with "
                              "ZeRO 1-3 only (bf16_master_weights_and_grads); allowed with zero=0: states=mixed")
        if b.offload:
            raise ConfigError("states=bf16: DeepSpeed offloads bf16 optimizer states only to its CPUAdam "
                              "(fp32_optimizer_states=false), which zero_bench does not run; allowed with "
                              "offload=true: states=mixed")
    if concern == "hybrid":
        raise ConfigError(f"parallel.dp_shard={b.parallel.dp_shard}: hybrid sharding runs with engine=fsdp2 (a 2-D "
                          "device mesh); DeepSpeed's MiCS / ZeRO++ hpZ are not wired in; allowed with "
                          "engine=deepspeed: parallel.dp_shard=null")
    if concern == "expert_parallel" and b.zero in (0, 3):
        why = ("DeepSpeed refuses its MoE with ZeRO stage 3 (engine.py: 'Native DeepSpeed MoE is not "
               "supported with ZeRO Stage 3')" if b.zero == 3 else
               "DeepSpeed's ZeRO-0 clips the gradients by the ranks' averaged norm, not the whole "
               "model's, when each rank holds other experts")
        raise ConfigError(f"parallel.ep={b.parallel.ep}: {why}; allowed with parallel.ep > 1: zero=1, zero=2, "
                          "or engine=fsdp2")
    if concern == "offload_param" and b.offload_param and b.zero != 3:
        raise ConfigError(f"offload_param=true: needs zero=3 (got zero={b.zero})")


def _fsdp2_validate(b: "BenchConfig", concern: str) -> None:
    """What engine=fsdp2 cannot run, each in one line with the nearest choices; it runs every shared
    feature (bf16 states with offload, hybrid sharding, ep at any stage, offload_param at zero=2)."""
    if concern != "engine":
        return
    if b.zero not in (2, 3):
        raise ConfigError(f"zero={b.zero}: engine=fsdp2 always shards parameters; allowed with fsdp2: zero=2 "
                          "(gathered parameters kept from forward to backward) or zero=3 (resharded after "
                          "forward); engine=deepspeed for zero=0/1")
    if b.precision == "fp16":
        raise ConfigError("precision=fp16: engine=fsdp2 has no dynamic loss scaling wired in (torch's "
                          "ShardedGradScaler), and unscaled fp16 gradients under- and overflow; allowed with "
                          "fsdp2: fp32, bf16")
    if b.offload_param != b.offload:
        raise ConfigError(f"offload_param={str(b.offload_param).lower()}: engine=fsdp2 offloads parameters, "
                          "gradients and optimizer states together (CPUOffloadPolicy); set offload=true or "
                          "false alone")
    if b.ds_preset != "default" or b.ds:  # reads_ds_config=False
        key = f"ds_preset={b.ds_preset}" if b.ds_preset != "default" else "ds"
        raise ConfigError(f"{key}: DeepSpeed settings; engine=fsdp2 reads no DeepSpeed config; allowed with "
                          "fsdp2: ds_preset=default and no ds.* keys")


FSDP2_NOTE = ("engine=fsdp2: PyTorch FSDP2 (fully_shard on every layer and the root); zero=3 reshards "
              "after forward (FULL_SHARD), zero=2 keeps the gathered parameters until backward "
              "(SHARD_GRAD_OP); same model, data, optimizer and measurements as DeepSpeed; no DeepSpeed "
              "config (its ds_config cell is {}).")

# In the order reports list the engines (baseline first).
SPECS: dict[str, EngineSpec] = {s.name: s for s in (
    EngineSpec(name="deepspeed", tag="", title="DeepSpeed",
               trainer="zero_bench.engines.deepspeed:DeepSpeedEngine",
               init_distributed="zero_bench.engines.deepspeed:init_distributed",
               estimate_parts="zero_bench.estimate:deepspeed_parts",
               stored_states="zero_bench.estimate.states:stored_states",
               validate=_deepspeed_validate, offload_param_follows=lambda zero: zero == 3,
               reads_ds_config=True, builds_deepspeed_ops=True, runs_fp16=True, published_fragmentation=True),
    EngineSpec(name="fsdp2", tag="fsdp2", title="FSDP2",
               trainer="zero_bench.engines.fsdp2:Fsdp2Engine",
               init_distributed="zero_bench.engines.fsdp2:init_distributed",
               estimate_parts="zero_bench.estimate.fsdp2:parts",
               stored_states="zero_bench.estimate.fsdp2:stored_states",
               # CPUOffloadPolicy moves parameters with the optimizer states: one key, `offload`
               validate=_fsdp2_validate, offload_param_follows=lambda zero: True,
               reads_ds_config=False, builds_deepspeed_ops=False, runs_fp16=False, published_fragmentation=False,
               report_note=FSDP2_NOTE),
)}


def spec(name: str) -> EngineSpec:
    """The spec of engine `name` (an EngineName or its string); KeyError for an unknown one."""
    return SPECS[str(name)]


def tag(name: str) -> str:
    """How labels name engine `name`: its spec's tag, or the name itself for one no spec knows (a
    grid entry skipped for naming it is still labelled)."""
    known = SPECS.get(str(name))
    return known.tag if known else str(name)
