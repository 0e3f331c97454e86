"""The model under test, described once: every count zero_bench derives (parameters per
tensor-parallel rank, FLOPs, activation bytes) comes from this description, and megatron.py builds
the live model from the same one, so the estimate cannot drift from what runs."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING


@dataclass
class ModelConfig:
    """A decoder-only transformer (conf/model/*.yaml); megatron-core's GPTModel with the local spec."""
    name: str = MISSING
    """Display name, as the report's Model column shows it."""
    num_layers: int = MISSING
    """Transformer layers."""
    hidden_size: int = MISSING
    """Width h of the residual stream; divisible by num_heads and by tp."""
    num_heads: int = MISSING
    """Attention heads a; divisible by tp."""
    seq_len: int = MISSING
    """Sequence length s of every sample (and of the learned position table)."""
    vocab_size: int = MISSING
    """Vocabulary V of the tokenizer (GPT-2: 50257); tokens are drawn from it."""
    pad_vocab_to: int = 1
    """The embedding / output layer has padded_vocab(tp) rows: V rounded up to a multiple of
    pad_vocab_to x tp, as Megatron's --make-vocab-size-divisible-by (128: 50304 at tp 1, 51200 at tp 8)."""

    def padded_vocab(self, tp: int = 1) -> int:
        step = self.pad_vocab_to * tp
        return -(-self.vocab_size // step) * step

    @property
    def num_params(self) -> int:
        """Parameters of the whole model (one tensor-parallel rank at tp 1)."""
        return sum(param_numels(self, 1))

    def params_per_shard(self, tp: int) -> int:
        """Parameters one tensor-parallel rank holds."""
        return sum(param_numels(self, tp))


def param_numels(model: ModelConfig, tp: int = 1) -> list[int]:
    """Element count of every parameter one tensor-parallel rank holds, in the module order of
    megatron's GPTModel (local spec, tied embeddings, learned positions). Column-parallel weights
    and biases (QKV, fc1) and row-parallel weights (projection, fc2) are split by tp; LayerNorms,
    row-parallel biases and the position table are replicated; the word embedding is split by rows.
    Per layer at tp 1: 12h^2 + 13h."""
    h, V, S = model.hidden_size, model.padded_vocab(tp), model.seq_len
    layer = [h, h,                          # input LayerNorm
             h * h // tp, h,                # projection (row parallel: bias replicated)
             3 * h * h // tp, 3 * h // tp,  # QKV (megatron registers it after the projection)
             h, h,                          # pre-MLP LayerNorm
             4 * h * h // tp, 4 * h // tp,  # fc1
             4 * h * h // tp, h]            # fc2
    return [V // tp * h, S * h] + layer * model.num_layers + [h, h]
