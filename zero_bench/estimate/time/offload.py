"""Offload terms of one rank's optimizer step: host <-> device copies over PCIe, the optimizer step on
the host's cores, and ZeRO-Infinity's NVMe reads and writes.

What moves, as DeepSpeed 0.19.8 and torch 2.13 do it:
- ZeRO-1/2 with offload_optimizer (stage_1_and_2.py): each reduced gradient partition copied into the
  host's fp32 buffer (async_inplace_copy_grad_to_fp32_buffer_from_gpu; ZeRO-2 every micro-step, its
  accumulation is on the host), DeepSpeedCPUAdam steps the fp32 partition, the updated partition copied
  back into the device's 16-bit one, then all-gathered (comm.py).
- ZeRO-3 with offload_optimizer: the same gradient copy every micro-step; with offload_param the 16-bit
  partitions live on the host and are fetched for forward and again for backward, every micro-step
  (partitioned_param_coordinator prefetches them: overlapped), and the step writes them there;
  without it the updated 16-bit partition is copied back after the step.
- offload_device=nvme (ZeRO-Infinity): the optimizer's fp32 master and both moments (12 B/param) read
  from and written to the swap files every step (partitioned_optimizer_swapper), and with
  offload_param the 16-bit parameters read per fetch and written after the step; every rank of a node
  shares the node's disk bandwidth.
- FSDP2's CPUOffloadPolicy: the fp32 shards on the host, copied to the device before each all-gather
  and the gradients back after each reduce-scatter; torch's AdamW steps on the host (DeepSpeed's
  cpu_adam.py says its CPU Adam is "5x to 7x" torch's: TORCH_ADAM_SLOWDOWN, the midpoint).
- The checkpointed layer inputs kept on the host between forward and backward (checkpoint_terms; any
  engine, with or without offload): the bytes are the memory estimate's own (bench_activations'
  `host`, what Estimate.host_bytes counts), copied down in every micro-step's forward and up in its
  backward, both exposed:
  - DeepSpeed's cpu_checkpointing with partition_activations (the megatron_deepspeed preset's offload
    file), runtime/activation_checkpointing/checkpointing.py: partition_activations() copies each
    checkpoint's 1/tp partition to the host with `partition.cpu()` (or, contiguous_memory_optimization,
    copy_ into a host buffer from new_empty), pageable memory, a blocking copy on the compute stream;
    CheckpointFunction.backward brings it back with `saved_data.to(device)`, blocking too, before the
    recompute. Nothing overlaps them. The rates are nvbandwidth's pinned figures: for pageable memory
    the term is a lower bound. On CPU both calls return the tensor itself: no copy, no term. (Without
    partition_activations DeepSpeed 0.19.8 copies asynchronously on a side stream, keeping the last
    input on the device: the memory estimate holds none of those inputs on the host, so neither
    does this.)
  - recompute_offload (models/sequence.py, both engines): to_host copies each chunk's input into
    pinned memory, non_blocking but on the compute stream, which runs it between the layers'
    kernels; restore copies it back the same way before the recompute. On CPU to_host is a clone
    (each byte read and written, at the measured copy rate, which counts bytes moved) and restore's
    .to("cpu") copies nothing.
CPU Adam's rate per core is not published (devices/rates.py): the term says so in its source.
"""
from __future__ import annotations

from zero_bench.config.hosts import local_ranks
from zero_bench.config.schema import BenchConfig, Device
from zero_bench.devices.rates import HardwareRates
from zero_bench.engines.specs import load, spec
from zero_bench.estimate.activations import bench_activations
from zero_bench.estimate.time.comm import overlap_comm
from zero_bench.estimate.time.compute import measured_optimizer, partition_params
from zero_bench.estimate.time.record import TimeTerm
from zero_bench.units import BYTES

FP32_GRAD = 4  # the host's gradient buffer is fp32 (the copy converts)
OPTIMIZER_SWAP_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per parameter
TORCH_ADAM_SLOWDOWN = 6.0  # cpu_adam.py: DeepSpeedCPUAdam is "5x to 7x" torch's Adam


def offload_terms(bench: BenchConfig, rates: HardwareRates) -> list[TimeTerm]:
    """Every offload term of one optimizer step ([] without offload): the engine's own copies and host
    step (its spec's step_offload), then ZeRO-Infinity's disk."""
    if not bench.offload and not bench.offload_param:
        return []
    return load(spec(bench.engine).step_offload)(bench, rates) + nvme_terms(bench, rates)


def deepspeed_offload(bench: BenchConfig, rates: HardwareRates) -> list[TimeTerm]:
    """PCIe: the gradients down every micro-step (ZeRO-1: once, at the boundary), the parameters up;
    then DeepSpeedCPUAdam on the host's cores (exposed: the device waits)."""
    n, ga, b = partition_params(bench), bench.batch.grad_accum, BYTES[bench.precision]
    d2h, h2d = rates.device_to_host_bytes_per_s, rates.host_to_device_bytes_per_s
    grads_times = 1 if bench.zero == 1 else ga
    out = [TimeTerm("gradients device->host", grads_times * n * FP32_GRAD / d2h.value, not overlap_comm(bench),
                    f"the reduced fp32 gradient partition to the host, {grads_times} per step, at {d2h.source}")]
    if bench.offload_param:
        out.append(TimeTerm("parameters host->device", 2 * ga * n * b / h2d.value, False,
                            f"ZeRO-3 offload_param: the {b}-B partition fetched for forward and backward every "
                            f"micro-step (prefetched) at {h2d.source}"))
    else:
        out.append(TimeTerm("parameters host->device after the step", n * b / h2d.value, True,
                            f"the updated {b}-B partition copied back after the host's step at {h2d.source}"))
    per_core, cores = rates.cpu_adam_params_per_s_per_core, rates.host_cores
    # on CPU the ranks step torch's AdamW with offload too (ds_configs/cpu.json: torch_adam)
    out.append(measured_optimizer(bench, rates, "optimizer step (host, torch AdamW)")
               or TimeTerm("optimizer step (host, CPU Adam)", n / (per_core.value * cores.value), True,
                           f"DeepSpeedCPUAdam at {per_core.source}, on {cores.source}"))
    return out


def fsdp2_offload(bench: BenchConfig, rates: HardwareRates) -> list[TimeTerm]:
    """CPUOffloadPolicy: the fp32 shards up before each all-gather, the gradients down after each
    reduce-scatter (both beside compute), then torch's AdamW on the host's cores (exposed)."""
    n, ga = partition_params(bench), bench.batch.grad_accum
    d2h, h2d = rates.device_to_host_bytes_per_s, rates.host_to_device_bytes_per_s
    fetches = ga * (2 if bench.zero == 3 else 1)
    per_core, cores = rates.cpu_adam_params_per_s_per_core, rates.host_cores
    step = measured_optimizer(bench, rates, "optimizer step (host, torch AdamW)") or TimeTerm(
        "optimizer step (host, torch AdamW)", n * TORCH_ADAM_SLOWDOWN / (per_core.value * cores.value), True,
        f"torch's AdamW, 1/{TORCH_ADAM_SLOWDOWN:g} of CPU Adam's {per_core.source}, on {cores.source}")
    return [TimeTerm("gradients device->host", ga * n * FP32_GRAD / d2h.value, False,
                     f"the reduced fp32 gradient partition to the host, {ga} per step, at {d2h.source}"),
            TimeTerm("parameters host->device", fetches * n * 4 / h2d.value, False,
                     f"CPUOffloadPolicy: the fp32 shards before each all-gather ({fetches} per step) at {h2d.source}"),
            step]


def nvme_terms(bench: BenchConfig, rates: HardwareRates) -> list[TimeTerm]:
    """ZeRO-Infinity's swap-file reads and writes, the node's ranks sharing its disk."""
    if not bench.nvme:
        return []
    n, ranks = partition_params(bench), local_ranks(bench)
    rd, wr = rates.nvme_read_bytes_per_s, rates.nvme_write_bytes_per_s
    states = n * OPTIMIZER_SWAP_BYTES * ranks
    out = [TimeTerm("NVMe optimizer states read", states / rd.value, True,
                    f"12 B/param swapped in every step, {ranks} ranks per node, at {rd.source}"),
           TimeTerm("NVMe optimizer states write", states / wr.value, True,
                    f"12 B/param swapped out every step, {ranks} ranks per node, at {wr.source}")]
    if bench.offload_param:
        b, ga = BYTES[bench.precision], bench.batch.grad_accum
        out += [TimeTerm("NVMe parameters read", 2 * ga * n * b * ranks / rd.value, True,
                         f"the {b}-B partition read for forward and backward every micro-step at {rd.source}"),
                TimeTerm("NVMe parameters write", n * b * ranks / wr.value, True,
                         f"the updated {b}-B partition written after the step at {wr.source}")]
    return out


def checkpoint_terms(bench: BenchConfig, rates: HardwareRates, micro: int) -> list[TimeTerm]:
    """The checkpointed layer inputs' copies to the host in forward and back in backward, every
    micro-step ([] where the memory estimate keeps none on the host, or the copy is none: DeepSpeed's
    cpu_checkpointing on CPU). Exposed: both run on, or block, the compute stream (module docstring)."""
    per_sample = bench_activations(bench)["host"]
    ga, on_cpu = bench.batch.grad_accum, bench.hardware.device == Device.cpu
    if not per_sample or (on_cpu and not bench.recompute_offload):
        return []
    nbytes = per_sample * micro * ga
    said = (f"the checkpointed layer inputs the memory estimate holds on the host ({per_sample:,} B a sample, "
            f"estimate/activations.py bench_activations) x micro {micro} x {ga} micro-step(s)")
    d2h, h2d = rates.device_to_host_bytes_per_s, rates.host_to_device_bytes_per_s
    if on_cpu:  # recompute_offload's to_host clones: read and write; restore moves nothing
        return [TimeTerm("checkpoints device->host", 2 * nbytes / d2h.value, True,
                         f"recompute_offload on CPU: {said}, cloned (each byte read and written) at {d2h.source}")]
    if bench.recompute_offload:
        how, bound = "recompute_offload: pinned, non_blocking on the compute stream (models/sequence.py)", ""
    else:
        how = ("DeepSpeed cpu_checkpointing + partition_activations: blocking copies to pageable memory "
               "(checkpointing.py partition_activations, CheckpointFunction.backward)")
        bound = " (pinned memory's rate: this term is a lower bound)"
    return [TimeTerm("checkpoints device->host", nbytes / d2h.value, True,
                     f"{said}, in forward; {how}, at {d2h.source}{bound}"),
            TimeTerm("checkpoints host->device", nbytes / h2d.value, True,
                     f"{said}, back before each recompute; {how}, at {h2d.source}{bound}")]
