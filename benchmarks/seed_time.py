"""Predicted against measured time/it on every row of the reference table that fits
(shared/seeds/zero_table_8xA100.md, 8 x A100-40GB, 2020's DeepSpeedExamples Megatron-LM GPT-2).

    python benchmarks/seed_time.py [path/to/zero_table_8xA100.md]

Each row is the configuration benchmarks/seed_table.py maps it to (+sweep=seed_grid: fp16,
recompute=full, ds_preset=megatron_deepspeed, a100_40gb, mp rows without sequence parallelism) at
micro = the row's max global batch / dp and grad_accum 1: the table's time/it (ms) is one optimizer
step over that global batch (its throughput column is exactly global batch / time/it). Timed: the
rows with a measured time/it whose configuration the estimate says fits at that micro (the predicted
device peak, high end of the GPU terms, within 40,537 MiB); the others are listed with the reason.
Predicted by zero_bench.estimate.time.predict_time with the a100_40gb preset's published rates
(devices/rates.py); nothing is fitted to this table. Per row: the predicted and measured time/it,
their ratio, the MFU of each (the table's: its time/it over the same model FLOPs), and the predicted
step by part. States no accuracy target and checks none: exits 0 whatever the ratios (1 only when
no row could be timed: a wrong or unreadable table).
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from seed_table import TABLE, Row, parse, predict

from zero_bench.estimate.time import TimePrediction

COMPUTE = ("forward", "backward", "recompute")  # the kernels: matmuls and memory-bound ops, re-run included
COMM = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "communication beyond compute")
HOST = ("optimizer step (host", "gradients device->host", "parameters host->device", "checkpoints", "NVMe")
PARTS = ("compute", "comm", "host", "other")


@dataclass(frozen=True)
class Summary:
    """What the ratios (predicted / measured time/it) of the timed rows add up to."""
    rows: int
    median: float
    low: float
    high: float
    within_15: int  # |ratio - 1| <= 0.15
    within_2x: int  # 0.5 <= ratio <= 2


def summarize(ratios: Sequence[float]) -> Summary:
    return Summary(len(ratios), statistics.median(ratios), min(ratios), max(ratios),
                   sum(abs(r - 1) <= 0.15 for r in ratios), sum(0.5 <= r <= 2 for r in ratios))


def part_of(name: str) -> str:
    """Which part of the step a term belongs to: comm first ("parameter all-gather (forward)" is no
    compute), else compute, host, or other (the device's optimizer step, the gradient norm, the
    assumed step overhead)."""
    if any(w in name for w in COMM):
        return "comm"
    return "compute" if name.startswith(COMPUTE) else "host" if name.startswith(HOST) else "other"


def breakdown(p: TimePrediction) -> dict[str, float]:
    """The exposed seconds of the step by part (they add up to step_s)."""
    out = dict.fromkeys(PARTS, 0.0)
    for t in p.terms:
        if t.exposed:
            out[part_of(t.name)] += t.seconds
    return out


def skipped(row: Row, est) -> Optional[str]:
    """Why a row is not timed (None: it is)."""
    if row.dp * row.mp != row.gpus:
        return f"dp x mp = {row.dp * row.mp} is not its {row.gpus} GPUs"
    if row.batch is None or row.time_ms is None:
        return "no measured time/it (the table: cannot initialize)"
    if not est.at_micro(row.batch // row.dp)["fits"]:
        return f"the estimate says micro {row.batch // row.dp} does not fit (max micro {est.max_micro()})"
    return None


HEADER = (f"{'row':31} {'micro':>5} {'pred ms':>8} {'table ms':>8} {'ratio':>5} {'MFU pred':>8} {'table':>5}  "
          f"{'compute':>7} {'comm':>6} {'host':>6} {'other':>5}")


def line(row: Row, p: TimePrediction) -> str:
    ratio = p.step_s * 1e3 / row.time_ms
    parts = "".join(f" {v * 1e3:{w}.0f}" for v, w in zip(breakdown(p).values(), (7, 6, 6, 5)))
    # the table's MFU: the same model FLOPs over its measured time = the predicted MFU x ratio
    mfu = f"{p.mfu:8.1%} {p.mfu * ratio:5.1%}" if p.mfu else f"{'-':>8} {'-':>5}"
    return f"{row.name:31} {p.micro:5d} {p.step_s * 1e3:8.0f} {row.time_ms:8.0f} {ratio:5.2f} {mfu} {parts}"


def main(path: Path = TABLE) -> int:
    ratios = []
    print(HEADER)
    for row in parse(path.read_text()):
        est = None if row.dp * row.mp != row.gpus else predict(row)
        why = skipped(row, est)
        if why:
            print(f"{row.name:31} not timed: {why}")
            continue
        p = est.time_at(row.batch // row.dp)
        ratios.append(p.step_s * 1e3 / row.time_ms)
        print(line(row, p))
    if not ratios:
        print(f"no row of {path} could be timed")
        return 1
    s = summarize(ratios)
    print(f"seed table time/it, predicted / measured on {s.rows} rows: median {s.median:.2f}, range "
          f"{s.low:.2f}-{s.high:.2f}; within 15 %: {s.within_15}/{s.rows}, within 2x: {s.within_2x}/{s.rows} "
          "(no accuracy stated or checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else TABLE))
