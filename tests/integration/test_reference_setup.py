"""The reference table's setup on CPU, in real 2-rank trials (children of one pool): activation
recompute (none / selective / full, the last through DeepSpeed's activation checkpointing), the
megatron_deepspeed preset with partitioned, host-resident, contiguous checkpoints and ZeRO-3's
zero.Init, torch.compile, and the new keys in a report built from those trials. The figures measured
are in docs/verified.md."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from zero_bench.config.schema import HardwareConfig, ModelConfig
from zero_bench.estimate import activation_bytes_per_sample
from zero_bench.records import Entry
from zero_bench.store import Store
from zero_bench.trial.launch import LaunchOptions, run_launch

from conftest import compile_case, cpu_cfg, measured_once

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Layers dominate this model's activations (the logits are small), so recompute shows.
LAYERED = ModelConfig(name="GPT-layers", num_layers=8, hidden_size=128, num_heads=4, seq_len=256, vocab_size=1024,
                      pad_vocab_to=128)
MICROS = (2, 6)


@pytest.fixture(scope="module")
def by_mode(tmp_path_factory, pools):
    out = {}
    for mode in ("none", "selective", "full"):
        b = cpu_cfg(model=LAYERED, recompute=mode)
        out[mode] = run_launch(b, [Entry(m, "probe") for m in MICROS], tmp_path_factory.mktemp(mode),
                               LaunchOptions(pools=pools))
    return out


def per_sample(results) -> float:
    """Live tensor bytes one more sample adds (largest rank), from the launch's two sizes."""
    lo, hi = (max(rank.peak_live_bytes for rank in r.ranks) for r in results)
    return (hi - lo) / (MICROS[1] - MICROS[0])


def test_every_mode_runs_with_identical_losses(by_mode):
    for mode, results in by_mode.items():
        assert [r.status for r in results] == ["ok", "ok"], (mode, [r.reason for r in results])
    reference = [r.ranks[0].losses for r in by_mode["none"]]
    for mode in ("selective", "full"):
        # recompute changes memory, not math: first-step and later losses are bit-identical
        assert [r.ranks[0].losses for r in by_mode[mode]] == reference, mode


def test_recompute_lowers_memory_per_sample_as_the_formulas_say(by_mode):
    measured = {mode: per_sample(results) for mode, results in by_mode.items()}
    formula = {mode: activation_bytes_per_sample(LAYERED, 1, "fp32", mode, device="cpu")["total"] for mode in ("none", "selective", "full")}
    assert measured["full"] < measured["selective"] < measured["none"], measured
    for mode in ("selective", "full"):
        got, want = measured[mode] / measured["none"], formula[mode] / formula["none"]
        assert got == pytest.approx(want, rel=0.25), (mode, measured, formula)


@pytest.fixture(scope="module")
def preset(tmp_path_factory, pools):
    b = cpu_cfg(zero=3, offload=True, offload_param=True, precision="bf16", recompute="full",
                ds_preset="megatron_deepspeed", hardware=HardwareConfig(device="cpu", memory_gb=8))
    (r,) = run_launch(b, [Entry(2, "measure")], tmp_path_factory.mktemp("preset"), LaunchOptions(pools=pools))
    return r


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, pools):
    """test_compile.py's compiled ZeRO-2 trial (gpt-mini, micro 2): in a whole run, that module's
    launch (conftest.measured_once), not a second cold compile of another model."""
    (r,), _ = measured_once(compile_case(zero=2, compile=True), [Entry(2, "measure")],
                            tmp_path_factory.mktemp("compiled"), pools)
    return r


def test_megatron_deepspeed_preset_with_zero_init_and_host_checkpoints(preset):
    r = preset
    assert r.status == "ok", r.reason
    ck = r.ds_config["activation_checkpointing"]
    assert ck["partition_activations"] and ck["cpu_checkpointing"] and ck["contiguous_memory_optimization"]
    assert r.ds_config["zero_optimization"]["reduce_bucket_size"] == 50_000_000
    assert all(rank.zero_init for rank in r.ranks)  # parameters partitioned as the model was built
    assert r.loss_scale is None and r.skipped_steps == 0  # bf16: no loss scaling


def test_compile_time_is_reported_apart_from_time_per_step(compiled):
    r = compiled
    assert r.status == "ok", r.reason
    assert r.compile_s > 10 * r.time_per_step_s, (r.compile_s, r.time_per_step_s)


def test_new_keys_reach_the_report(by_mode, preset, compiled, tmp_path):
    """The trials above, stored as `zero_bench run` / a search stores them, reported by the CLI: each
    new key a Details column with the value each trial ran with (no launch of its own; the Hydra
    multirun of keys is tests/integration/test_sweep.py's)."""
    store = Store(tmp_path / "s.sqlite")
    for r in [*(t for results in by_mode.values() for t in results), preset, compiled]:
        store.add_trial(r)
    out = tmp_path / "r.xlsx"
    p = subprocess.run([sys.executable, "-m", "zero_bench", "report", f"store={store.path}", f"report.out={out}",
                        f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    details = pd.read_excel(out, sheet_name="Details")
    got = sorted(zip(details["recompute"], details["ds preset"], details["compile"]))
    assert got == [("full", "default", "No"), ("full", "megatron_deepspeed", "No"), ("none", "default", "No"),
                   ("none", "default", "Yes"), ("selective", "default", "No")], got
