"""A local Hugging Face config.json (model_type llama, mistral, qwen2) -> the description's keys.
No weights, no network: the model is built from the shapes with random weights.

Every field that changes the built model is mapped or refused with one line naming it (a
ConfigError: exit 2); fields that only matter for inference or tokenisation (bos/eos ids,
use_cache, torch_dtype, initializer_range, max_position_embeddings, pretraining_tp) are ignored.
The sequence length, dropout and attention kernel are zero_bench's keys, not the checkpoint's:
max_position_embeddings is what a checkpoint supports, not what a run trains at.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from zero_bench.errors import ConfigError

MODEL_TYPES = ("llama", "mistral", "qwen2")
# megatron's RotaryEmbedding._apply_scaling has these fixed (Llama 3.x's values).
LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class HFConfigError(ConfigError):
    """A config.json zero_bench cannot honour; the message names the field."""


def config_path(path: str) -> Path:
    """The config.json a model.hf_config names (a file, or a directory holding one)."""
    p = Path(path).expanduser()
    return p / "config.json" if p.is_dir() else p


def display_name(path: str) -> str:
    """The name a config.json gives the model: its directory's (meta-llama/Meta-Llama-3-8B/config.json)."""
    p = config_path(path)
    return p.resolve().parent.name if p.name == "config.json" else p.stem


def read_hf_config(path: str, seq_len: int, dropout: float = 0.0) -> dict[str, Any]:
    """The description keys config.json at `path` determines. seq_len and dropout are the user's
    (the checks that depend on them: sliding window, attention dropout)."""
    cfg = _load(path)
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise HFConfigError(f"model.hf_config: model_type={model_type}: zero_bench reads {', '.join(MODEL_TYPES)} "
                            "config.json files (other families are not modelled)")
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    _check_activation(cfg)
    _check_head_dim(cfg, hidden, heads)
    _check_sliding_window(cfg, seq_len)
    _check_attention_dropout(cfg, dropout)
    if cfg.get("use_mrope"):
        raise HFConfigError("model.hf_config: use_mrope=true: multimodal RoPE is not modelled")
    add_bias, qkv_bias = _biases(cfg, model_type)
    theta, scaling = _rope(cfg)
    return {
        "num_layers": _int(cfg, "num_hidden_layers"),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_query_groups": _int(cfg, "num_key_value_heads", heads),
        "ffn_hidden_size": _int(cfg, "intermediate_size"),
        "vocab_size": _int(cfg, "vocab_size"),  # padded only if model.pad_vocab_to says so (default 1)
        "activation": "swiglu",
        "normalization": "rmsnorm",
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "position_embedding": "rope",
        "rope_base": theta,
        "rope_scaling_factor": scaling,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "add_bias": add_bias,
        "qkv_bias": qkv_bias,
    }


def _load(path: str) -> dict:
    p = config_path(path)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise HFConfigError(f"model.hf_config={path}: cannot read a JSON config ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"model.hf_config={path}: not a JSON object")
    return cfg


def _int(cfg: dict, key: str, default: Optional[int] = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFConfigError(f"model.hf_config: {key}={value}: must be a positive integer")
    return value


def _check_activation(cfg: dict) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"model.hf_config: hidden_act={act}: zero_bench builds SwiGLU (silu) MLPs for these "
                            "model types")


def _check_head_dim(cfg: dict, hidden: int, heads: int) -> None:
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise HFConfigError(f"model.hf_config: head_dim={head_dim}: only hidden_size / num_attention_heads = "
                            f"{hidden // heads} is modelled")


def _check_sliding_window(cfg: dict, seq_len: int) -> None:
    """Mistral windows every layer; Qwen2 only with use_sliding_window. A window at least as long as
    the sequence is the same computation as full causal attention, so only a shorter one is refused."""
    window = cfg.get("sliding_window")
    if cfg.get("model_type") == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) and window is None:
        raise HFConfigError(f"model.hf_config: layer_types={sorted(set(layer_types))}: only full attention is "
                            "modelled")
    if window is not None and window < seq_len:
        raise HFConfigError(f"model.hf_config: sliding_window={window}: shorter than model.seq_len={seq_len}; "
                            "sliding-window attention is not modelled (use model.seq_len <= the window)")


def _check_attention_dropout(cfg: dict, dropout: float) -> None:
    p = cfg.get("attention_dropout", 0.0) or 0.0
    if p not in (0.0, dropout):
        raise HFConfigError(f"model.hf_config: attention_dropout={p}: model.dropout applies to hidden states and "
                            "attention alike; set model.dropout")


def _biases(cfg: dict, model_type: str) -> tuple[bool, bool]:
    """(add_bias, qkv_bias). megatron puts add_bias_linear on all four linears of a layer and
    add_qkv_bias on QKV alone; Llama's attention_bias covers Q, K, V and O, mlp_bias the MLP."""
    if model_type == "qwen2":
        return False, True  # Qwen2Attention: bias on q/k/v_proj (hard-coded), none on o_proj or the MLP
    attention, mlp = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
    if attention != mlp:
        field = "attention_bias" if attention else "mlp_bias"
        raise HFConfigError(f"model.hf_config: {field}=true: megatron biases either all linear layers or QKV "
                            f"only; attention_bias={str(attention).lower()} with mlp_bias={str(mlp).lower()} "
                            "cannot be built")
    return attention, False


def _rope(cfg: dict) -> tuple[float, Optional[float]]:
    """(rope_base, rope_scaling_factor) from rope_theta + rope_scaling, or transformers v5's
    rope_parameters. Only Llama 3's scaling with megatron's fixed constants is honoured."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict) or not isinstance(params, dict):
        raise HFConfigError(f"model.hf_config: rope_scaling={scaling}: not a mapping")
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HFConfigError(f"model.hf_config: rope_scaling.rope_type={kind}: only llama3 frequency scaling is "
                            "modelled")
    for key, want in LLAMA3_SCALING.items():
        if float(merged.get(key, want)) != want:
            raise HFConfigError(f"model.hf_config: rope_scaling.{key}={merged[key]}: megatron's llama3 scaling "
                                f"fixes it at {want:g}")
    return theta, float(merged.get("factor", 8.0))
