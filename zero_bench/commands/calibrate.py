"""`zero_bench calibrate`: this machine's fixed terms, measured in one short real launch and stored
where the estimate finds them (zero_bench.devices.calibration).

The launch is the configuration's own: its tp x dp ranks, engine, ZeRO stage and precision, so the
NCCL communicators are the ones its groups create; the model is gpt-tiny unless one is given (cli.py),
one probe entry at batch.micro (steps.probe optimizer steps, then a profiled step); on CPU a timed
entry after it at micro + 1 (steps.warmup + steps.timed steps: the engine's time per step beyond the
kernels, estimate/time/engine.py).
CPU: each rank's RSS before the model and its peak RSS less its peak live tensors (the estimate's
fixed term), then, in this process under the machine lock, the matmul rate of each CPU precision.
GPU: what calibration.FixedTermsProbe measures at each rank's start (the context alone, NCCL's
world communicator, a group of the world's ranks that runs an all-to-all, cuBLAS's workspaces), and
at the entry's end the memory outside the allocator and torch's peak reserved / allocated.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import BenchConfig, Device, software_versions
from zero_bench.devices.calibration import Calibration, cpu_key, gpu_identity, gpu_key, save
from zero_bench.devices.metrics import cpu_model, measure_cpu_peak, rank_threads
from zero_bench.devices.rate_probes import cpu_adam_params_per_s, memory_bytes_per_s, rank_rates
from zero_bench.estimate.gpu import communicators
from zero_bench.records import Entry, Mode, RankRecord, Status, TrialResult
from zero_bench.trial.launch import LaunchOptions, run_launch
from zero_bench.trial.machine import machine_lock
from zero_bench.units import MiB

DEFAULT_MODEL = "gpt-tiny"  # a short launch: the smallest preset unless the command line names a model
CPU_PRECISIONS = ("fp32", "bf16")  # what a CPU trial computes in (fp16 is GPU only)


class CalibrationFailed(RuntimeError):
    """The launch did not finish its entry, or the machine cannot be named: nothing is stored."""


def calibrate(bench: BenchConfig, out: Path) -> tuple[Calibration, Path]:
    """Measure, store, and return the calibration with the cache's path."""
    on_cpu = bench.hardware.device == Device.cpu
    key, device, software = machine(bench)
    with machine_lock():  # the matmul rates too: no other trial may share the cores meanwhile
        # CPU: the same ranks then time warmup + timed steps (gpt-tiny: well under a second), the
        # engine's time per step beyond its kernel terms (estimate/time/engine.py); at micro + 1, as a
        # launch's entries are told apart by micro (ascending), after the probe's memory is recorded
        micro = bench.batch.micro
        plan = [Entry(micro, Mode.PROBE)] + ([Entry(micro + 1, Mode.MEASURE)] if on_cpu else [])
        res, *timed = run_launch(bench, plan, out, LaunchOptions(calibrate=True))
        if res.status != Status.OK:
            raise CalibrationFailed(f"{res.label} micro={res.micro}: {res.status}: {res.reason}")
        threads = rank_threads()
        rates = {p: measure_cpu_peak(p, threads)["flops"] for p in CPU_PRECISIONS} if on_cpu else {}
        # the time estimate's CPU rates (devices/rates.py cpu_rates), on the same threads
        time_rates = ({"memory_bytes_per_s": memory_bytes_per_s(threads),
                       "cpu_adam_params_per_s": cpu_adam_params_per_s(threads),
                       # the launch's ranks all probing at once: matmul, memory-bound ops, gloo, torch AdamW
                       "rank_rates": rank_rates(bench.parallel.world_size, threads, str(bench.precision)).to_dict()}
                      if on_cpu else {})
        if timed and timed[0].status == Status.OK and timed[0].time_per_step_s:
            time_rates["engine_points"] = [engine_point(bench, timed[0].micro, timed[0].time_per_step_s,
                                                        {**time_rates, "matmul_flops": rates})]
    cal = from_result(bench, res, key, device, software, rates, time_rates)
    return cal, save(cal)


def engine_point(bench: BenchConfig, micro: int, measured_s: float, time_rates: dict) -> dict:
    """The launch's EnginePoint (estimate/time/engine.py) as stored: its time/it against the kernel
    terms at the rates just measured. No launch of its own: the calibration's trial is timed anyway."""
    from zero_bench.devices.rates import cpu_rates
    from zero_bench.estimate.time import calibration_point

    measured = {"matmul_flops": time_rates.get("matmul_flops") or {}, "memory_bytes_per_s": time_rates.get("memory_bytes_per_s"),
                "cpu_adam_params_per_s": time_rates.get("cpu_adam_params_per_s"), "ranks": time_rates.get("rank_rates"),
                "said": "this calibration"}
    return calibration_point(bench, micro, measured_s, cpu_rates(bench, measured)).to_dict()


def machine(bench: BenchConfig) -> tuple[str, str, dict]:
    """(cache key, device name, software versions) of this machine for `bench`'s device."""
    software = dict(software_versions())
    if bench.hardware.device == Device.cpu:
        return cpu_key(), cpu_model(), software
    ident = gpu_identity(bench.hardware.devices)
    if ident is None:
        raise CalibrationFailed("NVML names no GPU here: a GPU calibration is keyed by the GPU's name and driver")
    software.update(cuda=ident.cuda, nccl=ident.nccl, driver=ident.driver)
    return gpu_key(str(bench.hardware.cuda_module_loading), ident), ident.name, software


def _largest(ranks: list[RankRecord], read: Callable[[RankRecord], Optional[float]]) -> Optional[float]:
    values = [v for v in map(read, ranks) if v is not None]
    return max(values) if values else None


def from_result(bench: BenchConfig, res: TrialResult, key: str, device: str, software: dict,
                rates: dict, time_rates: Optional[dict] = None) -> Calibration:
    """The calibration a finished entry's rank records hold (pure). Raises CalibrationFailed when a
    figure the estimate needs was not recorded."""
    ranks = res.ranks
    common = dict(key=key, kind=bench.hardware.device, device=device, date=time.strftime("%Y-%m-%d %H:%M"),
                  label=f"{bench.label()} micro={res.micro}", model=bench.model.name, engine=str(bench.engine),
                  zero=bench.zero, tp=bench.parallel.tp, dp=bench.parallel.dp, ep=bench.parallel.ep,
                  sp=bench.parallel.sp, hpz=bench.zeropp.hpz, software=software,
                  runtime_bytes=_largest(ranks, lambda r: r.runtime_bytes))
    if bench.hardware.device == Device.cpu:
        overhead = _largest(ranks, lambda r: None if r.peak_rss_bytes is None or r.peak_live_bytes is None
                            else r.peak_rss_bytes - r.peak_live_bytes)
        if overhead is None:
            raise CalibrationFailed("the ranks recorded no peak RSS / live tensors")
        return Calibration(**common, overhead_bytes=int(overhead), matmul_flops=rates, threads=rank_threads(),
                           **(time_rates or {}))
    outside, nccl = _largest(ranks, lambda r: r.outside_bytes), _largest(ranks, lambda r: r.nccl_world_bytes)
    context = _largest(ranks, lambda r: r.context_bytes)
    if outside is None or context is None:
        raise CalibrationFailed("the ranks recorded no CUDA context / memory outside the allocator")
    # every communicator the launch's groups connected, the expert, Ulysses and hpZ groups too: the
    # estimate adds NCCL's bytes for each of them (estimate.calibrated_gpu_terms), so none may stay in
    # the context term; nor may the probe's own all-to-all group, which no trial has
    comms = communicators(bench.layout, bench.zeropp.hpz)
    a2a = _largest(ranks, lambda r: r.nccl_all_to_all_bytes)
    world = str(bench.parallel.world_size)
    return Calibration(
        **common, module_loading=str(bench.hardware.cuda_module_loading), context_at_init_bytes=context,
        nccl_bytes={} if nccl is None else {world: nccl},
        nccl_all_to_all_bytes={} if a2a is None else {world: a2a},
        cublas_workspace_bytes=_largest(ranks, lambda r: r.cublas_workspace_bytes), outside_bytes=outside,
        # what stays outside besides NCCL is the context with the kernels loaded so far (lazy loading)
        context_bytes=max(0, outside - (nccl or 0) * len(comms) - (a2a or 0)),
        peak_allocated_bytes=_largest(ranks, lambda r: r.torch_peak_allocated),
        peak_reserved_bytes=_largest(ranks, lambda r: r.torch_peak_reserved),
        fragmentation=_largest(ranks, lambda r: r.torch_peak_reserved / r.torch_peak_allocated
                               if r.torch_peak_reserved and r.torch_peak_allocated else None))


def _mib(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / MiB:,.1f} MiB"


def terms(cal: Calibration) -> list[tuple[str, str, str]]:
    """(term, figure, how it was measured), one per measured term."""
    if cal.kind == Device.cpu:
        rates = [(f"matmul {p}", f"{f / 1e9:,.1f} GFLOP/s",
                  f"best 1024 x 1024 F.linear over 0.5 s on {cal.threads} thread(s), in the runner")
                 for p, f in cal.matmul_flops.items()]
        if cal.memory_bytes_per_s:
            rates.append(("memory bandwidth", f"{cal.memory_bytes_per_s / 1e9:,.1f} GB/s",
                          "best fp32 add of 64 MB tensors (2 reads + 1 write), in the runner"))
        if cal.cpu_adam_params_per_s:
            rates.append(("CPU Adam", f"{cal.cpu_adam_params_per_s / 1e6:,.0f} M params/s",
                          "best DeepSpeedCPUAdam step of 4M fp32 parameters, in the runner"))
        rates += rank_rate_lines(cal.rank_rates)
        rates += [(f"engine beyond kernels ({p['key']})", f"{(p['measured_s'] - p['kernels_s']) * 1e3:,.1f} ms/step",
                   f"{p['model']} time/it {p['measured_s']:.3f} s - kernel terms {p['kernels_s']:.3f} s; "
                   f"{p['tensors']} tensors") for p in cal.engine_points]
        return [("runtime before the model", _mib(cal.runtime_bytes),
                 "RSS at each rank's start, before its model is built (largest rank)"),
                ("rank overhead (the estimate's term)", _mib(cal.overhead_bytes),
                 "peak RSS - peak live tensors at the entry's end (largest rank)"), *rates]
    comms = len(communicators(RankLayout(tp=cal.tp, dp=cal.dp, ep=cal.ep, sp=cal.sp), cal.hpz))
    nccl = [(f"NCCL per communicator ({n} ranks)", _mib(b), "growth outside the allocator over the world "
             "group's first all-reduce") for n, b in cal.nccl_bytes.items()]
    nccl += [(f"NCCL all-to-all group ({n} ranks)", _mib(b), "growth outside the allocator over a new group of "
              "the world's ranks and its first all-to-all") for n, b in cal.nccl_all_to_all_bytes.items()]
    probe = " - the all-to-all group" if cal.nccl_all_to_all_bytes else ""
    frag = "-" if cal.fragmentation is None else f"x{cal.fragmentation:.3f}"
    return [("CUDA context at init", _mib(cal.context_at_init_bytes),
             "CUDA's used right after it started, before any communicator, less other processes'"), *nccl,
            ("cuBLAS workspaces", _mib(cal.cublas_workspace_bytes),
             "torch's allocated after a linear layer's forward and backward (main and autograd's thread)"),
            ("outside the allocator at the end", _mib(cal.outside_bytes), "CUDA's used - torch's reserved"),
            ("CUDA context and kernels (the estimate's term)", _mib(cal.context_bytes),
             f"outside at the end - {comms} communicator(s) x NCCL's{probe}"),
            ("allocator reserved / allocated", frag, f"{_mib(cal.peak_reserved_bytes)} / "
             f"{_mib(cal.peak_allocated_bytes)} at the entry's peak ({cal.model} ZeRO-{cal.zero})")]


def rank_rate_lines(r: dict) -> list[tuple[str, str, str]]:
    """calibrate's lines for rate_probes.RankRates' figures (none where not measured)."""
    if not r:
        return []
    at_once = f"{r['ranks']} rank(s) at once, {r['threads']} thread(s) each, in spawned processes"
    out = [(f"matmul {r['precision']}, ranks at once", f"{r['matmul_flops'] / 1e9:,.1f} GFLOP/s",
            f"median 1024 x 1024 F.linear, {at_once}"),
           ("memory-bound ops", f"{r['elementwise_bytes_per_s'] / 1e9:,.2f} GB/s",
            f"norm + GeLU + softmax + add forward and backward, {at_once}"),
           ("attention scores (unfused)", f"{r['scores_bytes_per_s'] / 1e9:,.2f} GB/s",
            f"masked_fill + softmax forward and backward, {at_once}"),
           ("loss (logits to fp32, cross-entropy)", f"{r['loss_bytes_per_s'] / 1e9:,.2f} GB/s",
            f"forward and backward of [256, 4, 8192] logits, {at_once}"),
           ("torch AdamW", f"{r['adam_params_per_s'] / 1e6:,.0f} M params/s",
            f"one 4M fp32 tensor, + {r['adam_per_tensor_s'] * 1e6:,.0f} us per tensor, {at_once}")]
    if r.get("all_reduce_bytes_per_s"):
        out += [("gloo all-reduce", f"{r['all_reduce_bytes_per_s'] / 1e9:,.2f} GB/s", f"bus bandwidth, 16 MB fp32, {at_once}"),
                ("gloo all-gather", f"{r['all_gather_bytes_per_s'] / 1e9:,.2f} GB/s", f"bus bandwidth, 16 MB fp32, {at_once}"),
                ("gloo latency", f"{r['collective_latency_s'] * 1e6:,.0f} us", f"one-element all-reduce, {at_once}")]
    return out


def lines(cal: Calibration, path: Path) -> list[str]:
    """What `zero_bench calibrate` prints: one line per term, then where it went."""
    width = max(len(t[0]) for t in terms(cal))
    out = [f"{name:<{width}}  {figure:>14}  {how}" for name, figure, how in terms(cal)]
    return out + [f"wrote {path} ({cal.said}; the estimate uses it for {cal.kind} on this machine)"]
