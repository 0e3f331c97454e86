"""The estimate's GPU terms: each a published figure (estimate/gpu.py), combined as nvidia-smi sees a
rank's memory: the fixed terms outside the allocator + the allocator's peak x its fragmentation."""
from __future__ import annotations


import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.layout import RankLayout
from zero_bench.estimate import estimate, gpu
from zero_bench.units import MiB


def seed_row(*overrides):
    return from_cfg(compose(["+sweep=seed_grid", "model=gpt345m", *overrides]), here=False)


def test_communicators_a_rank_joins():
    assert gpu.communicators(RankLayout(dp=8)) == [8, 8]  # the world and the data-parallel group (a group of its own)
    assert gpu.communicators(RankLayout(tp=8)) == [8, 8]  # the world and the tensor-parallel group
    assert gpu.communicators(RankLayout(tp=2, dp=2)) == [4, 2, 2]
    assert gpu.communicators(RankLayout()) == []
    assert gpu.nccl_bytes(RankLayout(dp=2)) == 2 * 544 * 10**6 and gpu.nccl_bytes(RankLayout(dp=8)) == 2 * 688 * 10**6


def test_the_ulysses_and_hpz_groups_are_communicators_too():
    """config/layout.py builds the sp group (Ulysses' all-to-alls) and DeepSpeed hpZ's group of hpz
    consecutive ranks (backward's all-gathers): each is an NCCL communicator of its own."""
    assert gpu.communicators(RankLayout(dp=8, sp=4)) == [8, 8, 4]
    assert [c.all_to_all for c in gpu.communicator_groups(RankLayout(dp=8, sp=4))] == [False, False, True]
    assert gpu.communicators(RankLayout(dp=8), hpz=4) == [8, 8, 4]
    h100 = ["model=llama3-8b", "parallel=dp8", "hardware=h100_80gb", "zero=3"]
    plain = estimate(from_cfg(compose(h100), here=False))
    for extra in (["parallel.sp=4"], ["zeropp.hpz=4"]):
        e = estimate(from_cfg(compose([*h100, *extra]), here=False))
        assert e.terms["NCCL buffers"] == plain.terms["NCCL buffers"] + 688 * 10**6, extra
        assert e.overhead == plain.overhead + 688 * 10**6


def test_module_loading_sets_the_context_and_both_ends_answer():
    eager, lazy = seed_row("parallel=dp8", "zero=1"), seed_row("parallel=dp8", "zero=1",
                                                               "hardware.cuda_module_loading=lazy")
    assert eager.hardware.cuda_module_loading == "eager"  # the seed grid's 2020 software
    e, l = estimate(eager), estimate(lazy)
    nccl = 2 * 688 * 10**6
    assert e.overhead == 1823 * MiB + nccl + 2 * 32 * MiB and e.overhead_low == 922 * MiB + nccl + 2 * 32 * MiB
    assert l.overhead == 481 * MiB + nccl + 2 * 32 * MiB and l.overhead_low == 274 * MiB + nccl + 2 * 32 * MiB
    lo_end, hi_end = e.max_micro_range()
    assert lo_end <= hi_end and l.max_micro() >= e.max_micro()  # a smaller context leaves more room


def test_device_peak_is_fixed_terms_plus_fragmented_allocator():
    e = estimate(seed_row("parallel=dp8", "zero=3"))
    assert e.fragmentation == 1.23 and e.peak_bytes(4) == e.overhead + int(1.23 * e.allocated_bytes(4))
    m = e.max_micro()
    assert e.peak_bytes(m) <= e.capacity < e.peak_bytes(m + 1)


def test_cpu_keeps_its_measured_runtime_and_no_fragmentation():
    b = from_cfg(compose(["hardware=cpu", "model=gpt-mini"]))
    e = estimate(b)
    assert e.fragmentation == 1.0 and e.overhead_low is None and e.peak_bytes(2) == e.overhead + e.allocated_bytes(2)


@pytest.mark.parametrize("loading", ["eager", "lazy"])
def test_the_estimate_command_answers_for_both_module_loadings(loading, capsys):
    from zero_bench.estimate.table import estimate_report

    cfg = compose(["+sweep=seed_grid", "model=gpt345m", "parallel=dp8", f"hardware.cuda_module_loading={loading}"])
    text = estimate_report(cfg, frozenset())
    assert f"CUDA context ({loading} loading)" in text and "max micro" in text
