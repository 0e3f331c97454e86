"""The GPT under test: megatron-core's GPTModel (local layer spec, no Transformer Engine).

Tensor parallelism comes from megatron.core.parallel_state; data parallelism and ZeRO come from
DeepSpeed. Everything megatron-core needs to run on DeepSpeed's CPU accelerator, and the adapter
DeepSpeed needs to see megatron's groups, lives in this one module.
"""
from __future__ import annotations

import torch

from zero_bench.config import BenchConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def install_cpu_shims() -> None:
    """Let megatron-core run without CUDA.

    megatron's attention takes its scratch buffer from GlobalMemoryBuffer.get_tensor, which always
    allocates on torch.cuda.current_device(); no flag avoids it, so on CPU we allocate there instead.
    """
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


class MpuAdapter:
    """The `mpu` DeepSpeed expects, answered by megatron's parallel_state.

    deepspeed.initialize(mpu=parallel_state) fails: DeepSpeed asks for get_model_parallel_*, which
    megatron names get_tensor_model_parallel_*. Data-parallel calls pass straight through; any
    other name raises AttributeError, so DeepSpeed's hasattr() probes see what megatron lacks.
    """

    RENAMED = {f"get_model_parallel_{x}": f"get_tensor_model_parallel_{x}" for x in ("world_size", "rank", "group")}
    PASSED = ("get_data_parallel_world_size", "get_data_parallel_rank", "get_data_parallel_group")

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.ps = ps

    def __getattr__(self, name: str):
        if name in self.RENAMED:
            return getattr(self.ps, self.RENAMED[name])
        if name in self.PASSED:
            return getattr(self.ps, name)
        raise AttributeError(name)


def init_parallel(tp: int, seed: int, on_cpu: bool) -> MpuAdapter:
    """Create megatron's TP/DP groups on top of the already initialised torch.distributed."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    # use_cpu_initialization draws from torch's default generator: seed it, or every run (and so
    # every ZeRO stage compared) starts from different weights.
    torch.manual_seed(seed)
    # The default RNG tracker calls torch.cuda.get_rng_state; the inference tracker does not.
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=on_cpu)
    if on_cpu:
        install_cpu_shims()
    return MpuAdapter()


def recompute_args(cfg: BenchConfig) -> dict:
    """megatron-core's names for `recompute`: selective recomputes core attention (its default
    recompute_modules); full recomputes every layer from its input, recompute_layers at a time."""
    if cfg.recompute == "selective":
        return {"recompute_granularity": "selective"}
    if cfg.recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": cfg.recompute_layers}
    return {}


def install_checkpointing(cfg: BenchConfig, mpu: MpuAdapter, ds_config: dict) -> None:
    """The checkpoint function megatron-core calls for `recompute`."""
    from megatron.core import tensor_parallel

    if cfg.recompute == "full":
        use_deepspeed_checkpointing(mpu, ds_config)
    elif cfg.recompute == "selective" and cfg.hardware.device == "cpu":
        # megatron's CheckpointFunction saves torch.cuda's RNG state; torch's own checkpoint
        # recomputes the same way without CUDA (dropout is off, so no RNG state matters).
        from torch.utils.checkpoint import checkpoint

        tensor_parallel.checkpoint = lambda function, _distribute, *args: checkpoint(function, *args,
                                                                                      use_reentrant=False)


def use_deepspeed_checkpointing(mpu: MpuAdapter, ds_config: dict) -> None:
    """recompute=full as Megatron-DeepSpeed runs it: DeepSpeed's checkpoint function replaces
    megatron's, so ds_config's activation_checkpointing (partition_activations, cpu_checkpointing,
    contiguous_memory_optimization) applies. Megatron-DeepSpeed sets mpu.checkpoint the same way;
    megatron-core's TransformerBlock looks tensor_parallel.checkpoint up at each call."""
    import deepspeed
    from megatron.core import tensor_parallel

    deepspeed.checkpointing.configure(mpu, deepspeed_config=ds_config)

    def checkpoint(function, distribute_saved_activations, *args):
        # distribute_saved_activations is megatron's own partitioning; DeepSpeed's config decides.
        # DeepSpeed's partitioned path miscounts None arguments (megatron passes several: context,
        # masks), so only the tensors go through it and the rest is put back around them.
        where = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        template = [None if torch.is_tensor(a) else a for a in args]

        def run(*tensors):
            full = list(template)
            for i, t in zip(where, tensors):
                full[i] = t
            return function(*full)

        return deepspeed.checkpointing.checkpoint(run, *(args[i] for i in where))

    tensor_parallel.checkpoint = checkpoint


def gathered(init):
    """An init method that works on a parameter deepspeed.zero.Init has already partitioned.

    megatron-core initialises the learned position table after its nn.Embedding was built, and
    zero.Init partitions a module's parameters as soon as it is built: the init then writes into an
    empty partition (the table keeps nn.Embedding's N(0, 1)) and every later layer draws different
    random numbers. Gathered, rank 0 initialises the whole table (as Megatron-DeepSpeed does), and
    the weights equal those built without zero.Init (tests/integration/test_trial.py)."""
    import deepspeed

    def gathered_init(weight):
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
            init(weight)

    return gathered_init


def build_gpt(cfg: BenchConfig, on_cpu: bool) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    model, tp, dtype = cfg.model, cfg.parallel.tp, DTYPES[cfg.precision]
    config = TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_heads,
        ffn_hidden_size=4 * model.hidden_size,
        tensor_model_parallel_size=tp,
        # Dropout off: the loss is then identical across ZeRO stages and TP degrees (a check).
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=on_cpu,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        **recompute_args(cfg),
    )
    if cfg.zero == 3:
        config.embedding_init_method = gathered(config.embedding_init_method)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=model.padded_vocab(tp),  # megatron pads it the same way (tokens stay < vocab_size)
        max_sequence_length=model.seq_len,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    return gpt if on_cpu else gpt.cuda()
