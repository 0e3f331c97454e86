"""Hybrid sharding for real on CPU: 4 ranks (gloo), FSDP2 sharding within pairs and replicating
across them (parallel.dp_shard=2, a 2 x 2 device mesh) against plain FSDP2 over all 4."""
from __future__ import annotations

import pytest

from zero_bench.config.schema import ParallelConfig
from zero_bench.estimate import estimate
from zero_bench.records import Entry
from zero_bench.trial.launch import LaunchOptions, run_launch

from conftest import cpu_cfg

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pools4):
    """llama-tiny, fp32, FSDP2 zero=3, dp 4: sharded over all 4, and over pairs (HSDP); children of the
    session's 4-rank pool (conftest.pools4)."""
    tmp = tmp_path_factory.mktemp("hsdp")
    out = {}
    for name, par in {"fsdp": ParallelConfig(tp=1, dp=4), "hsdp": ParallelConfig(tp=1, dp=4, dp_shard=2)}.items():
        cfg = cpu_cfg("llama-tiny", engine="fsdp2", zero=3, parallel=par)
        (res,) = run_launch(cfg, [Entry(2, "measure")], tmp / name, LaunchOptions(pools=pools4))
        assert res.status == "ok", (name, res.reason)
        out[name] = (cfg, res)
    return out


def test_hybrid_sharding_trains_the_same_model_and_holds_twice_the_shards(runs):
    """Same data, same arithmetic: the losses equal plain FSDP2's at every step; each rank holds
    the states of one of 2 shards instead of 4, exactly as the estimate counts them."""
    ref = runs["fsdp"][1].ranks[0].losses
    hsdp = runs["hsdp"][1]
    assert len(hsdp.ranks) == 4 and "dp_shard=2" in hsdp.label
    for r in hsdp.ranks:
        assert r.losses == pytest.approx(ref, rel=2e-6), (r.losses, ref)
    for name, (cfg, res) in runs.items():
        want = estimate(cfg).states
        for r in res.ranks:
            assert (r.model_states["params"], r.model_states["optimizer"]) == (want.params, want.moments), name
    assert hsdp.ranks[0].model_states["params"] == 2 * runs["fsdp"][1].ranks[0].model_states["params"]


def test_peaks_near_the_estimate(runs):
    """Measured: RSS -0.6 % to -0.3 %, live -3.4 % to -0.4 % (both layouts); held to the ZeRO
    stages' 12 % and the 6 % FSDP2's live peaks meet elsewhere."""
    for name, (cfg, res) in runs.items():
        e = estimate(cfg)
        for r in res.ranks:
            assert e.peak_bytes(2) == pytest.approx(r.peak_rss_bytes, rel=0.12), (name, r.rank)
            assert e.peak_bytes(2) - e.overhead == pytest.approx(r.peak_live_bytes, rel=0.06), (name, r.rank)
