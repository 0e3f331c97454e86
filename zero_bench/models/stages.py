"""Pipeline stages (parallel.pp > 1): megatron's GPTModel built as one rank's stages, each wrapped in
the module torch.distributed.pipelining's PipelineStage calls.

Which layers a rank builds is megatron's: megatron.core.parallel_state knows the pipeline
(init_parallel(pp=...)), the TransformerConfig carries pipeline_model_parallel_size (and
virtual_pipeline_model_parallel_size when interleaved), and GPTModel(pre_process=, post_process=,
vp_stage=) builds get_num_layers_to_build layers from get_transformer_layer_offset on. `chunks` says
the same in numbers (tests/unit/test_pipeline_stages.py holds it to megatron's functions): with pp
ranks and vpp virtual stages each, torch's stage index s = k x pp + r for virtual stage k of
pipeline rank r (torch's looped placement, the one its interleaved schedules expect), holding
layers s x n .. s x n + n - 1, n = num_layers / (pp x vpp); the embedding on stage 0, the final
norm, the output layer and the loss on the last.

The weights equal pp = 1's, layer for layer (on CPU, where megatron draws them whole from torch's
default generator: use_cpu_initialization). A stage would otherwise draw its first layer where
pp = 1 draws the embedding: before each stage is built the generator is seeded as init_parallel
seeded it and what pp = 1 builds before the stage's first layer (the word embedding, the earlier
layers) is drawn and dropped, one module at a time (the build's peak stays one layer above the
stage's own); nothing pp = 1 builds after a stage changes it. On GPU megatron draws from its
tracker streams and the weights are as random, not the same.

Tied embeddings are refused under a pipeline (configure.check_pipeline): megatron keeps a copy of
the word embedding on the last stage and all-reduces its gradient with the first's over its
embedding group, which neither engine's reduction knows of here.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from zero_bench.config.schema import BenchConfig


@dataclass(frozen=True)
class Chunk:
    """One stage of the pipeline that a rank holds."""
    stage: int
    """torch's stage index: virtual stage vp_stage of pipeline rank r is stage vp_stage x pp + r."""
    vp_stage: int
    """megatron's virtual stage on this rank (0 without interleaving)."""
    first: int
    """Its first layer (0-based, the pp = 1 model's numbering)."""
    layers: int
    """How many layers it holds."""
    pre: bool
    """The first stage: the word embedding, fed the tokens."""
    post: bool
    """The last stage: the final norm, the output layer and the loss."""


def chunks(num_layers: int, pp: int, vpp: int, pp_rank: int) -> list[Chunk]:
    """The stages pipeline rank `pp_rank` holds, in virtual-stage order (megatron's uniform split;
    RankLayout has checked that pp x vpp divides num_layers)."""
    stages = pp * vpp
    n = num_layers // stages
    return [Chunk(stage=k * pp + pp_rank, vp_stage=k, first=(k * pp + pp_rank) * n, layers=n,
                  pre=k * pp + pp_rank == 0, post=k * pp + pp_rank == stages - 1) for k in range(vpp)]


def pipeline_config(config, pp: int, vpp: int):
    """megatron's TransformerConfig of a pipeline: its size and, interleaved, its virtual stages
    (get_num_layers_to_build and get_transformer_layer_offset read them)."""
    config = copy.copy(config)
    config.pipeline_model_parallel_size = pp
    config.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    return config


class StageModule(torch.nn.Module):
    """One stage as PipelineStage calls it: module(*args, **kwargs).

    The first stage is fed the tokens, every other one the previous stage's hidden states [s, b, h]
    (megatron's set_input_tensor: its TransformerBlock then starts from them, the graph kept, so the
    schedule's backward reaches the received tensor). Every stage gets the positions and labels as
    keyword arguments (the schedule splits them into micro-batches alike); the last returns the
    per-token loss [b, s] (megatron's, as GPTModel returns it with labels), the others their hidden
    states. The attention mask is one tensor for all micro-batches (none for sdpa): an attribute the
    engine sets, not an argument the schedule would split."""

    def __init__(self, gpt: torch.nn.Module, chunk: Chunk):
        super().__init__()
        self.gpt = gpt
        self.chunk = chunk
        self.mask: Optional[torch.Tensor] = None
        self.marks: Optional[Callable[[str], None]] = None  # the worker's phase marks, set by the engine per step

    def forward(self, x: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.marks is not None:
            self.marks("forward")
        labels = labels if self.chunk.post else None
        if self.chunk.pre:
            out = self.gpt(x, pos, self.mask, labels=labels)
        else:
            self.gpt.set_input_tensor(x)
            out = self.gpt(None, pos, self.mask, labels=labels)
        if self.marks is not None and out.requires_grad:
            # the micro-batch's backward on this stage starts when its output's gradient arrives
            marks = self.marks
            out.register_hook(lambda grad: marks("backward"))
        return out


def stage_loss(output: torch.Tensor, target=None) -> torch.Tensor:
    """The schedule's loss_fn on the last stage: the micro-batch's mean per-token loss, as the engines
    take it at pp = 1 (each micro-batch's mean; the schedule divides the gradients by the number of
    micro-batches, as they divide the loss by grad_accum)."""
    return output.float().mean()


def build_stages(cfg: BenchConfig, config, on_cpu: bool, on_layer: Optional[Callable] = None) -> list[StageModule]:
    """This rank's stages of `cfg.model` (megatron's parallel_state initialised with the pipeline:
    models/megatron.py init_parallel), each a StageModule around a GPTModel holding its layers.
    on_layer as build_gpt's (FSDP2 shards each layer as it is built); the dropped draws never see it."""
    from megatron.core import parallel_state as ps

    from zero_bench.models.megatron import build_gpt, layer_spec
    from zero_bench.models.shims import seed_cpu_rng

    p = cfg.parallel
    config = pipeline_config(config, p.pp, p.vpp)
    out = []
    for chunk in chunks(cfg.model.num_layers, p.pp, p.vpp, ps.get_pipeline_model_parallel_rank()):
        if config.use_cpu_initialization:
            seed_cpu_rng(cfg.seed)  # as init_parallel left it for pp = 1's build
            _draw_before(cfg, config, chunk, layer_spec(cfg.model, config.sequence_parallel, p.sp))
        gpt = build_gpt(cfg, config, on_cpu, on_layer=on_layer,
                        stage=dict(pre_process=chunk.pre, post_process=chunk.post,
                                   vp_stage=chunk.vp_stage if p.vpp > 1 else None,
                                   layers=slice(chunk.first, chunk.first + chunk.layers)))
        assert len(gpt.decoder.layers) == chunk.layers, (len(gpt.decoder.layers), chunk)
        out.append(StageModule(gpt, chunk))
    return out


def _draw_before(cfg: BenchConfig, config, chunk: Chunk, spec) -> None:
    """What pp = 1's GPTModel draws before `chunk`'s first layer, drawn and dropped in its order:
    the word embedding (unless the chunk builds it), then layers 0 .. first - 1, each freed before
    the next is drawn."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.spec_utils import build_module

    from zero_bench.models.megatron import gpt_model_args

    if chunk.pre:
        return
    args = gpt_model_args(cfg.model, cfg.parallel.tp)
    dropped = LanguageModelEmbedding(config=config, vocab_size=args["vocab_size"],
                                     max_sequence_length=args["max_sequence_length"],
                                     position_embedding_type=args["position_embedding_type"])
    del dropped
    specs = spec.layer_specs if hasattr(spec, "layer_specs") else [spec] * cfg.model.num_layers
    vp_stage = chunk.vp_stage if config.virtual_pipeline_model_parallel_size else None
    for i in range(chunk.first):  # a layer's weights depend on neither its number nor its stage
        dropped = build_module(specs[i], config=config, layer_number=i + 1, vp_stage=vp_stage)
        del dropped
