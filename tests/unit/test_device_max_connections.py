"""CUDA_DEVICE_MAX_CONNECTIONS=1 only where megatron's tensor-parallel overlap is the only overlap: a
single hardware queue serializes the reduce-scatters and all-gathers FSDP2 and ZeRO-3 overlap with
compute on streams of their own (torchtitan#1147; issue 43 item 10)."""
from __future__ import annotations

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.trial.launcher import overlaps_data_parallel, trial_env

VAR = "CUDA_DEVICE_MAX_CONNECTIONS"


def bench(*overrides):
    return from_cfg(compose(["model=gpt-tiny", "hardware=gpu", "parallel.tp=2", "parallel.dp=2", *overrides]),
                    here=False)


@pytest.fixture(autouse=True)
def unset(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)


@pytest.mark.parametrize("overrides", [["engine=fsdp2", "zero=3"], ["engine=fsdp2", "zero=2"], ["zero=3"],
                                       ["zero=3", "offload=true"], ["zero=2", "ds_preset=megatron_deepspeed"],
                                       ["zero=1", "+ds.zero_optimization.overlap_comm=true"]])
def test_engines_that_overlap_their_collectives_keep_cudas_queues(overrides):
    b = bench(*overrides)
    assert overlaps_data_parallel(b)
    assert VAR not in trial_env(b)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_deepspeed_reducing_in_the_compute_stream_gets_one_queue_for_megatrons_overlap(zero, monkeypatch):
    b = bench(f"zero={zero}")  # DeepSpeed 0.19.8's GPU default: overlap_comm off below ZeRO-3
    assert not overlaps_data_parallel(b)
    assert trial_env(b)[VAR] == "1"
    monkeypatch.setenv(VAR, "8")  # the user's choice is kept
    assert trial_env(b)[VAR] == "8"


def test_no_tensor_parallelism_or_no_gpu_no_variable():
    assert VAR not in trial_env(from_cfg(compose(["model=gpt-tiny", "hardware=gpu", "parallel.dp=2", "zero=2"]),
                                         here=False))
    assert VAR not in trial_env(from_cfg(compose(["model=gpt-tiny", "hardware=cpu", "parallel.tp=2",
                                                  "parallel.dp=1", "zero=2"]), here=False))
