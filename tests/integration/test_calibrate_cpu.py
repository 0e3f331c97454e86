"""`zero_bench calibrate` on CPU for real: one 2-rank gpt-tiny launch writes this machine's entry to
the cache, and `zero_bench estimate` then sizes with it and says so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_bench.units import GiB, MiB

pytestmark = pytest.mark.slow


def zero_bench(tmp: Path, *args: str) -> str:
    env = {**os.environ, "ZERO_BENCH_CACHE": str(tmp / "cache")}  # the session's cache stays uncalibrated
    done = subprocess.run([sys.executable, "-m", "zero_bench", *args, f"hydra.run.dir={tmp / 'run'}"], cwd=tmp,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_calibrate_on_cpu_then_the_estimate_uses_it(tmp_path):
    out = zero_bench(tmp_path, "calibrate", "hardware=cpu", "parallel=dp2")
    (entry,) = json.loads((tmp_path / "cache" / "calibration.json").read_text()).values()
    assert entry["kind"] == "cpu" and entry["model"] == "GPT-tiny" and entry["dp"] == 2
    for k in ("runtime_bytes", "overhead_bytes"):  # what a rank's RSS is, before and besides its tensors
        assert 200 * MiB < entry[k] < 2 * GiB, (k, entry[k] / MiB)
    assert set(entry["matmul_flops"]) == {"fp32", "bf16"} and min(entry["matmul_flops"].values()) > 0
    # the time estimate's CPU rates (devices/rate_probes.py): an fp32 add's bytes/s, DeepSpeedCPUAdam's params/s
    assert 1e8 < entry["memory_bytes_per_s"] < 1e12 and entry["cpu_adam_params_per_s"] > 1e6
    assert "memory bandwidth" in out and "CPU Adam" in out
    # the launch's timed entry: the engine's time per step beyond its kernel terms (estimate/time/engine.py)
    (pt,) = entry["engine_points"]
    assert pt["key"] == f"deepspeed zero {entry['zero']}" and pt["model"] == "GPT-tiny" and pt["tensors"] > 0
    assert 0 < pt["kernels_s"] and 0 < pt["measured_s"] < 60 and "engine beyond kernels" in out
    said = f"calibrated on {entry['device']}, {entry['date'][:10]}"
    assert "runtime before the model" in out and said in out

    head, _, fixed, *_ = zero_bench(tmp_path, "estimate", "hardware=cpu", "zero=2").splitlines()
    assert head.endswith(f"fixed terms: {said}")
    assert fixed == f"fixed per rank: runtime (calibrated) {entry['overhead_bytes'] / MiB:,.0f} MiB"
    doc = json.loads(zero_bench(tmp_path, "estimate", "hardware=cpu", "zero=2", "offload=true", "json=true"))
    terms = {t["name"]: t for t in doc["configs"][0]["time"]["at_micro"]["terms"]}
    # on CPU DeepSpeed steps torch's AdamW (ds_configs/cpu.json): calibrate's rank probe measured it
    assert said in terms["forward memory-bound ops"]["source"] and said in terms["optimizer step (host, torch AdamW)"]["source"]
    assert "measured on GPT-tiny" in terms["engine overhead"]["source"] and "step overhead" not in terms
