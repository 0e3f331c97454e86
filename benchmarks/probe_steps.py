"""How many optimizer steps a memory probe needs before its peak is steady (`steps.probe`).

    python benchmarks/probe_steps.py [model=gpt-mini] [zero=2] [micro=8] [precision=fp32] [max_steps=4]

One fresh 2-rank launch per probe length (1..max_steps optimizer steps, then the profiled step);
prints each rank's peak RSS and live-tensor peak. Adam's state is allocated at the first
optimizer step, so one step is the least that counts it; the peak is steady from the length on
which adding a step no longer raises it. Run it alone on the machine.
"""
from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import yaml

from zero_bench.config.schema import BenchConfig, HardwareConfig, ModelConfig, StepsConfig
from zero_bench.records import Entry
from zero_bench.trial.launch import run_launch

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def main() -> None:
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    model = ModelConfig(**yaml.safe_load((ROOT / "conf/model" / f"{args.get('model', 'gpt-mini')}.yaml").read_text()))
    micro = int(args.get("micro", 8))
    cfg = BenchConfig(model=model, zero=int(args.get("zero", 2)), precision=args.get("precision", "fp32"),
                      hardware=HardwareConfig(device="cpu"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(1, int(args.get("max_steps", 4)) + 1):
            c = dataclasses.replace(cfg, steps=StepsConfig(probe=n)).with_micro(micro)
            (r,) = run_launch(c, [Entry(micro)], Path(tmp) / f"probe{n}")
            assert r.status == "ok", r.reason
            rss = max(x.peak_rss_bytes for x in r.ranks) / MiB
            live = max(x.peak_live_bytes for x in r.ranks) / MiB
            rows.append((n, rss, live))
            print(f"steps.probe={n}: peak RSS {rss:.1f} MiB, peak live tensors {live:.1f} MiB", flush=True)
    print(f"\n{cfg.label()} micro={micro}")
    for n, rss, live in rows:
        print(f"probe steps {n}: RSS {rss:8.1f} MiB ({rss - rows[-1][1]:+.1f} vs longest)  live {live:8.1f} MiB")


if __name__ == "__main__":
    main()
