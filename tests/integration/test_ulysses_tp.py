"""Ulysses (parallel.sp) with tensor parallelism in real 4-rank trials: tp=2 x dp=2, Megatron's
sequence parallelism on (its default at tp > 1), llama-tiny ZeRO-1 fp32. At sp=2 the two data-parallel
ranks of each tensor rank split one sequence, Megatron splits each rank's share again over tp in the
norms, and attention's all-to-all runs over heads / tp / sp (llama-tiny's 2 key/value groups leave one
per tensor rank, replicated over the 2 sequence ranks as DeepSpeed does); the losses and gradient norms
equal sp=1's at every step. The session's 4-rank pool (conftest.pools4), each trial a forked child."""
from __future__ import annotations

import pytest

from zero_bench.config.schema import ParallelConfig
from zero_bench.records import Entry
from zero_bench.trial.launch import LaunchOptions, run_launch

from conftest import cpu_cfg

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(tmp_path_factory, pools4):
    out = {}
    for sp in (1, 2):
        b = cpu_cfg("llama-tiny", parallel=ParallelConfig(tp=2, dp=2, sp=sp), zero=1)
        assert b.layout.sequence_parallel and b.layout.sp == sp
        (out[sp],) = run_launch(b, [Entry(1, "measure")], tmp_path_factory.mktemp(f"tp2sp{sp}"),
                                LaunchOptions(pools=pools4))
    return out


def test_tp2_sp2_gives_sp1s_losses_and_gradient_norms(pair):
    one, two = pair[1], pair[2]
    assert one.status == "ok", one.reason
    assert two.status == "ok", two.reason
    assert len(two.ranks) == len(one.ranks) == 4
    for r1, r2 in zip(one.ranks, two.ranks):
        assert len(r2.losses) >= 4 and len(r2.losses) == len(r1.losses)
        assert r2.losses == pytest.approx(r1.losses, rel=1e-5), (r1.losses, r2.losses)
        assert r2.grad_norms == pytest.approx(r1.grad_norms, rel=1e-5), (r1.grad_norms, r2.grad_norms)
    # a sample of a sequence group is one sequence: global batch = micro x dp / sp
    assert two.global_batch == one.global_batch // 2
