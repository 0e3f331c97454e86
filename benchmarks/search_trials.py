"""What the default CPU max-batch search costs and answers, per strategy: trials, launches, wall time.

    python benchmarks/search_trials.py [model=gpt-mini] [budget_gb=0.75] [zero=2] [precision=fp32]
                                      [strategies=default,fit,doubling,baseline]
    python benchmarks/search_trials.py model=gpt-zero-demo budget_gb=0.95 zero=0 precision=auto strategies=default

Strategies on the same config (each with a fresh store; run it alone on the machine):
  default    seeded by the analytic estimate, several sizes per launch to bracket, then the
             boundary decided in fresh launches (what `zero_bench maxbatch` does)
  fit        no estimate: doubling in one launch, then a prediction from measured memory per sample
  doubling   doubling in one launch, then bisection
  baseline   plain doubling + bisection, one size per launch (what people do by hand)
Every strategy ends on the same rule (b fits and b + 1 fails, both fresh), so every row must show
the same answer; the last line prints the default's figures.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import yaml

from zero_bench.config.configure import resolve
from zero_bench.config.schema import BenchConfig, HardwareConfig, ModelConfig, SearchConfig
from zero_bench.estimate import seed_micro
from zero_bench.search.maxbatch import SearchOptions, run_search
from zero_bench.store import Store

ROOT = Path(__file__).resolve().parent.parent


def strategies(cfg: BenchConfig) -> dict:
    return {"default": (SearchConfig(strategy="fit"), seed_micro(cfg)),
            "fit": (SearchConfig(strategy="fit"), None),
            "doubling": (SearchConfig(strategy="doubling"), None),
            "baseline": (SearchConfig(strategy="doubling", multi=False), None)}


def main() -> None:
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    model = ModelConfig(**yaml.safe_load((ROOT / "conf/model" / f"{args.get('model', 'gpt-mini')}.yaml").read_text()))
    cfg = resolve(BenchConfig(model=model, zero=int(args.get("zero", 2)), precision=args.get("precision", "fp32"),
                              hardware=HardwareConfig(device="cpu", memory_gb=float(args.get("budget_gb", 0.75)))))
    chosen = args.get("strategies", "default,fit,doubling,baseline").split(",")
    rows = []
    for name, (spec, seed) in strategies(cfg).items():
        if name not in chosen:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            res = run_search(cfg, spec, Store(Path(tmp) / "s.sqlite"), Path(tmp) / "run",
                             SearchOptions(seed=seed, progress=lambda s: print("   ", s, flush=True)))
            rows.append((name, res.max_micro, res.first_fail_micro, res.trials, res.launches, time.time() - t0))
    print(f"\n{cfg.label()}, budget {cfg.hardware.memory_gb} GiB per rank")
    print(f"{'strategy':<12}{'max micro':>10}{'fails at':>10}{'trials':>8}{'fresh trials':>14}{'wall s':>9}")
    for name, lo, hi, n, launches, wall in rows:
        print(f"{name:<12}{lo!s:>10}{hi!s:>10}{n:>8}{launches:>14}{wall:>9.0f}")
    name, lo, hi, n, launches, wall = rows[0]
    print(f"{name} search: max micro {lo}, fails at {hi}, {n} trials, {launches} fresh trials (launches), {wall:.0f} s")


if __name__ == "__main__":
    main()
