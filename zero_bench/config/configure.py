"""Compose conf/ over the schema (zero_bench.config.schema) and check it: every bad input fails here with one
line naming the key and what is allowed, before anything is launched. Types are the schema's (Hydra
and OmegaConf enforce them); ranges and choices are one function per section below; checks across
keys are validate_static's, which asks the layout (config/layout.py) about the parallel degrees and
each engine's refusals about what it runs; "auto" and None become concrete in `resolve`, the one
place that does.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from zero_bench.config import honoured
from zero_bench.devices import cpu_features
from zero_bench.config.checked import composition_error
from zero_bench.config.schema import (CONF_DIR, DS_TEMPLATES, ZERO_STAGES, BenchConfig, Config, Device, EngineName,
                                      HardwareConfig, OffloadDevice, PipelineSchedule, Precision, Recompute, ReportConfig, SearchConfig,
                                      States, structured)
from zero_bench.engines.specs import Concern, spec
from zero_bench.errors import ConfigError
from zero_bench.models import ModelConfig
from zero_bench.models.hf import display_name, read_hf_config


def compose(overrides: list[str]) -> Any:
    """conf/ composed with `overrides`, as a Hydra app would (no sweep values); Hydra's own errors
    (an unknown key, a value of the wrong type) become one-line ConfigErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose("config", overrides=list(overrides))
    except Exception as exc:  # noqa: BLE001 - Hydra's and OmegaConf's exceptions, one line each
        raise ConfigError(composition_error(exc, overrides)) from None


def _plain(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    return cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)


SEED_MAX = 2**32 - 1  # the seeds numpy and every framework accept (torch's generator takes seed + step)
MISSING_VALUE = "???"  # how OmegaConf.to_container writes a key no preset or override set


def with_hf_model(plain: dict) -> dict:
    """`plain` with model.hf_config's config.json read into the model's keys (models/hf.py); as it
    was without one. seq_len, dropout, attention and name stay the user's; a shape key the user
    also set differently is refused rather than silently replaced."""
    model = dict(plain.get("model") or {})
    path = model.get("hf_config")
    if path in (None, MISSING_VALUE):
        if path == MISSING_VALUE:
            raise ConfigError("model.hf_config: missing; `model=hf` needs model.hf_config=PATH/config.json")
        return plain
    seq_len = model.get("seq_len")
    if seq_len == MISSING_VALUE:
        raise ConfigError("model.seq_len: missing; with model.hf_config give the length you train at "
                          "(e.g. model.seq_len=4096)")
    integer("model.seq_len", seq_len)
    keys = read_hf_config(str(path), seq_len, model.get("dropout", 0.0))
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for k, v in keys.items():
        given = model.get(k, MISSING_VALUE)
        if given not in (MISSING_VALUE, defaults[k], v):
            raise ConfigError(f"model.{k}={given}: model.hf_config={path} sets it to {v}; leave the override out")
    if model.get("name") in (None, MISSING_VALUE):
        model["name"] = display_name(str(path))
    return {**plain, "model": {**model, **keys}}


def from_cfg(cfg: Any, here: bool = True, training: bool = True) -> BenchConfig:
    """A composed config (Hydra DictConfig or a plain dict) -> a checked, resolved BenchConfig.

    here: the trial runs on this machine (device=gpu needs a visible GPU). An estimate is for a
    machine one may not have: here=False keeps device=gpu and resolves "auto" as that device would.
    training: validate_static's: False for `zero_bench estimate`, which answers for pipelines no
    trial has run yet (check_pipeline_estimate in place of check_pipeline).
    """
    root = structured(Config, with_hf_model(_plain(cfg)))
    check_bench(root)
    bench = BenchConfig(**{f.name: getattr(root, f.name) for f in dataclasses.fields(BenchConfig)})
    bench = resolve(bench, here)
    validate_static(bench, training)
    return bench


def search_from_cfg(cfg: Any) -> SearchConfig:
    """The `search:` section, checked."""
    search = structured(SearchConfig, _plain(cfg).get("search") or {}, "search.")
    check_search(search)
    return search


def report_from_cfg(cfg: Any) -> ReportConfig:
    """The `report:` section, checked; runs=None becomes the config's `store`."""
    plain = _plain(cfg)
    rep = structured(ReportConfig, plain.get("report") or {}, "report.")
    check_report(rep)
    return rep if rep.runs else dataclasses.replace(rep, runs=plain.get("store") or Config.store)


def check_all(cfg: Any) -> None:
    """Every section's ranges, whatever the sub-command uses (a bad value is refused by every
    command); cross-field checks are from_cfg's."""
    root = structured(Config, with_hf_model(_plain(cfg)))
    check_bench(root)
    check_search(root.search)
    check_report(root.report)
    integer("repeats", root.repeats)


# -- one check per section: types are the schema's, ranges and choices are here ------------------

def choice(key: str, value: Any, allowed: tuple) -> Any:
    if not any(value == a and type(value) is type(a) for a in allowed):  # True is not the stage 1
        raise ConfigError(f"{key}={value}: allowed values are {', '.join(map(str, allowed))}")
    return value


def integer(key: str, value: Any, lo: int = 1, hi: Optional[int] = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{key}={value}: must be an integer {rng}")
    return value


def number(key: str, value: Any, lo: float = 0.0) -> float:
    """A finite number strictly greater than `lo` (inf is no memory size, timeout or budget)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > lo:
        shown = f"{value:g}" if isinstance(value, float) else value
        raise ConfigError(f"{key}={shown}: must be a number > {lo:g}")
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value:g}: must be a finite number")
    return float(value)


def check_model(m: ModelConfig) -> None:
    """The description's ranges, one key per message; choices (activation, ...) are the schema's enums."""
    for k in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size", "pad_vocab_to"):
        integer(f"model.{k}", getattr(m, k))
    for k in ("ffn_hidden_size", "num_query_groups", "head_dim"):
        if getattr(m, k) is not None:
            integer(f"model.{k}", getattr(m, k))
    if m.num_heads % m.query_groups:
        raise ConfigError(f"model.num_query_groups={m.query_groups}: must divide model.num_heads={m.num_heads}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout:g}: must be in [0, 1)")
    number("model.rope_base", m.rope_base)
    number("model.norm_eps", m.norm_eps)
    if m.rope_scaling_factor is not None:
        number("model.rope_scaling_factor", m.rope_scaling_factor)
        if m.position_embedding != "rope":
            raise ConfigError(f"model.rope_scaling_factor={m.rope_scaling_factor:g}: needs "
                              "model.position_embedding=rope")
    check_moe(m)


MOE_KEYS = ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_dense_layers")


def check_moe(m: ModelConfig) -> None:
    """The mixture-of-experts keys (models/description.py), one key per message."""
    if m.num_experts is None:
        for k in MOE_KEYS:
            if getattr(m, k) is not None:
                raise ConfigError(f"model.{k}={getattr(m, k)}: needs model.num_experts (a dense model has no experts)")
        return
    integer("model.num_experts", m.num_experts)
    integer("model.moe_router_topk", m.moe_router_topk, hi=m.num_experts)
    for k in MOE_KEYS[:2]:
        if getattr(m, k) is not None:
            integer(f"model.{k}", getattr(m, k))
    layers = m.moe_dense_layers or []
    if len(set(layers)) != len(layers) or not all(isinstance(i, int) and 0 <= i < m.num_layers for i in layers):
        raise ConfigError(f"model.moe_dense_layers={layers}: must be distinct layer indices in "
                          f"[0, {m.num_layers - 1}]")
    if m.moe_aux_loss_coeff < 0:
        raise ConfigError(f"model.moe_aux_loss_coeff={m.moe_aux_loss_coeff:g}: must be >= 0")


def check_hardware(hw: HardwareConfig) -> None:
    if hw.memory_gb is not None and hw.memory_mib is not None:
        raise ConfigError(f"hardware.memory_mib={hw.memory_mib}: give memory_gb or memory_mib, not both "
                          f"(memory_gb={hw.memory_gb})")
    if hw.memory_gb is not None:
        number("hardware.memory_gb", hw.memory_gb)
    if hw.memory_mib is not None:
        integer("hardware.memory_mib", hw.memory_mib)
    integer("hardware.num_nodes", hw.num_nodes)


def check_bench(b: BenchConfig) -> None:
    check_model(b.model)
    check_hardware(b.hardware)
    integer("parallel.tp", b.parallel.tp)
    integer("parallel.dp", b.parallel.dp)
    if b.parallel.dp_shard is not None:
        integer("parallel.dp_shard", b.parallel.dp_shard)
    integer("parallel.ep", b.parallel.ep)
    integer("zeropp.hpz", b.zeropp.hpz)
    integer("parallel.sp", b.parallel.sp)
    integer("parallel.pp", b.parallel.pp)
    integer("parallel.vpp", b.parallel.vpp)
    choice("parallel.pp_schedule", b.parallel.pp_schedule, tuple(s.value for s in PipelineSchedule))
    choice("zero", b.zero, ZERO_STAGES)
    integer("recompute_layers", b.recompute_layers)
    check_tiled_mlp(b.tiled_mlp)
    choice("ds_preset", b.ds_preset, ds_presets())
    integer("batch.micro", b.batch.micro)
    integer("batch.grad_accum", b.batch.grad_accum)
    integer("steps.warmup", b.steps.warmup, lo=0)
    integer("steps.timed", b.steps.timed)
    integer("steps.probe", b.steps.probe, lo=0)
    number("timeout_s", b.timeout_s)
    integer("seed", b.seed, lo=0, hi=SEED_MAX)


def check_ulysses(b: BenchConfig) -> None:
    """parallel.sp > 1 with what its trials have shown equal to sp = 1 (DeepSpeed ZeRO 1-3 and FSDP2,
    sdpa and unfused attention, GQA, RoPE, tiled_mlp over the rank's seq_len / sp tokens, tp = 2 with
    Megatron's sequence parallelism: tests/integration/test_ulysses_tp.py; at tp 1 every recompute
    policy, recompute=op's selective checkpoint recomputing the all-to-alls, which it does not keep, in
    backward on every rank alike; at tp 1 compile=true, DeepSpeed's whole-model and FSDP2's per-layer
    compile; a mixture of experts at ep 1, its load-balancing loss over the sequence: models/ulysses.py
    aux_loss_over_sequence); combinations no trial has compared yet are refused."""
    tp = b.parallel.tp
    untried = ((f"compile at parallel.tp={tp}", b.compile and tp > 1, "compile=false, or parallel.tp=1"),
               (f"recompute=op at parallel.tp={tp}", b.recompute == Recompute.op and tp > 1,
                "recompute=none, selective, full or block, or parallel.tp=1"))
    for key, bad, allowed in untried:
        if bad:
            raise ConfigError(f"parallel.sp={b.parallel.sp}: not compared with sp=1 together with {key} yet; allowed "
                              f"with parallel.sp > 1: {allowed}")


def check_pipeline(b: BenchConfig) -> None:
    """parallel.pp > 1: the schedule's keys agree with each other and give torch's schedule enough
    micro-batches; what runs under a pipeline is what trials have compared with pp = 1
    (tests/integration/test_pipeline_trials.py: llama-tiny in fp32 and bf16, FSDP2 zero=2/3 and DeepSpeed
    ZeRO 0-1, GPipe, 1F1B and interleaved 1F1B, pp=2 on 2 ranks, pp=2 x dp=2 and pp=2 x tp=2 with
    megatron's sequence parallelism on 4); every other
    dimension is refused in one line until a trial has compared it; what each engine cannot run is
    its refusals' (Concern.pipeline)."""
    check_pipeline_estimate(b)  # the schedule's keys and torch's own micro-batch rules
    p, n = b.parallel, b.batch.grad_accum
    interleaved = p.pp_schedule == PipelineSchedule.interleaved_1f1b
    if interleaved and (n < p.pp or n % p.pp):
        # megatron's interleaved schedule and torch's rounds of pp micro-batches (n % (n // pp) == 0)
        raise ConfigError(f"batch.grad_accum={n}: parallel.pp_schedule=interleaved_1f1b needs a multiple of "
                          f"parallel.pp={p.pp} micro-batches (batch.grad_accum is their number); allowed: "
                          f"batch.grad_accum = {p.pp}, {2 * p.pp}, ...")
    m = b.model
    untried = (
        ("model.tie_embeddings=true", m.tie_embeddings,
         "megatron keeps the word embedding on the first and the last stage and all-reduces its gradient over "
         "its embedding group, which neither engine's reduction runs here", "an untied model (llama-tiny, llama3-8b)"),
        (f"model.num_experts={m.num_experts}", m.is_moe, "a mixture of experts is not compared under a pipeline",
         "a dense model"),
        (f"model.attention={m.attention}", m.attention != "sdpa", "only sdpa attention is compared under a pipeline",
         "model.attention=sdpa"),
        (f"parallel.sp={p.sp}", p.sp > 1, "Ulysses is not compared under a pipeline", "parallel.sp=1"),
        (f"parallel.ep={p.ep}", p.ep > 1, "expert parallelism is not compared under a pipeline", "parallel.ep=1"),
        (f"parallel.dp_shard={p.dp_shard}", p.dp_shard is not None and p.dp_shard != p.dp,
         "hybrid sharding is not compared under a pipeline", "parallel.dp_shard=null"),
        (f"precision={b.precision}", b.precision == Precision.fp16,
         "fp16's loss scaling is not compared under a pipeline", "precision=fp32 or bf16"),
        (f"states={b.states}", b.states != States.mixed, "pure bf16 states are not compared under a pipeline",
         "states=mixed"),
        ("offload=true", b.offload or b.offload_param or b.nvme, "offload is not compared under a pipeline",
         "offload=false"),
        (f"recompute={b.recompute}", b.recompute != Recompute.none, "recompute is not compared under a pipeline",
         "recompute=none"),
        ("compile=true", b.compile, "torch.compile is not compared under a pipeline", "compile=false"),
        (f"loss={b.loss}", b.loss != "megatron", "only megatron's loss is compared under a pipeline", "loss=megatron"),
        (f"tiled_mlp={b.tiled_mlp}", b.tiled_mlp is not None, "the tiled MLP is not compared under a pipeline",
         "tiled_mlp=null"),
        ("recompute_offload=true", b.recompute_offload, "checkpoint offload is not compared under a pipeline",
         "recompute_offload=false"),
    )
    for key, bad, why, allowed in untried:
        if bad:
            raise ConfigError(f"{key}: {why} (parallel.pp={p.pp}); allowed with parallel.pp > 1: {allowed}")
    spec(b.engine).validate(b, Concern.pipeline)


def check_pipeline_estimate(b: BenchConfig) -> None:
    """parallel.pp > 1 as the estimate takes it (validate_static(training=False)): the schedule's keys
    agree with each other; whether trials have compared a pipeline with pp = 1 yet (check_pipeline)
    is not asked, so the estimate answers for a 70B on 32 GPUs before any pipeline trial ran. What
    no engine runs under a pipeline is the estimate's own refusal (estimate/pipeline.py refusal),
    so that `zero_bench estimate` without zero=... shows the stages that run."""
    p = b.parallel
    interleaved = p.pp_schedule == PipelineSchedule.interleaved_1f1b
    if p.vpp > 1 and not interleaved:
        raise ConfigError(f"parallel.vpp={p.vpp}: virtual stages run with parallel.pp_schedule=interleaved_1f1b (got "
                          f"{p.pp_schedule}); allowed with {p.pp_schedule}: parallel.vpp=1")
    if interleaved and p.vpp < 2:
        raise ConfigError("parallel.pp_schedule=interleaved_1f1b: needs parallel.vpp >= 2 virtual stages per rank; "
                          "allowed at parallel.vpp=1: parallel.pp_schedule=gpipe or 1f1b")
    m = b.batch.grad_accum  # the micro-batches of one pipeline step, as torch.distributed.pipelining's schedules take them
    if p.pp_schedule == PipelineSchedule.one_f_one_b and m < p.pp:  # Schedule1F1B's own ValueError
        raise ConfigError(f"batch.grad_accum={m}: the micro-batches of a pipeline step; parallel.pp_schedule=1f1b needs "
                          f"at least parallel.pp={p.pp} (torch's Schedule1F1B); allowed: batch.grad_accum >= {p.pp}, "
                          "or parallel.pp_schedule=gpipe")
    rounds = max(1, m // p.pp)
    if interleaved and m % rounds:  # ScheduleInterleaved1F1B's own ValueError
        raise ConfigError(f"batch.grad_accum={m}: parallel.pp_schedule=interleaved_1f1b runs the micro-batches in "
                          f"{rounds} rounds of equal size (torch's ScheduleInterleaved1F1B); allowed: a multiple of "
                          f"{rounds}, e.g. {rounds * p.pp}")


def check_search(s: SearchConfig) -> None:
    integer("search.min", s.min)
    integer("search.max", s.max)
    if s.max < s.min:
        raise ConfigError(f"search.max={s.max}: must be >= search.min={s.min}")
    integer("search.granularity", s.granularity)
    integer("search.max_trials", s.max_trials, lo=2)
    number("search.cpu_budget_gb", s.cpu_budget_gb)
    for key in ("seq_min", "seq_granularity"):
        if getattr(s, key) is not None:
            integer(f"search.{key}", getattr(s, key))
    integer("search.seq_max", s.seq_max)
    if s.seq_min is not None and s.seq_max < s.seq_min:
        raise ConfigError(f"search.seq_max={s.seq_max}: must be >= search.seq_min={s.seq_min}")


def check_report(r: ReportConfig) -> None:
    if r.out in (None, ""):
        raise ConfigError(f"report.out={r.out}: must be a path (the .csv and .md are written beside it)")
    for key in ("price_per_device_hour", "train_tokens"):
        if getattr(r, key) is not None:
            number(f"report.{key}", getattr(r, key))


def ds_presets() -> tuple:
    """The ds_configs/ template sets: default, and each {name}.json that is not a layer of another."""
    layers = {"base", "cpu", "nvme", "offload_optimizer", "offload_param", "zero0", "zero1", "zero2", "zero3"}
    names = {p.stem for p in DS_TEMPLATES.glob("*.json")} - layers
    return ("default",) + tuple(sorted(n for n in names if not any(n.startswith(o + "_") for o in names)))


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def gpu_bf16() -> bool:
    """Whether the first visible GPU computes bf16 natively (compute capability 8.0 and later, or
    ROCm): torch.cuda.is_bf16_supported(including_emulation=False), asked of the capability itself
    because torch versions without that argument count a V100's emulated bf16, by creating a tensor
    on the GPU, a CUDA context in this process that is no trial's."""
    import torch

    return bool(torch.version.hip) or torch.cuda.get_device_capability(0)[0] >= 8


def auto_precision(device: Device, engine: EngineName, here: bool = True) -> Precision:
    """What precision=auto runs at. CPU: bf16 only where this CPU computes it natively (cpu_features:
    an emulated bf16 matmul ran 5x to 100x slower than fp32 here), else fp32. GPU: bf16 where the
    card has it, else fp16. An estimate (here=False) assumes bf16 on GPU, as every GPU preset has it;
    on CPU it is this CPU's answer (its capacity is this host's too, capacity.py), so that an
    estimate and a run of one config share a search key."""
    if device == Device.cpu:
        return Precision(cpu_features.detect().auto_precision)
    if not here or gpu_bf16():
        return Precision.bf16
    if not spec(engine).runs_fp16:
        raise ConfigError(f"precision=auto: this GPU has no bf16 (compute capability < 8.0) and engine={engine} "
                          "runs no fp16; allowed here: precision=fp32")
    return Precision.fp16


def resolve(b: BenchConfig, here: bool = True) -> BenchConfig:
    """The one place "auto" and None become concrete: device (CUDA when torch sees it), precision
    (auto_precision), offload_param (follows offload with ZeRO-3, and always with engine=fsdp2),
    parallel.sequence_parallel (sequence_parallel).
    here=False (an estimate for another machine) keeps device=gpu without a visible GPU."""
    device = b.hardware.device
    if device == Device.auto:
        device = Device.gpu if cuda_available() else Device.cpu
    elif device == Device.gpu and here and not cuda_available():
        raise ConfigError("hardware.device=gpu: no CUDA device is visible; allowed here: cpu, auto")
    precision = b.precision
    if precision == Precision.auto:
        precision = auto_precision(Device(device), b.engine, here)
    rung = offload_rung(b)
    offload = rung != OffloadDevice.none
    follows = offload and spec(b.engine).offload_param_follows(b.zero)
    offload_param = bool(follows) if b.offload_param is None else b.offload_param
    parallel = dataclasses.replace(b.parallel, sequence_parallel=sequence_parallel(b))
    return dataclasses.replace(b, hardware=dataclasses.replace(b.hardware, device=Device(device)),
                               precision=precision, offload=offload, offload_param=offload_param,
                               offload_device=rung, parallel=parallel)


# Presets that reproduce a setup from before megatron's sequence parallelism (2022): the
# megatron_deepspeed preset is the 2021 Megatron-DeepSpeed of the reference table, whose tp ranks
# each held the whole sequence (and whose partitioned activation checkpoints assume they do).
BEFORE_SEQUENCE_PARALLEL = ("megatron_deepspeed",)


def sequence_parallel(b: BenchConfig) -> Optional[bool]:
    """parallel.sequence_parallel as given; left out at tp > 1: on, but off under a preset from
    before it. Left out at tp 1 it stays None (nothing to shard over), so that only a value the user
    gave there is named as unread (honoured.py)."""
    if b.parallel.sequence_parallel is not None or b.parallel.tp == 1:
        return b.parallel.sequence_parallel
    return b.ds_preset not in BEFORE_SEQUENCE_PARALLEL


def offload_rung(b: BenchConfig) -> OffloadDevice:
    """offload_device as given, or what `offload` says (true: cpu); the two may not disagree."""
    if b.offload_device is None:
        return OffloadDevice.cpu if b.offload else OffloadDevice.none
    if b.offload and b.offload_device == OffloadDevice.none:
        raise ConfigError("offload_device=none: offload=true asks for an offload; allowed with offload=true: "
                          "offload_device=cpu, nvme (or leave offload out)")
    return OffloadDevice(b.offload_device)


def validate_static(b: BenchConfig, training: bool = True) -> None:
    """Checks across keys that need only the config (inside a grid, a failing combination is
    recorded as skipped rather than ending the sweep). The parallel degrees are the layout's
    (config/layout.py RankLayout, validated once against the model); what each engine runs of them
    is its refusals'. training=False (`zero_bench estimate`): a pipeline is checked as the estimate
    takes it (check_pipeline_estimate), not as trials run it (check_pipeline)."""
    m, tp = b.model, b.parallel.tp
    spec(b.engine).validate(b, Concern.engine)
    check_states(b)
    layout = b.layout
    if layout.dp_shard is not None:  # FSDP2's hybrid sharding (given at all: DeepSpeed would ignore even dp_shard=dp)
        spec(b.engine).validate(b, Concern.hybrid)
    if layout.ep > 1:  # megatron's expert parallelism
        spec(b.engine).validate(b, Concern.expert_parallel)
    if layout.sp > 1:
        check_ulysses(b)
    if layout.pp > 1 or b.parallel.vpp > 1:
        (check_pipeline if training else check_pipeline_estimate)(b)
    if b.loss != "megatron" and tp > 1:
        raise ConfigError(f"loss={b.loss}: runs at parallel.tp=1 (at tp {tp} the vocabulary is split over the "
                          "ranks and only megatron's vocab-parallel loss reads it); allowed with tp > 1: "
                          "loss=megatron")
    if b.recompute == Recompute.full and m.num_layers % b.recompute_layers:
        raise ConfigError(f"recompute_layers={b.recompute_layers}: must divide model.num_layers={m.num_layers} "
                          "(megatron's uniform recompute)")
    chunk = layout.layers_per_chunk  # megatron's uniform loop runs over one model chunk's layers
    if b.recompute == Recompute.full and chunk % b.recompute_layers:
        raise ConfigError(f"recompute_layers={b.recompute_layers}: must divide the {chunk} layers of each pipeline "
                          f"chunk (model.num_layers={m.num_layers} / parallel.pp={layout.pp} x parallel.vpp="
                          f"{layout.vpp}: megatron's uniform recompute checkpoints a chunk's layers "
                          f"{b.recompute_layers} at a time); allowed: a divisor of {chunk}")
    if b.recompute == Recompute.block and b.recompute_layers > m.num_layers:
        raise ConfigError(f"recompute_layers={b.recompute_layers}: with recompute=block at most "
                          f"model.num_layers={m.num_layers} layers are recomputed")
    if m.head_dim is None and m.hidden_size % m.num_heads:  # heads are h / a wide unless head_dim says
        raise ConfigError(f"model.num_heads={m.num_heads}: must divide model.hidden_size={m.hidden_size} "
                          "(or set model.head_dim)")
    check_long_sequence(b)
    if b.offload and b.zero == 0:
        if b.nvme:
            raise ConfigError("offload_device=nvme: needs ZeRO stage 3 (got zero=0: no ZeRO optimizer to swap); "
                              "allowed with zero=0: offload_device=none")
        raise ConfigError("offload=true: needs ZeRO stage 1, 2 or 3 (got zero=0); allowed with zero=0: false")
    spec(b.engine).validate(b, Concern.offload_param)
    if b.zeropp.active:
        spec(b.engine).validate(b, Concern.zeropp)
    if b.nvme:
        spec(b.engine).validate(b, Concern.offload_device)
    if b.precision == "fp16" and b.hardware.device == Device.cpu:
        raise ConfigError("precision=fp16: not supported by DeepSpeed's CPU accelerator; allowed on cpu: fp32, bf16")
    # last: a key nothing reads is refused only once the config is otherwise one that runs
    honoured.check(b)  # its warnings are the commands' to print (subcommands.warn_unhonoured)
    spec(b.engine).validate(b, Concern.ignored)


def check_tiled_mlp(value: Optional[str]) -> None:
    """tiled_mlp: null, auto or a count of tiles >= 1."""
    if value is None or value == "auto":
        return
    try:
        tiles = int(value)
    except ValueError:
        tiles = 0
    if tiles < 1 or str(tiles) != value.strip():
        raise ConfigError(f"tiled_mlp={value}: must be an integer >= 1 (tiles over the sequence), auto, or null")


def check_long_sequence(b: BenchConfig) -> None:
    """What the tiled MLP and the checkpoint offload run with (models/sequence.py); recompute_offload
    without full/block recompute is honoured.py's refusal."""
    if b.tiled_mlp is not None:
        if b.model.is_moe:
            raise ConfigError(f"tiled_mlp={b.tiled_mlp}: tiles megatron's dense MLP; an MoE layer's experts see "
                              "routed rows, not the sequence; allowed with model.num_experts: tiled_mlp=null")
        if b.recompute == Recompute.op:
            raise ConfigError(f"tiled_mlp={b.tiled_mlp}: recompute=op keeps fc1's output, which the tiled MLP "
                              "never holds whole; allowed with tiled_mlp: recompute=none, selective, full or block")
    ck = b.ds.get("activation_checkpointing") or {}
    if b.recompute_offload and ck.get("cpu_checkpointing"):
        raise ConfigError("recompute_offload=true: ds.activation_checkpointing.cpu_checkpointing=true already moves "
                          "the checkpointed inputs to the host; give one of the two")


def check_states(b: BenchConfig) -> None:
    """Where the states' precision lives: only bf16 training has a choice; each engine's limits."""
    if b.states == States.mixed:
        return
    if b.precision != Precision.bf16:
        raise ConfigError(f"states={b.states}: needs precision=bf16 (got {b.precision}); allowed with "
                          f"precision={b.precision}: states=mixed")
    spec(b.engine).validate(b, Concern.states)


# -- the keys, for `zero_bench --help` ------------------------------------------------------------

def field_docs(cls) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), read from the source."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def keys_help(cls=Config, prefix: str = "") -> list[str]:
    """One line per key: name=default (choices) and what it means; sections recursively."""
    import typing
    from enum import Enum

    hints, docs, out = typing.get_type_hints(cls), field_docs(cls), []
    default = cls()
    for f in dataclasses.fields(cls):
        hint, value = hints[f.name], getattr(default, f.name)
        if dataclasses.is_dataclass(hint):
            out += keys_help(hint, f"{prefix}{f.name}.")
            continue
        enum = next((a for a in typing.get_args(hint) + (hint,) if isinstance(a, type) and issubclass(a, Enum)), None)
        shown = "null" if value is None else (str(value).lower() if isinstance(value, bool) else str(value))
        choices = f" ({' | '.join(e.value for e in enum)})" if enum else ""
        out.append(f"  {prefix}{f.name}={shown}{choices}  {docs.get(f.name, '')}".rstrip())
    return out
