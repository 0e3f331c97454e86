"""A core-attention module for megatron-core's local layer spec that calls torch's
scaled_dot_product_attention (flash / memory-efficient kernels on GPU, the flash kernel on CPU).

It takes the place of megatron.core.transformer.dot_product_attention.DotProductAttention
(megatron-core 0.16.1): same constructor, same forward signature, same layouts: query
[s, b, np, hn], key and value [s, b, ng, hn] (np heads and ng query groups of this tensor-parallel
rank), output [s, b, np * hn]. Causal self-attention only: is_causal=True replaces the mask, so the
attention_mask argument is ignored (megatron's causal spec passes the plain causal mask).

Memory, per token and rank: the kernel keeps q, k, v, its output and the log-sum-exp (a/t floats);
no s x s tensor. Which kernel runs (zero_bench/estimate/activations.py models each):
- CPU, dropout 0: _scaled_dot_product_flash_attention_for_cpu (forward and backward).
- CPU, dropout > 0: torch's CPU flash kernel has no dropout, so torch falls back to the math
  kernel, which keeps s x s tensors (softmax, dropout mask, dropped probabilities).
- CUDA: flash (16-bit) or memory-efficient (fp32) kernels. enable_gqa is used where the kernel
  takes it (CPU; CUDA flash, i.e. 16-bit); elsewhere K/V are expanded to np heads first, because
  torch falls back to the math kernel for enable_gqa on the memory-efficient kernel.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from zero_bench.models.description import native_gqa as gqa_rule


def native_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel torch picks for this device and dtype takes K/V with fewer heads
    (models/description.py's rule, which the estimate reads too)."""
    precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")
    return gqa_rule(device.type, precision)


def causal_mask(attention: str, seq_len: int, device) -> Optional[Tensor]:
    """The attention mask a training step hands megatron's GPTModel (trial/worker.py, the traced
    step in estimate/traced.py): None for sdpa, whose is_causal=True replaces it (this module), so
    no s x s tensor exists that the attention never reads: at 16,384 tokens the bool mask held
    256 MiB per rank and building it through a second s x s tensor (torch.triu(torch.ones))
    put the rank's RSS peak 512 MiB above the process (measured on CPU, issue 45). Unfused
    attention masks its scores with it: [1, 1, s, s] bool, made in place (one s x s allocation),
    s^2 bytes per rank that the estimate counts (estimate/prediction.py causal_mask)."""
    if attention == "sdpa":
        return None
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu_(1)[None, None]


class SDPAttention(MegatronModule):
    """torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=...)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention: context parallelism is not supported")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention: causal attention only (got {attn_mask_type})")
        if config.window_size is not None:
            raise ValueError("SDPAttention: sliding-window attention is not supported")
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention: softmax_type={config.softmax_type} is not supported")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        world_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)
        # megatron's apply_query_key_layer_scaling divides the scale by layer_number and multiplies
        # it back inside the fp32 softmax (a fp16 overflow guard): the net scale is 1/sqrt(hn).
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(self.hidden_size_per_attention_head))
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """[s, b, np, hn] x [s, b, ng, hn] x [s, b, ng, hn] -> [s, b, np * hn]."""
        if packed_seq_params is not None:
            raise ValueError("SDPAttention: packed sequences are not supported")
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise ValueError(f"SDPAttention: causal attention only (got {attn_mask_type})")
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        gqa = groups > 1 and native_gqa(query.device, query.dtype)
        if groups > 1 and not gqa:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # Contiguous copies: value (and with learned positions query and key too) are views of the
        # QKV projection's output; saved by the kernel as views they would keep all of it alive.
        # [s, b, n, d] -> [b, n, s, d] views: the kernels take any strides with a unit last dim.
        q, k, v = (t.contiguous().permute(1, 2, 0, 3) for t in (query, key, value))
        p = self.dropout_p if self.training else 0.0
        if p > 0.0 and not self.config.sequence_parallel:
            # Dropout inside a tensor-parallel region: a per-rank stream, as DotProductAttention.
            # (With sequence parallelism the block's fork is that stream already, shared with the
            # hidden dropouts: recompute=op runs this kernel again for them, op_recompute.policy.)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                     scale=self.softmax_scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        # The flash kernels return [b, n, s, d] with an [s, b, n, d] memory layout (like q): the
        # reshape is then a view, and linear_proj saves the tensor the kernel saved.
        out = out.permute(2, 0, 1, 3)
        return out.reshape(out.size(0), out.size(1), self.hidden_size_per_partition)
