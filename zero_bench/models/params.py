"""The parameter list of megatron's GPTModel (local spec) from the description, per tensor-parallel
rank: every tensor's name, shape and FSDP2 group. The one list every consumer derives from: the
counts (num_params, params_per_shard ... below), DeepSpeed's buffer arithmetic (largest parameter, persistence
threshold), FSDP2's per-group shards and padding (estimate/fsdp2.py), and the live-model check.

The list follows GPTModel.named_parameters() exactly (tests/unit/test_models.py compares names and
shapes with the live model built on the meta device, for every preset at tp 1, 2 and 8).

megatron's order: the word embedding, the position table (learned positions), then per layer the
input norm, the attention output projection (Attention.__init__ builds it before SelfAttention adds
the QKV projection), the QKV projection, the query and key norms (qk_norm), the pre-MLP norm, fc1,
fc2 (an MoE layer: _moe); then the final norm and, untied, the output layer. Column-parallel
weights and biases (QKV, fc1, the vocabulary) split dim 0 over tp, row-parallel weights dim 1; their
biases, the norms and the position table are replicated. Every head is kv_channels wide (head_dim,
or h / a), so Q, K, V and the projection follow it, not h.

Expert parallelism (parallel.ep, tp 1): a rank holds `experts` of each MoE layer's routed experts
(config.layout.RankLayout.experts_per_rank: num_experts / ep), numbered locally (local_experts.0 ..
experts - 1, as megatron's SequentialMLP names them on every expert-parallel rank); everything else
(attention, norms, router, shared expert, embeddings) whole on every rank. Param.expert marks the
routed experts' tensors; where each parameter's states are partitioned is the layout's answer
(RankLayout.partition_ranks), as are the per-rank counts at a given ep (RankLayout.held_params ...).
This module divides by no parallel degree but tp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from zero_bench.models.description import ModelConfig

ROOT = "root"  # FSDP2's root group: everything outside the transformer layers


@dataclass(frozen=True)
class Param:
    """One parameter as one tensor-parallel rank holds it."""
    name: str
    """megatron's named_parameters() name"""
    shape: tuple[int, ...]
    """the local shape (tp-split where megatron splits it); FSDP2 shards dim 0 of it"""
    group: str
    """the FSDP2 group it is gathered with: "root" or "layer{i}" (engines/fsdp2.py)"""
    tp_dim: Optional[int] = None
    """the dimension megatron splits over tp ranks (its partition_dim), None where every tp rank
    holds it whole (norms, row-parallel biases, positions, the router)"""
    expert: bool = False
    """a routed expert's tensor (megatron's allreduce=False parameters): with parallel.ep > 1 its
    states are partitioned over the expert-data-parallel ranks (config.layout.RankLayout.partition_ranks)"""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


Spec = tuple  # (name, local shape, tp_dim[, expert]): expert is False where left out


def _norm(m: ModelConfig, prefix: str, width: int | None = None) -> list[Spec]:
    """LayerNorm has a weight and a bias; RMSNorm a weight only."""
    w = (width or m.hidden_size,)
    return [(f"{prefix}.weight", w, None)] + ([(f"{prefix}.bias", w, None)] if m.normalization == "layernorm" else [])


def _linear(prefix: str, out: int, inp: int, bias: bool, tp_dim: Optional[int]) -> list[Spec]:
    """A linear layer: column parallel (tp_dim 0: weight and bias split) or row parallel (tp_dim 1:
    the bias whole, added after the all-reduce)."""
    return ([(f"{prefix}.weight", (out, inp), tp_dim)]
            + ([(f"{prefix}.bias", (out,), 0 if tp_dim == 0 else None)] if bias else []))


def _mlp(m: ModelConfig, prefix: str, f: int, tp: int) -> list[Spec]:
    """megatron's MLP of width f on one tp rank: linear_fc1 (column parallel; gated: gate and up),
    linear_fc2 (row parallel, its bias whole). A routed or shared expert is the same module
    (experts.py SequentialMLP, shared_experts.py SharedExpertMLP: MLP subclasses)."""
    h, fc1_out = m.hidden_size, (2 * f if m.gated else f) // tp
    return (_linear(f"{prefix}.linear_fc1", fc1_out, h, m.add_bias, 0)
            + _linear(f"{prefix}.linear_fc2", h, f // tp, m.add_bias, 1))


def _moe(m: ModelConfig, prefix: str, tp: int, experts: Optional[int] = None) -> list[Spec]:
    """megatron-core 0.16.1's MoELayer with the local spec (moe_grouped_gemm=False), in the order
    MoELayer.__init__ builds it: the TopKRouter's weight [E, h] (fp32 at build, params_dtype after;
    replicated over tp and ep; bias [E] with add_bias_linear: router.py Router), this rank's
    `experts` (None: all E) of SequentialMLP (local_experts.{j}, j local: fc1, fc2, split over the
    expert tp, = tp), then SharedExpertMLP (moe_shared_expert_intermediate_size, no gate; whole on
    every ep rank)."""
    E, h = m.num_experts, m.hidden_size
    out = _linear(f"{prefix}.router", E, h, m.add_bias, None)
    for e in range(E if experts is None else experts):
        out += [(*s, True) for s in _mlp(m, f"{prefix}.experts.local_experts.{e}", m.moe_ffn, tp)]
    if m.moe_shared_expert_intermediate_size:
        out += _mlp(m, f"{prefix}.shared_experts", m.moe_shared_expert_intermediate_size, tp)
    return out


def _layer(m: ModelConfig, i: int, tp: int, moe: bool, experts: Optional[int] = None) -> list[Spec]:
    h, d, p = m.hidden_size, m.kv_channels, f"decoder.layers.{i}"
    qkv_out = (m.num_heads + 2 * m.query_groups) * d // tp  # the a query heads, g key and g value heads
    out = _norm(m, f"{p}.input_layernorm")
    out += _linear(f"{p}.self_attention.linear_proj", h, m.num_heads * d // tp, m.add_bias, 1)
    out += _linear(f"{p}.self_attention.linear_qkv", qkv_out, h, m.has_qkv_bias, 0)
    if m.qk_norm:  # SelfAttention builds them after linear_qkv; d wide, shared by the heads
        out += _norm(m, f"{p}.self_attention.q_layernorm", d) + _norm(m, f"{p}.self_attention.k_layernorm", d)
    out += _norm(m, f"{p}.pre_mlp_layernorm")
    out += _moe(m, f"{p}.mlp", tp, experts) if moe else _mlp(m, f"{p}.mlp", m.ffn, tp)
    return out


def params(m: ModelConfig, tp: int = 1, *, experts: Optional[int] = None) -> list[Param]:
    """Every parameter one rank holds (tensor-parallel rank; `experts`: the routed experts of each
    MoE layer it holds, config.layout.RankLayout.experts_per_rank; None: all of them), in
    GPTModel.named_parameters() order. At a given layout: RankLayout.params, built once."""
    h, V = m.hidden_size, m.padded_vocab(tp)
    root = [("embedding.word_embeddings.weight", (V // tp, h), 0)]  # vocab parallel
    if m.position_embedding == "learned":
        root.append(("embedding.position_embeddings.weight", (m.seq_len, h), None))
    out = [Param(n, s, ROOT, d) for n, s, d in root]
    for i, moe in enumerate(m.moe_layers):
        out += [Param(*spec[:2], f"layer{i}", *spec[2:]) for spec in _layer(m, i, tp, moe, experts)]
    tail = _norm(m, "decoder.final_layernorm")
    if not m.tie_embeddings:
        tail.append(("output_layer.weight", (V // tp, h), 0))  # vocab parallel
    return out + [Param(n, s, ROOT, d) for n, s, d in tail]


def param_numels(m: ModelConfig, tp: int = 1, *, experts: Optional[int] = None) -> list[int]:
    """Element count of every parameter one rank holds, in GPTModel.parameters() order."""
    return [p.numel for p in params(m, tp, experts=experts)]


def layer_numels(m: ModelConfig, tp: int = 1, moe: bool = False, *, experts: Optional[int] = None) -> list[int]:
    """One transformer layer's parameters on one rank, in module order (moe: its MLP is the MoE
    layer, with `experts` routed experts; None: all of them)."""
    return [math.prod(s[1]) for s in _layer(m, 0, tp, moe, experts)]


def mlp_numels(m: ModelConfig, f: int, tp: int = 1) -> list[int]:
    """One MLP of width f (a dense layer's, a routed or a shared expert's) on one tp rank."""
    return [math.prod(s[1]) for s in _mlp(m, "mlp", f, tp)]


# -- counts, each a sum over the list above ----------------------------------------------------
def num_params(m: ModelConfig) -> int:
    """Parameters of the whole model (one tensor-parallel rank at tp 1)."""
    return sum(param_numels(m, 1))


def expert_params(m: ModelConfig, tp: int = 1) -> int:
    """Parameters of one routed expert on one tp rank (megatron's expert MLP: fc1, fc2, biases)."""
    return sum(mlp_numels(m, m.moe_ffn, tp))


def active_params(m: ModelConfig) -> int:
    """Parameters one token is computed with (tp 1): everything but the E - k routed experts it is
    not sent to in each MoE layer (router, shared expert, attention, embeddings included);
    num_params for a dense model. Mixtral-8x7B: 12,879,925,248 of 46,702,792,704."""
    if not m.is_moe:
        return num_params(m)
    idle = m.num_experts - m.moe_router_topk
    return num_params(m) - idle * expert_params(m, 1) * m.num_moe_layers


def params_per_shard(m: ModelConfig, tp: int) -> int:
    """Parameters of one tensor-parallel shard of the model (replicated norms and row biases
    included), every routed expert once: what one rank holds whole before any ZeRO / FSDP2
    sharding at ep 1 (at ep > 1: config.layout.RankLayout.held_params)."""
    return sum(param_numels(m, tp))


def routed_expert_params(m: ModelConfig, tp: int = 1, *, experts: Optional[int] = None) -> int:
    """Parameters of `experts` routed experts in each MoE layer on one tp rank (None: all of them;
    0 for a dense model)."""
    if not m.is_moe:
        return 0
    return (m.num_experts if experts is None else experts) * m.num_moe_layers * expert_params(m, tp)


def dense_params(m: ModelConfig, tp: int = 1) -> int:
    """Parameters every rank holds whatever ep (all but the routed experts), sharded over all dp
    ranks: params_per_shard(m, tp) - routed_expert_params(m, tp)."""
    return params_per_shard(m, tp) - routed_expert_params(m, tp)
