"""Shared helpers: tiny real configurations and a check that trials leave no process behind."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import psutil
import pytest
import yaml

from zero_bench.config import BenchConfig, HardwareConfig, ModelConfig, ParallelConfig, StepsConfig
from zero_bench.configure import resolve

CONF = Path(__file__).resolve().parent.parent / "conf"


def model(name: str) -> ModelConfig:
    return ModelConfig(**yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()))


def cpu_cfg(name: str = "gpt-tiny", **kw) -> BenchConfig:
    """A 2-rank CPU config, resolved as configure.from_cfg leaves it (its keys are the ones the
    search stores trials under); keyword arguments replace BenchConfig fields."""
    base = BenchConfig(model=model(name), hardware=HardwareConfig(device="cpu"), precision="fp32",
                       parallel=ParallelConfig(tp=1, dp=2), steps=StepsConfig(warmup=1, timed=2),
                       timeout_s=300)
    return resolve(dataclasses.replace(base, **kw), here=False)


def worker_processes(marker: str = "") -> list[psutil.Process]:
    """Launcher and rank processes (whose command line holds `marker`, e.g. the test's tmp dir)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if ("zero_bench.rank" in cmd or "deepspeed.launcher" in cmd) and marker in cmd:
            out.append(p)
    return out


@pytest.fixture
def no_leftovers(tmp_path):
    """Fails the test if any rank or launcher process of its trials (under tmp_path) outlives it,
    or if a launch left DeepSpeed's shared-memory buffers in /dev/shm (RAM, 66 MiB per rank)."""
    shm_before = set(Path("/dev/shm").glob("deepspeed_*"))
    yield tmp_path
    assert not set(Path("/dev/shm").glob("deepspeed_*")) - shm_before, "shm buffers left in /dev/shm"
    left = [p for p in worker_processes(str(tmp_path)) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left behind: {[' '.join(p.cmdline()) for p in left]}"
