"""Training FLOPs from the description, for MFU and HFU (zero_bench.devices.metrics divides them by the
peak). The convention is MPT's (llm-foundry scripts/train/benchmarking), so figures compare with
published tables: per sequence, passes x (2 x N x s + 4 x L x (a x d) x s^2), 3 passes (forward,
input gradient, weight gradient) for MFU, and what recompute re-runs on top for HFU.

N counts the weights a token is multiplied by: every parameter of the model with the vocabulary
matrix once; in a mixture of experts only the ACTIVE parameters (models.params.active_params: the
top-k routed experts, the router, the shared expert and everything dense), as the MoE papers count
"active parameters" (Mixtral: 12.9B of 46.7B). Tied (GPT-2) that is num_params, so every GPT preset keeps the figure it had; untied,
the input embedding is a lookup (no FLOPs) and the output layer is the one counted. SwiGLU's three
matrices (fc1 holds gate and up), GQA's smaller K/V projections, heads of head_dim wide and the
output layer all come in through N. The attention term counts QK^T and attention x V over all a query heads whatever the
number of K/V groups, over the full s x s square (MPT's convention; causal flash kernels skip about
half of it, so their hardware FLOPs are lower than counted); d is the head width (head_dim, or
h / a). Norms (qk-norm's too), biases, RoPE and softmax are inside N or left out, as the convention
does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from zero_bench.config.schema import Recompute
from zero_bench.models.params import active_params

if TYPE_CHECKING:
    from zero_bench.models.description import ModelConfig


def convention_flops_per_seq(n_params: float, n_layers: int, attn_width: int, seq_len: int,
                             passes: float = 3) -> float:
    """MPT's formula on plain numbers: `passes` x (2 N s + 4 L (a d) s^2). attn_width = a x d: the
    model width h unless head_dim sets d apart (Qwen3-0.6B: 16 x 128 = 2048 on h = 1024)."""
    return passes * (2 * n_params * seq_len + 4 * n_layers * attn_width * seq_len ** 2)


def flop_params(m: ModelConfig) -> int:
    """N: parameters that cost 2 FLOPs per token in the forward pass (the vocabulary matrix once)."""
    untied_input_embedding = 0 if m.tie_embeddings else m.padded_vocab(1) * m.hidden_size
    return active_params(m) - untied_input_embedding


def dense_flops_per_seq(m: ModelConfig) -> float:
    """Forward FLOPs of the multiplications with weights, one sequence."""
    return convention_flops_per_seq(flop_params(m), 0, 0, m.seq_len, 1)


def attention_flops_per_seq(m: ModelConfig) -> float:
    """Forward FLOPs of QK^T and attention x V, one sequence: 4 x L x (a x d) x s^2."""
    return convention_flops_per_seq(0, m.num_layers, m.num_heads * m.kv_channels, m.seq_len, 1)


def model_flops_per_seq(m: ModelConfig) -> float:
    """MFU's numerator per sequence: forward + backward (3 passes), nothing recomputed counted."""
    return 3 * (dense_flops_per_seq(m) + attention_flops_per_seq(m))


def hardware_flops_per_seq(m: ModelConfig, recompute: Recompute = Recompute.none, recompute_layers: int = 1) -> float:
    """HFU's numerator: what the hardware computes, recompute included. full re-runs every layer's
    forward (4 passes, as MPT counts activation checkpointing; the output layer is counted 4 times
    too, as there); block re-runs recompute_layers of the layers' forwards; selective re-runs the
    core attention, the s^2 term, once more; op re-runs the matmuls its policy does not keep
    (models/op_recompute.py: every second one, linear_proj and each down projection), and the
    attention's scores where no kernel output is kept: unfused, or with dropout (CPU's math kernel;
    a CUDA kernel that draws dropout masks is recomputed so that the recompute draws them again)."""
    dense, attn = dense_flops_per_seq(m), attention_flops_per_seq(m)
    if recompute == Recompute.op:
        parts = breakdown_per_token(m)
        down = parts["mlp"] / (3 if m.gated else 2)  # fc2 of the MLP's 3 (SwiGLU) or 2 matrices
        scores = attn if m.attention == "unfused" or m.dropout > 0 else 0  # no kernel output kept: recomputed
        return 3 * (dense + attn) + m.seq_len * (parts["attention_proj"] + down) + scores
    if recompute == Recompute.full:
        return 4 * (dense + attn)
    if recompute == Recompute.block:
        return (3 + min(recompute_layers, m.num_layers) / m.num_layers) * (dense + attn)
    if recompute == Recompute.selective:
        return 3 * dense + 4 * attn
    return 3 * (dense + attn)


def breakdown_per_token(m: ModelConfig) -> dict:
    """Forward FLOPs per token by part (tp 1), for reading the totals."""
    h, d, L, n_moe = m.hidden_size, m.kv_channels, m.num_layers, m.num_moe_layers
    mats = 3 if m.gated else 2
    # per MoE layer a token passes the router and k experts (and the shared expert)
    routed = m.moe_router_topk * m.moe_ffn + (m.moe_shared_expert_intermediate_size or 0) if m.is_moe else 0
    return {
        "qkv": 2 * L * h * (m.num_heads + 2 * m.query_groups) * d,
        "attention_proj": 2 * L * m.num_heads * d * h,
        "mlp": 2 * h * mats * ((L - n_moe) * m.ffn + n_moe * routed),
        "router": 2 * n_moe * h * (m.num_experts or 0),
        "output_layer": 2 * m.padded_vocab(1) * h,
        "attention_scores": attention_flops_per_seq(m) / m.seq_len,
    }
