"""The query / key norms (description's qk_norm; megatron's q_layernorm and k_layernorm, Qwen3's
q_norm and k_norm): torch's RMSNorm or LayerNorm over one head, d wide, one weight shared by all
heads, whose gradient is summed over the tensor-parallel ranks.

Why not megatron's own module: each tp rank normalises only its own heads, so its gradient of the
shared weight is a partial sum. megatron adds the partials in finalize_model_grads (its
DistributedDataParallel's step, megatron-core 0.16.1 distributed/finalize_model_grads.py
_allreduce_non_tensor_model_parallel_grads, matching "q_layernorm" / "k_layernorm" by name), which
neither DeepSpeed nor FSDP2 runs: the replicas would drift apart from the first step at tp > 1.
Here the weight passes through megatron's copy_to_tensor_model_parallel_region (identity forward,
all-reduce over the tp group in backward; nothing saved, nothing done at tp 1), so the gradient
every engine sees is already the whole one. The module, its parameter names and shapes are torch's
(megatron's local spec builds the same WrappedTorchNorm -> torch.nn.RMSNorm / LayerNorm).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _tp_summed(weight: Tensor) -> Tensor:
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(weight)


class TpSummedRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm whose weight's gradient is summed over the tp group."""

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, _tp_summed(self.weight), self.eps)


class TpSummedLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm whose weight's and bias's gradients are summed over the tp group."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, _tp_summed(self.weight), _tp_summed(self.bias), self.eps)


class QKNorm:
    """build_module target for SelfAttentionSubmodules.q_layernorm / k_layernorm (called as
    megatron calls WrappedTorchNorm: config, hidden_size = the head width, eps)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_) -> torch.nn.Module:
        norm = TpSummedRMSNorm if config.normalization == "RMSNorm" else TpSummedLayerNorm
        return norm(normalized_shape=hidden_size, eps=eps)
