"""megatron's sequence parallelism (parallel.sequence_parallel at tp > 1) under DeepSpeed and FSDP2.

With TransformerConfig.sequence_parallel megatron-core 0.16.1 itself shards the sequence: the
embedding's output is reduce-scattered (or scattered, with learned positions) to seq_len / tp
tokens per rank (models/common/embeddings/language_model_embedding.py), every column-parallel
linear all-gathers its input and saves only its shard for backward, every row-parallel linear
reduce-scatters its output (tensor_parallel/layers.py, mappings.py), and the output layer gathers
the final norm's output. The norms, dropouts and residuals between them see 1 / tp of the tokens.
Two things it leaves to its own training loop, which zero_bench does not run:

- The norms. The local spec's WrappedTorchNorm (transformer/torch_norm.py) asserts
  `not config.sequence_parallel`: megatron's only norms that run with it are Apex's and
  Transformer Engine's, which mark their weights `sequence_parallel` so that megatron's
  finalize_model_grads (distributed/finalize_model_grads.py _allreduce_layernorm_grads) sums their
  partial gradients over the tp group. Neither is installed (on either device). SequenceParallelNorm
  is torch's RMSNorm / LayerNorm, the same module and parameter names WrappedTorchNorm builds,
  whose weight (and bias) pass through megatron's copy_to_tensor_model_parallel_region: identity
  forward, all-reduce over tp in backward, so each rank's gradient is already the whole one.
- The row-parallel linears' biases (attention's linear_proj, the MLP's linear_fc2): added to the
  reduce-scattered output, each rank's bias gradient covers its own tokens only; megatron marks
  them `sequence_parallel` for the same all-reduce. install_bias_sum routes them through the same
  region.

Why in the graph and not a gradient hook: DeepSpeed's ZeRO 1-3 reduce each gradient over the
data-parallel group as autograd produces it, and FSDP2 reduce-scatters the unsharded gradients of
a whole unit after its backward; a sum made inside backward comes before every engine's reduction,
one mechanism for all of them (models/qk_norm.py does the same for the query / key norms, whose
gradients are partial over tp with or without sequence parallelism). The cost: one all-reduce of
h elements per norm (and row bias) per micro-batch, where megatron makes one bucketed all-reduce
per step.
"""
from __future__ import annotations

import torch

from zero_bench.models.qk_norm import TpSummedLayerNorm, TpSummedRMSNorm


class SequenceParallelNorm:
    """build_module target for a layer's input_layernorm / pre_mlp_layernorm and the block's final
    norm with sequence parallelism (called as megatron calls WrappedTorchNorm)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_) -> torch.nn.Module:
        norm = TpSummedRMSNorm if config.normalization == "RMSNorm" else TpSummedLayerNorm
        return norm(normalized_shape=hidden_size, eps=eps)


def install_bias_sum() -> None:
    """RowParallelLinear.forward, then with sequence parallelism its bias passed through
    copy_to_tensor_model_parallel_region (its gradient summed over tp) and added as megatron adds
    it: returned beside the output (skip_bias_add, the local spec's linear_proj and linear_fc2) or
    to the output. Without sequence parallelism, or without a bias, megatron's own forward."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    if getattr(RowParallelLinear.forward, "_sums_sequence_parallel_bias", False):
        return
    forward = RowParallelLinear.forward

    def summed(self, input_, *args, **kwargs):
        if not self.sequence_parallel or self.bias is None:
            return forward(self, input_, *args, **kwargs)
        skip = self.skip_bias_add
        self.skip_bias_add = True  # the bias back unadded, to add it summed
        try:
            output, _ = forward(self, input_, *args, **kwargs)
        finally:
            self.skip_bias_add = skip
        bias = summed_bias(self)
        return (output, bias) if skip else (output + bias, None)

    summed._sums_sequence_parallel_bias = True
    RowParallelLinear.forward = summed


def summed_bias(linear) -> torch.Tensor:
    """A row-parallel linear's bias through copy_to_tensor_model_parallel_region: itself in forward,
    its gradient summed over tp in backward. A custom Function: under no_grad it returns a detached
    alias, through which no gradient reaches the parameter (see unadded_bias)."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(linear.bias, group=linear.tp_group)


def unadded_bias(linear):
    """The bias a RowParallelLinear hands back beside its output (skip_bias_add), as its forward
    returns it here: tp-summed with sequence parallelism (install_bias_sum), the parameter without;
    None when it has none or adds it itself. For callers that ran the linear under no_grad
    (models/sequence.py's tiled MLP) and need the bias with its graph."""
    if linear.bias is None or not linear.skip_bias_add:
        return None
    return summed_bias(linear) if linear.sequence_parallel else linear.bias
