"""Per-token terms of a layer's attention as megatron-core 0.16.1 keeps them for backward (the
table in estimate/activations.py's docstring: the norms, Q/K/V, the core attention, the context),
and the shapes every term is counted in. Apart from activations.py so that estimate/ulysses.py, which
replaces some of them at sp > 1, and activations.py, which adds them up, both read them."""
from __future__ import annotations

from zero_bench.config.schema import Device
from zero_bench.models import ModelConfig
from zero_bench.models.description import native_gqa
from zero_bench.units import BYTES


def dims(m: ModelConfig, tp: int) -> dict:
    d = m.kv_channels  # head_dim where set: q and kv follow the heads' width, not h
    return {"h": m.hidden_size, "q": m.num_heads * d // tp, "kv": m.query_groups * d // tp, "f": m.ffn // tp,
            "A": m.num_heads * m.seq_len // tp, "heads": m.num_heads // tp, "groups": m.query_groups // tp,
            "rep": m.num_heads // m.query_groups}


def mask_bytes(B: int, device: str) -> int:
    return B if device == Device.cpu else 1


def sdpa_kernel(m: ModelConfig, device: str) -> str:
    """Which kernel scaled_dot_product_attention runs: flash (CPU flash, CUDA flash or
    memory-efficient: nothing s x s) or math (CPU with dropout: torch's CPU flash has no dropout)."""
    return "math" if device == Device.cpu and m.dropout > 0 else "flash"


def norm_bytes(m: ModelConfig, precision: str, device: str) -> float:
    """Bytes per token one norm keeps: its input (+ what the implementation adds)."""
    B, h = BYTES[precision], m.hidden_size
    if m.normalization == "rmsnorm" and device == Device.cpu:
        # torch 2.13 on CPU: _fused_rms_norm falls back to the composite, which saves the input
        # upcast to fp32 (the input itself in fp32), rsqrt, and x * rsqrt in fp32.
        return 4 * h + 4 * h + 8
    return B * h + 8  # input + mean/rstd (LayerNorm) or rstd (fused RMSNorm)


def attention_inputs_bytes(m: ModelConfig, tp: int, precision: str) -> float:
    """What the core attention's inputs pin (selective recompute keeps exactly these): with RoPE
    the rotated Q and K plus the QKV output that V is a view of; learned positions: the QKV output."""
    B, x = BYTES[precision], dims(m, tp)
    qkv_out = x["q"] + 2 * x["kv"]
    return B * (qkv_out + (x["q"] + x["kv"] if m.position_embedding == "rope" else 0))


def qkv_output_kept(m: ModelConfig, tp: int, ulysses_sp: int = 1) -> bool:
    """Whether the core attention already keeps the whole QKV output alive (unfused MHA: V, a view
    of it, is saved by the bmm); sdpa and unfused GQA keep copies, and at Ulysses' sp > 1 every
    attention keeps the all-to-all's outputs (estimate/ulysses.py)."""
    return m.attention == "unfused" and dims(m, tp)["rep"] == 1 and ulysses_sp == 1


def qk_norm_terms(m: ModelConfig, tp: int, precision: str, device: str, ulysses_sp: int = 1) -> dict:
    """Bytes per token the query and key norms keep (qk_norm; 0 without): {"qk_norm": their own
    tensors, "qk_norm_qkv_output": the QKV output that K's saved input, a view of it, pins where
    nothing else keeps it}. The key is a view of the QKV output; the query too with one head per
    group (MHA), else megatron's reshape copies it (q*B). CPU RMSNorm (torch's composite, as
    norm_bytes): the input upcast to fp32 (the input itself in fp32, so a view pins the QKV output;
    in 16-bit a 4-byte copy), the fp32 normalised x and an fp32 rsqrt per head. GPU's fused RMSNorm
    and LayerNorm: the input (B) and 4 or 8 bytes of statistics per head. Measured on CPU
    (qwen3-tiny, GQA and MHA, fp32 and bf16, sdpa and unfused: to 0.1 %)."""
    if not m.qk_norm:
        return {"qk_norm": 0, "qk_norm_qkv_output": 0}
    B, x = BYTES[precision], dims(m, tp)
    q, kv, rows, q_copy = x["q"], x["kv"], x["heads"] + x["groups"], x["rep"] > 1
    if m.normalization == "rmsnorm" and device == Device.cpu:
        upcast = B != 4  # a new fp32 tensor; in fp32 the saved input is the query copy / the view itself
        own = 4 * (q + kv) + 4 * rows + (4 * q if upcast or q_copy else 0) + (4 * kv if upcast else 0)
        pins = not upcast
    else:
        own, pins = (B * q if q_copy else 0) + (4 if m.normalization == "rmsnorm" else 8) * rows, True
    pinned = B * (q + 2 * kv) if pins and not qkv_output_kept(m, tp, ulysses_sp) else 0
    return {"qk_norm": own, "qk_norm_qkv_output": pinned}


def softmax_upcast(precision: str, device: str, fusions: bool = False) -> bool:
    """Whether megatron's unfused attention upcasts 16-bit scores to an fp32 softmax (models/megatron.py
    softmax_in_fp32: CPU, or GPU with fusions=false); fp32 runs have nothing to upcast."""
    if BYTES[precision] == 4:
        return False
    if device == Device.cpu or not fusions:
        return True  # answered without importing torch, as swiglu_fused
    from zero_bench.models.megatron import softmax_in_fp32

    return softmax_in_fp32(on_cpu=False, fusions=True)


def core_attention_terms(m: ModelConfig, tp: int, precision: str, device: str, fusions: bool = False) -> dict:
    """Bytes per token of the core attention: {"qkv": Q/K/V storages it saves, "internal": what
    selective recompute drops besides them, "context": its output as linear_proj keeps it}.
    fusions: the BenchConfig key (on GPU the unfused attention's softmax stays in 16 bits)."""
    B, x = BYTES[precision], dims(m, tp)
    q, kv, A, p = x["q"], x["kv"], x["A"], m.dropout > 0
    if m.attention == "unfused":
        qkv = 3 * q * B if x["rep"] > 1 else attention_inputs_bytes(m, tp, precision)
        upcast = softmax_upcast(precision, device, fusions)
        internal = (4 if upcast else B) * A  # the softmax's output, which it saves
        if upcast and not p:
            internal += B * A  # its 16-bit copy, what bmm keeps
        if p:
            internal += mask_bytes(B, device) * A + B * A  # dropout mask + dropped probabilities
        return {"qkv": qkv, "internal": internal, "context": q * B}
    if sdpa_kernel(m, device) == "math":
        # torch's math kernel (float intermediates): Q, K and V expanded to a/t heads, softmax,
        # dropout mask, dropped probabilities; its [b, n, s, d] output is copied to [s, b, h].
        return {"qkv": 3 * q * 4, "internal": 3 * A * 4, "context": q * B}
    kv_kept = kv if (native_gqa(device, precision) or x["rep"] == 1) else q
    return {"qkv": (q + 2 * kv_kept) * B, "internal": 4 * x["heads"], "context": q * B}
