"""What Ulysses sequence parallelism (parallel.sp > 1) changes in one layer's activations, per local
token, beyond keeping seq_len / sp tokens of every per-token term (estimate/activations.py divides).

models/ulysses.py wraps megatron's core attention in DeepSpeed 0.19.8's DistributedAttention
(deepspeed/sequence/layer.py): Q, K and V [s/sp, b, heads, d] are exchanged by _SeqAllToAll for
[s, b, heads/sp, d], the context back the other way. _SeqAllToAll saves no tensor for backward (its
ctx holds the group and the indices only); what changes is which tensors the modules around it keep:
  attention_qkv    the core attention keeps the exchange's outputs, fresh tensors. With a kernel that
                   takes GQA (models/description.py native_gqa) and key/value heads fewer than sp,
                   K and V arrive repeated sp / g times (models/ulysses.py repeat_interleave before
                   the exchange, DeepSpeed's kv_replication_factor): 2 kv (rep - 1) more. megatron's
                   unfused MHA no longer keeps the whole QKV output (V's view pinned it at sp = 1)
                   and RoPE's rotated Q and K beside it: those are the exchange's inputs, freed.
  ulysses_context  linear_proj's input is the exchange's output (single_all_to_all's post_all2all
                   permuted copy), no longer the core attention's own output: with torch's flash
                   kernel, which keeps its output for backward, both are kept, q more. Unfused
                   attention and torch's math kernel keep no output of their own (the permuted
                   copy that was linear_proj's input at sp = 1 is the exchange's input now, freed).
  exchange         transient, one exchange at a time: the tensor, single_all_to_all's contiguous
                   permuted copy (pre_all2all_fun, or post_all2all's on the way back) and the
                   all_to_all_single output buffer, 3 q for the query and the context (K and V are
                   no larger). In the backward of the last layer's attention (the context's
                   gradient exchanged back, then dq, dk, dv) it stands beside what the kernel's
                   backward holds; the larger of the two is the moment's.
Selective recompute checkpoints the whole DistributedAttention (it is megatron's core_attention
module): the checkpoint keeps sp = 1's inputs (pre-exchange Q, K, V) and linear_proj's input, and
the exchanges run again in backward, so the context copy is rebuilt with the rest.
Measured on CPU tensor by tensor (tests/integration/test_ulysses_ranks.py: two gloo ranks, the storages
the forward saves at sp = 2 against sp = 1's half, to the byte).
"""
from __future__ import annotations

from zero_bench.estimate.attention import core_attention_terms, dims, sdpa_kernel
from zero_bench.models import ModelConfig
from zero_bench.models.description import native_gqa
from zero_bench.units import BYTES


def kv_repeat(m: ModelConfig, tp: int, sp: int) -> int:
    """How often models/ulysses.py repeats each key/value head before the exchange (DeepSpeed's
    kv_replication_factor): sp / g where this tp rank's g query groups are fewer than sp."""
    return max(1, sp // (m.query_groups // tp))


def attention_terms(m: ModelConfig, tp: int, precision: str, device: str, sp: int) -> dict:
    """{"attention_qkv", "ulysses_context"}: bytes per local token at sp > 1 (module docstring);
    attention_qkv replaces activations.core_attention_terms' at sp = 1."""
    B, x = BYTES[precision], dims(m, tp)
    q, kv = x["q"], x["kv"]
    core = core_attention_terms(m, tp, precision, device)
    if m.attention == "unfused":
        # megatron expands K/V to every head under GQA; MHA: the exchange's three outputs
        return {"attention_qkv": 3 * q * B if x["rep"] > 1 else (q + 2 * kv) * B, "ulysses_context": 0}
    if sdpa_kernel(m, device) == "math":
        return {"attention_qkv": core["qkv"], "ulysses_context": 0}
    rep = kv_repeat(m, tp, sp)
    whole = x["groups"] * rep == x["heads"]  # K/V arrive with as many heads as Q
    kv_kept = kv * rep if (native_gqa(device, precision) or whole) else q
    return {"attention_qkv": (q + 2 * kv_kept) * B, "ulysses_context": q * B}


def exchange_bytes(m: ModelConfig, tp: int, precision: str) -> float:
    """Bytes per local token one all-to-all holds at once (module docstring: exchange)."""
    return 3 * dims(m, tp)["q"] * BYTES[precision]
