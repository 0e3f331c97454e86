"""The model under test, built by megatron-core: GPTModel with the local layer spec (no Transformer
Engine), from the one description in models/description.py.

Pure functions give TransformerConfig's and GPTModel's keyword arguments (tests compare them
without building); build_gpt builds. Tensor parallelism comes from megatron.core.parallel_state;
data parallelism and sharding come from the engine (zero_bench.engines). On CPU the shims in
models/shims.py are installed first.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from zero_bench.config.schema import BenchConfig, Recompute
from zero_bench.models.description import ModelConfig
from zero_bench.models.loss import install_loss
from zero_bench.models import ulysses
from zero_bench.models.shims import install_cpu_shims, seed_cpu_rng

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


def init_parallel(tp: int, seed: int, on_cpu: bool, ep: int = 1, sp: int = 1, pp: int = 1,
                  vpp: int = 1) -> MpuAdapter:
    """Create megatron's TP/DP (and, ep > 1, expert-parallel; sp > 1, models/ulysses.py's
    sequence-parallel; pp > 1, pipeline with vpp virtual stages: models/stages.py) groups on top of
    the already initialised torch.distributed, and seed its RNG streams. use_cpu_initialization
    draws the weights from torch's default generator: it is seeded here, or every run (and so every
    ZeRO stage compared) would start from other weights. megatron's order puts tp fastest, then dp,
    then pp: ranks 0 .. tp x dp - 1 are the first stage."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    ulysses.init_groups(tp, torch.distributed.get_world_size() // (tp * pp), sp)
    if on_cpu:
        install_cpu_shims()
        seed_cpu_rng(seed)  # megatron's tracker calls torch.cuda's RNG; the CPU one keeps its streams
    else:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return PipelineMpu() if pp > 1 else MpuAdapter()


class PipelineMpu(MpuAdapter):
    """The `mpu` DeepSpeed gets under a pipeline (one DeepSpeed engine per stage, engines/deepspeed.py):
    DeepSpeed's "model parallel" group is megatron's model-parallel one, tp x pp ranks, over which
    ZeRO sums the squared gradient norms (stage_1_and_2.py _model_parallel_all_reduce; runtime/utils.py
    clip_grad_norm_ at ZeRO-0), so every stage clips with the whole model's norm, as DeepSpeed's own
    PipelineEngine's grid does. Its rank stays the tensor-parallel one: DeepSpeed counts a parameter
    megatron did not split only where that rank is 0 (a replicated norm once per tp group), and
    every stage holds other parameters."""

    def get_model_parallel_group(self):
        return self.ps.get_model_parallel_group()

    def get_model_parallel_world_size(self):
        return torch.distributed.get_world_size(self.ps.get_model_parallel_group())

    def get_model_parallel_rank(self):
        return self.ps.get_tensor_model_parallel_rank()


def recompute_args(cfg: BenchConfig) -> dict:
    """megatron-core's names for `recompute`: selective recomputes core attention (its default
    recompute_modules); full recomputes every layer from its input, recompute_layers at a time.
    Which checkpoint function runs is the engine's choice (engines/deepspeed.py install_checkpointing)."""
    if cfg.recompute == Recompute.selective:
        return {"recompute_granularity": "selective"}
    if cfg.recompute in (Recompute.full, Recompute.block):
        method = "uniform" if cfg.recompute == Recompute.full else "block"
        return {"recompute_granularity": "full", "recompute_method": method,
                "recompute_num_layers": cfg.recompute_layers}
    return {}


def model_args(m: ModelConfig) -> dict:
    """TransformerConfig's keys for the description's layers."""
    return dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_heads,
        num_query_groups=m.query_groups,
        kv_channels=m.kv_channels,  # head_dim, or h / a (megatron's own default)
        qk_layernorm=m.qk_norm,
        ffn_hidden_size=m.ffn,
        normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=m.norm_eps,
        gated_linear_unit=m.gated,
        activation_func=F.silu if m.gated else F.gelu,
        add_bias_linear=m.add_bias,
        add_qkv_bias=m.qkv_bias,
        hidden_dropout=m.dropout,
        attention_dropout=m.dropout,
        **moe_args(m),
    )


def moe_args(m: ModelConfig) -> dict:
    """TransformerConfig's MoE keys ({} for a dense model): dropless top-k softmax routing, the
    allgather dispatcher (megatron's default; ep 1), SequentialMLP experts (no grouped GEMM)."""
    if not m.is_moe:
        return {}
    return dict(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                moe_ffn_hidden_size=m.moe_ffn,
                moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                moe_router_pre_softmax=not m.norm_topk_prob, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
                moe_layer_freq=[int(x) for x in m.moe_layers], moe_grouped_gemm=False)


def expert_parallel_args(cfg: BenchConfig) -> dict:
    """ep > 1: megatron's expert_model_parallel_size and its alltoall dispatcher, which sends each
    token to the ranks that hold its experts (the allgather one would gather every token of the ep
    group on every rank)."""
    ep = cfg.parallel.ep
    if ep == 1:
        return {}
    return dict(expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall")


def transformer_config(cfg: BenchConfig, on_cpu: bool, initialize: bool = True):
    """megatron's TransformerConfig for the description, precision, tp and recompute of `cfg`.
    initialize=False: shapes only (a meta-device build for counting parameters)."""
    from megatron.core.transformer import TransformerConfig

    dtype = DTYPES[cfg.precision]
    return TransformerConfig(
        **model_args(cfg.model),
        **expert_parallel_args(cfg),
        tensor_model_parallel_size=cfg.parallel.tp,
        sequence_parallel=cfg.parallel.sequence_sharded,  # models/sequence_parallel.py
        use_cpu_initialization=on_cpu,
        perform_initialization=initialize,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        **fusion_args(cfg.model, on_cpu, cfg.fusions),
        **recompute_args(cfg),
    )


def fusion_args(m: ModelConfig, on_cpu: bool, fusions: bool = True) -> dict:
    """megatron's fusions that run here. Never: the fused masked softmax, RoPE, persistent LayerNorm
    and the weight-gradient accumulation, which need CUDA extensions (megatron's fused kernels,
    Apex, Transformer Engine >= 1.4) this install does not have. Where jit_fused (GPU, the
    `fusions` key): bias-dropout-add, bias-activation where bias_activation_fused says, and the
    unfused attention's softmax in 16 bits (softmax_in_fp32) in place of the masked softmax kernel."""
    jit = jit_fused(on_cpu, fusions)
    return dict(bias_dropout_fusion=jit, bias_activation_fusion=bias_activation_fused(m, on_cpu, fusions),
                masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                persist_layer_norm=False, apply_rope_fusion=False,
                attention_softmax_in_fp32=softmax_in_fp32(on_cpu, fusions))


def softmax_in_fp32(on_cpu: bool, fusions: bool = True) -> bool:
    """TransformerConfig.attention_softmax_in_fp32 for megatron's unfused attention (16-bit runs
    only; in fp32 the scores are fp32 already). True upcasts the 16-bit scores and keeps the fp32
    softmax output for backward beside the 16-bit copy the next matmul keeps: 6 bytes per score.
    Megatron-LM's GPU runs take the fused scale-mask-softmax kernel instead (Apex's
    scaled_upper_triang_masked_softmax_cuda, Transformer Engine's in its unfused backend), which
    computes in fp32 and keeps only its 16-bit output, 2 bytes, shared with the next matmul
    (Korthikanti et al.'s count). That kernel is not installed here; torch's 16-bit softmax
    (fp32 accumulation inside, 16-bit output) keeps the same tensor, so on GPU with `fusions`
    megatron runs it (False here). CPU trials keep the fp32 softmax they were measured with."""
    return not jit_fused(on_cpu, fusions)


def jit_fused(on_cpu: bool, fusions: bool = True) -> bool:
    """Whether megatron's jit-fused bias-dropout-add / bias-activation run: on GPU with `fusions`.
    megatron-core 0.16.1 writes them in plain torch under its jit_fuser, which is torch.compile
    (megatron/core/jit.py enable_jit_fuser, torch >= 2.2): each rank compiles them with inductor
    and Triton in its first step (trial/time_limits.py allows for it; `zero_bench doctor` tries a
    tiny one). What megatron's users train with (its GPT scripts turn them on). Off on CPU, where
    that torch.compile costs minutes of inductor per shape; off with fusions=false: eager ops."""
    return fusions and not on_cpu


def bias_activation_fused(m: ModelConfig, on_cpu: bool, fusions: bool = True) -> bool:
    """megatron's bias_activation_fusion for this model (transformer/mlp.py MLP.forward then takes
    fusions/fused_bias_swiglu.py bias_swiglu_impl, or for MoE experts weighted_bias_swiglu_impl,
    or fused_bias_gelu.py bias_gelu_impl). Where jit_fused, and:
    - gated (SwiGLU), unless an MoE model has biases: SequentialMLP hands each expert its routing
      weights as per_token_scale, and weighted_bias_swiglu_impl raises NotImplementedError when
      fc1 has a bias; one TransformerConfig serves every MLP of the model, so the whole model runs
      megatron's eager glu then;
    - GeLU only with a bias (TransformerConfig.__post_init__'s check) and never for MoE experts
      (mlp.py fuses only SwiGLU and quick-GeGLU with per_token_scale: GeLU raises ValueError).
    What the fusion keeps for backward is the estimate's (estimate/activations.py mlp_bytes)."""
    if not jit_fused(on_cpu, fusions):
        return False
    if m.gated:
        return not (m.is_moe and m.add_bias)
    return m.add_bias and not m.is_moe


def layer_spec(m: ModelConfig, sequence_parallel: bool = False, sp: int = 1):
    """get_gpt_layer_local_spec with the description's norm and, for sdpa, models/sdpa.py's core
    attention in place of megatron's DotProductAttention; with qk_norm, models/qk_norm.py's query
    and key norms (megatron's, with their gradient summed over tp, which DeepSpeed and FSDP2 miss);
    with sequence_parallel, models/sequence_parallel.py's norms (the layers' and the final one: the
    local spec's refuse it) as the block's spec; at sp > 1 the core attention inside Ulysses'
    all-to-all (models/ulysses.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    norm = "RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm"
    dense = _swapped(m, get_gpt_layer_local_spec(normalization=norm, qk_layernorm=m.qk_norm), sequence_parallel, sp)
    final_norm = LayerNormImpl
    if sequence_parallel:
        from zero_bench.models.sequence_parallel import SequenceParallelNorm

        final_norm = SequenceParallelNorm
    if not m.is_moe:
        if not sequence_parallel:
            return dense
        # the block's spec, as _get_block_submodules builds it from one layer's (pp 1: every layer)
        return TransformerBlockSubmodules(layer_specs=[dense] * m.num_layers, layer_norm=final_norm)
    # MoE: one spec per layer, as get_gpt_decoder_layer_specs builds them from moe_layer_freq (the
    # final norm is the block's LayerNormImpl, as for a single layer spec)
    moe = _swapped(m, get_gpt_layer_local_spec(num_experts=m.num_experts, moe_grouped_gemm=False,
                                               normalization=norm, qk_layernorm=m.qk_norm), sequence_parallel, sp)
    return TransformerBlockSubmodules(layer_specs=[moe if x else dense for x in m.moe_layers],
                                      layer_norm=final_norm)


def _swapped(m: ModelConfig, spec, sequence_parallel: bool = False, sp: int = 1):
    """`spec` with zero_bench's sdpa core attention, qk norms and sequence-parallel norms where the
    description and the layout ask, and at sp > 1 the core attention (sdpa or megatron's unfused)
    wrapped by Ulysses' all-to-all."""
    swaps, layer_swaps = {}, {}
    if m.attention == "sdpa":
        from zero_bench.models.sdpa import SDPAttention

        swaps["core_attention"] = SDPAttention
    if sp > 1:
        core = swaps.get("core_attention", spec.submodules.self_attention.submodules.core_attention)
        swaps["core_attention"] = ulysses.ulysses(core)
    if m.qk_norm:
        from zero_bench.models.qk_norm import QKNorm

        swaps.update(q_layernorm=QKNorm, k_layernorm=QKNorm)
    if sequence_parallel:
        from zero_bench.models.sequence_parallel import SequenceParallelNorm

        layer_swaps.update(input_layernorm=SequenceParallelNorm, pre_mlp_layernorm=SequenceParallelNorm)
    if swaps or layer_swaps:
        attn = spec.submodules.self_attention
        attn_sub = dataclasses.replace(attn.submodules, **swaps)
        layer_sub = dataclasses.replace(spec.submodules, self_attention=dataclasses.replace(attn, submodules=attn_sub),
                                        **layer_swaps)
        spec = dataclasses.replace(spec, submodules=layer_sub)
    return spec


def gpt_model_args(m: ModelConfig, tp: int) -> dict:
    """GPTModel(config, spec, **this)."""
    return dict(
        vocab_size=m.padded_vocab(tp),  # tokens stay < vocab_size; the padded rows are never drawn
        max_sequence_length=m.seq_len,
        share_embeddings_and_output_weights=m.tie_embeddings,
        position_embedding_type="rope" if m.position_embedding == "rope" else "learned_absolute",
        rotary_base=m.rope_base,
        rope_scaling=m.rope_scaling_factor is not None,
        rope_scaling_factor=m.rope_scaling_factor if m.rope_scaling_factor is not None else 8.0,
    )


def build_gpt(cfg: BenchConfig, config, on_cpu: bool, on_layer: Optional[Callable] = None,
              stage: Optional[dict] = None) -> torch.nn.Module:
    """GPTModel of `cfg.model` with megatron `config` (transformer_config, possibly adjusted by the
    engine). Under `with torch.device("meta")` only shapes are made (parameter counts of 405B models).

    on_layer: called on each transformer layer as soon as megatron has built it, before the next one
    draws its weights (FSDP2 shards it there, as zero.Init partitions each module; the weights are
    megatron's, from the same generator in the same order). The caller then places the model itself.

    stage: GPTModel's pre_process / post_process / vp_stage for one pipeline stage (models/stages.py),
    and `layers`, the slice of the model's layers it holds; None: the whole model."""
    from megatron.core.models.gpt import GPTModel

    if cfg.model.is_moe:
        _moe_without_te()
        _moe_releases_dispatch_state()
        _experts_drawn_as_at_ep1()
    if config.sequence_parallel:
        from zero_bench.models.sequence_parallel import install_bias_sum

        install_bias_sum()
    spec = layer_spec(cfg.model, config.sequence_parallel, cfg.parallel.sp)
    stage = dict(stage or {})
    layers = stage.pop("layers", None)
    if layers is not None and hasattr(spec, "layer_specs"):
        # a block spec lists every layer; megatron builds a stage from it as given (get_gpt_decoder_block_spec
        # slices it by the stage's offset itself): the stage's own layers
        spec = dataclasses.replace(spec, layer_specs=spec.layer_specs[layers])
    if on_layer is not None:
        spec = _then(spec, on_layer)
    gpt = GPTModel(config=config, transformer_layer_spec=spec, **gpt_model_args(cfg.model, cfg.parallel.tp),
                   **stage)
    if gpt.post_process:
        install_loss(gpt, cfg.loss)
    ulysses.rotary_at_offset(gpt)
    ulysses.aux_loss_over_sequence(gpt)
    if cfg.recompute == Recompute.op:
        from zero_bench.models import op_recompute

        op_recompute.apply(gpt, cfg.model)
    from zero_bench.models import sequence

    sequence.install(gpt, cfg)  # tiled_mlp, recompute_offload
    return gpt if on_cpu or on_layer is not None else gpt.cuda()


def _moe_without_te() -> None:
    """megatron-core 0.16.1's moe_utils imports te_general_gemm from Transformer Engine in a try
    block and RouterGatingLinearFunction tests `te_general_gemm is not None`: without TE (zero_bench
    installs none, on either device) the name is undefined and every MoE forward raises NameError.
    None is what the test means: the torch matmul path."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _moe_releases_dispatch_state() -> None:
    """MoELayer.forward, then its dispatcher's per-forward tensors dropped. megatron-core 0.16.1's
    allgather dispatcher keeps local_probs, local_map and the permutation mapping as attributes
    until the next forward (token_dispatcher.py dispatch_postprocess), and local_probs carries its
    autograd history. Under torch's non-reentrant recompute (CPU, FSDP2) the attribute set by a
    layer's recompute holds that recomputed graph - the layer's attention half and router, never
    backpropagated - alive to the next step: measured on moe-tiny (CPU, fp32, recompute=full) the
    backward peak held 5.9 MiB per sample more than one rebuilt layer, about 2 MiB per layer
    already differentiated. Dropped after the layer's forward, where nothing reads them again, and
    when a recompute is stopped early (torch's checkpoint raises out of it once it has what
    backward needs, after the dispatcher has set them)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if getattr(MoELayer.forward, "_releases_dispatch_state", False):
        return
    forward = MoELayer.forward

    def released(self, *args, **kwargs):
        try:
            return forward(self, *args, **kwargs)
        finally:  # also when torch's checkpoint stops a recompute early (it raises out of the forward)
            d = self.token_dispatcher
            # allgather's, then alltoall's (ep > 1: probs and routing_map, with probs' history)
            for name in ("local_probs", "local_map", "reversed_local_input_permutation_mapping", "probs",
                         "routing_map"):
                if hasattr(d, name):
                    setattr(d, name, None)

    released._releases_dispatch_state = True
    MoELayer.forward = released


def _experts_drawn_as_at_ep1() -> None:
    """With ep > 1 and use_cpu_initialization (CPU), each rank still builds ep=1's experts.

    megatron-core 0.16.1 draws CPU-initialised weights whole from torch's default generator
    (tensor_parallel/layers.py _initialize_affine_weight_cpu, lines 149-190), seeded alike on every
    rank; its expert RNG stream is used on the GPU path only (lines 141-146). Each rank's
    SequentialMLP (transformer/moe/experts.py) would then draw its num_experts / ep experts first:
    every ep rank the same weights (rank 1's experts 4-7 equal to rank 0's 0-3), and the layers after
    them other weights than at ep=1. So the other ranks' experts are drawn and dropped around this
    rank's, and the weights equal ep=1's expert for expert: runs at ep 1 and 2 compare step by step.
    On GPU megatron's own expert stream decides, as in its training."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP

    if getattr(SequentialMLP.__init__, "_drawn_as_at_ep1", False):
        return
    init = SequentialMLP.__init__

    def drawn(self, num_local_experts, config, submodules, *args, **kwargs):
        ep = ps.get_expert_model_parallel_world_size()
        if ep == 1 or not config.use_cpu_initialization:
            return init(self, num_local_experts, config, submodules, *args, **kwargs)
        expert_config = copy.deepcopy(config)  # as SequentialMLP makes its own (no __post_init__ again)
        expert_config.ffn_hidden_size = config.moe_ffn_hidden_size

        def draw(n: int) -> None:
            for _ in range(n):
                MLP(expert_config, submodules, ffn_hidden_size=config.moe_ffn_hidden_size, is_expert=True,
                    tp_group=ps.get_expert_tensor_parallel_group())

        rank = ps.get_expert_model_parallel_rank()
        draw(rank * num_local_experts)
        init(self, num_local_experts, config, submodules, *args, **kwargs)
        draw((ep - 1 - rank) * num_local_experts)

    drawn._drawn_as_at_ep1 = True
    SequentialMLP.__init__ = drawn


def _then(spec, hook: Callable):
    """`spec` whose layer class calls `hook(layer)` at the end of its __init__ (a block spec: each layer's)."""
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[_then(s, hook) for s in spec.layer_specs])
    base = spec.module

    class Built(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            hook(self)

    Built.__name__, Built.__qualname__ = base.__name__, base.__qualname__
    return dataclasses.replace(spec, module=Built)
