"""Everything megatron-core needs to run without CUDA, in one place (DeepSpeed's CPU accelerator).

megatron-core assumes a GPU in a few spots that no flag turns off; each shim below names the spot.
They are installed once per process (models.megatron.init_parallel), before the model is built.
"""
from __future__ import annotations

import torch


def install_cpu_shims() -> None:
    """megatron's attention takes its scratch buffer from GlobalMemoryBuffer.get_tensor, which always
    allocates on torch.cuda.current_device(); on CPU the buffer is allocated in host memory instead."""
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


def torch_checkpoint_for_selective() -> None:
    """recompute=selective on CPU: megatron's CheckpointFunction saves torch.cuda's RNG state, which
    fails without CUDA; torch's own checkpoint recomputes the same way (with dropout off no RNG
    state matters). megatron-core's TransformerBlock looks tensor_parallel.checkpoint up at each call."""
    from megatron.core import tensor_parallel
    from torch.utils.checkpoint import checkpoint

    tensor_parallel.checkpoint = lambda function, _distribute, *args: checkpoint(function, *args, use_reentrant=False)
