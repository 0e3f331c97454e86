"""The model under test, described once: every count zero_bench derives (parameters per
tensor-parallel rank, FLOPs, activation bytes) comes from this description, and megatron.py builds
the live model from the same one, so the estimate cannot drift from what runs.

The defaults describe the GPT-2-era models zero_bench ran first (learned positions, LayerNorm, GeLU
4h MLP, multi-head attention, tied embeddings, linear biases, no dropout, megatron's unfused
attention): a conf/model/gpt*.yaml or a stored record that names only the shape keys keeps its
meaning and its parameter count. Ranges and choices are checked in zero_bench.config.configure.check_model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Optional

from omegaconf import MISSING


class Activation(StrEnum):
    gelu = "gelu"  # fc1 (h -> f), GeLU, fc2 (f -> h)
    swiglu = "swiglu"  # fc1 (h -> 2f: gate and up), SiLU(gate) * up, fc2 (f -> h)


class Normalization(StrEnum):
    layernorm = "layernorm"  # weight and bias
    rmsnorm = "rmsnorm"  # weight only


class PositionEmbedding(StrEnum):
    learned = "learned"  # a seq_len x h table added to the token embeddings
    rope = "rope"  # rotary embeddings on queries and keys, no parameters


class Attention(StrEnum):
    unfused = "unfused"  # megatron's DotProductAttention: keeps a x s x s score tensors
    sdpa = "sdpa"  # torch's scaled_dot_product_attention, is_causal: flash kernels, nothing s x s


ENUMS = {"activation": Activation, "normalization": Normalization, "position_embedding": PositionEmbedding,
         "attention": Attention}
FLOATS = ("rope_base", "rope_scaling_factor", "dropout", "norm_eps", "moe_aux_loss_coeff")



def native_gqa(device: str, precision: str) -> bool:
    """Whether the attention kernel torch picks takes K/V with fewer heads than Q (enable_gqa): the
    CPU flash kernel in every precision, CUDA's flash kernel in 16 bits; CUDA's memory-efficient
    kernel (fp32) would fall back to the math kernel, so K/V are expanded first. The one rule:
    models/sdpa.py runs by it and estimate/activations.py counts the copies it implies."""
    return device == "cpu" or precision in ("bf16", "fp16")

@dataclass
class ModelConfig:
    """A decoder-only transformer (conf/model/*.yaml, or a Hugging Face config.json through
    hf_config); megatron-core's GPTModel with the local layer spec."""
    name: str = MISSING
    """Display name, as the report's Model column shows it."""
    num_layers: int = MISSING
    """Transformer layers L."""
    hidden_size: int = MISSING
    """Width h of the residual stream; divisible by tp (and by num_heads unless head_dim is set)."""
    num_heads: int = MISSING
    """Query heads a; divisible by tp. Each head is head_dim wide (default hidden_size / num_heads)."""
    seq_len: int = MISSING
    """Sequence length s of every sample: the length you train at, not a checkpoint's
    max_position_embeddings (with learned positions also the size of the position table)."""
    vocab_size: int = MISSING
    """Vocabulary V of the tokenizer (GPT-2: 50257, Llama 3: 128256); tokens are drawn from it."""
    pad_vocab_to: int = 1
    """The embedding / output layer has padded_vocab(tp) rows: V rounded up to a multiple of
    pad_vocab_to x tp, as Megatron's --make-vocab-size-divisible-by (128: 50304 at tp 1, 51200 at
    tp 8); 1 keeps a published vocabulary as published."""
    ffn_hidden_size: Optional[int] = None
    """MLP intermediate width f (SwiGLU: the width of each of the gate and up projections); null: 4h."""
    num_query_groups: Optional[int] = None
    """Key/value heads g (grouped-query attention; 1 = multi-query); must divide num_heads, and tp
    must divide it; null: num_heads (multi-head attention)."""
    head_dim: Optional[int] = None
    """Width d of each query, key and value head (megatron's kv_channels); null: hidden_size /
    num_heads. Set where a model's heads are not h/a wide: Mistral-Nemo (h 5120, 32 heads of 128),
    Qwen3 (Qwen3-0.6B: h 1024, 16 heads of 128)."""
    qk_norm: bool = False
    """A norm (model.normalization's kind, one d-wide weight shared by the heads) on each query
    and key head before RoPE: megatron's qk_layernorm, Qwen3's q_norm / k_norm."""
    activation: Activation = Activation.gelu
    """gelu: fc1 (h -> f), GeLU, fc2 (f -> h). swiglu: fc1 (h -> 2f, gate and up), SiLU(gate) * up, fc2."""
    normalization: Normalization = Normalization.layernorm
    """layernorm (weight and bias) or rmsnorm (weight only): before attention, before the MLP and
    after the last layer."""
    position_embedding: PositionEmbedding = PositionEmbedding.learned
    """learned: a seq_len x h position table; rope: rotary embeddings on queries and keys (no parameters)."""
    rope_base: float = 10000.0
    """RoPE's base period theta (Llama 3: 500000); unused with learned positions."""
    rope_scaling_factor: Optional[float] = None
    """Llama 3.1's RoPE frequency scaling ("rope_type": "llama3"; low/high frequency factors 1/4,
    original context 8192, as megatron's RotaryEmbedding implements it): changes values, never
    shapes or memory. null: no scaling."""
    tie_embeddings: bool = True
    """The output layer reuses the word-embedding matrix (GPT-2); false gives it its own V x h."""
    add_bias: bool = True
    """Biases on every linear layer (QKV, attention output, fc1, fc2), as GPT-2."""
    qkv_bias: bool = False
    """A bias on the QKV projection only (Qwen2); implied by add_bias."""
    dropout: float = 0.0
    """Dropout probability after the embedding, on the attention probabilities and after the
    attention and MLP blocks (Megatron's --hidden-dropout and --attention-dropout together). 0 keeps
    fp32 losses equal across ZeRO stages."""
    attention: Attention = Attention.unfused
    """unfused: megatron's DotProductAttention (softmax(QK^T)V; keeps a x s x s tensors per layer).
    sdpa: torch's scaled_dot_product_attention with is_causal (flash / memory-efficient kernels on
    GPU, the flash kernel on CPU; no s x s tensor). With sdpa, recompute=selective saves nothing
    (flash keeps no s x s tensors to drop) and costs a little: docs/models.md,
    "What is modelled, and what is not"."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm."""
    num_experts: Optional[int] = None
    """Routed experts E of every mixture-of-experts layer (megatron's num_moe_experts; Mixtral 8,
    Qwen3-30B-A3B 128); null: a dense model. Each expert is an MLP of model.activation, moe_ffn wide;
    all E are parameters of every rank (ZeRO and FSDP2 shard them like any tensor), or with
    parallel.ep > 1 (expert parallelism) E / ep of them per rank."""
    moe_router_topk: int = 2
    """Experts k each token is routed to (megatron's moe_router_topk, HF's num_experts_per_tok);
    1 <= k <= num_experts. Routing is dropless (no capacity factor): k x tokens expert rows per layer."""
    moe_ffn_hidden_size: Optional[int] = None
    """Intermediate width of each routed expert (HF: Mixtral intermediate_size, Qwen3-MoE
    moe_intermediate_size); null: ffn_hidden_size."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared expert every token also goes through (Qwen2-MoE style, megatron's
    moe_shared_expert_intermediate_size; no gate); null: none (Mixtral, Qwen3-MoE)."""
    moe_dense_layers: Optional[list[int]] = None
    """0-based layers whose MLP stays dense (ffn_hidden_size wide); every other layer is an MoE
    layer. From Qwen3-MoE's mlp_only_layers and decoder_sparse_step (layer i is MoE when
    (i + 1) % step == 0); megatron builds it as a moe_layer_freq list. null: every layer is MoE."""
    norm_topk_prob: bool = True
    """The k routing weights are renormalised to sum 1 (softmax over the top-k logits: megatron's
    moe_router_pre_softmax=false; Mixtral always, Qwen3-MoE's norm_topk_prob). false: softmax over
    all experts, then top-k (moe_router_pre_softmax=true). The router has a bias iff add_bias
    (megatron's router follows add_bias_linear)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (megatron's moe_aux_loss_coeff, HF's
    router_aux_loss_coef); > 0 keeps the router's full fp32 softmax for backward."""
    hf_config: Optional[str] = None
    """A local Hugging Face config.json (or its directory; model_type llama, mistral, qwen2, qwen3,
    mixtral or qwen3_moe): its shape keys replace the ones above (configure.py reads it; no
    weights, no network). seq_len, dropout and attention stay yours (`model=hf
    model.hf_config=PATH model.seq_len=4096`)."""

    def __post_init__(self) -> None:
        # Plain values (a YAML read directly, a stored record) become the types the schema has, so
        # a description compares and hashes the same whichever way it was built.
        for key, kind in ENUMS.items():
            setattr(self, key, kind(getattr(self, key)))
        for key in FLOATS:
            value = getattr(self, key)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, key, float(value))

    # -- derived shapes -------------------------------------------------------------------------
    def padded_vocab(self, tp: int = 1) -> int:
        """Rows of the embedding (and of an untied output layer) over all tp ranks together."""
        step = self.pad_vocab_to * tp
        return -(-self.vocab_size // step) * step

    @property
    def ffn(self) -> int:
        """MLP intermediate width f."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """Key/value heads g."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_heads

    @property
    def kv_channels(self) -> int:
        """Width d of one head."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def gated(self) -> bool:
        """fc1 produces two f-wide halves (SwiGLU)."""
        return self.activation == Activation.swiglu

    @property
    def has_qkv_bias(self) -> bool:
        return self.add_bias or self.qkv_bias

    # -- mixture of experts ---------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def moe_ffn(self) -> int:
        """Intermediate width of one routed expert."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn

    @property
    def moe_layers(self) -> list[bool]:
        """Per layer (0-based): whether its MLP is an MoE layer."""
        dense = set(self.moe_dense_layers or ())
        return [self.is_moe and i not in dense for i in range(self.num_layers)]

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)


def summary(m: ModelConfig) -> str:
    """One line a user checks the description by (an imported config.json especially)."""
    heads = f"{m.num_heads} heads" + (f" of {m.head_dim}" if m.head_dim is not None else "")
    heads += (f" / {m.query_groups} query groups" if m.query_groups != m.num_heads else "")
    heads += ", qk-norm" if m.qk_norm else ""
    biases = "biases" if m.add_bias else ("QKV bias" if m.qkv_bias else "no biases")
    rope = f"RoPE base {m.rope_base:g}" + (f" scaled x{m.rope_scaling_factor:g}" if m.rope_scaling_factor else "")
    return (f"{m.num_layers} layers, hidden {m.hidden_size}, {heads}, {m.activation} {m.ffn}, {m.normalization}, "
            f"{rope if m.position_embedding == 'rope' else 'learned positions'}, "
            f"{'tied' if m.tie_embeddings else 'untied'}, {biases}, {m.attention} attention, dropout {m.dropout:g}, "
            f"seq {m.seq_len}, vocab {m.vocab_size} ({m.padded_vocab(1)} rows){moe_summary(m)}")


def moe_summary(m: ModelConfig) -> str:
    """The MoE part of summary(): experts, top-k, widths and the dense layers ("" when dense)."""
    if not m.is_moe:
        return ""
    shared = (f" + shared {m.moe_shared_expert_intermediate_size}"
              if m.moe_shared_expert_intermediate_size else "")
    dense = f", dense MLP in layers {m.moe_dense_layers}" if m.moe_dense_layers else ""
    return f", MoE {m.num_experts} experts of {m.moe_ffn} top-{m.moe_router_topk}{shared}{dense}"


# Fields added after records were first stored: at their default they describe the GPT those
# records ran, so they stay out of a configuration's key and old keys keep their value.
LATER_FIELDS = ("ffn_hidden_size", "num_query_groups", "activation", "normalization", "position_embedding",
                "rope_base", "rope_scaling_factor", "tie_embeddings", "add_bias", "qkv_bias", "dropout",
                "attention", "norm_eps", "hf_config", "head_dim", "qk_norm", "num_experts", "moe_router_topk",
                "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_dense_layers", "norm_topk_prob",
                "moe_aux_loss_coeff")


def key_fields(model: dict) -> dict:
    """The model's part of a configuration key (BenchConfig.search_key): a stored dict without the
    later fields that are at their default."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    return {k: v for k, v in model.items() if not (k in LATER_FIELDS and v == defaults[k])}


def from_stored(model: dict[str, Any]) -> Optional[ModelConfig]:
    """A stored model dict (any zero_bench version) -> ModelConfig; None when it cannot describe a
    model (a raw grid entry with missing keys, an unknown value)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        m = ModelConfig(**{k: v for k, v in model.items() if k in known})
    except (TypeError, ValueError):
        return None
    return m if describes(m) else None


def describes(m: ModelConfig) -> bool:
    """Whether `m` describes a model: every shape it is computed from filled (not ModelConfig's
    unfilled defaults, as a skipped grid entry's partial model leaves them)."""
    required = ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size")
    return all(isinstance(getattr(m, k), int) and not isinstance(getattr(m, k), bool) for k in required)
