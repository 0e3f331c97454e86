"""The time prediction (zero_bench/estimate/time/, issue 52): each term against a case computed here by
hand from its source (the published rate in devices/rates.py, the volume DeepSpeed / megatron issue),
the orderings a user choosing a configuration relies on, and `zero_bench estimate`'s time sheet.
No launch. Llama-3-8B's counts: 8,030,261,248 parameters, of which 65 RMSNorm weights of 4,096
(2 per layer + the final one) stay under ZeRO-3's persistence threshold, and 128,256 x 4,096 are
the untied input embedding (a lookup: no FLOPs)."""
from __future__ import annotations

import json

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.devices.rates import GPU_RATES, Rate, gpu_rates
from zero_bench.estimate import estimate
from zero_bench.estimate.table import estimate_report
from zero_bench.estimate.time import predict_time

P = 8_030_261_248
NORMS = 65 * 4096
EMBED = 128_256 * 4096
MAMF_H100 = 792.1e12
NVLS_H100 = 476e9  # 8 x H100 all-reduce busbw
NDR = 46e9
LLAMA = ["model=llama3-8b", "parallel=dp8", "hardware=h100_80gb"]


@pytest.fixture(autouse=True)
def no_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path))


def bench(*overrides):
    return from_cfg(compose([*LLAMA, *overrides]), here=False)


def at(*overrides, micro=1):
    return predict_time(bench(*overrides), micro)


def close(a, b):
    return a == pytest.approx(b, rel=1e-9)


# -- compute ---------------------------------------------------------------------------------------

def test_forward_is_the_flops_formula_at_mamf_and_backward_twice_it():
    p = at("zero=1", micro=1)
    dense = 2 * (P - EMBED) * 8192  # 2 N s, the vocabulary matrix once
    causal_attention = 4 * 32 * 4096 * 8192 ** 2 / 2  # 4 L (a d) s^2, the lower triangle of it
    assert close(p.term("forward matmuls").seconds, (dense + causal_attention) / MAMF_H100)
    assert close(p.term("backward matmuls").seconds, 2 * p.term("forward matmuls").seconds)


def test_each_recompute_policy_reruns_what_it_recomputes():
    from zero_bench.estimate.time.compute import memory_bound_parts

    fwd = at("zero=1", micro=2).term("forward matmuls").seconds
    loss = memory_bound_parts(bench("zero=1"), 2)["loss"] / 3.35e12  # the loss is no layer's: never re-run
    mem = at("zero=1", micro=2).term("forward memory-bound ops").seconds - loss
    assert close(at("zero=1", "recompute=full", micro=2).term("recompute (full)").seconds, fwd + mem)
    block = at("zero=1", "recompute=block", "recompute_layers=8", micro=2).term("recompute (block)").seconds
    assert close(block, (fwd + mem) / 4)
    selective = at("zero=1", "recompute=selective", micro=2).term("recompute (selective)").seconds
    assert close(selective, 2 * 4 * 32 * 4096 * 8192 ** 2 / 2 / MAMF_H100)  # the core attention once more
    op = at("zero=1", "recompute=op", micro=2).term("recompute (op)").seconds
    assert 0 < op < fwd  # every second matmul, not the whole forward
    with pytest.raises(KeyError):
        at("zero=1", micro=2).term("recompute (none)")


def test_the_device_optimizer_step_reads_and_writes_the_partition_at_hbm_bandwidth():
    p = at("zero=1")
    assert close(p.term("optimizer step (device)").seconds, P / 8 * (4 + 4 + 8 + 12 + 2) / 3.35e12)


# -- communication -----------------------------------------------------------------------------------

def test_zero3_all_gathers_twice_and_reduce_scatters_every_micro_step():
    p = at("zero=3", "batch.grad_accum=4")
    per_micro = (P - NORMS) * 2 * 7 / 8 / NVLS_H100  # 16-bit params, (n-1)/n of the gathered tensor
    assert close(p.term("parameter all-gather (forward)").seconds, 4 * per_micro)
    assert close(p.term("parameter all-gather (backward)").seconds, 4 * per_micro)
    assert close(p.term("gradient reduce-scatter").seconds, 4 * P * 2 * 7 / 8 / NVLS_H100)
    assert not any(p.term(n).exposed for n in ("parameter all-gather (forward)", "gradient reduce-scatter"))


def test_zero1_all_reduces_once_per_step_zero2_every_micro_step_both_all_gather_after_the_step():
    allreduce = P * 2 * 2 * 7 / 8 / NVLS_H100  # ring all-reduce: 2 (n-1)/n
    z1, z2 = at("zero=1", "batch.grad_accum=4"), at("zero=2", "batch.grad_accum=4")
    assert close(z1.term("gradient all-reduce").seconds, allreduce)
    assert close(z2.term("gradient all-reduce").seconds, 4 * allreduce)
    for p in (z1, z2):
        assert p.term("gradient all-reduce").exposed  # overlap_comm resolves to False below stage 3
        assert close(p.term("parameter all-gather after the step").seconds, P * 2 * 7 / 8 / NVLS_H100)


def test_overlap_comm_true_hides_zero2s_all_reduce():
    p = at("zero=2", "+ds.zero_optimization.overlap_comm=true")
    assert not p.term("gradient all-reduce").exposed


def test_zero0_bf16_all_reduces_the_fp32_accumulation_buffers():
    p = at("zero=0")
    assert close(p.term("gradient all-reduce").seconds, P * 4 * 2 * 7 / 8 / NVLS_H100)


def test_overlapped_communication_beyond_compute_is_exposed():
    # two nodes of 8: ZeRO-3's gathers run at the NIC's 46 GB/s, more than one sample's compute
    p = at("zero=3", "parallel.dp=16", "hardware.num_nodes=2", micro=1)
    hidden = sum(t.seconds for t in p.terms if not t.exposed)
    compute = p.seconds("forward ") + p.seconds("backward ")  # matmuls and memory-bound ops: any kernel hides it
    assert close(p.term("parameter all-gather (forward)").seconds, (P - NORMS) * 2 * 15 / 16 / NDR)
    assert close(p.term("communication beyond compute").seconds, hidden - compute)
    assert p.term("communication beyond compute").seconds > 0
    assert close(p.step_s, sum(t.seconds for t in p.terms if t.exposed))


def test_tensor_parallel_across_nodes_is_slower_than_within_one():
    within = predict_time(from_cfg(compose(["model=llama3-8b", "parallel.tp=8", "parallel.dp=2", "zero=1",
                                            "hardware=h100_80gb", "hardware.num_nodes=2"]), here=False), 2)
    across = predict_time(from_cfg(compose(["model=llama3-8b", "parallel.tp=8", "parallel.dp=2", "zero=1",
                                            "hardware=h100_80gb", "hardware.num_nodes=4"]), here=False), 2)
    name = "tensor-parallel all-gather/reduce-scatter"
    # 2 x (2L + 1) collectives of [b, s, h] each way, (n-1)/n of each
    assert close(within.term(name).seconds, 2 * 2 * 65 * 2 * 8192 * 4096 * 2 * 7 / 8 / NVLS_H100)
    assert close(across.term(name).seconds / within.term(name).seconds, NVLS_H100 / NDR)
    assert across.step_s > within.step_s


def test_zero3_communicates_more_than_zero1_at_the_same_batch():
    def comm(p):
        return sum(t.seconds for t in p.terms if "all-" in t.name or "reduce-scatter" in t.name)

    # DeepSpeed's ZeRO-1 all-reduces (2 (n-1)/n) and all-gathers ((n-1)/n): ZeRO-3's 3 x (n-1)/n per micro-step
    assert comm(at("zero=3", "batch.grad_accum=4")) > 3 * comm(at("zero=1", "batch.grad_accum=4"))
    assert comm(at("zero=3")) == pytest.approx(comm(at("zero=1")), rel=1e-3)


def test_ulysses_and_expert_all_to_alls():
    p = at("zero=3", "parallel.sp=8", micro=8)
    # per layer each way: q and out (32 heads), k and v (8 groups) of d = 128, s / sp tokens each rank
    per_pass = 8 * 8192 / 8 * (2 * 32 + 2 * 8) * 128 * 2 * 32
    assert close(p.term("Ulysses all-to-all").seconds, 2 * per_pass * 7 / 8 / NVLS_H100)
    moe = predict_time(from_cfg(compose(["model=mixtral-8x7b", "parallel=dp8", "hardware=h200_141gb", "zero=2",
                                         "parallel.ep=8"]), here=False), 1)
    # dispatch + combine of top-2 copies of a 4,096-token sample's 4,096-wide tokens per MoE layer (32), each way
    a2a = 2 * 2 * 4096 * 2 * 4096 * 2 * 32
    assert close(moe.term("expert all-to-all").seconds, a2a * 7 / 8 / 482e9)


# -- offload -------------------------------------------------------------------------------------------

def test_offload_terms_are_the_partition_over_pcie_and_cpu_adam_on_the_hosts_cores():
    p = at("zero=2", "offload=true", "batch.grad_accum=2")
    assert close(p.term("gradients device->host").seconds, 2 * P / 8 * 4 / 53e9)
    assert close(p.term("parameters host->device after the step").seconds, P / 8 * 2 / 35e9)
    assert close(p.term("optimizer step (host, CPU Adam)").seconds, P / 8 / (1e8 * 14))
    assert "to be calibrated" in p.term("optimizer step (host, CPU Adam)").source
    assert "optimizer step (device)" not in {t.name for t in p.terms}


def test_nvme_swaps_the_optimizer_states_every_step_on_the_nodes_disk():
    p = at("zero=3", "offload_device=nvme")
    ranks = 8
    assert close(p.term("NVMe optimizer states read").seconds, P / 8 * 12 * ranks / 7.0e9)
    assert close(p.term("NVMe optimizer states write").seconds, P / 8 * 12 * ranks / 3.8e9)
    assert close(p.term("NVMe parameters read").seconds, 2 * P / 8 * 2 * ranks / 7.0e9)


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_offload_is_slower_than_no_offload(stage):
    assert at(f"zero={stage}", "offload=true", micro=2).step_s > at(f"zero={stage}", micro=2).step_s
    assert at("zero=3", "offload_device=nvme", micro=2).step_s > at("zero=3", "offload=true", micro=2).step_s


# Llama-3-8B's checkpointed layer inputs: 32 layers x 8,192 tokens x 4,096 x 2 bytes a sample
INPUTS = 32 * 8192 * 4096 * 2
CHECKPOINTS = ("checkpoints device->host", "checkpoints host->device")


def checkpoint_seconds(p):
    return {t.name: t.seconds for t in p.terms if t.name in CHECKPOINTS}


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp2"])
def test_recompute_offload_copies_the_hosts_checkpoints_down_and_up_every_micro_step(engine):
    """recompute_offload (models/sequence.py): every checkpointed input down in forward and up in
    backward, each micro-step, both exposed (on the compute stream): the step grows by exactly
    bytes / PCIe each way, and the bytes are the ones the memory estimate holds on the host."""
    keys = [f"engine={engine}", "zero=3", "recompute=full", "batch.grad_accum=2"]
    off, on = at(*keys, micro=3), at(*keys, "recompute_offload=true", micro=3)
    moved = INPUTS * 3 * 2
    assert estimate(bench(*keys, "recompute_offload=true")).activations["host"] == INPUTS
    assert checkpoint_seconds(off) == {}
    assert close(on.term("checkpoints device->host").seconds, moved / 53e9)
    assert close(on.term("checkpoints host->device").seconds, moved / 35e9)
    assert all(on.term(n).exposed for n in CHECKPOINTS)
    assert close(on.step_s - off.step_s, moved / 53e9 + moved / 35e9)


def test_deepspeeds_cpu_checkpointing_copies_each_inputs_tp_partition():
    """The megatron_deepspeed preset's offload file turns cpu_checkpointing on beside
    partition_activations: each input's 1/tp partition goes to the host (checkpointing.py
    partition_activations); without cpu_checkpointing nothing is copied and the step is shorter by
    exactly the two copies."""
    keys = ["parallel.tp=2", "parallel.dp=4", "zero=2", "offload=true", "recompute=full",
            "ds_preset=megatron_deepspeed", "parallel.sequence_parallel=false"]
    on = at(*keys, micro=2)
    off = at(*keys, "+ds.activation_checkpointing.cpu_checkpointing=false", micro=2)
    moved = INPUTS / 2 * 2  # the tp partition, micro 2
    assert close(on.term("checkpoints device->host").seconds, moved / 53e9)
    assert close(on.term("checkpoints host->device").seconds, moved / 35e9)
    assert "pageable" in on.term("checkpoints device->host").source
    assert checkpoint_seconds(off) == {}
    assert close(on.step_s - off.step_s, moved / 53e9 + moved / 35e9)


def test_on_cpu_recompute_offload_clones_and_deepspeeds_cpu_checkpointing_copies_nothing():
    """On CPU recompute_offload's host copy is a clone (read + write at the measured copy rate, which
    counts bytes moved), its restore a no-op; DeepSpeed's partition.cpu() / .to("cpu") return the
    tensor itself, so cpu_checkpointing adds no term though the memory estimate holds the bytes."""
    from zero_bench.devices.rates import cpu_rates

    cpu = ["model=gpt-tiny", "hardware=cpu", "parallel=dp2", "precision=fp32", "zero=2", "recompute=full"]
    got = {"matmul_flops": {"fp32": 5e10}, "memory_bytes_per_s": 8e9, "said": "in a test"}
    b = from_cfg(compose([*cpu, "recompute_offload=true"]), here=False)
    m = b.model
    inputs = m.num_layers * m.seq_len * m.hidden_size * 4
    p = predict_time(b, 2, cpu_rates(b, got))
    assert checkpoint_seconds(p) == {"checkpoints device->host": pytest.approx(2 * inputs * 2 / 8e9, rel=1e-9)}
    ds = from_cfg(compose([*cpu, "+ds.activation_checkpointing.partition_activations=true",
                           "+ds.activation_checkpointing.cpu_checkpointing=true"]), here=False)
    assert estimate(ds).activations["host"] == inputs
    assert checkpoint_seconds(predict_time(ds, 2, cpu_rates(ds, got))) == {}


def test_fsdp2_gathers_bf16_reduces_fp32_and_hides_both_behind_compute():
    p = predict_time(bench("engine=fsdp2", "zero=3"), 1)
    assert close(p.term("parameter all-gather").seconds, 2 * P * 2 * 7 / 8 / NVLS_H100)
    assert close(p.term("gradient reduce-scatter").seconds, P * 4 * 7 / 8 / NVLS_H100)
    z2 = predict_time(bench("engine=fsdp2", "zero=2"), 1)
    assert close(z2.term("parameter all-gather").seconds, p.term("parameter all-gather").seconds / 2)


# -- the record ------------------------------------------------------------------------------------------

def test_throughput_mfu_and_cost_follow_from_the_step():
    p = at("zero=1", "batch.grad_accum=2", micro=3)
    assert close(p.tokens_per_s_per_device, 3 * 2 * 8 * 8192 / p.step_s / 8)
    flops = 3 * (2 * (P - EMBED) * 8192 + 4 * 32 * 4096 * 8192 ** 2)  # MFU's FLOPs: full square, 3 passes
    assert close(p.mfu, flops * 3 * 2 * 8 / p.step_s / (8 * 989.5e12))
    assert close(p.cost_per_million_tokens(2.0), 2.0 / (p.tokens_per_s_per_device * 3600) * 1e6)
    assert p.dominant.name == "backward matmuls"


def test_every_published_rate_names_its_source_and_cards_match_by_nvml_name():
    for _, rates in GPU_RATES:
        for name, r in vars(rates).items():
            if isinstance(r, Rate):
                assert r.source and r.value > 0, (rates.name, name)
    assert gpu_rates("NVIDIA A100-SXM4-80GB").name == "A100 80GB"
    assert gpu_rates("NVIDIA A100-SXM4-40GB").name == "A100 40GB"
    assert gpu_rates("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert gpu_rates("RTX 4090") is None


# -- where users see it ------------------------------------------------------------------------------------

def test_estimate_prints_time_throughput_mfu_cost_and_the_offloaded_rungs_terms():
    text = estimate_report(compose([*LLAMA, "recompute=full", "report.price_per_device_hour=2.5"]), frozenset())
    sheet = text[text.index("predicted time per optimizer step"):]
    header = sheet.splitlines()[1]
    for col in ("time/it s", "tokens/s/device", "MFU %", "cost per 1M tokens", "dominant term"):
        assert col in header
    e = estimate(bench("zero=2", "offload=true", "recompute=full"))
    m = e.max_micro()
    want = e.time_at(m)
    row = next(line for line in sheet.splitlines() if line.split()[:2] == ["zero2+offload", str(m)])
    assert f"{want.step_s:,.3f}" in row and f"{want.cost_per_million_tokens(2.5):,.3f}" in row
    terms = next(line for line in sheet.splitlines() if line.strip().startswith(f"zero2+offload @ {m}:"))
    assert "optimizer step (host, CPU Adam)" in terms and "gradients device->host" in terms
    rung3 = next(line for line in sheet.splitlines() if line.strip().startswith("zero3+offload+param @"))
    assert "~parameters host->device" in rung3  # ZeRO-3 prefetches the host's partitions


def test_estimate_json_carries_every_term_with_its_source():
    doc = json.loads(estimate_report(compose([*LLAMA, "zero=3", "offload=true", "json=true"]), frozenset({"zero"})))
    time = doc["configs"][0]["time"]
    assert time["at_micro"]["micro"] == 2 and time["at_max_micro"]["micro"] == doc["configs"][0]["max_micro"]
    terms = time["at_micro"]["terms"]
    assert all(t["source"] for t in terms)
    assert close(time["at_micro"]["step_s"], sum(t["seconds"] for t in terms if t["exposed"]))


def test_a_gpu_without_rates_says_so():
    text = estimate_report(compose(["model=llama3-8b", "parallel=dp8", "hardware=gpu", "zero=1"]), frozenset({"zero"}))
    assert "time per step: no rates for hardware.card=None" in text


# -- this CPU's rates ------------------------------------------------------------------------------------

def test_cpu_rates_take_what_was_measured_and_say_the_rest_is_assumed():
    from zero_bench.devices.rates import cpu_rates

    b = from_cfg(compose(["model=gpt-tiny", "hardware=cpu", "parallel=dp2", "precision=fp32", "zero=2",
                          "offload=true"]), here=False)
    got = {"matmul_flops": {"fp32": 5e10}, "memory_bytes_per_s": 8e9, "cpu_adam_params_per_s": 4e8, "said": "in a test"}
    r = cpu_rates(b, got)
    assert (r.matmul_flops.value, r.memory_bytes_per_s.value, r.cpu_adam_params_per_s_per_core.value) == (5e10, 8e9, 4e8)
    assert r.matmul_flops.calibrated and not r.intra_node_bytes_per_s.calibrated and r.intra_node_bytes_per_s.assumed
    p = predict_time(b, 2, r)
    n = sum(b.layout.zero_groups(b.layout.tp_shard_params))
    assert close(p.term("optimizer step (host, CPU Adam)").seconds, n / 4e8)
    assert p.mfu is not None  # against the measured rate


def test_the_rate_probes_measure_something_on_this_cpu():
    from zero_bench.devices.rate_probes import memory_bytes_per_s

    assert 1e8 < memory_bytes_per_s(1, n=1_000_000) < 1e12


def test_each_group_spans_the_ranks_megatrons_order_gives_it():
    from zero_bench.config.layout import RankLayout

    assert RankLayout(tp=2, dp=4, sp=2).spans == {"world": 8, "dp": 8, "tp": 2, "sp": 4}
    assert RankLayout(tp=1, dp=8, ep=4).spans == {"world": 8, "dp": 8, "tp": 1, "ep": 4, "expert_dp": 8}


def test_train_tokens_give_the_runs_days_and_cost():
    text = estimate_report(compose([*LLAMA, "zero=1", "report.price_per_device_hour=2", "report.train_tokens=1e12"]),
                           frozenset({"zero"}))
    sheet = text[text.index("predicted time per optimizer step"):].splitlines()
    assert "days to train" in sheet[1] and "cost to train" in sheet[1]
    p = estimate(bench("zero=1")).time_at(2)
    row = next(line for line in sheet if line.split()[:2] == ["zero1", "2"])
    days = 1e12 / (p.tokens_per_s_per_device * 8) / 86400
    assert f"{days:,.1f}" in row and f"{1e12 / 1e6 * p.cost_per_million_tokens(2):,.0f}" in row
