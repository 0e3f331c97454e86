"""Before any launch: check the config against this machine, refuse what the estimate says cannot
fit this host, and label grid entries that are invalid."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import psutil

from zero_bench.config.hosts import check_hostfile, device_tokens, local_ranks
from zero_bench.config.schema import (DEFAULT_ENGINE, BenchConfig, ConfigError, Device, ParallelConfig, States, ZeroppConfig,
                                      make_label, pipeline_tag)
from zero_bench.devices import aio
from zero_bench.devices.capacity import search_capacity
from zero_bench.engines.ds_config import check_with_deepspeed
from zero_bench.engines.refusals import quantizer_missing
from zero_bench.engines.specs import spec
from zero_bench.estimate import estimate
from zero_bench.records import Entry, SearchResult, SearchStatus, Status, TrialResult
from zero_bench.trial.outcome import trial
from zero_bench.units import GiB


def available_devices(device: Device) -> int:
    if device == Device.gpu:
        import torch

        return torch.cuda.device_count()
    return os.cpu_count() or 1


def check_devices(b: BenchConfig) -> None:
    """Every rank of a node needs its own GPU from the list the user gave."""
    tokens = device_tokens(b) if b.hardware.device == Device.gpu else None
    if tokens is not None and len(tokens) < local_ranks(b):
        key = "hardware.devices" if b.hardware.devices is not None else "CUDA_VISIBLE_DEVICES"
        raise ConfigError(f"{key}={','.join(tokens)}: lists {len(tokens)} GPUs but {local_ranks(b)} ranks per node "
                          "need one each")
    check_mig(b, tokens)


def check_mig(b: BenchConfig, tokens: Optional[list[str]]) -> None:
    """One rank per node on a MIG slice, never several: a CUDA process enumerates one MIG instance
    only (NVIDIA's MIG user guide, "CUDA Device Enumeration"), so ranks past the first would select
    an ordinal that does not exist, and MIG instances have no peer-to-peer or CUDA IPC between them
    (the guide's "Application Considerations"), which NCCL's transports between local ranks use.
    Handing each rank its own slice would not help: NCCL does not support MIG (NVIDIA/nccl#1716,
    its maintainer: a slice has no CUDA index of its own and NCCL's topology maps one PCI device to
    one rank; nccl#431: NCCL refuses ranks on MIG slices). One rank per node on a slice runs; across
    nodes NCCL talks over the network."""
    n = local_ranks(b)
    if not tokens or n < 2 or not any(t.upper().startswith("MIG-") for t in tokens[:n]):
        return
    key = "hardware.devices" if b.hardware.devices is not None else "CUDA_VISIBLE_DEVICES"
    raise ConfigError(f"{key}: {n} ranks per node on MIG slices; a CUDA process sees one MIG instance and slices "
                      "cannot talk to each other: one rank per node (parallel=dp1) on a slice, or whole GPUs")


def refuse_estimate_only(b: BenchConfig) -> None:
    """What zero_bench estimates but cannot run here: 8-bit AdamW needs torchao, not one of its
    dependencies; ZeRO++'s quantized collectives need a quantizer kernel the CPU accelerator lacks."""
    if b.states == States.adam8bit:
        raise ConfigError("states=adam8bit: 8-bit AdamW needs torchao, which zero_bench does not install; "
                          "`zero_bench estimate` models it; trials allowed with states=mixed or bf16")
    missing = quantizer_missing(b)  # ZeRO++'s qwZ / qgZ on an accelerator without the kernel
    if missing:
        raise ConfigError(missing)


def validate_machine(b: BenchConfig) -> None:
    """Checks against this machine: device count, bf16 support, hostfile, DeepSpeed's view of `ds`
    (engine=deepspeed)."""
    refuse_estimate_only(b)
    if b.hardware.num_nodes > 1 and not b.hardware.hostfile:
        raise ConfigError(f"hardware.num_nodes={b.hardware.num_nodes}: needs hardware.hostfile (the nodes' hosts; "
                          "hardware.hostfile=slurm inside a Slurm allocation)")
    check_devices(b)
    if spec(b.engine).reads_ds_config:  # others' specs refuse ds.* (configure.validate_static)
        check_with_deepspeed(b)
    if b.hardware.hostfile:
        check_hostfile(b)  # ranks live on the hostfile's hosts, not here
        return
    if b.nvme:
        check_nvme(b)
    have = available_devices(b.hardware.device)
    # CPU ranks are processes: allow two per core before calling it a mistake.
    limit = have if b.hardware.device == Device.gpu else 2 * have
    if b.parallel.world_size > limit:
        raise ConfigError(f"parallel.dp={b.parallel.dp}: world size tp*dp*pp={b.parallel.world_size} exceeds the "
                          f"{have} {b.hardware.device.upper()} devices here (max {limit})")
    if b.precision == "bf16" and b.hardware.device == Device.gpu:
        import torch

        if not torch.cuda.is_bf16_supported():
            raise ConfigError("precision=bf16: this GPU has no bf16; allowed here: fp32, fp16")


def check_nvme(b: BenchConfig) -> None:
    """offload_device=nvme on this machine: DeepSpeed's async_io op, a swap folder it can write with
    O_DIRECT, and free disk for the swap files the estimate predicts for this node's ranks."""
    problem = aio.async_io_problem()
    if problem:
        raise ConfigError(f"offload_device=nvme: {problem}")
    given = b.nvme_path is not None
    path = Path(b.nvme_path) if given else Path.cwd() / "runs"
    key = f"nvme_path={b.nvme_path}" if given else f"nvme_path=null (swap files under the run directory, {path})"
    problem = aio.folder_problem(path, must_exist=given)
    if problem:
        raise ConfigError(f"{key}: {problem}; allowed: an existing, writable folder on a local disk's filesystem")
    need, free = estimate(b).disk_bytes(), aio.free_bytes(path)
    if need > free:
        raise ConfigError(f"{key}: {free / GiB:.2f} GiB free, the swap files of {local_ranks(b)} ranks need "
                          f"{need / GiB:.2f} GiB (estimated); free space there or name another nvme_path")


def preflight(bench: BenchConfig, force: bool = False, micro: Optional[int] = None) -> Optional[TrialResult]:
    """A TrialResult with status "estimated_oom" when the estimate says the host cannot hold it.

    CPU: the predicted per-rank peak (zero_bench.estimate, at `micro`, default bench.batch.micro)
    times the ranks on this host, against the host's available memory. GPU: the device's fixed
    part (overhead + model states + buffers) against the per-device capacity ("cannot initialize
    (estimated)"), and offloaded states times the local ranks against the host's available memory.
    Multi-node (hostfile) skips the host checks: the ranks' hosts are not this one.
    None when it fits, when force=true, or when the estimate cannot be made.
    """
    if force:
        return None
    try:
        est = estimate(bench, capacity=search_capacity(bench))
    except Exception:  # noqa: BLE001 - no estimate: let the launch decide
        return None
    micro = micro or bench.batch.micro
    ranks, avail = local_ranks(bench), psutil.virtual_memory().available
    reason = ""
    if bench.hardware.device == Device.cpu:
        need = est.peak_bytes(micro)
        if not bench.hardware.hostfile and need * ranks > avail:
            reason = (f"does not fit (estimated): {need / GiB:.1f} GiB per rank x {ranks} ranks > "
                      f"{avail / GiB:.1f} GiB available on this host (micro={micro}); force=true launches anyway")
    else:
        fixed, cap = est.fixed_bytes(), est.capacity
        if cap and fixed > cap:
            reason = (f"cannot initialize (estimated): model states + buffers {fixed / GiB:.1f} GiB per device > "
                      f"capacity {cap / GiB:.1f} GiB; force=true launches anyway")
        elif not bench.hardware.hostfile and est.host_bytes() > avail:
            reason = (f"does not fit (estimated): offloaded states {est.states.host / GiB:.1f} GiB per rank x "
                      f"{ranks} ranks > {avail / GiB:.1f} GiB available on this host; force=true launches anyway")
    if not reason:
        return None
    return trial(bench, Entry(micro), 0, Status.ESTIMATED_OOM, reason=reason, phase="init",
                 capacity_bytes=est.capacity)


def skipped_search(c: dict, reason: str) -> SearchResult:
    """A grid entry that failed validation (`c`: the composed config as a dict), recorded with its
    reason and shown in the report."""
    m, p = c["model"], c["parallel"]
    engine = c.get("engine") or DEFAULT_ENGINE
    label = make_label(m["name"], p["tp"], p["dp"], c["zero"], c["offload"], c["precision"], engine)
    try:  # the entry may be skipped for its zeropp values themselves
        zpp = ZeroppConfig(**{k: v for k, v in (c.get("zeropp") or {}).items() if k in ("qwz", "qgz", "hpz")}).tag()
    except (TypeError, ValueError):
        zpp = ""
    label += f" {zpp}" if zpp else ""
    if (p.get("pp") or 1) > 1:  # the pipeline as BenchConfig.label names it
        label += " " + pipeline_tag(ParallelConfig(**{k: p[k] for k in ("pp", "pp_schedule", "vpp") if k in p}))
    keyed = {k: c[k] for k in ("model", "parallel", "zero", "offload", "precision", "batch")}
    if engine != DEFAULT_ENGINE:  # the default engine's skipped entries keep the keys they had before `engine`
        keyed["engine"] = engine
    key = "skip-" + hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return SearchResult(search_key=key, label=label, status=SearchStatus.SKIPPED, note=reason, config=c)
