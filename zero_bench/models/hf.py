"""A local Hugging Face config.json (model_type llama, mistral, qwen2, qwen3, and the mixtures of
experts mixtral, qwen3_moe) -> the description's keys. No weights, no network: the model is built from the shapes with random weights.

Read as transformers reads it: a key the file leaves out takes transformers' default for that
model_type (DEFAULTS: transformers 4.57.1's configuration_<type>.py, and where the model reads a
key with a fallback of its own, modeling_<type>.py), so a Mistral config.json without
num_key_value_heads has 8 K/V heads and a 4096-token sliding window, as transformers builds it.
transformers itself is not imported (nor a dependency).

Every field that changes the built model is mapped or refused with one line naming it (a
ConfigError: exit 2); fields that only matter for inference or tokenisation (bos/eos ids,
use_cache, torch_dtype, initializer_range, pretraining_tp) are ignored. The sequence length,
dropout and attention kernel are zero_bench's keys, not the checkpoint's: max_position_embeddings
is what a checkpoint supports, not what a run trains at (a longer model.seq_len is warned about,
not refused: RoPE has no table to outgrow).
"""
from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path
from typing import Any, Optional

from zero_bench.errors import ConfigError

TRANSFORMERS_VERSION = "4.57.1"  # the release DEFAULTS were read from (pip download transformers==4.57.1)
_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
           "attention_dropout": 0.0, "head_dim": None}
# transformers 4.57.1, models/<type>/configuration_<type>.py __init__ defaults (head_dim None:
# hidden_size // num_attention_heads, as modeling_<type>.py falls back; num_key_value_heads None:
# num_attention_heads, as every one of these configs does).
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "mistral": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {**_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28},
    "qwen3": {**_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
              "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "attention_bias": False},
    # MixtralConfig: no head_dim default (None -> h / a, modeling_mixtral.py); the router (`gate`) and
    # w1/w2/w3 have no bias; modeling_mixtral.py always renormalises the top-k weights.
    "mixtral": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8,
                "output_router_logits": False, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0},
    # Qwen3MoeConfig: no head_dim parameter (modeling_qwen3_moe.py: getattr(config, "head_dim",
    # h // a)); q_norm / k_norm as Qwen3; a layer is MoE unless in mlp_only_layers or
    # (i + 1) % decoder_sparse_step != 0; the router (`gate`) has no bias.
    "qwen3_moe": {**_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "max_position_embeddings": 32768, "attention_bias": False, "use_sliding_window": False,
                  "sliding_window": 4096, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
                  "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
                  "output_router_logits": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": []},
}
MODEL_TYPES = tuple(DEFAULTS)
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # mixture-of-experts configs
# megatron's RotaryEmbedding._apply_scaling has these fixed (Llama 3.x's values).
LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_said: set[str] = set()  # warnings printed by this process (precheck and each job read the file again)


class HFConfigError(ConfigError):
    """A config.json zero_bench cannot honour; the message names the field."""


class HFConfig:
    """config.json's keys, with transformers' default for its model_type where a key is absent."""

    def __init__(self, raw: dict, model_type: str):
        self.raw, self.model_type, self.defaults = raw, model_type, DEFAULTS[model_type]

    def get(self, key: str) -> Any:
        return self.raw[key] if key in self.raw else self.defaults.get(key)

    def shown(self, key: str) -> str:
        """`key=value` for a message, saying where an absent key's value came from."""
        value = self.get(key)
        if key in self.raw:
            return f"{key}={value}"
        return f"{key}={value} (absent: transformers {TRANSFORMERS_VERSION}'s default for {self.model_type})"

    def positive(self, key: str) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HFConfigError(f"model.hf_config: {key}={value}: must be a positive integer")
        return value


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
    (the checks that depend on them: sliding window, attention dropout, max_position_embeddings)."""
    raw = _load(path)
    cfg = HFConfig(raw, _model_type(raw))
    hidden, heads = cfg.positive("hidden_size"), cfg.positive("num_attention_heads")
    _check_activation(cfg)
    _check_sliding_window(cfg, seq_len)
    _check_attention_dropout(cfg, dropout)
    _warn_long(cfg, path, seq_len)
    if cfg.get("use_mrope"):
        raise HFConfigError("model.hf_config: use_mrope=true: multimodal RoPE is not modelled")
    add_bias, qkv_bias = _biases(cfg)
    theta, scaling = _rope(cfg)
    groups = heads if cfg.get("num_key_value_heads") is None else cfg.positive("num_key_value_heads")
    return {
        "num_layers": cfg.positive("num_hidden_layers"),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_query_groups": groups,
        "head_dim": _head_dim(cfg, hidden, heads),
        "qk_norm": cfg.model_type in ("qwen3", "qwen3_moe"),  # q_norm / k_norm: RMSNorm over head_dim
        "ffn_hidden_size": cfg.positive("intermediate_size"),
        "vocab_size": cfg.positive("vocab_size"),  # padded only if model.pad_vocab_to says so (default 1)
        "activation": "swiglu",
        "normalization": "rmsnorm",
        "norm_eps": float(cfg.get("rms_norm_eps")),
        "position_embedding": "rope",
        "rope_base": theta,
        "rope_scaling_factor": scaling,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings")),
        "add_bias": add_bias,
        "qkv_bias": qkv_bias,
        **_moe(cfg),
    }


def _moe(cfg: HFConfig) -> dict[str, Any]:
    """The description's MoE keys ({} for a dense family). The load-balancing loss is added in
    training only with output_router_logits (MixtralForCausalLM / Qwen3MoeForCausalLM.forward)."""
    if cfg.model_type not in ("mixtral", "qwen3_moe"):
        return {}
    if cfg.get("router_jitter_noise"):
        raise HFConfigError(f"model.hf_config: {cfg.shown('router_jitter_noise')}: router input jitter is not "
                            "modelled")
    aux = float(cfg.get("router_aux_loss_coef")) if cfg.get("output_router_logits") else 0.0
    if cfg.model_type == "mixtral":
        return {"num_experts": cfg.positive("num_local_experts"), "moe_router_topk": cfg.positive("num_experts_per_tok"),
                "moe_ffn_hidden_size": cfg.positive("intermediate_size"), "norm_topk_prob": True,
                "moe_aux_loss_coeff": aux}
    return {"num_experts": cfg.positive("num_experts"), "moe_router_topk": cfg.positive("num_experts_per_tok"),
            "moe_ffn_hidden_size": cfg.positive("moe_intermediate_size"), "moe_dense_layers": _dense_layers(cfg),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob")), "moe_aux_loss_coeff": aux}


def _dense_layers(cfg: HFConfig) -> Optional[list[int]]:
    """Qwen3MoeDecoderLayer: layer i is MoE unless i is in mlp_only_layers or (i + 1) %
    decoder_sparse_step != 0; null when every layer is."""
    step, layers = cfg.positive("decoder_sparse_step"), cfg.positive("num_hidden_layers")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise HFConfigError(f"model.hf_config: mlp_only_layers={only}: must be a list of layer indices")
    dense = [i for i in range(layers) if i in only or (i + 1) % step]
    return dense or None


def position_limit(path: str) -> Optional[int]:
    """The max_position_embeddings config.json gives (the positions the checkpoint was trained for)."""
    limit = _load(path).get("max_position_embeddings")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def _load(path: str) -> dict:
    p = config_path(path)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise HFConfigError(f"model.hf_config={path}: cannot read a JSON config ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"model.hf_config={path}: not a JSON object")
    return cfg


def _model_type(raw: dict) -> str:
    """The family, or one line naming what is modelled and the nearest of them."""
    model_type = raw.get("model_type")
    if model_type in DEFAULTS:
        return model_type
    nearest = difflib.get_close_matches(str(model_type), MODEL_TYPES, n=1, cutoff=0.0)[0]
    moe = next((k for k in MOE_KEYS if k in raw), None)
    why = f"mixture-of-experts ({moe}) of this family is not modelled" if moe else "other families are not modelled"
    raise HFConfigError(f"model.hf_config: model_type={model_type}: {why}; zero_bench reads "
                        f"{', '.join(MODEL_TYPES)} (nearest: {nearest})")


def _head_dim(cfg: HFConfig, hidden: int, heads: int) -> Optional[int]:
    """The description's head_dim: null where heads are hidden / heads wide (the default a preset
    has), else the width the model builds (Mistral-Nemo's 128 on 5120 / 32; any Qwen3's)."""
    d = hidden // heads if cfg.get("head_dim") is None else cfg.positive("head_dim")
    return None if d * heads == hidden else d


def _check_activation(cfg: HFConfig) -> None:
    if cfg.get("hidden_act") != "silu":
        raise HFConfigError(f"model.hf_config: {cfg.shown('hidden_act')}: zero_bench builds SwiGLU (silu) MLPs "
                            "for these model types")


def _check_sliding_window(cfg: HFConfig, seq_len: int) -> None:
    """Mistral windows every layer (4096 when the key is absent; null: none); Qwen2/3 only with
    use_sliding_window. A window at least as long as the sequence is the same computation as full
    causal attention, so only a shorter one is refused."""
    window = cfg.get("sliding_window")
    if cfg.model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None
    elif cfg.model_type == "llama":
        window = None  # LlamaAttention has no window
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) and window is None:
        raise HFConfigError(f"model.hf_config: layer_types={sorted(set(layer_types))}: only full attention is "
                            "modelled")
    if window is not None and window < seq_len:
        raise HFConfigError(f"model.hf_config: {cfg.shown('sliding_window')}: shorter than model.seq_len={seq_len}; "
                            "sliding-window attention is not modelled (use model.seq_len <= the window)")


def _check_attention_dropout(cfg: HFConfig, dropout: float) -> None:
    p = cfg.get("attention_dropout") or 0.0
    if p not in (0.0, dropout):
        raise HFConfigError(f"model.hf_config: attention_dropout={p}: model.dropout applies to hidden states and "
                            "attention alike; set model.dropout")


def _warn_long(cfg: HFConfig, path: str, seq_len: int) -> None:
    """Training past the positions a checkpoint was made for runs (RoPE has no table); say it once."""
    limit = cfg.get("max_position_embeddings")
    if isinstance(limit, int) and seq_len > limit:
        line = (f"model.seq_len={seq_len}: longer than {cfg.shown('max_position_embeddings')} of "
                f"model.hf_config={path}; measured as asked")
        if line not in _said:
            _said.add(line)
            print(f"zero_bench: warning: {line}", file=sys.stderr, flush=True)


def _biases(cfg: HFConfig) -> tuple[bool, bool]:
    """(add_bias, qkv_bias), as each family's modeling file builds its linears. megatron puts
    add_bias_linear on all four linears of a layer and add_qkv_bias on QKV alone. Llama:
    attention_bias covers Q, K, V and O, mlp_bias the MLP; Qwen3: attention_bias on Q, K, V and O,
    never the MLP (Qwen3-MoE likewise; its experts and router have none); Qwen2: Q, K, V always
    (hard-coded), never O or the MLP; Mistral and Mixtral: none (their modeling files ignore both keys)."""
    if cfg.model_type == "qwen2":
        return False, True
    if cfg.model_type in ("mistral", "mixtral"):
        return False, False
    attention = bool(cfg.get("attention_bias"))
    mlp = bool(cfg.get("mlp_bias")) if cfg.model_type == "llama" else False
    if attention != mlp:
        field = "attention_bias" if attention else "mlp_bias"
        raise HFConfigError(f"model.hf_config: {field}=true: megatron biases either all linear layers or QKV "
                            f"only; attention_bias={str(attention).lower()} with mlp_bias={str(mlp).lower()} "
                            f"cannot be built ({cfg.model_type})")
    return attention, False


def _rope(cfg: HFConfig) -> tuple[float, Optional[float]]:
    """(rope_base, rope_scaling_factor) from rope_theta + rope_scaling, or transformers v5's
    rope_parameters. Only Llama 3's scaling with megatron's fixed constants is honoured."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict) or not isinstance(params, dict):
        raise HFConfigError(f"model.hf_config: rope_scaling={scaling}: not a mapping")
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta")))
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
