"""The CPU's measured time terms (issue 52, item 4): the ranks' own rates (devices/rate_probes.py
rank_rates: every rank of the machine probing at once) read into HardwareRates, and the terms that
use them: the memory-bound ops by kind, torch AdamW per parameter and per tensor, gloo's bandwidth and
latency per collective call. No launch, no spawned process: the figures are given."""
from __future__ import annotations

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.devices.rate_probes import RankRates, slowest
from zero_bench.devices.rates import cpu_rates
from zero_bench.estimate.time import predict_time
from zero_bench.estimate.time.compute import memory_bound_parts, optimizer_tensors, partition_params

RANKS = RankRates(ranks=2, threads=1, precision="bf16", matmul_flops=1e11, elementwise_bytes_per_s=5e9,
                  scores_bytes_per_s=4e9, loss_bytes_per_s=2e9, all_reduce_bytes_per_s=1e9,
                  all_gather_bytes_per_s=5e8, collective_latency_s=3e-4, adam_params_per_s=1e8,
                  adam_per_tensor_s=2e-5, op_overhead_s=1e-6)
MEASURED = {"matmul_flops": {"bf16": 2e11}, "memory_bytes_per_s": 2e10, "cpu_adam_params_per_s": 1e9,
            "ranks": RANKS.to_dict(), "said": "in a test"}


@pytest.fixture(autouse=True)
def no_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path))


def bench(*overrides):
    return from_cfg(compose(["model=gpt-mini", "hardware=cpu", "parallel=dp2", "precision=bf16", *overrides]))


def at(*overrides, micro=4, measured=MEASURED):
    b = bench(*overrides)
    return predict_time(b, micro, cpu_rates(b, measured))


def test_the_ranks_rates_replace_the_single_rank_ones_in_their_precision():
    r = cpu_rates(bench(), MEASURED)
    assert r.matmul_flops.value == 1e11  # both ranks at once, not one alone (2e11)
    assert (r.intra_node_bytes_per_s.value, r.gather_bytes_per_s.value, r.collective_latency_s.value) == (1e9, 5e8, 3e-4)
    assert (r.elementwise_bytes_per_s.value, r.scores_bytes_per_s.value, r.loss_bytes_per_s.value) == (5e9, 4e9, 2e9)
    assert (r.optimizer_params_per_s.value, r.optimizer_per_tensor_s.value) == (1e8, 2e-5)
    assert r.memory_bytes_per_s.value == 2e10  # copies (offload on CPU) stay at the copy rate
    assert all(x.calibrated and "2 ranks at once" in x.source for x in (r.matmul_flops, r.loss_bytes_per_s))
    fp32 = cpu_rates(bench("precision=fp32"), {**MEASURED, "matmul_flops": {"fp32": 7e10}})
    assert fp32.matmul_flops.value == 7e10 and fp32.elementwise_bytes_per_s is None  # bf16 figures: not fp32's


def test_memory_bound_ops_run_at_their_kinds_rate():
    b = bench()
    parts = memory_bound_parts(b, 4)
    tokens = 4 * 256
    assert parts["loss"] == tokens * 8192 * 10  # gpt-mini's vocabulary, 2 + 4 + 4 bytes per logit
    assert parts["scores"] == tokens * 4 * 4 * 4 * 256 * 2  # 4 layers x 4 heads x (4 x s) elements, bf16
    fwd = parts["layers"] / 5e9 + parts["scores"] / 4e9 + parts["loss"] / 2e9
    p = at()
    assert p.term("forward memory-bound ops").seconds == pytest.approx(fwd)
    assert p.term("backward memory-bound ops").seconds == pytest.approx(2 * fwd)


def test_recompute_reruns_the_layers_memory_bound_ops_not_the_losses():
    parts = memory_bound_parts(bench(), 4)
    full = at("recompute=full")
    matmuls = full.term("forward matmuls").seconds
    assert full.term("recompute (full)").seconds == pytest.approx(matmuls + parts["layers"] / 5e9 + parts["scores"] / 4e9)


def test_the_optimizer_step_is_torch_adamw_per_parameter_and_per_tensor():
    z0, z1 = bench("zero=0"), bench("zero=1")
    assert optimizer_tensors(z0) == 52 and optimizer_tensors(z1) == 1  # per parameter; one flat partition
    assert optimizer_tensors(bench("engine=fsdp2", "zero=3")) == 52  # a DTensor shard per parameter
    assert at("zero=0").term("optimizer step (device)").seconds == pytest.approx(
        partition_params(z0) / 1e8 + 52 * 2e-5)
    assert at("zero=1").term("optimizer step (device)").seconds == pytest.approx(partition_params(z1) / 1e8 + 2e-5)
    # offload on CPU steps the same torch AdamW on the host (ds_configs/cpu.json torch_adam)
    off = at("zero=2", "offload=true").term("optimizer step (host, torch AdamW)")
    assert off.seconds == pytest.approx(partition_params(bench("zero=2", "offload=true")) / 1e8 + 2e-5)


def test_gloo_collectives_pay_their_bandwidth_and_a_latency_per_call():
    b = bench("zero=3")
    p = at("zero=3")
    held = b.layout.held_params
    # ZeRO-3's reduce-scatter and all-gathers at the all-gather rate, one latency each
    assert p.term("gradient reduce-scatter").seconds == pytest.approx(held * 2 * 0.5 / 5e8 + 3e-4)
    from zero_bench.estimate.time.comm import gathered_calls, gathered_params

    calls = gathered_calls(b)  # gpt-mini: the 2 embeddings + 4 weights per layer; biases and norms stay resident
    assert calls == 2 + 4 * 4
    assert p.term("parameter all-gather (forward)").seconds == pytest.approx(
        gathered_params(b) * 2 * 0.5 / 5e8 + calls * 3e-4)
    fsdp2 = at("engine=fsdp2", "zero=3")
    assert "10 call(s)" in fsdp2.term("parameter all-gather").source  # 2 passes x (4 layers + the root)
    z0 = at("zero=0").term("gradient all-reduce")
    assert z0.seconds == pytest.approx(held * 4 * 1.0 / 1e9 + 3e-4)  # bf16 ZeRO-0 reduces fp32 buffers
    tp = at("zero=1", "parallel.tp=2", "parallel.dp=1")
    (t,) = [t for t in tp.terms if t.name.startswith("tensor-parallel")]
    assert "call(s)" in t.source and t.seconds > 2 * (2 * 4 + 1) * 3e-4  # 2L+1 each way, at least


def test_the_slowest_rank_sets_each_rate():
    fast = RankRates(**{**RANKS.to_dict(), "matmul_flops": 2e11, "collective_latency_s": 1e-4})
    got = slowest([fast, RANKS])
    assert (got.matmul_flops, got.collective_latency_s) == (1e11, 3e-4)


def test_calibrate_prints_the_ranks_rates():
    from zero_bench.commands.calibrate import rank_rate_lines

    names = [n for n, _, _ in rank_rate_lines(RANKS.to_dict())]
    assert "gloo all-reduce" in names and "torch AdamW" in names and rank_rate_lines({}) == []


def test_the_probe_mixes_count_bytes_as_compute_does():
    import torch

    from zero_bench.devices.rate_probes import LOGITS_SHAPE, SCORES_SHAPE, _loss_mix, _scores_mix

    _, scores = _scores_mix(torch.bfloat16)
    _, loss = _loss_mix(torch.bfloat16)
    n_scores = SCORES_SHAPE[0] * SCORES_SHAPE[1] * SCORES_SHAPE[2] * SCORES_SHAPE[3]
    assert scores == 3 * 4 * n_scores * 2 and loss == 3 * 10 * LOGITS_SHAPE[0] * LOGITS_SHAPE[1] * LOGITS_SHAPE[2]


def test_a_probe_keeps_the_ranks_busy_or_makes_a_fixed_number_of_collective_calls():
    from zero_bench.devices import rate_probes

    calls, synced = [], []
    rate_probes._median(lambda: calls.append(1), lambda: synced.append(1), seconds=0.02)
    assert len(calls) > rate_probes.MIN_CALLS and synced == [1]  # one barrier, then busy for the window
    calls.clear()
    rate_probes._median(lambda: calls.append(1), lambda: None, calls=5)
    assert len(calls) == 6  # the untimed first + 5: every rank makes as many collective calls


def test_a_stored_figure_without_the_scores_and_loss_rates_uses_the_layers_mix():
    old = {k: v for k, v in RANKS.to_dict().items() if k not in ("scores_bytes_per_s", "loss_bytes_per_s")}
    r = cpu_rates(bench(), {**MEASURED, "ranks": old})
    assert r.scores_bytes_per_s is None and r.loss_bytes_per_s is None
    from zero_bench.estimate.time.compute import elementwise_rates

    assert {k: v.value for k, v in elementwise_rates(r).items()} == {"layers": 5e9, "scores": 5e9, "loss": 5e9}
