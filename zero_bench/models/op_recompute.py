"""recompute=op: per-op selective activation checkpointing, torchtitan's `op` policy
(activation_checkpoint.py _apply_op_sac, selective_ac_option="op", as torchtitan 0.1-0.2 ship it
in 2025 and its users train with).

Each transformer layer runs under torch's non-reentrant checkpoint with a selective policy
(torch.utils.checkpoint.create_selective_checkpoint_contexts). In the layer's forward the outputs
of these ops are kept for backward; every other op is recomputed when backward reaches the layer:
  - aten.mm, except every second one: the 1st, 3rd, 5th ... mm of the layer's forward are kept
    (counted apart in the forward and in the recompute, so both make the same choice);
  - the attention kernels: CUDA's flash, memory-efficient and cuDNN scaled_dot_product_attention
    (torchtitan's list) and CPU's flash kernel (the same op on this machine: zero_bench's addition),
    unless called with dropout (then recomputed, so the recompute draws the forward's masks: policy);
  - reduce-scatter (sequence parallelism) and max (float8 scaling), as torchtitan lists them.
The MoE router's gating matmul is always recomputed and not counted, as torchtitan's default
per_op_sac_force_recompute_mm_shapes_by_fqns does for `moe.router.gate` (matched, as there, by the
weight's shape).
In megatron's layer the mms come as linear_qkv (1, kept), linear_proj (2), linear_fc1 (3, kept),
linear_fc2 (4); an MoE layer's experts each run fc1 (kept) then fc2, and the shared expert after
them, so every down projection is recomputed and every up projection kept. Unfused attention's
baddbmm / bmm and torch's math kernel (CPU with dropout) are not on the list: their scores are recomputed.
What a layer keeps is estimate/activations.py op_kept_terms; measured on CPU in docs/estimate.md.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Iterator

import torch

from zero_bench.models.description import ModelConfig
from zero_bench.models.shims import tracker_as


ATTENTION_KERNELS = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def _saved_ops() -> set:
    aten = torch.ops.aten
    names = [*ATTENTION_KERNELS, "max"]
    ops = {aten.mm.default} | {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return ops


def dropout_p(func, args: tuple, kwargs: dict) -> float:
    """The dropout_p an op is called with (0 for an op without one), found by name in its schema:
    the kernels take it at different positions (flash 3rd, efficient and cuDNN 5th, from 0)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            given = args[i] if i < len(args) else kwargs.get("dropout_p", arg.default_value)
            return float(given or 0.0)
    return 0.0


def policy(gate_shapes: set) -> Callable:
    """The selective policy for one checkpointed forward (and its recompute): a fresh mm count.

    An attention kernel called with dropout is recomputed, not kept: torch's selective checkpoint
    hands a kept op's output back in the recompute without running the op, so the kernel would not
    draw its dropout's random numbers from the generator there (checkpoint.py
    _CachedTorchDispatchMode). With megatron's sequence parallelism the kernel and the layer's
    hidden dropouts draw from one generator (transformer_block runs the whole block in one tracker
    fork; models/sdpa.py forks only without it), so every later mask in the recompute would differ
    from the forward's: wrong gradients on GPU (issue 51 item 2). Without it the kernel has the
    tracker's stream to itself and keeping it was right; the rule does not ask, so what a layer
    keeps depends on the model alone (estimate/activations.py op_kept_terms)."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved, mm, count = _saved_ops(), torch.ops.aten.mm.default, defaultdict(int)

    def decide(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            if tuple(args[1].shape) in gate_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            count[key] += 1
        keep = func in saved and not (func == mm and count[key] % 2 == 0)
        if keep and dropout_p(func, args, kwargs) > 0:
            keep = False  # the kernel draws random numbers: run it again
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def checkpointed(forward: Callable, gate_shapes: set) -> Callable:
    """`forward` under torch's non-reentrant checkpoint with the op policy; megatron's RNG tracker
    streams are put back for the recompute (shims.tracker_as), so dropout masks equal the forward's.

    The hidden states go to torch's checkpoint positionally. megatron's TransformerBlock calls each
    layer with keywords only (`layer(hidden_states=..., attention_mask=..., ...)`), and torch's
    checkpoint finds the devices whose generators it saves and restores from its positional
    arguments alone (checkpoint.py _infer_device_type(*args), get_device_states(*args)): with none,
    it records no CUDA device, its recompute's fork_rng(devices=[]) neither restores nor protects
    the CUDA generator, and the recomputed hidden-dropout masks (the default CUDA generator) differ
    from the forward's: wrong gradients on GPU with dropout (pytorch#121462 is the same failure for
    nested arguments). The CPU generator is restored whatever the arguments, so CPU runs hid it.
    The layer itself is still called with the keywords megatron gave."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    def run(*args, **kwargs):
        at_forward = get_cuda_rng_tracker().get_states()

        def contexts():
            in_forward, in_recompute = create_selective_checkpoint_contexts(policy(gate_shapes))

            @contextlib.contextmanager
            def recompute() -> Iterator[None]:
                with tracker_as(at_forward), in_recompute:
                    yield

            return in_forward, recompute()

        if "hidden_states" not in kwargs:
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True,
                              context_fn=contexts, **kwargs)
        hidden_states = kwargs.pop("hidden_states")

        def as_megatron_calls(hidden_states, *positional):
            return forward(*positional, hidden_states=hidden_states, **kwargs)

        return checkpoint(as_megatron_calls, hidden_states, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=contexts)

    return run


def gate_shapes(m: ModelConfig) -> set:
    """The shapes the router's gating mm sees as its second argument (weight.t(): h x experts)."""
    return {(m.hidden_size, m.num_experts)} if m.is_moe else set()


def _profiler_marks_ignored() -> None:
    """torch's selective checkpoint replays the forward's ops by their count, and raises where the
    recompute calls an op more often than the forward did. The profiler's record_function marks are
    such ops and carry no data: FSDP2's nested expert unit (parallel.ep > 1) marks its hooks in
    the recompute other times than in the forward. They join SAC_IGNORED_OPS (checkpoint.py), which
    both of SAC's dispatch modes run straight through."""
    from torch.utils import checkpoint

    profiler = torch.ops.profiler
    checkpoint.SAC_IGNORED_OPS.update({profiler._record_function_enter_new.default,
                                       profiler._record_function_exit.default,
                                       profiler._record_function_exit._RecordFunction})


def apply(gpt: torch.nn.Module, m: ModelConfig) -> None:
    """Every transformer layer's forward checkpointed with the op policy. Inside the layer's call,
    so the engines' module hooks (FSDP2's unshard, ZeRO-3's gathers) run around it as around any
    forward, and again for the submodules the recompute calls."""
    _profiler_marks_ignored()
    shapes = gate_shapes(m)
    for layer in gpt.decoder.layers:
        layer.forward = checkpointed(layer.forward, shapes)
