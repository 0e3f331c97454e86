"""megatron's unfused attention (DotProductAttention), what it saves for backward measured tensor
by tensor on this CPU (saved_tensors_hooks around the core attention of a one-layer model, one
gloo rank), against the estimate's core attention terms (estimate/activations.py): the s x s
tensors per score, with the softmax upcast to fp32 (CPU trials; GPU with fusions=false) and in 16
bits (what a GPU rank with fusions runs: models/megatron.py softmax_in_fp32), dropout 0 and 0.1."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from zero_bench.config.schema import BenchConfig, HardwareConfig
from zero_bench.estimate.activations import activation_bytes_per_sample, core_attention_terms
from zero_bench.models.megatron import build_gpt, fusion_args, softmax_in_fp32, transformer_config
from zero_bench.models.shims import seed_cpu_rng
from zero_bench.units import BYTES

from conftest import megatron_one_rank, model, profiled_allocations

BATCH = 2


@pytest.fixture(scope="module", autouse=True)
def megatron_tp1(tmp_path_factory):
    with megatron_one_rank(tmp_path_factory.mktemp("pg") / "store"):
        yield


def saved_score_bytes(m, precision: str, upcast: bool) -> float:
    """Bytes per score (per element of the b x a x s x s scores) of the per-sample s x s storages
    the core attention saves for backward (the causal mask, one s x s for every sample, is not)."""
    seed_cpu_rng(1)
    cfg = BenchConfig(model=m, hardware=HardwareConfig(device="cpu"), precision=precision)
    config = transformer_config(cfg, on_cpu=True)
    config.attention_softmax_in_fp32 = upcast
    gpt = build_gpt(cfg, config, on_cpu=True)
    if precision == "bf16":
        gpt = gpt.to(torch.bfloat16)
    core = gpt.decoder.layers[0].self_attention.core_attention
    scores, saved, inside = BATCH * m.num_heads * m.seq_len ** 2, {}, [False]

    def pack(t):
        if inside[0] and t.numel() == scores:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    core.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    core.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    tok = torch.randint(0, m.vocab_size, (BATCH, m.seq_len + 1), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(m.seq_len).unsqueeze(0).expand(BATCH, -1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gpt(tok[:, :-1], pos, None, labels=tok[:, 1:])
    return sum(saved.values()) / scores


def small(name: str, dropout: float):
    return dataclasses.replace(model(name), num_layers=1, seq_len=64, dropout=dropout, attention="unfused")


def formula_score_bytes(m, precision: str, device: str, fusions: bool) -> float:
    A = m.num_heads * m.seq_len  # scores per token (tp 1)
    return core_attention_terms(m, 1, precision, device, fusions)["internal"] / A


def test_a_gpu_rank_with_fusions_runs_the_16_bit_softmax_and_a_cpu_rank_the_fp32_one():
    assert softmax_in_fp32(on_cpu=True) and softmax_in_fp32(on_cpu=True, fusions=False)
    assert softmax_in_fp32(on_cpu=False, fusions=False) and not softmax_in_fp32(on_cpu=False)
    assert fusion_args(model("gpt-tiny"), on_cpu=False)["attention_softmax_in_fp32"] is False


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_attention_keeps_what_the_formula_counts(name, dropout, precision):
    m = small(name, dropout)
    measured = saved_score_bytes(m, precision, upcast=softmax_in_fp32(on_cpu=True))
    assert formula_score_bytes(m, precision, "cpu", fusions=True) == pytest.approx(measured, rel=1e-3)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_gpu_ranks_16_bit_softmax_keeps_what_the_formula_counts(name, dropout):
    """The GPU path's softmax, run here: its 16-bit output (shared with the next matmul) and, with
    dropout, the mask and the dropped probabilities, 2 bytes per score without dropout where the
    fp32 softmax kept 6. The one difference a GPU makes: native_dropout's mask is a bool (1 byte),
    where torch's CPU dropout keeps a mask of the input's dtype (BYTES)."""
    m = small(name, dropout)
    measured = saved_score_bytes(m, "bf16", upcast=softmax_in_fp32(on_cpu=False))
    cpu_mask_extra = (BYTES["bf16"] - 1) if dropout else 0
    assert formula_score_bytes(m, "bf16", "gpu", fusions=True) + cpu_mask_extra == pytest.approx(measured, rel=1e-3)
    upcast = saved_score_bytes(m, "bf16", upcast=True)
    assert measured < upcast  # what the fp32 softmax kept, and the formula counted on GPU before
    assert formula_score_bytes(m, "bf16", "gpu", fusions=False) + cpu_mask_extra == pytest.approx(upcast, rel=1e-3)


def test_gpu_figures_move_only_where_the_softmax_runs_in_16_bits():
    m = dataclasses.replace(model("gpt-tiny"), attention="unfused", dropout=0.1)
    fused = activation_bytes_per_sample(m, precision="bf16", device="gpu", fusions=True)
    eager = activation_bytes_per_sample(m, precision="bf16", device="gpu", fusions=False)
    assert fused["per_layer"] < eager["per_layer"]
    for precision, device in (("fp32", "gpu"), ("bf16", "cpu")):
        a, b = (activation_bytes_per_sample(m, precision=precision, device=device, fusions=f) for f in (True, False))
        assert a == b
    sdpa = dataclasses.replace(m, attention="sdpa")
    assert (activation_bytes_per_sample(sdpa, precision="bf16", device="gpu", fusions=True)
            == activation_bytes_per_sample(sdpa, precision="bf16", device="gpu", fusions=False))


def peak_per_sample(m, upcast: bool) -> float:
    """The step's peak of net allocations (torch.profiler's memory events, every allocation of a
    bf16 forward and backward in view), bytes one more sample adds (micro 1 -> 2)."""
    seed_cpu_rng(1)
    cfg = BenchConfig(model=m, hardware=HardwareConfig(device="cpu"), precision="bf16")
    config = transformer_config(cfg, on_cpu=True)
    config.attention_softmax_in_fp32 = upcast
    gpt = build_gpt(cfg, config, on_cpu=True).to(torch.bfloat16)

    def step(micro: int) -> None:
        tok = torch.randint(0, m.vocab_size, (micro, m.seq_len + 1), generator=torch.Generator().manual_seed(micro))
        pos = torch.arange(m.seq_len).unsqueeze(0).expand(micro, -1)
        gpt(tok[:, :-1].contiguous(), pos, None, labels=tok[:, 1:].contiguous()).float().mean().backward()

    peaks = []
    for micro in (1, 2):
        cur = peak = 0
        for n in profiled_allocations(gpt, step, micro):
            cur += n
            peak = max(peak, cur)
        peaks.append(peak)
    return peaks[1] - peaks[0]


def test_the_16_bit_softmaxs_backward_peak_is_the_formulas():
    """Where the attention's backward is the step's peak (long sequence, small vocabulary): the
    16-bit softmax differentiated holds what the fp32 path does, in 16 bits (backward_transients)."""
    m = dataclasses.replace(model("gpt-tiny"), num_layers=2, seq_len=384, dropout=0.0, attention="unfused")
    f = activation_bytes_per_sample(m, 1, "bf16", device="gpu", fusions=True)
    assert f["total"] == f["attention_backward"]
    assert f["total"] == pytest.approx(peak_per_sample(m, upcast=softmax_in_fp32(on_cpu=False)), rel=0.02)
    assert activation_bytes_per_sample(m, 1, "bf16", device="cpu")["total"] == pytest.approx(
        peak_per_sample(m, upcast=True), rel=0.02)
