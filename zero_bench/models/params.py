"""Parameter counts of megatron's GPTModel (local spec) from the description, per tensor-parallel rank.

The list follows GPTModel.parameters() order exactly (tests/unit/test_models.py compares it with
the live model built on the meta device, element for element, for every preset at tp 1, 2 and 8),
so DeepSpeed's buffer arithmetic (largest parameter, persistence threshold) sees the tensors the
engine will.

megatron's order: the word embedding, the position table (learned positions), then per layer the
input norm, the attention output projection (Attention.__init__ builds it before SelfAttention adds
the QKV projection), the QKV projection, the query and key norms (qk_norm), the pre-MLP norm, fc1,
fc2 (an MoE layer: moe_numels); then the final norm and, untied, the output layer. Column-parallel
weights and biases (QKV, fc1, the vocabulary) are split over tp; row-parallel biases (projection, fc2), norms and the
position table are replicated. Every head is kv_channels wide (head_dim, or h / a), so Q, K, V and
the projection follow it, not h.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zero_bench.models.description import ModelConfig


def _norm(m: ModelConfig) -> list[int]:
    """LayerNorm has a weight and a bias; RMSNorm a weight only."""
    h = m.hidden_size
    return [h, h] if m.normalization == "layernorm" else [h]


def _qk_norms(m: ModelConfig) -> list[int]:
    """q_layernorm and k_layernorm: one d-wide norm each, shared by the heads, replicated over tp."""
    if not m.qk_norm:
        return []
    d = m.kv_channels
    return 2 * ([d, d] if m.normalization == "layernorm" else [d])


def mlp_numels(m: ModelConfig, f: int, tp: int = 1) -> list[int]:
    """megatron's MLP of width f on one tp rank: linear_fc1 (column parallel; gated: gate and up),
    linear_fc2 (row parallel, its bias whole). A routed or shared expert is the same module
    (experts.py SequentialMLP, shared_experts.py SharedExpertMLP: MLP subclasses)."""
    h = m.hidden_size
    fc1_out = (2 * f if m.gated else f) // tp
    return [fc1_out * h] + ([fc1_out] if m.add_bias else []) + [h * (f // tp)] + ([h] if m.add_bias else [])


def moe_numels(m: ModelConfig, tp: int = 1) -> list[int]:
    """megatron-core 0.16.1's MoELayer with the local spec (moe_grouped_gemm=False), in the order
    MoELayer.__init__ builds it: the TopKRouter's weight [E, h] (fp32 at build, params_dtype after;
    replicated over tp; bias [E] with add_bias_linear: router.py Router), the E experts of
    SequentialMLP (local_experts.{i}: fc1, fc2, split over the expert tp, = tp; no expert
    parallelism), then SharedExpertMLP (moe_shared_expert_intermediate_size, no gate)."""
    E, h = m.num_experts, m.hidden_size
    out = [E * h] + ([E] if m.add_bias else [])
    out += mlp_numels(m, m.moe_ffn, tp) * E
    if m.moe_shared_expert_intermediate_size:
        out += mlp_numels(m, m.moe_shared_expert_intermediate_size, tp)
    return out


def layer_numels(m: ModelConfig, tp: int = 1, moe: bool = False) -> list[int]:
    """One transformer layer's parameters on one tp rank, in module order (moe: its MLP is the MoE layer)."""
    h, d = m.hidden_size, m.kv_channels
    qkv_out = (m.num_heads + 2 * m.query_groups) * d // tp  # the a query heads, g key and g value heads
    out = _norm(m)
    out += [h * (m.num_heads * d // tp)] + ([h] if m.add_bias else [])  # linear_proj (row parallel)
    out += [qkv_out * h] + ([qkv_out] if m.has_qkv_bias else [])  # linear_qkv (column parallel)
    out += _qk_norms(m)  # SelfAttention builds them after linear_qkv
    out += _norm(m)
    out += moe_numels(m, tp) if moe else mlp_numels(m, m.ffn, tp)
    return out


def param_numels(m: ModelConfig, tp: int = 1) -> list[int]:
    """Element count of every parameter one tensor-parallel rank holds, in GPTModel.parameters() order."""
    h, V = m.hidden_size, m.padded_vocab(tp)
    out = [V // tp * h]  # word embeddings (vocab parallel)
    if m.position_embedding == "learned":
        out.append(m.seq_len * h)  # position table (replicated)
    for moe in m.moe_layers:
        out += layer_numels(m, tp, moe)
    out += _norm(m)  # final norm
    if not m.tie_embeddings:
        out.append(V // tp * h)  # output layer (vocab parallel)
    return out
