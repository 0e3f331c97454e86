"""The causal mask a trial hands the model, and the estimate's term for it (issue 45, 16K tokens):
sdpa takes is_causal and gets no mask, unfused attention one [1, 1, s, s] bool tensor, which the
estimate counts to the byte in every phase of both engines. And the CPU peak RSS a trial records:
VmHWM read at the end of the profiled step, set back after the profiler's own bookkeeping
(trial/worker.py profiled_step), which only holds if the kernel really moves the mark."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from zero_bench.config.configure import compose, from_cfg
from zero_bench.engines.storages import storage_bytes
from zero_bench.estimate import estimate
from zero_bench.models.sdpa import causal_mask
from zero_bench.trial.worker import reset_rss_high_water, rss_high_water, rss_now

MiB = 2**20


def bench(model: str, engine: str, attention: str, seq: int):
    return from_cfg(compose([f"model={model}", "hardware.device=cpu", "precision=fp32", f"engine={engine}",
                             "zero=3" if engine == "fsdp2" else "zero=1", "parallel.dp=2",
                             f"model.attention={attention}", f"model.seq_len={seq}"]), here=False)


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp2"])
@pytest.mark.parametrize("attention", ["unfused", "sdpa"])
def test_the_estimate_counts_the_mask_the_step_hands_the_model(engine, attention):
    b = bench("llama-tiny", engine, attention, 512)
    mask = causal_mask(b.model.attention, b.model.seq_len, "cpu")
    p = estimate(b).prediction
    names = [x.name for x in p.buffers]
    if attention == "sdpa":
        assert mask is None and "causal_mask" not in names
        return
    got = sum(storage_bytes([mask]).values())
    assert got == 512 * 512 and mask.shape == (1, 1, 512, 512) and mask.dtype == torch.bool
    assert bool(mask[0, 0, 0, 1]) and not bool(mask[0, 0, 1, 0])  # True = masked out: the future
    term = p.buffer("causal_mask")
    assert term.bytes == got and set(term.phases) == set(p.phases)


def test_the_mask_term_moves_the_peak_by_its_bytes_and_grows_with_the_square():
    """Only the term: the same unfused configuration with and without it, at two lengths."""
    for seq in (1024, 2048):
        e = estimate(bench("gpt-tiny", "deepspeed", "unfused", seq))
        without = dataclasses.replace(e, prediction=dataclasses.replace(
            e.prediction, buffers=[x for x in e.prediction.buffers if x.name != "causal_mask"]))
        assert e.peak_bytes(1) - without.peak_bytes(1) == seq * seq


def test_a_freed_transient_stays_in_the_high_water_mark_until_it_is_set_back():
    if not reset_rss_high_water():
        pytest.skip("this kernel refuses /proc/self/clear_refs")
    base = rss_now()
    x = torch.ones(64 * MiB // 4)  # 64 MiB, touched, then freed (mmap'd: back to the OS)
    del x
    assert rss_high_water() >= base + 60 * MiB > rss_now() + 40 * MiB
    assert reset_rss_high_water()
    assert rss_high_water() < rss_now() + 16 * MiB
