"""Composed config -> the exact DeepSpeed JSON a trial runs with.

Layers, later wins: ds_configs/base.json, zero{stage}.json, offload_*.json, the ds_preset's
templates ({preset}.json, {preset}_zero3.json with ZeRO-3, {preset}_offload.json with offload),
cpu.json (on CPU), the values that follow from the config (batch, precision, bucket sizes on the
default preset, the activation checkpoints), then the user's `ds.*` keys. Last, on a GPU where
DeepSpeed's FusedAdam cannot be built, torch's fused AdamW (zero_bench.devices.toolkit), unless the user
chose the optimizer's implementation.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Optional

from zero_bench.config.schema import DS_TEMPLATES, BenchConfig, Device, Recompute
from zero_bench.devices.toolkit import TORCH_FUSED_ADAMW, fused_adam_fallback
from zero_bench.errors import ConfigError

TEMPLATE_DIR = DS_TEMPLATES

# zero_optimization values kept where serial_unpinned() says (see there).
SERIAL = {"zero_optimization": {"overlap_comm": False}}
UNPINNED = {"pin_memory": False}
# DeepSpeed's defaults are sized for billion-parameter models; on a small model they dwarf the
# partitions ZeRO saves (field notes: ZeRO-3 used more RSS than ZeRO-0 with them).
BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
               "stage3_max_live_parameters", "stage3_param_persistence_threshold")


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if k.startswith("_"):
            continue  # comments in templates
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_template(name: str) -> dict:
    return json.loads((TEMPLATE_DIR / f"{name}.json").read_text())


def scaled_buckets(num_params_per_rank: int) -> dict:
    """Buckets proportional to the model (1/16 of its parameters, within [5e5, 5e8] elements)."""
    bucket = int(min(5e8, max(5e5, num_params_per_rank // 16)))
    return {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "stage3_prefetch_bucket_size": bucket,
        "stage3_max_live_parameters": 2 * bucket,
        "stage3_param_persistence_threshold": int(1e4),
    }


# states=bf16: DeepSpeed 0.19.8's bf16 master weights, gradients and Adam moments (runtime/
# precision_config.py; ZeRO 1-3, checked by configure.check_states). Nothing is added otherwise, so
# every other config's JSON stays byte-identical.
PURE_BF16 = {"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}


def zeropp_keys(cfg: BenchConfig) -> dict:
    """zeropp.* as DeepSpeed 0.19.8 names them (runtime/zero/config.py); only the ones switched on, so
    a config without ZeRO++ keeps its JSON byte for byte (configure refuses them below ZeRO-3)."""
    z = cfg.zeropp
    keys = {"zero_quantized_weights": z.qwz, "zero_quantized_gradients": z.qgz,
            "zero_hpz_partition_size": z.hpz if z.hpz > 1 else None}
    return {"zero_optimization": {k: v for k, v in keys.items() if v}} if z.active else {}


# Where a JSON built without a run directory (the estimate, the check before launch) says the swap
# files go; a trial's JSON names its launch's own folder (write, swap_dir).
NVME_PLACEHOLDER = "<run_dir>/nvme"
# DeepSpeed's swappers skip tensors under MIN_AIO_BYTES (runtime/swap_tensor/utils.py: 1 MiB): a
# sub-group of fewer fp32 elements than this would stay in host memory.
MIN_SWAP_ELEMENTS = (1024 ** 2) // 4


def build(cfg: BenchConfig, nvme_path: Optional[str] = None) -> dict:
    """The trial's DeepSpeed JSON; nvme_path: the folder an offload_device=nvme trial swaps into."""
    serial = serial_unpinned(cfg)
    ds = merge(load_template("base"), load_template(f"zero{cfg.zero}"))
    if serial and cfg.zero >= 2:
        ds = merge(ds, SERIAL)
    for wanted, section in ((cfg.offload, "offload_optimizer"), (cfg.offload_param, "offload_param")):
        if wanted:
            ds = merge(ds, load_template(section))
            if serial:
                ds = merge(ds, {"zero_optimization": {section: UNPINNED}})
            if cfg.nvme:
                ds = merge(ds, {"zero_optimization": {section: {
                    "device": "nvme", "nvme_path": nvme_path or cfg.nvme_path or NVME_PLACEHOLDER}}})
    if cfg.nvme:
        ds = merge(ds, load_template("nvme"))
    ds = _with_preset(ds, cfg)
    ds = merge(ds, zeropp_keys(cfg))
    on_cpu = cfg.hardware.device == Device.cpu
    if on_cpu:
        ds = merge(ds, load_template("cpu"))
    ds = merge(ds, {
        "train_micro_batch_size_per_gpu": cfg.batch.micro,
        "gradient_accumulation_steps": cfg.batch.grad_accum,
        # DeepSpeed's count over its data-parallel ranks, the sp ones included (each holds a part of
        # a sequence it counts as a sample): global_batch counts whole sequences
        "train_batch_size": cfg.batch.micro * cfg.batch.grad_accum * cfg.parallel.dp,
        "bf16": {"enabled": cfg.precision == "bf16", **PURE_BF16.get(cfg.states, {})},
        "fp16": {"enabled": cfg.precision == "fp16"},
    })
    checkpoints = ds.get("activation_checkpointing") or {}
    if cfg.recompute in (Recompute.full, Recompute.block) and checkpoints.get("contiguous_memory_optimization"):
        # DeepSpeed sizes the contiguous buffer by the checkpoints one forward pass stores.
        n = cfg.model.num_layers // cfg.recompute_layers if cfg.recompute == Recompute.full else cfg.recompute_layers
        ds = merge(ds, {"activation_checkpointing": {"number_checkpoints": n}})
    user_zero = (cfg.ds.get("zero_optimization") or {})
    if on_cpu and cfg.zero > 0 and cfg.ds_preset == "default":
        buckets = scaled_buckets(cfg.layout.held_params)
        keep = {k: v for k, v in buckets.items() if k not in user_zero}
        if cfg.zero < 3:
            keep = {k: v for k, v in keep.items() if not k.startswith("stage3")}
        ds = merge(ds, {"zero_optimization": keep})
        if cfg.nvme and "sub_group_size" not in user_zero:
            ds = merge(ds, {"zero_optimization": {"sub_group_size": scaled_sub_group(cfg)}})
    if cfg.nvme and cfg.offload_param and "buffer_size" not in (user_zero.get("offload_param") or {}):
        ds = merge(ds, {"zero_optimization": {"offload_param": {"buffer_size": param_swap_buffer(cfg)}}})
    return with_buildable_adam(merge(ds, cfg.ds), cfg)


def scaled_sub_group(cfg: BenchConfig) -> int:
    """offload_device=nvme on CPU (default preset): sub_group_size sized to the model, as the buckets
    are. DeepSpeed's default (1e9) makes the whole partition one sub-group, and the optimizer swapper
    pins buffer_count (4) x its largest sub-group (optimizer_utils.py SwapBufferManager) in host
    memory, the very memory NVMe offload is to free. Here an eighth of the partition, at least what
    DeepSpeed swaps at all (1 MiB)."""
    return max(MIN_SWAP_ELEMENTS, cfg.layout.held_params // cfg.parallel.dp // 8)


def param_swap_buffer(cfg: BenchConfig) -> int:
    """offload_param.buffer_size with offload_device=nvme, on every device and preset: the largest
    parameter partition. DeepSpeed's parameter swapper asserts every swapped partition fits one of its
    buffers (partitioned_param_swapper.py get_buffer, at zero.Init), and its default (1e8 elements) is
    smaller than Llama-3-8B's 525 M-element embedding split over dp <= 5 ranks, or a 70B's over 8;
    on a small model the default instead pins buffer_count (5) x 1e8 elements of host memory for
    nothing. A partition is the parameter split over dp, padded up (partition_parameters.py
    _aligned_size)."""
    largest = max(-(-p.numel // cfg.parallel.dp) for p in cfg.layout.params)
    return max(MIN_SWAP_ELEMENTS, largest)


def serial_unpinned(cfg: BenchConfig) -> bool:
    """Whether ZeRO-2/3 reduce gradients without overlapping backward (SERIAL) and offload uses
    unpinned host memory (UNPINNED): what zero_bench's CPU figures were measured with (one
    reduction bucket alive, as estimate/buffers.py counts it; pinning needs an accelerator) and
    what the reference preset ran with before its own template (its overlap_comm: true still
    wins). A GPU run on the default preset gets DeepSpeed 0.19.8's own defaults instead, as its
    users do: runtime/zero/config.py overlap_comm None -> `self.stage == ZeroStageEnum.weights`
    (on for ZeRO-3 only), offload_config.py pin_memory True. Merged right after the templates
    these values used to sit in, so the CPU and preset JSON keep their bytes, key order included."""
    return cfg.hardware.device == Device.cpu or cfg.ds_preset != "default"


def with_buildable_adam(ds: dict, cfg: BenchConfig) -> dict:
    """GPU, no optimizer offload, Adam/AdamW and FusedAdam not to be had here (no nvcc, or one of
    another CUDA major than torch's): torch's fused AdamW, instead of a run that stops at its build."""
    opt = ds.get("optimizer") or {}
    if (cfg.hardware.device != Device.gpu or cfg.offload or str(opt.get("type", "")).lower() not in ("adam", "adamw")
            or "torch_adam" in (opt.get("params") or {}) or not fused_adam_fallback()):
        return ds
    return merge(ds, TORCH_FUSED_ADAMW)


def _with_preset(ds: dict, cfg: BenchConfig) -> dict:
    if cfg.ds_preset == "default":
        return ds
    ds = merge(ds, load_template(cfg.ds_preset))
    for suffix, wanted in (("zero3", cfg.zero == 3), ("offload", cfg.offload)):
        if wanted and (TEMPLATE_DIR / f"{cfg.ds_preset}_{suffix}.json").exists():
            ds = merge(ds, load_template(f"{cfg.ds_preset}_{suffix}"))
    return ds


def write(cfg: BenchConfig, path: Path, nvme_path: Optional[str] = None) -> dict:
    ds = build(cfg, nvme_path)
    path.write_text(json.dumps(ds, indent=2) + "\n")
    return ds


def check_with_deepspeed(cfg: BenchConfig) -> None:
    """Validate the JSON with DeepSpeed's own config model, in this process, before any launch:
    a bad `ds.*` key is then one line here instead of a failure inside every rank 15 s later."""
    import logging

    ds = build(cfg)
    # DeepSpeedConfig checks train_batch_size against the world size it finds (1 here).
    ds["train_batch_size"] = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    # Say which accelerator, or importing DeepSpeed guesses and announces it on stdout.
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    from deepspeed.utils.logging import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from deepspeed.runtime.config import DeepSpeedConfig

        DeepSpeedConfig(ds)
    except Exception as exc:  # noqa: BLE001 - pydantic ValidationError, AssertionError, ValueError ...
        raise ConfigError(f"ds: DeepSpeed refuses the config: {_one_line(exc)}") from None
    finally:
        logger.setLevel(level)
    check_moe_settings(cfg, ds.get("zero_optimization") or {})


def check_moe_settings(cfg: BenchConfig, zero: dict) -> None:
    """With expert parallelism DeepSpeed's ZeRO reduces the experts' gradients by reduce-scatter
    into contiguous buffers only: runtime/zero/stage_1_and_2.py asserts both (lines 865, 870) in
    every rank at initialize; said here instead, before any launch."""
    if cfg.parallel.ep == 1:
        return
    if zero.get("reduce_scatter", True) is False:
        raise ConfigError(f"ds.zero_optimization.reduce_scatter=false: DeepSpeed reduces expert-parallel "
                          f"gradients only by reduce-scatter; allowed with parallel.ep={cfg.parallel.ep}: true")
    offloaded = (zero.get("offload_optimizer") or {}).get("device", "none") != "none"
    if cfg.zero == 2 and zero.get("contiguous_gradients", True) is False and not offloaded:
        raise ConfigError(f"ds.zero_optimization.contiguous_gradients=false: DeepSpeed's ZeRO-2 keeps "
                          f"expert-parallel gradients only in contiguous buffers; allowed with "
                          f"parallel.ep={cfg.parallel.ep}: true")


def _one_line(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic: name the section and the key
        e = errors()[0]
        section = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedFP16Config": "fp16",
                   "DeepSpeedBF16Config": "bf16"}.get(getattr(exc, "title", ""), getattr(exc, "title", ""))
        key = ".".join(str(x) for x in (section, *e.get("loc", ())) if x)
        return f"{key}={e.get('input')!r}: {e.get('msg')}"
    return " ".join(str(exc).split())[:300] or type(exc).__name__
