"""`zero_bench calibrate` with expert parallelism: the expert groups' communicators are taken out of
the context term, as the estimate adds NCCL's bytes for them (issue 43 item 10)."""
from __future__ import annotations

from zero_bench.commands.calibrate import from_result, terms
from zero_bench.config.configure import compose, from_cfg
from zero_bench.devices.calibration import Calibration
from zero_bench.estimate import calibrated_gpu_terms
from zero_bench.estimate.gpu import communicator_bytes, communicators
from zero_bench.records import Event, RankRecord, Status, TrialResult
from zero_bench.units import MiB


def bench(*overrides):
    return from_cfg(compose(["model=moe-tiny", "hardware=gpu", "zero=2", *overrides]), here=False)


def result(ranks) -> TrialResult:
    return TrialResult(search_key="k", trial_key="t", label="MoE-tiny", micro=2, global_batch=8, status=Status.OK,
                       ranks=ranks)


def test_the_expert_groups_nccl_bytes_leave_the_context_term_once():
    b = bench("parallel.dp=4", "parallel.ep=2")
    assert communicators(b.layout) == [4, 4, 2, 2]  # world, data-parallel, expert-parallel, expert-data-parallel
    ranks = [RankRecord(rank=r, event=Event.END, runtime_bytes=700 * MiB, context_bytes=300 * MiB,
                        nccl_world_bytes=100 * MiB, cublas_workspace_bytes=64 * MiB, outside_bytes=1000 * MiB,
                        torch_peak_allocated=100 * MiB, torch_peak_reserved=110 * MiB) for r in range(4)]
    cal = from_result(b, result(ranks), "gpu|x", "NVIDIA H100 80GB HBM3", {}, {})
    assert cal.context_bytes == 1000 * MiB - 4 * 100 * MiB  # was 1000 - 2 x 100: the expert groups twice
    assert cal.ep == 2
    # what the estimate then adds: that context once, and NCCL's bytes once for each of the four
    # communicators (the size-4 ones as measured, the size-2 ones at their published figure)
    fixed = calibrated_gpu_terms(b, cal)["terms"]
    assert fixed["CUDA context and kernels (calibrated)"] == 600 * MiB
    assert fixed["NCCL buffers (calibrated)"] == 2 * 100 * MiB
    assert fixed["NCCL buffers (published)"] == 2 * communicator_bytes(2)
    assert any("4 communicator(s)" in how for _, _, how in terms(cal))


def test_an_entry_written_before_ep_was_recorded_reads_as_ep_1():
    d = dict(key="gpu|x", kind="gpu", device="NVIDIA H100 80GB HBM3", date="2026-11-25 10:00", label="GPT-tiny",
             model="GPT-tiny", engine="deepspeed", zero=2, tp=1, dp=2, context_bytes=400 * MiB)
    assert Calibration.from_dict(d).ep == 1
