"""The traced prediction (zero_bench/estimate/traced.py) and the formula against live peaks measured on
CPU, and the trace's time on Llama-3-8B.

    python benchmarks/traced_vs_measured.py            # the measured configurations (~2 minutes); exit 1 on a miss
    python benchmarks/traced_vs_measured.py measure    # re-measure the llama-tiny rows: 9 real trials, one at a time
    python benchmarks/traced_vs_measured.py llama3-8b  # Llama-3-8B, FSDP2 zero=3, dp 8, H100 80GB

No launch but `measure`: every figure is traced in this process under FakeTensorMode with a fake
process group. The measured live peaks (rank 0, 2 ranks, gloo, the worker's profiled step: live
tensors before it plus the largest net allocation during it) are read from
tests/data/measured/fsdp2_live_peaks.json, each set with its machine, date, command and versions:
- GPT-tiny / mini / small, fp32 / bf16, zero 3 / 2, micro 2 / 4: issue 29's prototype (as recorded);
- llama-tiny, micro 2 (zero=3, zero=2, recompute=full, bf16): zero_bench trials, written by `measure`
  (run_launch, one launch per configuration, under the machine lock); grad_accum 2, recompute=block
  and the bf16 losses (and recompute=full again): issue 51's trials, a set of their own.
The accuracy stated (TRACE_WITHIN, FORMULA_WITHIN, KNOWN_MISSES, RUN_TO_RUN) is checked on every run: a
configuration outside it, or a known miss that no longer misses, exits 1.
qwen3-tiny and gpt-mini at other settings are traced beside the formula only (no FSDP2 live peak
of theirs is stored); moe-tiny is refused (a mixture of experts: data-dependent shapes).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from zero_bench.config.configure import compose, from_cfg
from zero_bench.estimate import estimate
from zero_bench.estimate.traced import compare, trace, warnings
from zero_bench.errors import ConfigError
from zero_bench.units import MiB

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from measured import LIVE_PEAKS, live_peaks  # noqa: E402

TRACE_WITHIN = 3.0  # % of the measured live peak, every stored configuration but KNOWN_MISSES
# the formula, every stored configuration (tests/unit/test_fsdp2.py's tolerances: GPT-tiny/mini within
# 0.1 %, GPT-small -4.0 to +0.2 %, llama-tiny -3.5 to +0.4 % but for RUN_TO_RUN's rows; before issue 51
# bf16 was +12.6 %: the logits counted at backward's start, docs/engines.md)
FORMULA_WITHIN = {"fp32": 4.5, "bf16": 4.5}
# (model, overrides) -> why the trace misses by more than TRACE_WITHIN; each must still miss (else the
# statement is stale). None today: llama-tiny recompute=full was one (-5.3 %) while its "measurement"
# was rebuilt from the formula (docs/estimate.md, "Against what was measured")
KNOWN_MISSES: dict = {}
# (model, overrides) -> (%, why): configurations whose measured peak moves from run to run by more than
# TRACE_WITHIN; both the trace and the formula are held to this instead, for every stored run of them
RUN_TO_RUN = {("llama-tiny", ("zero=3", "precision=fp32", "recompute=full")):
              (5.5, "48.67 and 51.36 MiB in two runs: one fp32 layer, gloo's second all-gather buffer"),
              **{("llama-tiny", ("zero=%d" % z, "precision=fp32", "batch.grad_accum=2")):
                 (4.5, "one fp32 layer more or less from run to run: 62.37 and 65.06 MiB at micro 1 in two runs "
                       "of test_estimate_vs_measured (docs/estimate.md)") for z in (3, 2)}}
# llama-tiny, micro 2: the configurations `measure` runs
LLAMA_TINY = [("zero=3", "precision=fp32"), ("zero=2", "precision=fp32"),
              ("zero=3", "precision=fp32", "recompute=full"), ("zero=3", "precision=bf16"),
              ("zero=3", "precision=fp32", "batch.grad_accum=2"), ("zero=2", "precision=fp32", "batch.grad_accum=2"),
              ("zero=3", "precision=fp32", "recompute=block", "recompute_layers=2"),
              ("zero=3", "precision=bf16", "loss=chunked"), ("zero=3", "precision=bf16", "loss=fp32")]
# traced beside the formula only
UNMEASURED = [("qwen3-tiny", ("zero=3", "precision=fp32")), ("qwen3-tiny", ("zero=3", "precision=bf16")),
              ("llama-tiny", ("zero=3", "precision=fp32", "recompute=op")),
              ("llama-tiny", ("zero=3", "precision=fp32", "parallel.tp=2", "parallel.dp=1")),
              ("llama-tiny", ("zero=3", "precision=bf16", "states=bf16")),
              ("llama-tiny", ("zero=3", "precision=fp32", "batch.grad_accum=2")),
              ("moe-tiny", ("zero=3", "precision=fp32"))]


def bench(name: str, *overrides: str):
    return from_cfg(compose(["hardware=cpu", f"model={name}", "engine=fsdp2", "parallel.dp=2", *overrides]))


def line(b, micro: int, measured) -> tuple:
    t = trace(b, micro)
    e = estimate(b)
    formula = e.allocated_bytes(micro) / MiB
    traced = t.peak_bytes / MiB
    err = lambda x: "" if measured is None else f"{(x - measured) / measured * 100:+6.1f}"  # noqa: E731
    print(f"{b.label():42s} {micro:5d} {'-' if measured is None else f'{measured:9.2f}':>9s} {formula:9.2f} "
          f"{err(formula):>7s} {traced:9.2f} {err(traced):>7s}  {t.phase:15s} {t.seconds:5.1f}", flush=True)
    for w in warnings(b.label(), compare(e, t), t.peak_bytes):
        print("   ", w)
    return None if measured is None else ((traced - measured) / measured * 100, (formula - measured) / measured * 100)


def misses(model: str, overrides: tuple, precision: str, trace_err: float, formula_err: float) -> list[str]:
    """What of the stated accuracy this configuration breaks (empty: it holds)."""
    out, known = [], (model, overrides) in KNOWN_MISSES
    wider = RUN_TO_RUN.get((model, overrides), (0.0, ""))[0]
    trace_within, formula_within = max(TRACE_WITHIN, wider), max(FORMULA_WITHIN[precision], wider)
    if known and abs(trace_err) <= trace_within:
        out.append(f"trace {trace_err:+.1f} %: listed as a known miss ({KNOWN_MISSES[(model, overrides)]}) "
                   f"but within {trace_within} % now")
    if not known and abs(trace_err) > trace_within:
        out.append(f"trace {trace_err:+.1f} %, stated within {trace_within} %")
    if abs(formula_err) > formula_within:
        out.append(f"formula {formula_err:+.1f} %, stated within {formula_within} %")
    return [f"{model} {' '.join(overrides)}: {m}" for m in out]


def measured_table() -> int:
    """The table; the number of broken statements (0: the stated accuracy holds)."""
    print(f"{'configuration':42s} {'micro':>5s} {'measured':>9s} {'formula':>9s} {'err %':>7s} {'traced':>9s} "
          f"{'err %':>7s}  {'traced phase':15s} {'s':>5s}   (MiB of live tensors, rank 0)")
    errs, broken = [], []
    for p in live_peaks():
        trace_err, formula_err = line(bench(p.model, *p.overrides), p.micro, p.mib)
        errs.append(trace_err)
        precision = dict(o.split("=", 1) for o in p.overrides)["precision"]
        broken += misses(p.model, p.overrides, precision, trace_err, formula_err)
    print(f"traced vs measured: {len(errs)} configurations, worst {max(errs, key=abs):+.1f} %, "
          f"{sum(abs(e) <= TRACE_WITHIN for e in errs)} within {TRACE_WITHIN} % (source: {LIVE_PEAKS.name})")
    for name, overrides in UNMEASURED:
        try:
            line(bench(name, *overrides), 2, None)
        except ConfigError as exc:
            print(f"{name} {' '.join(overrides)}: {exc}")
    for b in broken:
        print("NOT AS STATED:", b)
    return len(broken)


def measure() -> None:
    """The llama-tiny rows, measured again: one real trial per configuration (2 gloo ranks, micro 2,
    the worker's profiled step), one at a time under the machine lock; written as a set of their own
    with where and how."""
    import deepspeed
    import megatron.core
    import torch

    from zero_bench.records import Entry
    from zero_bench.trial.launch import run_launch
    from zero_bench.trial.machine import machine_lock

    rows = []
    with machine_lock(wait=True):  # the four back to back, no other zero_bench's trials between them
        for overrides in LLAMA_TINY:
            cfg = bench("llama-tiny", *overrides)
            with tempfile.TemporaryDirectory(prefix="zb-tvm-") as tmp:
                (res,) = run_launch(cfg, [Entry(2, "measure")], Path(tmp))
            if res.status != "ok":
                raise SystemExit(f"llama-tiny {' '.join(overrides)}: {res.status} ({res.reason})")
            live = [r.peak_live_bytes for r in sorted(res.ranks, key=lambda r: r.rank)]
            print(f"llama-tiny {' '.join(overrides)}: rank 0 {live[0] / MiB:.2f} MiB, rank 1 {live[1] / MiB:.2f}",
                  flush=True)
            rows.append({"model": "llama-tiny", "overrides": list(overrides), "micro": 2, "peak_live_bytes": live})
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    doc = json.loads(LIVE_PEAKS.read_text())
    doc["sets"] = [s for s in doc["sets"] if s["name"] != "llama-tiny trials"] + [{
        "name": "llama-tiny trials",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu}, {os.cpu_count()} cores, {platform.node() or 'unnamed'}",
        "command": "python benchmarks/traced_vs_measured.py measure (run_launch, Entry(2, 'measure'), one launch each)",
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                     "megatron-core": megatron.core.__version__, "python": platform.python_version()},
        "precision": "bytes, [rank 0, rank 1]; the comparison reads rank 0",
        "rows": rows}]
    LIVE_PEAKS.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"written: {LIVE_PEAKS}")


def llama3_8b() -> None:
    t0 = time.perf_counter()
    b = from_cfg(compose(["model=llama3-8b", "engine=fsdp2", "zero=3", "parallel=dp8", "hardware=h100_80gb"]),
                 here=False)
    t = trace(b)
    e = estimate(b)
    print(f"{b.label()} micro {t.micro}: traced {t.peak_bytes / 2**30:.2f} GiB of tensors per rank in the "
          f"{t.phase}, the formula {e.allocated_bytes(t.micro) / 2**30:.2f} GiB; trace {t.seconds:.1f} s, "
          f"{time.perf_counter() - t0:.1f} s with the configuration")
    for term in compare(e, t):
        print(f"  {term.name:28s} formula {term.formula / 2**30:8.2f} GiB  traced {term.traced / 2**30:8.2f} GiB")
    for w in warnings(b.label(), compare(e, t), t.peak_bytes):
        print("  ", w)


if __name__ == "__main__":
    if sys.argv[1:] == ["llama3-8b"]:
        llama3_8b()
    elif sys.argv[1:] == ["measure"]:
        measure()
    else:
        sys.exit(1 if measured_table() else 0)
