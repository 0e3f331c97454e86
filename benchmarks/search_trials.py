"""How many trials, launches and seconds the default CPU max-batch search costs, per strategy.

    python benchmarks/search_trials.py [model=gpt-mini] [budget_gb=0.75]

Strategies on the same config (each with a fresh store):
  fit+estimate  the default: seeded by the analytic estimate, several sizes per launch
  fit           no estimate: doubling in one launch, then a prediction from measured memory per sample
  doubling      doubling in one launch, then bisection
  baseline      plain doubling + bisection, one launch per trial (what people do by hand)
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import yaml

from zero_bench.config import BenchConfig, HardwareConfig, ModelConfig
from zero_bench.estimate import seed_micro
from zero_bench.results import Store
from zero_bench.search import SearchSpec, run_search

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    model = ModelConfig(**yaml.safe_load((ROOT / "conf/model" / f"{args.get('model', 'gpt-mini')}.yaml").read_text()))
    cfg = BenchConfig(model=model, zero=2, precision="fp32",
                      hardware=HardwareConfig(device="cpu", memory_gb=float(args.get("budget_gb", 0.75))))
    strategies = {
        "fit+estimate": (SearchSpec(strategy="fit"), seed_micro(cfg)),
        "fit": (SearchSpec(strategy="fit"), None),
        "doubling": (SearchSpec(strategy="doubling"), None),
        "baseline": (SearchSpec(strategy="doubling", multi=False), None),
    }
    rows = []
    for name, (spec, seed) in strategies.items():
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            res = run_search(cfg, spec, Store(Path(tmp) / "s.sqlite"), Path(tmp) / "run", seed=seed,
                             progress=lambda s: print("   ", s, flush=True))
            rows.append((name, res.max_micro, res.first_fail_micro, res.trials, res.launches, time.time() - t0))
    print(f"\n{cfg.label()}, budget {cfg.hardware.memory_gb} GiB per rank")
    print(f"{'strategy':<14}{'max micro':>10}{'fails at':>10}{'trials':>8}{'launches':>10}{'wall s':>9}")
    for name, lo, hi, n, launches, wall in rows:
        print(f"{name:<14}{lo!s:>10}{hi!s:>10}{n:>8}{launches:>10}{wall:>9.0f}")


if __name__ == "__main__":
    main()
