"""Long-sequence memory savers on megatron's GPTModel (issue 45 items 3 and 4, ALST: Bekman et al.
2025): the MLP tiled over the sequence (`tiled_mlp`) and the checkpointed layer inputs kept in host
memory between forward and backward (`recompute_offload`).

tiled_mlp: DeepSpeed 0.19.8's own TiledMLP (runtime/sequence_parallel/ulysses_sp.py) around each
dense layer's megatron MLP. TiledMLP's forward runs the MLP one tile at a time under no_grad and
keeps only the MLP's input; its backward recomputes each tile with grad and backpropagates it, so
one tile's intermediates are alive at a time instead of the whole sequence's. TiledMLP tiles dim -2
in forward and the flattened rows in backward, written for HF's [b, s, h]; megatron's MLP takes
[s, b, h], whose dim -2 is the batch (one tile at micro-batch 1). So the MLP is handed the tokens as
[s*b, h] (the 2-D shape TiledMLP documents for MoE experts): a tile is a run of consecutive
positions over the whole micro-batch, the same rows in forward and backward, and each tile goes
through megatron's MLP as [n, 1, h] (every op in it is per token).

recompute_offload: with recompute=full/block each checkpointed chunk keeps its input hidden states
for backward, held by reference (DeepSpeed's CheckpointFunction keeps the argument objects in
ctx.deepspeed_saved_tensors; torch's non-reentrant checkpoint, FSDP2's, in its recompute closure),
not through saved-tensor hooks, so torch's save_on_cpu around a layer would move nothing for
FSDP2. So both engines get what DeepSpeed's cpu_checkpointing does (checkpointing.py
get_cpu_activations_for_backward: the argument's storage swapped for a host copy, put back before
its backward), at the one seam both share (megatron's tensor_parallel.checkpoint): after the chunk's
forward its input's storage goes to host memory (pinned, an asynchronous copy on the compute stream
on GPU), and a pre-hook on the chunk output's backward node brings it back before the recompute.
On CPU the host copy is a second CPU tensor: the mechanics run, the peak cannot drop. (DeepSpeed's
own cpu_checkpointing without partition_activations cannot run there: on its CPU accelerator the
"host copy" is the argument itself, whose storage it then empties - the recompute got a 0-D tensor,
"both arguments to linear need to be at least 1D", run with DeepSpeed 0.19.8.)
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:  # the estimate reads mlp_tiles without importing torch
    import torch

OFFLOADED = "_zb_offloaded"  # the attribute that marks the wrapped checkpoint function


def mlp_tiles(setting: Optional[str], tokens: int, hidden: int) -> int:
    """Tiles per MLP call for the `tiled_mlp` key (None: 0, untiled). auto: DeepSpeed's own choice
    (TiledMLP's docstring, ALST): ceil(tokens / hidden), the tiles that make one tile's tokens at
    most the hidden size; `tokens` is the sequence one rank's MLP sees."""
    if setting is None:
        return 0
    if str(setting) == "auto":
        return max(1, math.ceil(tokens / hidden))
    return int(setting)


def effective_tiles(rows: int, tiles: int) -> int:
    """The chunks torch.chunk really makes of `rows` rows asked for `tiles`: ceil(rows / ceil(rows /
    tiles)), fewer than asked when the rows do not split evenly (10 rows in 6 asked: 5 of 2). TiledMLP
    must be told this count: its backward marks the parameters' gradients ready (ds_grad_is_ready,
    read by ZeRO's reduce hooks) only at chunk number `shards`, which would never come."""
    tiles = min(tiles, rows)
    return math.ceil(rows / math.ceil(rows / tiles))


def tile_mlp(mlp: torch.nn.Module, tiles: int) -> None:
    """Replace `mlp`'s forward (megatron's MLP, [s, b, h] in, (output, bias) out) by DeepSpeed's
    TiledMLP over `tiles` sequence tiles."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    from zero_bench.models.sequence_parallel import unadded_bias

    forward = mlp.forward
    params = [p for p in mlp.parameters() if p.requires_grad]

    def per_tile(module, rows: torch.Tensor) -> torch.Tensor:
        out, _ = forward(rows.unsqueeze(1))  # [n, 1, h]: n consecutive tokens
        return out.squeeze(1)

    def tiled(hidden_states: torch.Tensor, per_token_scale=None, **kwargs: Any):
        if per_token_scale is not None:  # an MoE expert: configure refuses tiling MoE models
            return forward(hidden_states, per_token_scale, **kwargs)
        s, b, h = hidden_states.shape
        rows = hidden_states.reshape(s * b, h)
        out = TiledMLP.apply(per_tile, mlp, rows, effective_tiles(s * b, tiles), params)
        # fc2's bias (skip_bias_add), taken here with grad: what the tiles returned beside their
        # output was made under TiledMLP's no_grad, where sequence parallelism's tp sum of it is a
        # detached alias (its gradient never reached the parameter: issue 51 item 1)
        return out.view(s, b, -1), unadded_bias(mlp.linear_fc2)

    mlp.forward = tiled


def install(gpt: torch.nn.Module, cfg) -> None:
    """The tiled MLP and the checkpoint offload `cfg` asks for, on a built GPTModel (dense layers)."""
    m = cfg.model
    tiles = mlp_tiles(cfg.tiled_mlp, m.seq_len // getattr(cfg.parallel, "sp", 1), m.hidden_size)
    if tiles:
        for layer in gpt.decoder.layers:
            tile_mlp(layer.mlp, tiles)
    if cfg.recompute_offload:
        offload_checkpoint_inputs()


# -- recompute_offload ---------------------------------------------------------------------------

def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`: pinned and asynchronous from a GPU (ordered on the current stream, so the
    device storage freed next is reused only after the copy has read it); a second tensor on CPU."""
    import torch

    if t.device.type == "cpu":
        return t.detach().clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    return host


def offload(t: torch.Tensor) -> Callable:
    """Move `t`'s storage to the host now; the returned function puts it back on its device."""
    import torch

    device, host = t.device, [to_host(t)]
    t.data = torch.empty(0, dtype=t.dtype, device=device)

    def restore(*_):
        if host:  # once; the host copy is released with it (the hook lives as long as the graph)
            t.data = host.pop().to(device, non_blocking=True)

    return restore


def offloaded(checkpoint: Callable) -> Callable:
    """megatron's tensor_parallel.checkpoint (whichever the engine installed) with the chunk's input
    hidden states in host memory from the end of its forward to the start of its backward."""
    import torch

    if getattr(checkpoint, OFFLOADED, False):
        return checkpoint

    @functools.wraps(checkpoint)
    def run(function: Callable, distribute_saved_activations: bool, hidden_states, *args):
        out = checkpoint(function, distribute_saved_activations, hidden_states, *args)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if torch.is_grad_enabled() and torch.is_tensor(hidden_states) and first.grad_fn is not None:
            # every node of the chunk's backward comes after the one that made its output: the input
            # is back before the recompute reads it
            first.grad_fn.register_prehook(offload(hidden_states))
        return out

    setattr(run, OFFLOADED, True)
    return run


def offload_checkpoint_inputs() -> None:
    """Wrap the checkpoint function megatron's TransformerBlock looks up at each call (the engine
    has installed its own by the time the model is built: DeepSpeed's, or shims.cpu_checkpoint)."""
    from megatron.core import tensor_parallel

    tensor_parallel.checkpoint = offloaded(tensor_parallel.checkpoint)
