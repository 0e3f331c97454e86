"""MFU/HFU against published tables, the peak-FLOP/s table, and the cached CPU microbenchmark."""
import json
import time

import pytest
import torch

from zero_bench.devices.metrics import cpu_peak_flops, gpu_peak_flops, matmul_flops, mfu_hfu, utilization
from zero_bench.models.flops import convention_flops_per_seq, model_flops_per_seq

from conftest import model
from zero_bench.models.params import num_params

A100, H100 = 312e12, 989.5e12

# Rows of the MPT training benchmark tables (mosaicml/llm-foundry scripts/train/benchmarking/README.md),
# each from its own columns: NumParams, n_layers/d_model of the size's yaml, SeqLen, Throughput (T/s),
# # GPUs, Activation Checkpointing -> the published MFU and HFU (%).
MPT_ROWS = [
    # name,              n_params,    layers, d_model, seq, tokens/s, gpus, peak, ckpt, MFU, HFU
    ("7b 8xH100", 6658859008, 32, 4096, 2048, 85144, 8, H100, False, 46.44, 46.44),
    ("13b 8xH100", 12853954560, 40, 5120, 2048, 38336, 8, H100, False, 39.79, 39.79),
    ("30b 32xH100 ckpt", 29975214080, 48, 7168, 2048, 73860, 32, H100, True, 43.92, 58.57),
    ("70b 64xH100 ckpt", 64862437376, 80, 8192, 2048, 66523, 64, H100, True, 42.57, 56.76),
    ("760m 8xH100", 760470528, 24, 1536, 2048, 505177, 8, H100, False, 34.90, 34.90),
    ("7b 8xA100-80", 6658859008, 32, 4096, 2048, 37130, 8, A100, False, 64.23, 64.23),
    ("13b 8xA100-80 seq4096 ckpt", 12864440320, 40, 5120, 4096, 16482, 8, A100, True, 57.62, 76.82),
    ("3b 8xA100-80", 2651837440, 32, 2560, 2048, 86491, 8, A100, False, 62.11, 62.11),
    ("1b 8xA100-80", 1315950592, 24, 2048, 2048, 164109, 8, A100, False, 59.86, 59.86),
    ("7b 8xA100-40 ckpt", 6658859008, 32, 4096, 2048, 29436, 8, A100, True, 50.92, 67.89),
]


@pytest.mark.parametrize("row", MPT_ROWS, ids=[r[0] for r in MPT_ROWS])
def test_mfu_hfu_reproduces_published_mpt_rows(row):
    """The convention models/flops.py applies to every description, on MPT's own numbers."""
    _, n_params, layers, d_model, seq, tokens_s, gpus, peak, ckpt, mfu_pct, hfu_pct = row
    mfu = utilization(convention_flops_per_seq(n_params, layers, d_model, seq, 3), tokens_s / seq, gpus, peak)
    hfu = utilization(convention_flops_per_seq(n_params, layers, d_model, seq, 4 if ckpt else 3), tokens_s / seq,
                      gpus, peak)
    assert round(mfu * 100, 2) == pytest.approx(mfu_pct, abs=0.005)
    assert round(hfu * 100, 2) == pytest.approx(hfu_pct, abs=0.005)


def test_hfu_counts_the_recomputed_forward():
    m = model("gpt-small")
    args = (m, 100.0, 8, A100)
    mfu, hfu = mfu_hfu(*args)
    assert hfu == mfu
    mfu_c, hfu_c = mfu_hfu(*args, recompute="full")
    assert mfu_c == mfu and hfu_c == pytest.approx(mfu * 4 / 3)
    # selective re-runs the core attention only: between the two
    assert mfu < mfu_hfu(*args, recompute="selective")[1] < hfu_c


@pytest.mark.parametrize("name", ["gpt-mini", "gpt345m", "gpt8.3b"])
def test_gpt_flops_are_the_convention_on_num_params(name):
    """Tied GPT presets: N is num_params, as metrics.py computed it before the description did."""
    m = model(name)
    assert model_flops_per_seq(m) == convention_flops_per_seq(num_params(m), m.num_layers, m.hidden_size, m.seq_len)


def test_llama_flops_count_the_output_layer_once():
    """Untied: the input embedding is a lookup; SwiGLU's three matrices and GQA's K/V come in through N."""
    m = model("llama3-8b")
    n = num_params(m) - m.padded_vocab(1) * m.hidden_size
    assert model_flops_per_seq(m) == convention_flops_per_seq(n, 32, 4096, 8192)
    assert model_flops_per_seq(m) / 8192 == pytest.approx(6 * n + 12 * 32 * 4096 * 8192)


def test_qwen3_flops_count_heads_of_head_dim():
    """Qwen3-0.6B: 16 heads of 128 on h = 1024, so the attention term's a x d is 2048, not h; tied,
    so N is num_params (qk-norm's 256 weights per layer inside it, as norms are)."""
    m = model("qwen3-0.6b")
    assert model_flops_per_seq(m) == convention_flops_per_seq(num_params(m), 28, 16 * 128, 4096)
    assert model_flops_per_seq(m) / 4096 == pytest.approx(6 * num_params(m) + 12 * 28 * 2048 * 4096)


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100-PCIE-40GB", "fp16", 312e12),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5e12),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12),
    ("NVIDIA H100 80GB HBM3", "fp8", 1979e12),
    ("NVIDIA H100 PCIe", "fp8", 1513e12),
    ("NVIDIA H200", "fp8", 1979e12),
    ("NVIDIA A100-SXM4-80GB", "fp8", None),  # no fp8 on Ampere
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H200", "bf16", 989.5e12),
    ("NVIDIA GH200 480GB", "bf16", 989.5e12),
    ("NVIDIA L40S", "bf16", 362e12),
    ("Tesla V100-SXM2-32GB", "fp16", 125e12),
    ("Tesla V100-SXM2-32GB", "bf16", None),  # no bf16 on Volta
    ("NVIDIA A10G", "bf16", None),  # not the A10's figure
    ("Some Future GPU", "bf16", None),
])
def test_gpu_peak_table(name, precision, peak):
    assert gpu_peak_flops(name, precision) == peak


def test_cpu_peak_is_measured_once_then_cached(tmp_path, monkeypatch):
    """The real microbenchmark (about 0.5 s) runs once per precision and thread count; the second
    ask reads the cache file."""
    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path))
    first = cpu_peak_flops("fp32", threads=1)
    second = cpu_peak_flops("fp32", threads=1)
    assert (first["cached"], second["cached"]) == (False, True)
    assert first["flops"] > 0 and (second["flops"], second["measured_at"]) == (first["flops"], first["measured_at"])
    stored = json.loads((tmp_path / "cpu_peak.json").read_text())
    assert [v["flops"] for v in stored.values()] == [first["flops"]]
    other = cpu_peak_flops("fp32", threads=2)  # another thread count is another figure
    assert not other["cached"] and len(json.loads((tmp_path / "cpu_peak.json").read_text())) == 2


def test_cpu_peak_cache_key_has_torchs_capability_and_onednns_limit(tmp_path, monkeypatch):
    """ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA change the kernels (a bf16 linear ran at 21.6 instead
    of 212 GFLOP/s here with both set to AVX2): a restricted process measures its own rate instead of
    reusing the unrestricted one, and the unrestricted one stays. (The capability is replaced by one
    this process cannot have, DEFAULT, so the test means the same under any restriction.)"""
    from zero_bench.devices import cpu_features
    from zero_bench.devices import metrics

    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path))
    for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(k, raising=False)
    rates = iter([217e9, 0.9e9, 0.8e9])
    monkeypatch.setattr(metrics, "matmul_flops", lambda precision, threads: next(rates))
    free = cpu_peak_flops("bf16", threads=1)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    held = cpu_peak_flops("bf16", threads=1)
    assert (held["cached"], held["flops"], held["onednn_isa"]) == (False, 0.9e9, "AVX2")
    monkeypatch.setattr(metrics, "torch_capability", lambda: "DEFAULT")  # as ATEN_CPU_CAPABILITY=default makes it
    both = cpu_peak_flops("bf16", threads=1)
    assert (both["cached"], both["flops"], both["capability"]) == (False, 0.8e9, "DEFAULT")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(metrics, "torch_capability", cpu_features.torch_capability)
    again = cpu_peak_flops("bf16", threads=1)
    assert (again["cached"], again["flops"], again["capability"]) == (True, 217e9, free["capability"])
    keys = sorted(json.loads((tmp_path / "cpu_peak.json").read_text()))
    assert len(keys) == 3 and all("|bf16|torch=" in k for k in keys)
    assert any(k.endswith("|torch=DEFAULT|onednn=AVX2") for k in keys), keys


def peak_flops_per_core() -> float:
    """An upper bound on one core's fp32 FLOP/s: two FMA units of its widest vectors (AVX-512: 16
    lanes, AVX2: 8, else SSE's 4) times 2 FLOP per FMA, at 6.2 GHz (above any CPU's boost clock)."""
    flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "").split()
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    return 2 * lanes * 2 * 6.2e9


def test_matmul_microbenchmark_is_between_an_average_run_and_the_cores_peak():
    """The best n x n matmul: no slower than the same product's average over as many runs timed
    here (half of it: the machine's load may change between the two), no faster than one core can
    compute (the bound says how: peak_flops_per_core)."""
    n = 256
    flops = matmul_flops("fp32", threads=1, n=n, seconds=0.2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        runs, t0 = 0, time.perf_counter()
        while runs < 5 or time.perf_counter() - t0 < 0.2:
            torch.mm(a, b)
            runs += 1
        average = runs * 2 * n ** 3 / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    assert average / 2 <= flops <= peak_flops_per_core(), (flops, average, peak_flops_per_core())
