"""`zero_bench estimate`: the estimate of every configuration asked for, as a table or JSON.

Without zero=... it shows every ZeRO stage x offload (offload=... alone pins the offload); the
configuration is read with from_cfg(here=False): an estimate is for a machine one may not have.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Optional

from zero_bench.config.configure import from_cfg, report_from_cfg, search_from_cfg, validate_static
from zero_bench.config.schema import BenchConfig, ConfigError, Device, OffloadDevice
from zero_bench.engines.specs import spec
from zero_bench.estimate import Estimate, estimate, zeropp
from zero_bench.estimate.pipeline import refusal as pipeline_refusal
from zero_bench.estimate.seq import host_at, longest_seq, seq_top
from zero_bench.estimate.time.table import time_json, time_sheet
from zero_bench.models.description import summary
from zero_bench.models.params import active_params, num_params
from zero_bench.records import SearchStatus
from zero_bench.search.dimension import seq_grid
from zero_bench.store import Store
from zero_bench.units import GiB, MiB

COLUMNS = {"config": "config", "params": "params GiB", "grads": "grads GiB", "optimizer": "optim GiB",
           "device_states": "states/dev GiB", "host_states": "host/rank GiB", "buffers": "buffers GiB",
           "act_per_sample": "act/sample MiB", "peak_micro1": "peak@micro1 GiB", "host_needed": "host/node GiB",
           "max_micro": "max micro", "max_micro_low_overhead": "max micro (low end)", "max_global_batch": "max global",
           "measured_max_micro": "measured micro", "nvme_states": "NVMe/rank GiB", "disk_needed": "NVMe/node GiB",
           "peak_stage": "peak stage"}
GIB_COLUMNS = ("params", "grads", "optimizer", "device_states", "host_states", "buffers", "peak_micro1", "host_needed",
               "nvme_states", "disk_needed")
LEGEND = ("states/dev: params+grads+optimizer on the device; host/rank: offloaded states per rank (on CPU the "
          "same memory); peak@micro1 includes the fixed terms and buffers; max micro: predicted largest micro-batch "
          "per rank for the capacity ('?' when no capacity is known), with the fixed terms at the high end of their "
          "published ranges; (low end): the same at the low end (zero_bench/estimate/gpu.py names each term's source).")
# the peak at the configured batch.micro, per rank: what a run at that micro measures (estimate.Estimate.at_micro)
AT_MICRO_COLUMNS = {"gpu": {"allocated_bytes": "allocated GiB", "reserved_bytes": "reserved GiB",
                            "device_peak_bytes": "device peak GiB"},
                    "cpu": {"live_tensors_bytes": "live tensors GiB", "peak_rss_bytes": "peak RSS GiB"}}
AT_MICRO_LEGEND = {
    "gpu": "allocated: torch's max allocated; reserved: x the allocator's fragmentation; device peak: reserved + the "
           "fixed terms (high end), what nvidia-smi shows; ",
    "cpu": "live tensors: the tensors at the peak; peak RSS: + the runtime; "}
AT_MICRO_TAIL = ("fits: the peak <= the capacity, true up to max micro; grad_accum runs each micro-batch's "
                 "forward and backward in the same memory before the step.")
# FSDP2 accumulates each micro-batch's reduce-scattered gradients into the sharded ones (estimate/fsdp2.py)
HELD_TAIL = ("fits: the peak <= the capacity, true up to max micro; with grad_accum > 1 FSDP2 holds the "
             "sharded gradients of the micro-batches before through the next one's forward and backward.")


def _held(ests: list) -> bool:
    """Whether grad_accum raises some configuration's peak (Prediction.held_across_micro_batches)."""
    return any(e.prediction.held_across_micro_batches for _, e in ests)


def variants(bench: BenchConfig, explicit: frozenset) -> list[BenchConfig]:
    """The configurations to show: all stages x offload to none / cpu, or just the configured one when
    the user gave zero=... (offload=... or offload_device=... alone pins the rung and shows every stage
    that runs it: offload_device=nvme, ZeRO-3)."""
    stages = [bench.zero] if "zero" in explicit else [0, 1, 2, 3]
    rungs = ([bench.offload_device] if explicit & {"zero", "offload", "offload_device"}
             else [OffloadDevice.none, OffloadDevice.cpu])
    out = []
    for z in stages:
        for rung in rungs:
            off = rung != OffloadDevice.none
            # offload_param follows offload as configure.resolve has it (the engine's spec says when)
            follows = off and spec(bench.engine).offload_param_follows(z)
            op = bench.offload_param if "offload_param" in explicit else follows
            v = dataclasses.replace(bench, zero=z, offload=off, offload_param=op, offload_device=rung)
            try:
                validate_static(v, training=False)
            except ConfigError:
                continue  # e.g. ZeRO-0 with offload
            if pipeline_refusal(v):  # e.g. DeepSpeed's ZeRO-2 under a pipeline
                continue
            out.append(v)
    if not out and pipeline_refusal(bench):
        raise ConfigError(pipeline_refusal(bench))
    return out


def measured_max_micro(store: Optional[str], bench: BenchConfig) -> Optional[int]:
    """max micro a finished search in the store found for this configuration, if any."""
    if not store or not Path(store).exists():
        return None
    try:
        res = Store(store).search(bench.search_key())
    except ConfigError:  # the store is optional here
        return None
    return res.max_micro if res and res.status == SearchStatus.DONE else None


def estimate_report(cfg: Any, explicit: frozenset) -> str:
    """The table (or, with json=true, the JSON document) for the configured model."""
    bench = from_cfg(cfg, here=False, training=False)
    ests = [(v, estimate(v)) for v in variants(bench, explicit)]
    seq_micro = seq_micro_of(bench, explicit)
    grid = seq_grid(search_from_cfg(cfg), bench.layout)
    rows = [{**e.row(), "measured_max_micro": measured_max_micro(cfg.get("store"), v),
             "max_seq_len": longest_seq(v, seq_micro, grid)} for v, e in ests]
    for r, (v, _) in zip(rows, ests):
        host = host_at(v, r["max_seq_len"], seq_micro) if r["max_seq_len"] else None
        if host is not None:  # the offloaded checkpoints: the node's RAM is the next wall
            r["max_seq_host_needed"] = host
    micro, rep = bench.batch.micro, report_from_cfg(cfg)
    at = [{"config": r["config"], **e.at_micro(micro)} for r, (_, e) in zip(rows, ests)]
    first = ests[0][1] if ests else None
    traces = traced_variants(bench, ests) if cfg.get("traced", False) else None
    if cfg.get("json", False):
        doc = as_json(bench, first, rows, [e for _, e in ests], at, {"micro": seq_micro, **grid_of(bench, grid)})
        doc = with_time(doc, rows, [e for _, e in ests], micro)
        return doc if traces is None else with_traces(doc, rows, ests, traces)
    m, tp, layout = bench.model, bench.parallel.tp, bench.layout
    ep = layout.ep
    active = f", {active_params(m):,} active per token" if m.is_moe else ""  # MoE: FLOPs count these
    # ep > 1: a rank holds its num_experts / ep experts of each MoE layer and everything else whole
    held = (f"{layout.held_params:,} per rank with {layout.experts_per_rank} of {m.num_experts} experts"
            if ep > 1 else f"{layout.held_params:,} per TP shard")
    pp = layout.pp
    pipe = (f" pp={pp} ({bench.parallel.pp_schedule}{f', vpp={layout.vpp}' if layout.vpp > 1 else ''}; "
            f"{layout.world_size} ranks)" if pp > 1 else "")
    head = (f"zero_bench estimate: {m.name} ({num_params(m):,} params{active}, {held}) tp={tp} "
            f"dp={bench.parallel.dp}{f' ep={ep}' if ep > 1 else ''}{pipe} on {bench.hardware.device} {bench.precision}, "
            f"micro {micro} x grad_accum "
            f"{bench.batch.grad_accum}; capacity {_gib(first.capacity if first else None)} GiB per rank"
            + (f"; fixed terms: {first.calibration}" if first else ""))
    zpp = [zeropp.line(v, e.prediction.buffers_detail()) for v, e in ests if v.zeropp.active][:1]  # ZeRO-3 only: one at most
    return "\n".join([head, f"model: {summary(m)}; recompute={bench.recompute}", fixed_line(first), *zpp,
                      format_table(rows), *stage_tables(bench, rows, [e for _, e in ests]),
                      seq_line(bench, rows, seq_micro, grid), LEGEND, "",
                      at_micro_table(at, bench, _held(ests)),
                      AT_MICRO_LEGEND[_kind(bench)] + (HELD_TAIL if _held(ests) else AT_MICRO_TAIL), "",
                      time_sheet(bench, rows, [e for _, e in ests], rep.price_per_device_hour, rep.train_tokens)]
                     + ([] if traces is None else ["", traced_table(bench, rows, ests, traces)]))


# -- traced=true: the traced prediction beside the formula (estimate/traced.py) -----------------------

TRACED_COLUMNS = {"cpu": ("formula live MiB", "traced live MiB", "traced peak RSS MiB"),
                  "gpu": ("formula allocated MiB", "traced allocated MiB", "traced device peak MiB")}


def traced_variants(bench: BenchConfig, ests: list) -> list:
    """Per configuration shown, its Traced or the one line why it is not traced. ConfigError (exit 2)
    where nothing shown can be traced: the engine, the model, the world, torch, compile."""
    from zero_bench.estimate.traced import check, refusal, trace

    check(bench)
    why = [refusal(v) for v, _ in ests]
    if ests and all(why):
        raise ConfigError(why[0])
    return [w if w else trace(v) for (v, _), w in zip(ests, why)]


def traced_table(bench: BenchConfig, rows: list[dict], ests: list, traces: list) -> str:
    """The formula's and the trace's peak per rank at batch.micro, their terms, and a warning naming
    each term on which they differ by more than 10 %."""
    import pandas as pd

    import torch

    from zero_bench.estimate.traced import compare, warnings

    kind = _kind(bench)
    f_col, t_col, p_col = TRACED_COLUMNS[kind]
    world = bench.parallel.tp * bench.parallel.dp
    lines, terms, notes, warned = [], [], [], []
    for r, (_, e), t in zip(rows, ests, traces):
        if isinstance(t, str):
            notes.append(f"{r['config']}: not traced: {t}")
            continue
        cmp = compare(e, t)
        total = cmp[-1]
        lines.append({"config": r["config"], f_col: _mib(total.formula), t_col: _mib(total.traced),
                      "formula vs traced %": _pct(total.error), p_col: _mib(traced_peak(e, t)),
                      "fits": "?" if e.capacity is None else ("yes" if traced_peak(e, t) <= e.capacity else "no"),
                      "traced peak in": t.phase, "trace s": f"{t.seconds:.1f}"})
        terms += [{"config": r["config"], "term": c.name, "formula MiB": _mib(c.formula), "traced MiB": _mib(c.traced),
                   "formula vs traced %": _pct(c.error)} for c in cmp[:-1]]
        warned += warnings(r["config"], cmp, t.peak_bytes)
    title = (f"traced peak per rank at batch.micro={bench.batch.micro}, grad_accum {bench.batch.grad_accum} "
             f"(rank 0 of {world} fake ranks: torch {torch.__version__}'s FSDPMemTracker under FakeTensorMode):")
    out = [title]
    if lines:
        out += [pd.DataFrame(lines).to_string(index=False), "the terms of each peak, at the moment it falls:",
                pd.DataFrame(terms).to_string(index=False)]
    out += warned + notes
    if lines:
        differs = next(t.differs for t in traces if not isinstance(t, str))
        peak = ("+ the fixed terms, x the fragmentation" if kind == "gpu" else "+ the runtime")
        out.append(f"traced peak: the traced tensors {peak} as the formula has them; {differs}.")
    return "\n".join(out)


def traced_peak(e: Estimate, t) -> int:
    """What a run would show with the trace's tensors: RSS on CPU, nvidia-smi's used on GPU."""
    return e.overhead + int(e.fragmentation * t.peak_bytes)


def with_traces(doc: str, rows: list[dict], ests: list, traces: list) -> str:
    """The JSON document with each configuration's `traced`: the trace (bytes), the terms beside the
    formula's and the warnings; or {"refused": why}."""
    from zero_bench.estimate.traced import compare, warnings

    d = json.loads(doc)
    for entry, r, (_, e), t in zip(d["configs"], rows, ests, traces):
        if isinstance(t, str):
            entry["traced"] = {"refused": t}
            continue
        cmp = compare(e, t)
        entry["traced"] = {**t.to_dict(), "peak_bytes_with_fixed_terms": traced_peak(e, t),
                           "terms": [{"name": c.name, "formula_bytes": c.formula, "traced_bytes": c.traced}
                                     for c in cmp],
                           "warnings": warnings(r["config"], cmp, t.peak_bytes)}
    return json.dumps(d, indent=2)


def with_time(doc: str, rows: list[dict], ests: list[Estimate], micro: int) -> str:
    """The JSON document with each configuration's `time` (estimate/time/: every term, its source)."""
    d = json.loads(doc)
    for entry, r, e in zip(d["configs"], rows, ests):
        entry["time"] = time_json(e, r.get("max_micro"), micro)
    return json.dumps(d, indent=2)


STAGE_COLUMNS = {"stage": "stage", "layers": "layers", "params_per_rank": "params/rank", "in_flight": "in flight",
                 "device_states": "states/dev GiB", "buffers": "buffers GiB", "act_per_sample": "act/sample MiB",
                 "p2p_per_sample": "p2p/sample MiB", "peak_micro1": "peak@micro1 GiB", "max_micro": "max micro"}


def stage_tables(bench: BenchConfig, rows: list[dict], ests: list[Estimate]) -> list[str]:
    """Under a pipeline, one table per configuration: each stage's figures (estimate/pipeline.py;
    in flight: micro-batches' worth of the stage's activations at its peak)."""
    import pandas as pd

    out = []
    for r, e in zip(rows, ests):
        if not e.stages:
            continue
        df = pd.DataFrame(e.stage_rows())
        for k in ("device_states", "buffers", "peak_micro1"):
            df[k] = df[k].map(_gib)
        for k in ("act_per_sample", "p2p_per_sample"):
            df[k] = df[k].map(lambda x: f"{x / MiB:.1f}")
        df["params_per_rank"] = df["params_per_rank"].map(lambda x: f"{x:,}")
        df["in_flight"] = df["in_flight"].map(lambda x: f"{x:g}")
        df["max_micro"] = df["max_micro"].map(_count)
        out.append(f"{r['config']}: per pipeline stage ({bench.parallel.pp_schedule}, {bench.batch.grad_accum} "
                   f"micro-batches; the peak: {e.stage_name}):\n"
                   + df[list(STAGE_COLUMNS)].rename(columns=STAGE_COLUMNS).to_string(index=False))
    return out


def _mib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / MiB:,.1f}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.1f}"


def fixed_line(e: Optional[Estimate]) -> str:
    """The named fixed terms per rank (their high end) and the allocator's fragmentation."""
    if e is None:
        return ""
    terms = ", ".join(f"{name} {value / MiB:,.0f} MiB" for name, value in e.terms.items())
    how = ", calibrated" if e.fragmentation_calibrated else ""
    frag = f"; allocator fragmentation x{e.fragmentation:.2f} (ZeRO-{e.zero}{how})" if e.fragmentation != 1 else ""
    return f"fixed per rank: {terms}{frag}"


def as_json(bench: BenchConfig, first: Optional[Estimate], rows: list[dict], ests: list[Estimate],
            at: list[dict], seq: Optional[dict] = None) -> str:
    """seq: what each config's max_seq_len was predicted at (micro, the grid's step and range)."""
    return json.dumps({"model": bench.model.name, "description": bench.to_dict()["model"],
                       "micro": bench.batch.micro, "grad_accum": bench.batch.grad_accum,
                       "num_params": num_params(bench.model), "active_params": active_params(bench.model),
                       "params_per_shard": bench.layout.tp_shard_params,
                       "tp": bench.parallel.tp, "dp": bench.parallel.dp,
                       **({"pp": bench.layout.pp, "pp_schedule": bench.parallel.pp_schedule, "vpp": bench.layout.vpp,
                           "world_size": bench.layout.world_size} if bench.layout.pp > 1 else {}),
                       **({"ep": bench.layout.ep, "params_per_rank": bench.layout.held_params}
                          if bench.layout.ep > 1 else {}),
                       "device": bench.hardware.device,
                       "precision": bench.precision, "capacity_bytes": first.capacity if first else None,
                       "overhead_bytes": first.overhead if first else None,
                       "calibration": first.calibration if first else None, "terms": first.terms if first else {},
                       **({"max_seq_len_at": seq} if seq else {}),
                       "configs": [{**r, "at_micro": {k: v for k, v in a.items() if k != "config"},
                                    "buffers_detail": e.prediction.buffers_detail(),
                                    "activations": e.prediction.activations,
                                    **({"zeropp_communication": zeropp.communication(bench)} if e.zeropp else {}),
                                    **({"stages": e.stage_rows()} if e.stages else {})}
                                   for r, e, a in zip(rows, ests, at)]}, indent=2)


def _gib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def _count(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "?"
    return "does not fit" if x == 0 else str(int(x))


def format_table(rows: list[dict]) -> str:
    import pandas as pd

    df = pd.DataFrame(rows)
    for k in GIB_COLUMNS:
        if k in df:  # the NVMe columns only where a row swaps to disk
            df[k] = df[k].map(_gib)
    df["act_per_sample"] = df["act_per_sample"].map(lambda x: f"{x / MiB:.1f}")
    for k in ("max_micro", "max_micro_low_overhead", "max_global_batch", "measured_max_micro"):
        if k in df:
            df[k] = df[k].map(_count)
    keep = [k for k in COLUMNS if k in df]
    return df[keep].rename(columns=COLUMNS).to_string(index=False)


def at_micro_table(at: list[dict], bench: BenchConfig, held: bool = False) -> str:
    """One line per configuration: the predicted peak at batch.micro and whether it fits. held: the
    gradients of the micro-batches before are in the peaks (_held)."""
    cols = AT_MICRO_COLUMNS[_kind(bench)]
    lines = [{"config": a["config"], **{name: _gib(a[k]) for k, name in cols.items()},
              "fits": "?" if a["fits"] is None else ("yes" if a["fits"] else "no")} for a in at]
    accum = (f"grad_accum {bench.batch.grad_accum}: the sharded gradients of the micro-batches before held" if
             held else f"grad_accum {bench.batch.grad_accum} does not change it")
    if bench.layout.pp > 1:
        accum = (f"grad_accum {bench.batch.grad_accum}: the pipeline's micro-batches, those in flight on a stage "
                 "held; the largest stage's")
    title = f"peak per rank at batch.micro={bench.batch.micro} ({accum}):"
    if not lines:
        return title
    import pandas as pd

    return title + "\n" + pd.DataFrame(lines).to_string(index=False)


def seq_micro_of(bench: BenchConfig, explicit: frozenset) -> int:
    """The micro-batch maxseq runs at: batch.micro where the user gave it, else 1 (long context
    trains one sequence per rank)."""
    return bench.batch.micro if "batch.micro" in explicit else 1


def grid_of(bench: BenchConfig, grid) -> dict:
    return {"granularity": grid.granularity, "min": grid.min, "max": seq_top(bench, grid)}


def seq_line(bench: BenchConfig, rows: list[dict], micro: int, grid) -> str:
    """The predicted longest sequence of each configuration shown, on maxseq's grid."""
    top = seq_top(bench, grid)
    learned = (f"; learned positions: up to their table, model.seq_len={bench.model.seq_len:,}"
               if top < grid.max else "")
    each = " | ".join(f"{r['config']} {_count(r['max_seq_len']) if not r['max_seq_len'] else format(r['max_seq_len'], ',')}"
                      + (f" (host RAM {r['max_seq_host_needed'] / GiB:,.0f} GiB per node)" if "max_seq_host_needed" in r else "")
                      for r in rows)
    return (f"max seq len at micro {micro} (predicted, multiples of {grid.granularity} from {grid.min:,} to "
            f"{top:,}{learned}): {each}")


def _kind(bench: BenchConfig) -> str:
    return "cpu" if bench.hardware.device == Device.cpu else "gpu"
