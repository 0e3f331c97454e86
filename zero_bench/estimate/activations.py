"""Activation bytes one sample adds to a rank's peak: Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", for recompute none / selective / full."""
from __future__ import annotations

from typing import Mapping, Optional

from zero_bench.units import BYTES
from zero_bench.models import ModelConfig


def activation_bytes_per_sample(model: ModelConfig, tp: int = 1, precision: str = "bf16", recompute: str = "none",
                                checkpointing: Optional[Mapping] = None) -> dict:
    """Activation bytes one sample (sequence) adds to a rank's peak.

    Per transformer layer, Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", eq. 2, tensor parallel t, no sequence parallelism), 16-bit:
    s*h*(10 + 24/t + 5*a*s/(h*t)), of which the dropout masks (2 s*h, a*s^2) and dropout's output
    (2 a*s^2) exist only with dropout. zero_bench's GPT runs without dropout, so:
        none:      s*h*(8 + 24/t + 2*a*s/(h*t))  per layer (2*a*s^2: the softmax output)
        selective: s*h*(8 + 24/t)                per layer, + one layer's attention while recomputed
        full:      2*s*h per layer (its input, kept), /t with partition_activations, in host memory
                   with cpu_checkpointing, + one layer's activations while it is recomputed
    Embedding and output: the final LayerNorm's and the output projection's inputs: 4*s*h. Logits
    (megatron's vocab-parallel cross entropy): the projection's output in the training dtype plus
    its fp32 softmax: s*V/t*(bytes + 4), V padded. fp32 doubles every 16-bit term.
    Measured live tensor bytes per sample on CPU (8 layers, h 128, s 256, fp32; README): none,
    selective and full within 4 % of this.
    checkpointing: the ds_config's activation_checkpointing section (recompute=full only).
    Returns bytes: per_layer, layers (what L layers keep), recomputed (one layer, in backward),
    embedding, logits, host (on the host: cpu_checkpointing), total (the rank's device).
    """
    s, h, a, L = model.seq_len, model.hidden_size, model.num_heads, model.num_layers
    V = model.padded_vocab(tp)
    b = BYTES[precision]
    scale = b / 2
    attention = 2 * a * s * s / tp * scale
    layer = s * h * (8 + 24 / tp) * scale + attention
    ck = checkpointing or {}
    host = 0.0
    if recompute == "full":
        kept = 2 * s * h * scale / (tp if ck.get("partition_activations") else 1)
        layers, recomputed = L * kept, layer
        if ck.get("partition_activations") and ck.get("cpu_checkpointing"):
            layers, host = 0.0, L * kept
    elif recompute == "selective":
        layers, recomputed = L * (layer - attention), attention
    else:
        layers, recomputed = L * layer, 0.0
    embed = 4 * s * h * scale
    logits = s * V / tp * (b + 4)
    out = {"per_layer": layer, "layers": layers, "recomputed": recomputed, "embedding": embed,
           "logits": logits, "host": host, "total": layers + recomputed + embed + logits}
    return {k: int(v) for k, v in out.items()}
