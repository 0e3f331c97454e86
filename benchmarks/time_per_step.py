"""Does the reported time/it agree with the wall clock? Two independent timings of the same steps.

    python benchmarks/time_per_step.py [model=gpt-mini] [micro=4] [extra=20] [pairs=3]

1. Within one trial: the wall clock between rank 0's step records (written after each step, outside
   the timed region, so they include everything between two steps) against the median step time
   the trial reports as time/it.
2. Across trials: pairs of trials forked from one pool (a ~1 s start that varies little, where a
   launch of its own varies by seconds), steps.timed = 2 and 2 + extra, alternating; the extra
   steps' wall time is the difference of the trials' durations, divided by `extra`.
Run it alone on the machine; it prints each figure and the ratio to time/it.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from zero_bench.config.schema import BenchConfig, HardwareConfig, ModelConfig, StepsConfig
from zero_bench.records import Entry, Mode
from zero_bench.trial.launch import LaunchOptions, run_launch
from zero_bench.trial.pool import PoolSlot

ROOT = Path(__file__).resolve().parent.parent


def step_gaps(run_dir: Path) -> list[float]:
    """Seconds between rank 0's consecutive step records (the first step, which allocates, left out)."""
    recs = [json.loads(x) for x in (run_dir / "rank0.jsonl").read_text().splitlines()]
    times = [r["time"] for r in recs if r["event"] == "step"][1:]
    return [b - a for a, b in zip(times, times[1:])]


def trial(cfg: BenchConfig, micro: int, timed: int, run_dir: Path, pools: PoolSlot):
    c = cfg.with_micro(micro)
    c = BenchConfig(**{**c.__dict__, "steps": StepsConfig(warmup=1, timed=timed)})
    (res,) = run_launch(c, [Entry(micro, Mode.MEASURE)], run_dir, LaunchOptions(pools=pools))
    assert res.status == "ok", res.reason
    return res


def main() -> None:
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    model = ModelConfig(**yaml.safe_load((ROOT / "conf/model" / f"{args.get('model', 'gpt-mini')}.yaml").read_text()))
    micro, extra, pairs = int(args.get("micro", 4)), int(args.get("extra", 20)), int(args.get("pairs", 3))
    cfg = BenchConfig(model=model, zero=2, precision=args.get("precision", "fp32"), hardware=HardwareConfig(device="cpu"))
    with tempfile.TemporaryDirectory() as tmp, PoolSlot(Path(tmp) / "pool") as pools:
        trial(cfg, micro, 2, Path(tmp) / "warm", pools)  # the pool's start is no trial's
        rows = []
        for i in range(pairs):
            short = trial(cfg, micro, 2, Path(tmp) / f"short{i}", pools)
            long = trial(cfg, micro, 2 + extra, Path(tmp) / f"long{i}", pools)
            gaps = step_gaps(Path(long.run_dir))
            rows.append((long.time_per_step_s, statistics.mean(gaps), (long.duration_s - short.duration_s) / extra))
    print(f"{cfg.label()} micro {micro}: time/it (median of timed steps) against two wall clocks, {extra} extra steps")
    print(f"{'time/it s':>10}{'step gaps s':>13}{'ratio':>7}{'extra steps s':>15}{'ratio':>7}")
    for tps, gap, per_extra in rows:
        print(f"{tps:>10.3f}{gap:>13.3f}{gap / tps:>7.3f}{per_extra:>15.3f}{per_extra / tps:>7.3f}")


if __name__ == "__main__":
    main()
