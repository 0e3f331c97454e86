"""Does sampling memory every 50 ms slow the trial? time/it with and without the sampler.

    python benchmarks/sampler_overhead.py [model=gpt-mini] [micro=4] [pairs=3]

Launches alternate (on, off, on, off, ...) so drift in the machine hits both; the figure is the
ratio of median time/it, sampler on / off (target: at most 1.02).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from zero_bench.config.schema import BenchConfig, HardwareConfig, ModelConfig, StepsConfig
from zero_bench.records import Entry
from zero_bench.trial.launch import LaunchOptions, run_launch

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    model = ModelConfig(**yaml.safe_load((ROOT / "conf/model" / f"{args.get('model', 'gpt-mini')}.yaml").read_text()))
    micro, pairs = int(args.get("micro", 4)), int(args.get("pairs", 3))
    cfg = BenchConfig(model=model, zero=2, precision="fp32", hardware=HardwareConfig(device="cpu"),
                      steps=StepsConfig(warmup=2, timed=10)).with_micro(micro)
    times: dict[str, list[float]] = {"on": [], "off": []}
    samples = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            for mode, interval in (("on", 0.05), ("off", 0.0)):
                (r,) = run_launch(cfg, [Entry(micro, "measure")], Path(tmp) / f"{mode}{i}",
                                  LaunchOptions(sample_interval=interval))
                assert r.status == "ok", r.reason
                # every timed step of every rank: the sampler would slow all of them
                times[mode] += [rk.time_per_step for rk in r.ranks]
                if mode == "on":
                    samples.append(sum(d.samples for d in r.devices))
                print(f"{mode:>3} #{i}: time/it {r.time_per_step_s * 1e3:.1f} ms", flush=True)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"\n{cfg.label()} micro={micro}: median time/it sampler on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, "
          f"ratio {on / off:.3f} (target <= 1.02); {statistics.mean(samples):.0f} samples per trial")


if __name__ == "__main__":
    main()
