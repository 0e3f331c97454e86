"""ZeRO-3 (DeepSpeed) beside FSDP2 (zero=3 and zero=2) on CPU: exact model states, peak RSS and peak
live tensor bytes per rank, with the estimate's prediction beside each.

    python benchmarks/fsdp2_vs_zero3.py [models=gpt-mini,gpt-small] [precisions=fp32,bf16] [micro=2]

2 ranks, gloo, one probe entry per trial (steps.probe optimizer steps, then the profiled step), every
trial a child forked from one pool (as a search runs them). Run it alone on the machine
(/work/tools/serial): RSS moves with the allocator's arenas, not with other processes, but the
machine lock keeps other zero_bench trials out anyway. Prints one markdown table (MiB, rank 0;
rank 1 within 1 MiB RSS) and the largest difference of the estimate from the measurements.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import yaml

from zero_bench.config.schema import BenchConfig, HardwareConfig, ModelConfig, StepsConfig
from zero_bench.estimate import estimate
from zero_bench.records import Entry
from zero_bench.trial.launch import LaunchOptions, run_launch
from zero_bench.trial.pool import PoolSlot
from zero_bench.units import MiB

ROOT = Path(__file__).resolve().parent.parent
ENGINES = {"ZeRO-3": dict(engine="deepspeed", zero=3), "FSDP2 zero=3": dict(engine="fsdp2", zero=3),
           "FSDP2 zero=2": dict(engine="fsdp2", zero=2)}


def config(model: str, precision: str, **kw) -> BenchConfig:
    m = ModelConfig(**yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text()))
    return BenchConfig(model=m, hardware=HardwareConfig(device="cpu"), precision=precision,
                       steps=StepsConfig(probe=1), timeout_s=900, **kw)


def states_mib(rank) -> float:
    """What persists between steps: parameters, master copy, optimizer states (gradients are freed)."""
    s = rank.model_states
    return (s["params"] + s["master"] + s["optimizer"] + s["grads"]) / MiB


def row(name: str, cfg: BenchConfig, micro: int, pools: PoolSlot, tmp: Path) -> tuple[str, float, float]:
    (res,) = run_launch(cfg, [Entry(micro)], tmp / f"{cfg.model.name}-{cfg.precision}-{name}".replace(" ", ""),
                        LaunchOptions(pools=pools))
    if res.status != "ok":
        return f"| {cfg.model.name} | {cfg.precision} | {name} | {res.status}: {res.reason[:80]} |", 0.0, 0.0
    r0 = res.ranks[0]
    e = estimate(cfg)
    pred_rss, pred_live = e.peak_bytes(micro), e.peak_bytes(micro) - e.overhead
    err_rss = (pred_rss - r0.peak_rss_bytes) / r0.peak_rss_bytes * 100
    err_live = (pred_live - r0.peak_live_bytes) / r0.peak_live_bytes * 100
    text = (f"| {cfg.model.name} | {cfg.precision} | {name} | {states_mib(r0):.1f} | {e.persistent / MiB:.1f} | "
            f"{r0.peak_rss_bytes / MiB:.0f} | {pred_rss / MiB:.0f} ({err_rss:+.1f} %) | "
            f"{r0.peak_live_bytes / MiB:.1f} | {pred_live / MiB:.1f} ({err_live:+.1f} %) | {r0.peak_phase} |")
    return text, err_rss, err_live


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    models = args.get("models", "gpt-mini,gpt-small").split(",")
    precisions = args.get("precisions", "fp32,bf16").split(",")
    micro = int(args.get("micro", 2))
    lines = [f"micro {micro}, DP=2 | states = params + master + optimizer (+ grads still held) after the step",
             "| model | precision | engine | states MiB | est. | peak RSS MiB | est. | peak live MiB | est. | phase |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    worst = [0.0, 0.0]
    with tempfile.TemporaryDirectory() as d, PoolSlot(Path(d) / "pool") as pools:
        for model in models:
            for precision in precisions:
                for name, kw in ENGINES.items():
                    text, e_rss, e_live = row(name, config(model, precision, **kw), micro, pools, Path(d))
                    print(text, flush=True)
                    lines.append(text)
                    if kw["engine"] == "fsdp2":
                        worst = [max(worst[0], abs(e_rss)), max(worst[1], abs(e_live))]
    print("\n".join(lines))
    print(f"FSDP2 estimate vs measured, largest |error|: peak RSS {worst[0]:.1f} %, peak live {worst[1]:.1f} %")


if __name__ == "__main__":
    main(sys.argv[1:])
