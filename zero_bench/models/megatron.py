"""The model under test, built by megatron-core: GPTModel with the local layer spec (no Transformer
Engine), from the one description in models/description.py.

Tensor parallelism comes from megatron.core.parallel_state; data parallelism and sharding come from
the engine (zero_bench.engines). On CPU, the shims in models/shims.py are installed first.
"""
from __future__ import annotations

import torch

from zero_bench.config import BenchConfig
from zero_bench.models.shims import install_cpu_shims

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def transformer_config(cfg: BenchConfig, on_cpu: bool):
    """megatron's TransformerConfig for the description, precision, tp and recompute of `cfg`."""
    from megatron.core.transformer import TransformerConfig

    model, dtype = cfg.model, DTYPES[cfg.precision]
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_heads,
        ffn_hidden_size=4 * model.hidden_size,
        tensor_model_parallel_size=cfg.parallel.tp,
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


def build_gpt(cfg: BenchConfig, config, on_cpu: bool) -> torch.nn.Module:
    """GPTModel of `cfg.model` with megatron `config` (transformer_config, possibly adjusted by the engine)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = cfg.model
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=model.padded_vocab(cfg.parallel.tp),  # megatron pads it the same way (tokens stay < vocab_size)
        max_sequence_length=model.seq_len,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    return gpt if on_cpu else gpt.cuda()
