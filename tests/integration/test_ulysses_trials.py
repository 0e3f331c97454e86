"""Ulysses sequence parallelism (parallel.sp) in real 2-rank trials: at sp=2 the two data-parallel
ranks split one sequence (each keeps seq_len / 2 tokens, attention exchanges sequence shards for
head shards by DeepSpeed's all-to-all), and the losses and gradient norms equal sp=1's at every
step (fp32), for DeepSpeed ZeRO-1 with recompute=op on llama-tiny (GQA: 2 key/value heads over 2
ranks; the per-op checkpoint recomputes the all-to-alls in backward), FSDP2 with the tiled MLP on
qwen3-tiny (qk-norm, tied embeddings) and ZeRO-3 with the tiled MLP on llama-tiny. At sp=1 the same
two ranks train the same tokens, which the worker gives every rank, so both runs see one sequence
per micro-step. Each case is one pair of trials (the suite's time): the untiled MLP at sp=2 runs in
the op case, FSDP2 untiled at sp=1 in test_fsdp2_trials; FSDP2 with recompute=op and moe-tiny without
its load-balancing loss were compared by hand (docs/long-context.md)."""
from __future__ import annotations

import pytest

from zero_bench.config.schema import ParallelConfig
from zero_bench.records import Entry
from zero_bench.trial.launch import LaunchOptions, run_launch

from conftest import cpu_cfg

pytestmark = pytest.mark.slow

# tiled_mlp at sp=2 tiles each rank's seq_len / 2 tokens (4 tiles of 32 rows), under ZeRO-3's gathered weights
# and FSDP2's unsharded ones
CASES = {"llama_zero1_op": ("llama-tiny", dict(zero=1, recompute="op")),
         "qwen3_fsdp2_tiled": ("qwen3-tiny", dict(engine="fsdp2", zero=3, tiled_mlp="4")),
         "llama_zero3_tiled": ("llama-tiny", dict(zero=3, tiled_mlp="4"))}


@pytest.fixture(scope="module")
def trials(tmp_path_factory, pools):
    """One pool (conftest.pools), each trial a fresh child: every case at sp=1 and sp=2, micro 1."""
    out = {}
    for name, (model, kw) in CASES.items():
        for sp in (1, 2):
            b = cpu_cfg(model, parallel=ParallelConfig(dp=2, sp=sp), **kw)
            (out[name, sp],) = run_launch(b, [Entry(1, "measure")], tmp_path_factory.mktemp(f"{name}{sp}"),
                                          LaunchOptions(pools=pools))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_sp2_gives_sp1s_losses_and_gradient_norms(trials, name):
    one, two = trials[name, 1], trials[name, 2]
    assert one.status == "ok", one.reason
    assert two.status == "ok", two.reason
    for r1, r2 in zip(one.ranks, two.ranks):
        assert len(r2.losses) >= 4 and len(r2.losses) == len(r1.losses)
        assert r2.losses == pytest.approx(r1.losses, rel=1e-5), (name, r1.losses, r2.losses)
        assert r2.grad_norms == pytest.approx(r1.grad_norms, rel=1e-5), (name, r1.grad_norms, r2.grad_norms)
    # both ranks of the sequence group report the group's loss
    assert two.ranks[0].losses == pytest.approx(two.ranks[1].losses, rel=1e-6)
    # a sample of the sequence group is one sequence: global batch = micro x dp / sp
    assert two.global_batch == one.global_batch // 2
