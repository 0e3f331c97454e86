"""Ulysses sequence parallelism (`parallel.sp`) around megatron-core's GPTModel, with DeepSpeed's
all-to-all (deepspeed/sequence/layer.py DistributedAttention, DeepSpeed 0.19.8).

Each group of sp consecutive data-parallel ranks trains the same sequences, every rank sp_rank's
seq / sp consecutive tokens of them (trial/worker.py slices the batch). Everything but attention is
per token and runs on the local tokens unchanged; megatron's core attention (models/sdpa.py or
megatron's unfused DotProductAttention, both [s, b, heads, d]) is wrapped by DistributedAttention:
q, k and v exchanged by all-to-all over the group (sequence gathered, heads scattered: each rank
attends over the whole sequence with heads / sp of its heads), the context exchanged back. Key/value
heads fewer than sp are replicated first, as DeepSpeed's UlyssesSPAttentionHF does
(runtime/sequence_parallel/ulysses_sp.py kv_replication_factor); RankLayout has checked that they
divide sp then. RoPE angles are megatron's for the rank's token offsets (its RotaryEmbedding takes
an offset: arange(local) + offset is exactly the full-length table's slice).

Why not DeepSpeed's UlyssesSPAttentionHF: it replaces a Hugging Face model's attention function
(ALL_ATTENTION_FUNCTIONS), which megatron's model never calls; DistributedAttention is the part of it
that fits any [s, b, h, d] core attention.

Gradients: every rank backpropagates the mean loss of its own tokens, and the engine averages the
gradients over all dp ranks. With equal tokens per rank the sum over a group of the local means,
divided by sp (one group's share of the dp average), is the mean over the sequence: the gradients
equal sp = 1's. The reported loss is the group's mean (sequence_mean).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_GROUP: Optional[dist.ProcessGroup] = None
_SP = 1


def init_groups(tp: int, dp: int, sp: int) -> None:
    """One process group per sp consecutive data-parallel ranks of each tensor-parallel rank,
    created by every rank in the same order (torch's new_group is collective). megatron's default
    order puts tp innermost: the data-parallel ranks of tensor rank t are t, t + tp, ..."""
    global _GROUP, _SP
    _GROUP, _SP = None, sp
    if sp == 1:
        return
    import deepspeed
    from megatron.core import parallel_state as ps

    # DistributedAttention's all-to-all goes through deepspeed.comm; under FSDP2 torch.distributed
    # was initialised by torch alone, and DeepSpeed then only wraps it (comm.py init_distributed)
    deepspeed.init_distributed()

    me = dist.get_rank()
    mine = dist.get_process_group_ranks(ps.get_data_parallel_group())
    for t in range(tp):
        ranks = [t + tp * i for i in range(dp)]
        if me in ranks and ranks != mine:
            raise RuntimeError(f"sequence parallelism: megatron's data-parallel ranks {mine} are not {ranks}")
        for i in range(0, dp, sp):
            group = dist.new_group(ranks[i:i + sp])
            if me in ranks[i:i + sp]:
                _GROUP = group


def degree() -> int:
    return _SP


def group() -> Optional[dist.ProcessGroup]:
    return _GROUP


def rank() -> int:
    """This rank's index in its sequence-parallel group (0 at sp 1): which token block it keeps."""
    return 0 if _GROUP is None else dist.get_rank(_GROUP)


def local_block(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's 1 / sp of `t` along `dim` (the sequence), contiguous."""
    if _SP == 1:
        return t
    n = t.shape[dim] // _SP
    return t.narrow(dim, rank() * n, n).contiguous()


def sequence_mean(values: list[float], device: torch.device) -> list[float]:
    """The group's mean of per-rank figures (each rank's mean loss over its tokens): the mean over
    the whole sequences, as sp = 1 reports it."""
    if _SP == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=_GROUP)
    return (t / _SP).tolist()


def rotary_at_offset(gpt: torch.nn.Module) -> None:
    """megatron computes RoPE's angles for positions 0..local-1 (GPTModel.forward from the local
    decoder input's length): the rank's block starts at rank() * local instead."""
    rope = getattr(gpt, "rotary_pos_emb", None)
    if _SP == 1 or rope is None:
        return
    forward = rope.forward

    def at_offset(max_seq_len: int, offset: int = 0, *args, **kwargs):
        return forward(max_seq_len, offset + rank() * max_seq_len, *args, **kwargs)

    rope.forward = at_offset


def aux_loss_over_sequence(gpt: torch.nn.Module) -> None:
    """megatron's load-balancing loss (moe/router.py _apply_aux_loss) over the whole sequence, as at
    sp = 1. megatron counts the tokens per expert over the router's tp_cp group (its sequence and
    context parallelism): handed this rank's sequence-parallel group instead, the counts are the
    sequence's and the rank's loss is its tokens' share of the sequence's (the shares sum to it).
    Each rank backpropagates its local mean loss, sp times its share of the sequence's mean (the
    module docstring), so the share is weighted by sp too: the coefficient, for that call only."""
    if _SP == 1:
        return
    for router in (mod for mod in gpt.modules() if hasattr(mod, "_apply_aux_loss")):
        apply, coeff, own = router._apply_aux_loss, router.get_aux_loss_coeff, router.tp_cp_group

        def over_sequence(*args, _apply=apply, _coeff=coeff, _own=own, _router=router, **kwargs):
            _router.tp_cp_group, _router.get_aux_loss_coeff = _GROUP, lambda kind: _coeff(kind) * _SP
            try:
                return _apply(*args, **kwargs)
            finally:
                _router.tp_cp_group, _router.get_aux_loss_coeff = _own, _coeff

        router._apply_aux_loss = over_sequence


class _Heads(torch.nn.Module):
    """The core attention as DistributedAttention wants it: output [S, b, heads, d] (megatron's
    returns [S, b, heads * d])."""

    def __init__(self, inner: torch.nn.Module, head_dim: int):
        super().__init__()
        self.inner, self.head_dim = inner, head_dim

    def forward(self, q, k, v, *args, **kwargs):
        out = self.inner(q, k, v, *args, **kwargs)
        return out.view(out.shape[0], out.shape[1], -1, self.head_dim)


def ulysses(core: type) -> type:
    """A core-attention class for megatron's layer spec: `core` (same constructor and forward
    signature) inside DeepSpeed's DistributedAttention over this rank's sequence-parallel group."""
    from deepspeed.sequence.layer import DistributedAttention
    from megatron.core.transformer.module import MegatronModule

    class UlyssesAttention(MegatronModule):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config=config)
            inner = core(config, *args, **kwargs)
            sp, heads, groups = _SP, inner.num_attention_heads_per_partition, inner.num_query_groups_per_partition
            self.kv_repeat = max(1, sp // groups)  # DeepSpeed's kv_replication_factor
            # after the all-to-all the inner attention sees heads / sp of this tp rank's heads
            inner.num_attention_heads_per_partition = heads // sp
            inner.num_query_groups_per_partition = groups * self.kv_repeat // sp
            inner.hidden_size_per_partition //= sp
            self.head_dim = inner.hidden_size_per_attention_head
            self.dist = DistributedAttention(_Heads(inner, self.head_dim), _GROUP, scatter_idx=2, gather_idx=0)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if self.kv_repeat > 1:
                key = key.repeat_interleave(self.kv_repeat, dim=2)
                value = value.repeat_interleave(self.kv_repeat, dim=2)
            out = self.dist(query, key, value, 1, None, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            return out.reshape(out.shape[0], out.shape[1], -1)  # [s, b, heads * d]

    UlyssesAttention.__name__ = UlyssesAttention.__qualname__ = f"Ulysses{core.__name__}"
    return UlyssesAttention
