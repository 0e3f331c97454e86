"""Real 2-rank DeepSpeed trials on CPU: every ZeRO stage, offload, TP=2 and bf16's peaks (children of
one pool), and failures (launches of their own)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from zero_bench.config.schema import ParallelConfig
from zero_bench.records import Entry, Fault
from zero_bench.trial.launch import LaunchOptions, run_launch

from conftest import cpu_cfg, measured_once, model
from zero_bench.models.params import num_params, params_per_shard

pytestmark = pytest.mark.slow

VARIANTS = {
    "zero0": dict(zero=0),
    "zero1": dict(zero=1),
    "zero2": dict(zero=2),
    "zero3": dict(zero=3),
    "zero2_offload": dict(zero=2, offload=True),
    "zero3_offload": dict(zero=3, offload=True, offload_param=True),
    "tp2": dict(zero=1, parallel=ParallelConfig(tp=2, dp=1)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pools):
    """One measured trial per variant (gpt-tiny, fp32, micro 2), each a child of the module's pool."""
    out = {}
    for name, kw in VARIANTS.items():
        cfg = cpu_cfg(**kw)
        (res,), run_dir = measured_once(cfg, [Entry(2, "measure")], tmp_path_factory.mktemp(name), pools)
        out[name] = (cfg, res, run_dir)
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_runs_and_reports(runs, name):
    cfg, res, run_dir = runs[name]
    assert res.status == "ok", res.reason
    assert math.isfinite(res.loss)
    assert res.time_per_step_s > 0 and res.samples_per_s > 0
    assert res.global_batch == 2 * cfg.parallel.dp
    for f in ("ds_config.json", "cmd.txt", "stdout.log", "stderr.log", "memory_timeline.csv"):
        assert (run_dir / f).exists(), f
    ranks = sorted(run_dir.glob("rank*.jsonl"))
    assert len(ranks) == cfg.parallel.world_size == len(res.ranks)
    # the process before its model: imports and the process group, a good part of the peak
    assert all(100 * 2**20 < r.runtime_bytes < r.peak_rss_bytes for r in res.ranks), [r.runtime_bytes for r in res.ranks]
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == cfg.zero
    assert ("offload_optimizer" in ds["zero_optimization"]) == cfg.offload
    assert ("offload_param" in ds["zero_optimization"]) == cfg.offload_param
    # ... and DeepSpeed's own ZeRO optimizer enacted it (its flags, not our config read back)
    want = {"optimizer": cfg.offload, "params": cfg.offload_param}
    assert [r.offloaded for r in res.ranks] == [want] * len(res.ranks)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parameter_count_matches_formula(runs, name):
    cfg, res, _ = runs[name]
    local = [r.model_states["numel_local"] for r in res.ranks]
    if cfg.zero == 3:  # each rank holds a partition (the last one padded)
        assert sum(local) == pytest.approx(num_params(cfg.model), abs=cfg.parallel.dp)
    else:
        assert local == [params_per_shard(cfg.model, cfg.parallel.tp)] * len(local)


def test_model_state_bytes_fall_as_stage_rises(runs):
    """Exact per-rank tensor counts: ZeRO-1 partitions optimizer states, ZeRO-3 the parameters too."""
    total = {z: sum(v for k, v in runs[f"zero{z}"][1].ranks[0].model_states.items() if k != "numel_local")
             for z in range(4)}
    p = num_params(runs["zero0"][0].model)
    assert total[0] > total[1] >= total[2] > total[3]
    # fp32 in DeepSpeed: ZeRO-0 = params 4P + Adam moments 8P (the optimizer updates the params
    # in place); ZeRO-1/2 = params 4P + an fp32 master partition 4P/dp + moments 8P/dp;
    # ZeRO-3 = parameter partition 4P/dp + its fp32 master copy 4P/dp + moments 8P/dp.
    dp = runs["zero0"][0].parallel.dp
    assert total[0] == pytest.approx(12 * p, rel=0.01)
    assert total[1] == pytest.approx(4 * p + 12 * p / dp, rel=0.01)
    assert total[3] == pytest.approx(16 * p / dp, rel=0.01)


def step_losses(run_dir, rank: int = 0) -> list[float]:
    """Every optimizer step's loss of the measured entry: warm-up, timed, then the profiled step."""
    recs = [json.loads(line) for line in (run_dir / f"rank{rank}.jsonl").read_text().splitlines()]
    return next(r for r in recs if r.get("event") == "end")["losses"]


def test_every_rank_records_every_steps_loss(runs):
    """warm-up + timed + the profiled step, on every rank: losses[k] is computed after k updates, so
    the comparisons below cover at least three optimizer updates."""
    for name, (cfg, _, run_dir) in runs.items():
        want = cfg.steps.warmup + cfg.steps.timed + 1
        assert want >= 4, "fewer than three updates would be compared"
        per_rank = [step_losses(run_dir, r) for r in range(cfg.parallel.world_size)]
        assert all(len(x) == want for x in per_rank), (name, per_rank)
        assert all(x == per_rank[0] for x in per_rank), (name, per_rank)  # same tokens on every rank


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "tp2", "zero2_offload", "zero3_offload"])
def test_fp32_losses_equal_zero0_at_every_step(runs, name):
    """With dropout off and the same tokens, ZeRO, offload and TP change where tensors live, not the
    math: every step's loss, so every partitioned update (optimizer step, gradient reduction, the
    parameter all-gather) is checked, not only the first forward pass. Measured (2026-11-23): every
    variant within 1.4e-7 relative of ZeRO-0 at every step; with ZeRO-2's optimizer step skipped on
    partition 1 (DeepSpeed patched locally, not committed) zero2 and zero2_offload were 1.1e-4 off
    from the second step on, while the first-step check this replaced still passed. 1e-5 lies between."""
    want, got = step_losses(runs["zero0"][2]), step_losses(runs[name][2])
    assert len(got) == len(want)
    assert got == pytest.approx(want, rel=1e-5, abs=0), list(zip(want, got))


# gpt-small's parameters (~69M: what ZeRO-1's saving is made of, and what makes it show above a rank's
# ~410 MiB fixed RSS) at 16 tokens per sample instead of 128: a step's bf16 matmuls, 5x to 35x slower
# than fp32 on a CPU without native bf16, scale with the tokens; the model states compared here do not.
BF16_MODEL = dataclasses.replace(model("gpt-small"), seq_len=16)


def test_bf16_zero1_peak_memory_below_zero0(tmp_path, pools):
    """gpt-small's ~69M params in bf16 at DP=2: ZeRO-1 drops half of the 12 bytes/param of fp32
    master + Adam moments (6P ~ 400 MiB), which must show in both RSS and live tensor peaks.
    Each stage a fresh child of the module's pool (peaks as in a launch of its own)."""
    peaks = {}
    for z in (0, 1):
        cfg = cpu_cfg(model=BF16_MODEL, zero=z, precision="bf16")
        (res,) = run_launch(cfg, [Entry(1, "probe")], tmp_path / f"z{z}", LaunchOptions(pools=pools))
        assert res.status == "ok", res.reason
        peaks[z] = (max(r.peak_rss_bytes for r in res.ranks), max(r.peak_live_bytes for r in res.ranks))
    p = num_params(cfg.model)
    rss_saved, live_saved = peaks[0][0] - peaks[1][0], peaks[0][1] - peaks[1][1]
    assert peaks[1][0] < 0.85 * peaks[0][0]
    # Paper: 12P/2 saved. DeepSpeed's bf16 ZeRO-0 also keeps full fp32 gradient accumulators that
    # ZeRO-1 holds only for its partition (+4P/2), so the saving lies between 6P and 8P bytes.
    assert 0.9 * 6 * p <= live_saved <= 1.1 * 8 * p, (live_saved / p)
    assert rss_saved >= 0.9 * 6 * p


def test_rank_exception_is_an_error_and_leaves_nothing(no_leftovers):
    res = run_launch(cpu_cfg(), [Entry(1), Entry(2)], no_leftovers / "raise",
                     LaunchOptions(fault=Fault(kind="raise", rank=1, min_micro=2)))
    assert [r.status for r in res] == ["ok", "error"]
    assert "injected fault on rank 1" in res[1].reason


def test_killed_rank_is_oom_and_earlier_entries_are_kept(no_leftovers):
    res = run_launch(cpu_cfg(), [Entry(1), Entry(2), Entry(4)], no_leftovers / "kill",
                     LaunchOptions(fault=Fault(kind="kill", rank=1, min_micro=2)))
    assert [r.status for r in res] == ["ok", "oom", "not_run"]


def test_bad_config_reaching_deepspeed_is_error(no_leftovers):
    cfg = cpu_cfg(ds={"zero_optimization": {"stage": 7}})
    (res,) = run_launch(cfg, [Entry(1)], no_leftovers / "bad")
    assert res.status == "error" and res.phase == "init"
    assert res.reason


def test_timeout_is_classified_and_killed(no_leftovers):
    """A rank stuck in its first step, in a launch of its own: after timeout_s without a finished
    step (the floor: a gpt-tiny step takes milliseconds) the launch is killed, classified timeout,
    with the reason in one line (no_leftovers: nothing of it is left)."""
    cfg = cpu_cfg(timeout_s=1.0)
    (res,) = run_launch(cfg, [Entry(1)], no_leftovers / "slow", LaunchOptions(fault=Fault(kind="hang", rank=1)))
    assert res.status == "timeout"
    assert res.reason.startswith("no step finished within 1 s (micro=1;"), res.reason
