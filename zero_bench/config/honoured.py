"""Which keys the chosen engine, stage and device honour: a key given a value that nothing in the
configured trial reads is refused in one line naming the key and what honours it, or, where ignoring
it is harmless and expected, named in one warning line. Before this, such keys ran as if they were
not there (issue 43 item 3): `recompute_layers=4` without full/block recompute, `hardware.devices`
on CPU, `+ds.zero_optimization.stage3_max_live_parameters` at ZeRO-2.

Every key of the schema is classified here, and tests/unit/test_honoured.py holds the schema to it:
a key the schema gains is in CONDITIONS (honoured only when its condition holds) or in EVERYWHERE
(read by every trial, whatever the engine, stage and device). A key "has a value" when it differs
from the schema's default (presets count: a preset that sets a key asks for it too). The DeepSpeed
keys under `ds` are DeepSpeed's engine's concern: engines/refusals.py ds_keys_read refuses them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from zero_bench.config.schema import BenchConfig, Device, Recompute
from zero_bench.errors import ConfigError


@dataclass(frozen=True)
class Condition:
    """Key `key` is read only when `holds(b)`; `by` names what honours it (for the message)."""
    key: str
    holds: Callable[[BenchConfig], bool]
    by: str
    harmless: bool = False
    """Ignoring it changes nothing the user would measure: a warning line, not a refusal."""
    why: str = ""
    """What happens instead, said in the warning or the refusal."""


def _gpu(b: BenchConfig) -> bool:
    return b.hardware.device == Device.gpu


CONDITIONS: tuple[Condition, ...] = (
    Condition("recompute_layers", lambda b: b.recompute in (Recompute.full, Recompute.block),
              "recompute=full (layers per checkpoint) or recompute=block (layers recomputed)"),
    Condition("recompute_offload", lambda b: b.recompute in (Recompute.full, Recompute.block),
              "recompute=full or recompute=block (the checkpointed layer inputs it moves to the host)"),
    Condition("model.rope_base", lambda b: b.model.position_embedding == "rope", "model.position_embedding=rope",
              why="learned positions have no rotary base"),
    Condition("model.moe_router_topk", lambda b: b.model.is_moe, "model.num_experts (a mixture of experts)"),
    Condition("model.norm_topk_prob", lambda b: b.model.is_moe, "model.num_experts (a mixture of experts)"),
    Condition("model.moe_aux_loss_coeff", lambda b: b.model.is_moe, "model.num_experts (a mixture of experts)"),
    Condition("hardware.devices", _gpu, "hardware.device=gpu", why="a CPU trial picks no GPUs"),
    Condition("hardware.launcher", lambda b: bool(b.hardware.hostfile), "hardware.hostfile (a multi-node launch)",
              why="one node is launched without a multi-node launcher"),
    Condition("hardware.cuda_module_loading", _gpu, "hardware.device=gpu", harmless=True,
              why="no CUDA context on CPU"),
    Condition("hardware.card", _gpu, "hardware.device=gpu", harmless=True,
              why="it names the GPU whose calibration the estimate uses"),
    Condition("parallel.sequence_parallel", lambda b: b.parallel.tp > 1, "parallel.tp > 1", harmless=True,
              why="at tp 1 every rank holds the whole sequence: there is nothing to shard it over"),
    Condition("parallel.pp_schedule", lambda b: b.parallel.pp > 1, "parallel.pp > 1", harmless=True,
              why="at pp 1 there is no pipeline to schedule: every micro-batch runs forward then backward"),
    Condition("fusions", _gpu, "hardware.device=gpu", harmless=True,
              why="megatron's jit fusions are always off on CPU"),
    Condition("zeropp.qgz", lambda b: b.hardware.num_nodes > 1, "hardware.num_nodes > 1", harmless=True,
              why="DeepSpeed 0.19.8 quantizes gradients only across nodes (stage3.py: num_nodes > 1); one "
                  "node reduce-scatters them as plain ZeRO-3 does"),
    Condition("nvme_path", lambda b: b.nvme, "offload_device=nvme", why="nothing is swapped to disk"),
    Condition("offload", lambda b: _gpu(b) or b.nvme, "hardware.device=gpu or offload_device=nvme", harmless=True,
              why="on CPU the states move from host memory to host memory: the code path runs, the peak RSS "
                  "cannot drop (reports made on CPU say so)"),
)
"""Keys honoured only under a condition. The engines' own limits (ds_preset and ds.* with FSDP2,
offload_param below ZeRO-3, states=bf16 ...) are engines/refusals.py's and configure's checks."""

EVERYWHERE = frozenset({
    "model.name", "model.num_layers", "model.hidden_size", "model.num_heads", "model.seq_len", "model.vocab_size",
    "model.pad_vocab_to", "model.ffn_hidden_size", "model.num_query_groups", "model.head_dim", "model.qk_norm",
    "model.activation", "model.normalization", "model.position_embedding", "model.rope_scaling_factor",
    "model.tie_embeddings", "model.add_bias", "model.qkv_bias", "model.dropout", "model.attention", "model.norm_eps",
    "model.num_experts", "model.moe_ffn_hidden_size", "model.moe_shared_expert_intermediate_size",
    "model.moe_dense_layers", "model.hf_config",
    "parallel.tp", "parallel.dp", "parallel.dp_shard", "parallel.ep", "parallel.sp", "parallel.pp", "parallel.vpp",
    "hardware.device", "hardware.memory_gb", "hardware.memory_mib", "hardware.hostfile", "hardware.num_nodes",
    "zeropp.qwz", "zeropp.hpz",
    "engine", "zero", "offload_param", "offload_device", "precision", "states", "loss", "recompute", "ds_preset", "compile",
    "tiled_mlp",
    "batch.micro", "batch.grad_accum", "steps.warmup", "steps.timed", "steps.probe", "timeout_s", "seed", "ds",
})
"""Keys every trial reads (or whose every value the checks in configure.py and engines/refusals.py
already refuse where it cannot run: rope_scaling_factor without RoPE, dp_shard with DeepSpeed ...)."""


def leaf_keys(obj: Any = None, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a BenchConfig (the schema's default one if None)."""
    obj = BenchConfig() if obj is None else obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaf_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def _given(b: BenchConfig) -> dict[str, Any]:
    """The keys of `b` that differ from the schema's defaults."""
    default = dict(leaf_keys())
    return {k: v for k, v in leaf_keys(b) if v != default[k]}


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check(b: BenchConfig) -> list[str]:
    """Refuse (ConfigError) the first key given a value this trial would not read; the warning lines
    for keys whose being ignored is harmless."""
    given, warnings = _given(b), []
    for c in CONDITIONS:
        if c.key not in given or c.holds(b):
            continue
        line = (f"{c.key}={_shown(given[c.key])}: read only with {c.by}"
                + (f" ({c.why})" if c.why else ""))
        if not c.harmless:
            raise ConfigError(f"{line}; leave it out here")
        warnings.append(line)
    return warnings
