"""What a trial costs before its first step: a forked child of a search's pool, a launch of its own,
and a bare deepspeed launch of a script that only initializes the process group.

    python benchmarks/launch_cost.py [pairs=3]

gpt-tiny, 2 ranks on CPU, fp32 ZeRO-2, micro 1 (run it alone on the machine). Per pair, in turn:
a bare `deepspeed --num_gpus 2` launch of an init-only script (init_distributed + a barrier,
timed from start to exit), a trial in a fresh launch, and a trial forked from a pool that has
already served its first trial (the search's first trial pays for the pool's launch and is not
counted). A trial's fixed cost runs from the runner's request (the run_launch call) to the first
forward pass on rank 0 (its phase marks). Medians are printed; the last line:
`per-trial fixed cost: X s, bare deepspeed launch: Y s, ratio X/Y`.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from zero_bench.config.schema import BenchConfig, HardwareConfig, ModelConfig, StepsConfig
from zero_bench.records import Entry
from zero_bench.trial.launch import LaunchOptions, run_launch
from zero_bench.trial.launcher import free_port
from zero_bench.trial.pool import PoolSlot

ROOT = Path(__file__).resolve().parent.parent
INIT_ONLY = """import deepspeed, torch
deepspeed.init_distributed()
torch.distributed.barrier()
"""


def bare_launch(tmp: Path) -> float:
    script = tmp / "init_only.py"
    script.write_text(INIT_ONLY)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(free_port()),
                    "--num_gpus", "2", str(script)], env=env, check=True, capture_output=True, cwd=tmp)
    return time.time() - t0


def first_step(run_dir: Path) -> float:
    """When rank 0 began its first forward pass (unix time, from its phase marks)."""
    for line in (run_dir / "rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for t, phase in rec.get("marks") or []:
            if phase == "forward":
                return t
    raise RuntimeError(f"no step in {run_dir}")


def trial_cost(cfg: BenchConfig, run_dir: Path, pools=None) -> float:
    t0 = time.time()
    (r,) = run_launch(cfg, [Entry(1, "measure")], run_dir, LaunchOptions(pools=pools))
    if r.status != "ok":
        raise RuntimeError(f"{run_dir}: {r.status} {r.reason}")
    return first_step(run_dir) - t0


def main() -> None:
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    pairs = int(args.get("pairs", 3))
    model = ModelConfig(**yaml.safe_load((ROOT / "conf/model/gpt-tiny.yaml").read_text()))
    cfg = BenchConfig(model=model, zero=2, precision="fp32", hardware=HardwareConfig(device="cpu"),
                      steps=StepsConfig(warmup=1, timed=1)).with_micro(1)
    bare, fresh, forked = [], [], []
    with tempfile.TemporaryDirectory() as tmp, PoolSlot(Path(tmp) / "pool") as pools:
        tmp = Path(tmp)
        first = trial_cost(cfg, tmp / "first", pools)
        print(f"first pooled trial (starts the pool, not counted): {first:.1f} s", flush=True)
        for i in range(pairs):
            bare.append(bare_launch(tmp))
            fresh.append(trial_cost(cfg, tmp / f"fresh{i}"))
            forked.append(trial_cost(cfg, tmp / f"forked{i}", pools))
            print(f"pair {i + 1}: bare launch {bare[-1]:.1f} s, fresh launch to first step {fresh[-1]:.1f} s, "
                  f"forked child to first step {forked[-1]:.1f} s", flush=True)
    x, y, z = statistics.median(forked), statistics.median(bare), statistics.median(fresh)
    print(f"medians of {pairs}: a launch of its own to first step {z:.2f} s (ratio {z / y:.2f})")
    print(f"per-trial fixed cost: {x:.2f} s, bare deepspeed launch: {y:.2f} s, ratio {x / y:.2f}")


if __name__ == "__main__":
    main()
