"""Everything megatron-core 0.16.1 needs to train without CUDA, in one place (DeepSpeed's CPU
accelerator). megatron-core assumes a GPU in a few spots that no flag turns off; each shim names the
spot (paths relative to site-packages/megatron/core). install_cpu_shims() is idempotent and runs
once per rank (models.megatron.init_parallel) before the model is built; seed_cpu_rng() replaces
model_parallel_cuda_manual_seed on CPU; cpu_checkpoint is the tensor_parallel.checkpoint that
recompute=selective calls on CPU (recompute=full goes through DeepSpeed's, engines/deepspeed.py).

Not needed on CPU (checked by running them): torch.nn.RMSNorm (transformer/torch_norm.py picks it
for normalization="RMSNorm"), the SwiGLU path (transformer/mlp.py glu(), bias_activation_fusion
off), RoPE's application (models/common/embeddings/rope_utils.py, apply_rope_fusion off), the
vocab-parallel cross entropy.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

_installed = False


def install_cpu_shims() -> None:
    """Patch the places where megatron-core's training path allocates on CUDA unconditionally."""
    global _installed
    if _installed:
        return
    _global_memory_buffer_on_cpu()
    _rotary_embedding_stays_on_cpu()
    _default_causal_mask_on_cpu()
    _router_stays_on_cpu()
    _expert_parallel_on_cpu()
    _sequence_parallel_on_cpu()
    _installed = True


def _global_memory_buffer_on_cpu() -> None:
    """utils.py GlobalMemoryBuffer.get_tensor allocates with device=torch.cuda.current_device();
    unfused attention (transformer/dot_product_attention.py, the baddbmm input buffer "mpu") takes
    its scratch buffer from it every forward. On CPU the buffer is allocated in host memory."""
    from megatron.core import utils

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = 1
        for n in tensor_shape:
            numel *= n
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype, device="cpu")
        return buf[:numel].view(*tensor_shape)

    utils.GlobalMemoryBuffer.get_tensor = get_tensor


def _rotary_embedding_stays_on_cpu() -> None:
    """models/common/embeddings/rotary_pos_embedding.py RotaryEmbedding.get_emb (lines 160-162)
    moves inv_freq to torch.cuda.current_device() at the first forward whenever it is on the CPU,
    which use_cpu_initialization=True guarantees. The same method without the move."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    RotaryEmbedding.get_emb = get_emb


def _router_stays_on_cpu() -> None:
    """transformer/moe/router.py Router.gating (lines 88-92) moves the router's weight and bias to
    torch.cuda.current_device() at every forward where they are on the CPU. The same method without
    the move."""
    from megatron.core.transformer.moe import router

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return router.router_gating_linear(input, self.weight, self.bias, router_dtype)

    router.Router.gating = gating


class _TorchOnCpu:
    """torch, except that torch.cuda.current_device() is the CPU (for one module's globals)."""

    class _Cuda:
        def __getattr__(self, name: str):
            return getattr(torch.cuda, name)

        @staticmethod
        def current_device() -> str:
            return "cpu"

    cuda = _Cuda()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _expert_parallel_on_cpu() -> None:
    """Expert parallelism (parallel.ep > 1: megatron's alltoall dispatcher) on CPU.

    tensor_parallel/mappings.py allocates the outputs of its gathers, reduce-scatters and uneven
    all-to-alls with device=torch.cuda.current_device() (lines 91, 141, 148, 181, 442); the
    dispatcher gathers the token counts over the ep group and exchanges the tokens with them. That
    module's `torch` answers the CPU there (gloo runs both collectives on host tensors).
    transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher creates a class-wide
    torch.cuda.Stream() in __init__ (line 445) and _maybe_dtoh_and_synchronize (lines 862-899)
    copies the split sizes to the host on that stream: on CPU they are host tensors already, so the
    same conversion runs without streams or events: the splits as numpy arrays (moe_utils
    maybe_move_tensor_to_cpu converts only CUDA tensors; all_to_all_single takes no tensor splits)."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Dispatcher

    mappings.torch = _TorchOnCpu()
    Dispatcher.cuda_dtoh_stream = "cpu"  # not None: __init__ then creates no CUDA stream

    def on_host(self, point: str, tokens_per_expert=None):
        if self.drop_and_pad or point != self.cuda_dtoh_point:
            return tokens_per_expert
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
        return tokens_per_expert

    Dispatcher._maybe_dtoh_and_synchronize = on_host


def _sequence_parallel_on_cpu() -> None:
    """megatron's sequence parallelism (parallel.sequence_parallel) on CPU. Its gathers and
    reduce-scatters are mappings.py's (answered above) and layers.py's: the column-parallel linear's
    backward allocates the reduce-scattered input gradient with device=torch.cuda.current_device()
    (tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication.backward, line 552);
    that module's `torch` answers the CPU there too. Its all-gathers write into GlobalMemoryBuffer's
    "mpu" tensor (shimmed above); gloo runs all_gather_into_tensor and reduce_scatter_tensor, async
    included. The norms are not a CPU matter: models/sequence_parallel.py."""
    from megatron.core.tensor_parallel import layers

    layers.torch = _TorchOnCpu()


def _default_causal_mask_on_cpu() -> None:
    """transformer/utils.py get_default_causal_mask builds the mask with device="cuda"; the unfused
    softmax (fusions/fused_softmax.py forward_torch_softmax) calls it when attention_mask is None.
    zero_bench's worker passes its own CPU mask, so this only makes None work (patched in both
    modules: fused_softmax imported the name)."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    @functools.lru_cache(maxsize=8)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


# -- RNG ---------------------------------------------------------------------------------------
def _cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME, CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """megatron's tracker with torch's CPU generator in place of CUDA's.

        tensor_parallel/random.py CudaRNGStatesTracker.add / fork call torch.cuda.get_rng_state /
        _set_cuda_rng_state. megatron's inference tracker would avoid them by making fork() a no-op,
        but then attention dropout draws the same masks on every tp rank (for different heads).
        This keeps megatron's semantics: a separate per-tp-rank stream inside tensor-parallel regions."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def seed_cpu_rng(seed: int) -> None:
    """model_parallel_cuda_manual_seed for CPU: the same three streams and seed offsets
    (tensor_parallel/random.py), on torch's CPU generator. The default generator ends seeded with
    `seed` (the weights drawn next are the same whatever the streams)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tracker = _cpu_tracker_class()()
    torch.manual_seed(seed)  # the data-parallel (default) stream: hidden and embedding dropout, weights
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    # megatron's expert stream: + 100 per expert-parallel rank (random.py model_parallel_cuda_manual_seed)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ps.get_expert_model_parallel_rank())
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


# -- recompute ---------------------------------------------------------------------------------
def cpu_checkpoint(function: Callable, distribute_saved_activations: bool, *args: Any) -> Any:
    """tensor_parallel.checkpoint on CPU: torch's non-reentrant checkpoint.

    megatron's CheckpointFunction (tensor_parallel/random.py) saves torch.cuda's RNG state in
    forward. torch's checkpoint restores the CPU generator (hidden dropout) by itself; the tracker's
    streams (attention dropout) are put back by tracker_as, so the recomputed dropout masks equal
    the forward's (plain torch checkpoint gave 30 % wrong gradients with dropout 0.1).
    distribute_saved_activations (megatron's own partitioning) is not applied."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from torch.utils.checkpoint import checkpoint

    at_forward = get_cuda_rng_tracker().get_states()
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: (contextlib.nullcontext(), tracker_as(at_forward)))


@contextlib.contextmanager
def tracker_as(states: dict) -> Iterator[None]:
    """megatron's RNG tracker streams set to `states` (those at a checkpointed forward) for its
    recompute, then put back: torch's checkpoint restores only torch's own generators."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    now = tracker.get_states()
    tracker.set_states(states)
    try:
        yield
    finally:
        tracker.set_states(now)


def install_cpu_checkpoint() -> None:
    """Route megatron's recompute (Attention's selective core_attn, TransformerBlock's checkpointed
    forward) through cpu_checkpoint; both look tensor_parallel.checkpoint up at each call."""
    from megatron.core import tensor_parallel

    tensor_parallel.checkpoint = cpu_checkpoint
