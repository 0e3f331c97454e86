"""PyTorch FSDP2 (torch.distributed.fsdp.fully_shard): the alternative to ZeRO a user weighs.

The same megatron-core GPT as the DeepSpeed engine (models/), built with the same seed on every
rank; `fully_shard` on each transformer layer as soon as megatron has built it (so no rank ever
holds the whole unsharded model: the build's peak is one layer plus the shards so far, as under
DeepSpeed's zero.Init), then on the root (embeddings, final norm, the output layer) over megatron's
data-parallel group. Not torchtitan's meta-device build: that re-initialises the shards with its
own init, and megatron's weights (the ones ZeRO trains from, drawn whole in construction order)
would differ, so the engines' losses would no longer be comparable step by step. In ZeRO's words:
  zero=3: reshard_after_forward=True (parameters re-gathered in backward; FSDP1's FULL_SHARD)
  zero=2: reshard_after_forward=False (gathered parameters kept from forward to backward; FSDP1's
          SHARD_GRAD_OP). FSDP2 always reshards after backward: between steps both hold the same
          shards, only the peak differs.
  bf16:   MixedPrecisionPolicy(bf16 compute, fp32 reduce): the sharded fp32 parameters are the
          master, no 16-bit copy persists. states=bf16: the model built in bf16, no policy (pure
          bf16: bf16 shards, gradients reduced in bf16, AdamW's moments in bf16).
  offload: CPUOffloadPolicy (parameters, gradients and optimizer states; the step runs on the host).
  ep > 1: each MoE layer's experts (this rank's num_experts / ep) their own group, sharded over
          megatron's expert-data-parallel ranks (torchtitan's llama4 way), the rest of the layer
          over the data-parallel ones (shard_layer).
zero 0/1 and fp16 are refused by its spec (engines/refusals.py, fsdp2). Optimizer and clipping are
ds_configs/base.json's (torch's AdamW, fused on GPU), so both engines train the same way: fp32
losses equal ZeRO-3's within rounding (tests/integration/test_fsdp2_trials.py).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import BenchConfig, Precision, Recompute, States
from zero_bench.engines.ds_config import load_template
from zero_bench.engines.pipeline import PipelineEngine
from zero_bench.engines.storages import storage_bytes
from zero_bench.models.compiled import same_graphs_on_every_rank
from zero_bench.models.megatron import build_gpt, init_parallel, transformer_config
from zero_bench.models.shims import install_cpu_checkpoint
from zero_bench.records import ModelStates, TrialSpec


def init_distributed(cfg: BenchConfig, on_cpu: bool) -> None:
    """torch.distributed from the launcher's RANK / WORLD_SIZE / MASTER_* variables. Not DeepSpeed's
    init_distributed: on CPU it loads DeepSpeed's JIT-built shared-memory op, which FSDP2 never uses.
    GPU with offload: the sharded gradients live on the host, and clipping all-reduces their norm
    there, which NCCL cannot (pytorch/pytorch#148532): gloo serves the CPU tensors, NCCL the rest."""
    if on_cpu:
        dist.init_process_group("gloo")
        return
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # FSDP2 shards onto the current device
    dist.init_process_group("cpu:gloo,cuda:nccl" if cfg.offload else "nccl")


class Fsdp2Engine:
    """One optimizer step over grad_accum micro-batches with the DeepSpeed engine's semantics: loss /
    grad_accum for the backward, gradients reduce-scattered every micro-batch (as ZeRO-2/3 do),
    clipping, AdamW, gradients freed after the step."""

    zero_init = True  # each layer is sharded as it is built (build_gpt's on_layer)
    hpz_secondary: dict = {}  # ZeRO++ is DeepSpeed's (refused with fsdp2): never any

    def __init__(self, spec: TrialSpec, on_cpu: bool):
        cfg = spec.config
        layout = cfg.layout  # the degrees, validated (config/layout.py)
        self.mixed = mixed_bf16(cfg)
        init_parallel(layout.tp, cfg.seed, on_cpu, layout.ep, layout.sp)
        if cfg.recompute != Recompute.none:
            # megatron's CheckpointFunction is reentrant (it hides the layer's forward from FSDP2's
            # backward hooks) and saves CUDA's RNG state; torch's non-reentrant checkpoint recomputes
            # the same function and composes with fully_shard, and cpu_checkpoint puts megatron's
            # tracker streams back for the recompute, so dropout masks equal the forward's.
            install_cpu_checkpoint()
        kw = shard_options(dp_mesh(on_cpu, layout), cfg, on_cpu)
        experts_kw = expert_shard_options(kw, on_cpu, layout.ep)
        dtype = torch.bfloat16 if cfg.states == States.bf16 else None
        model = build_gpt(cfg, compute_config(cfg, on_cpu), on_cpu,
                          on_layer=lambda layer: shard_layer(as_dtype(layer, dtype), kw, experts_kw))
        fully_shard(as_dtype(model, dtype), **kw)  # the root: what no layer holds
        if not on_cpu:
            # the whole layers, each freed once sharded, stay cached; nvidia-smi would count them
            torch.cuda.empty_cache()
        self.tp_split = tp_split_names(cfg)
        self.module = model
        self.optimizer, self.clip = make_optimizer(model, on_cpu)
        from megatron.core import parallel_state

        self.tp, self.tp_rank = layout.tp, parallel_state.get_tensor_model_parallel_rank()
        self.ep = layout.ep
        self.grads_at_step = 0  # bytes of sharded gradients the last step read
        self.last_grad_norm: Optional[float] = None

    def step(self, batches: list, mask: Optional[torch.Tensor], marks: Callable[[str], None]) -> list[float]:
        losses = []
        for inputs, pos, labels in batches:
            marks("forward")
            loss = self.module(inputs, pos, mask, labels=labels).float().mean()
            marks("backward")
            (loss / len(batches)).backward()  # as DeepSpeed scales by gradient_accumulation_steps
            losses.append(loss.item())
        marks("step")
        named = list(self.module.named_parameters())
        self.grads_at_step = sum(storages(p.grad for _, p in named).values())
        self.last_grad_norm = clip_grad_norm(named, self.clip, self.tp_rank, self.tp, self.tp_split, self.ep)
        self.optimizer.step()
        # set_to_none: the sharded gradients are freed between steps, as DeepSpeed's engine.step does.
        self.optimizer.zero_grad(set_to_none=True)
        return losses

    def grad_norm(self) -> Optional[float]:
        return self.last_grad_norm

    def was_step_applied(self) -> bool:
        return True  # no loss scaler, no skipped steps (fp16 is refused)

    def loss_scale(self) -> Optional[float]:
        return None

    def model_states(self) -> ModelStates:
        states = count_states(self.module, self.optimizer, self.mixed)
        return dataclasses.replace(states, grads_at_step=self.grads_at_step)

    def offloaded(self) -> dict:
        # FSDP2 offloads parameters, gradients and optimizer states together: each sharded parameter says
        groups = [m._get_fsdp_state()._fsdp_param_group for m in self.module.modules()
                  if hasattr(m, "_get_fsdp_state")]
        on = [p.offload_to_cpu for g in groups if g is not None for p in g.fsdp_params]
        return {"optimizer": bool(on) and all(on), "params": bool(on) and all(on)}

    def compile(self) -> None:
        """torch.compile each transformer layer (torchtitan's per-block compile): FSDP2's hooks stay
        outside the compiled regions, so its all-gathers and reduce-scatters run as in eager mode."""
        same_graphs_on_every_rank()
        for layer in self.module.decoder.layers:
            layer.compile()


class Fsdp2PipelineEngine(PipelineEngine, Fsdp2Engine):
    """parallel.pp > 1, torchtitan's composition: this rank's stages (models/stages.py) each
    fully_shard'ed over the stage's data-parallel mesh (every layer as it is built, then the stage
    itself as the root, the module torch's PipelineStage calls, so that the stage drives FSDP2's
    gradient sync: none until the last micro-batch's backward, then one reduce-scatter per group,
    engines/pipeline.py), one AdamW over the rank's stages, the whole pipeline's gradient norm
    (torchtitan's: each stage's norm squared, summed over the pipeline: clip_pipeline_grad_norm) and
    torch's schedule over the micro-batches (engines/pipeline.py).

    reshard_after_forward follows `zero` as at pp = 1 (zero=3: each micro-batch's backward gathers
    again; zero=2: the gathered parameters are kept from a micro-batch's forward to its backward,
    torchtitan's default under a pipeline). Under a pipeline every micro-batch's gradients accumulate
    unsharded on the stage until the last backward (torch's stage sets requires_gradient_sync off),
    as torchtitan trains."""

    def __init__(self, spec: TrialSpec, on_cpu: bool):
        from zero_bench.engines.pipeline import Pipeline
        from zero_bench.models.stages import build_stages

        cfg = spec.config
        layout = cfg.layout
        self.mixed = mixed_bf16(cfg)
        init_parallel(layout.tp, cfg.seed, on_cpu, layout.ep, layout.sp, layout.pp, layout.vpp)
        kw = shard_options(dp_mesh(on_cpu, layout), cfg, on_cpu)
        stages = build_stages(cfg, compute_config(cfg, on_cpu), on_cpu,
                              on_layer=lambda layer: shard_layer(layer, kw, None))
        for stage in stages:
            fully_shard(stage, **kw)  # the stage's root: its embedding, final norm, output layer
        if not on_cpu:
            torch.cuda.empty_cache()
        self.module = torch.nn.ModuleList(stages)
        self.optimizer, self.clip = make_optimizer(self.module, on_cpu)
        from megatron.core import parallel_state

        self.tp, self.tp_rank = layout.tp, parallel_state.get_tensor_model_parallel_rank()
        self.tp_split, self.ep, self.pp = tp_split_names(cfg), layout.ep, layout.pp
        self.pipeline = Pipeline(cfg, stages, torch.device("cpu") if on_cpu else
                                 torch.device("cuda", torch.cuda.current_device()))
        self.grads_at_step = 0
        self.last_grad_norm: Optional[float] = None

    def step(self, batches: list, mask: Optional[torch.Tensor], marks: Callable[[str], None]) -> list[float]:
        losses = self.pipeline.step(batches, mask, marks)  # marks each stage's forwards and backwards
        marks("step")
        named = list(self.module.named_parameters())
        self.grads_at_step = sum(storages(p.grad for _, p in named).values())
        if self.tp == 1:
            self.last_grad_norm = clip_pipeline_grad_norm([p for _, p in named], self.clip, self.pipeline.group)
        else:  # megatron's tp slices are no DTensors: pp=1's plain sum over the world, each stage's its own
            self.last_grad_norm = clip_grad_norm(pp1_names(self.module), self.clip, self.tp_rank, self.tp,
                                                 self.tp_split, self.ep)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses


# -- building --------------------------------------------------------------------------------------

def compute_config(cfg: BenchConfig, on_cpu: bool):
    """megatron's TransformerConfig with fp32 parameters whatever the precision: FSDP2's sharded
    parameters are the fp32 master, and bf16 is only what MixedPrecisionPolicy gathers and computes
    in. config.bf16 is set anyway: megatron reads it (here) only to run the attention softmax in fp32
    on bf16 inputs, as its own bf16 runs and DeepSpeed's do. states=bf16 (pure bf16): the model is
    built in bf16, and its shards, gradients and AdamW's moments (torch keeps them in the
    parameter's dtype) stay bf16."""
    if cfg.states == States.bf16:
        return transformer_config(cfg, on_cpu)
    config = transformer_config(dataclasses.replace(cfg, precision=Precision.fp32), on_cpu)
    config.bf16 = cfg.precision == Precision.bf16
    return config


def dp_mesh(on_cpu: bool, layout: RankLayout) -> DeviceMesh:
    """A 1-D mesh over this rank's megatron data-parallel group. megatron's tensor parallelism is not
    DTensor-based, so FSDP2 need see only the DP ranks; megatron's group keeps its TP x DP layout.
    Hybrid sharding (layout.hybrid: dp_shard < dp, tp 1, so the DP ranks are the world): a 2-D mesh,
    replicas x shards; fully_shard then shards over the second dimension and all-reduces across the
    first (HSDP). Consecutive ranks share a shard group, as torchtitan lays it out (a node's GPUs)."""
    from megatron.core import parallel_state
    from torch.distributed.device_mesh import init_device_mesh

    if layout.hybrid:
        return init_device_mesh("cpu" if on_cpu else "cuda", (layout.replicas, layout.shard_size),
                                mesh_dim_names=("replicate", "shard"))

    group = parallel_state.get_data_parallel_group()
    return DeviceMesh.from_group(group, "cpu" if on_cpu else "cuda", mesh_dim_names=("dp",))


def mixed_bf16(cfg: BenchConfig) -> bool:
    """bf16 compute over fp32 shards (the master); not pure bf16 (states=bf16), not fp32."""
    return cfg.precision == Precision.bf16 and cfg.states == States.mixed


def as_dtype(module: torch.nn.Module, dtype: Optional[torch.dtype]) -> torch.nn.Module:
    """Pure bf16: every parameter not yet sharded in `dtype`. megatron builds its linear layers in
    params_dtype but its norms (torch's RMSNorm / LayerNorm) in fp32, and FSDP2 wants one dtype per
    group; DeepSpeed's bf16 engine casts the whole module the same way (module.bfloat16())."""
    if dtype is not None:
        for p in module.parameters():
            if not isinstance(p, DTensor) and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return module


def shard_options(mesh: DeviceMesh, cfg: BenchConfig, on_cpu: bool) -> dict:
    """fully_shard's arguments, the same for every group: each transformer layer is its own
    all-gather / reduce-scatter group, the root holds the rest (word and position embeddings, the
    final norm, the output layer or, tied, the word embedding it reuses). FSDP2 moves each group to
    the mesh's device as it shards it."""
    # pure bf16 (states=bf16): the parameters are bf16 already; gradients are reduced in bf16.
    # cast_forward_inputs=False: by default FSDP2 casts every floating-point argument of a unit's
    # forward to param_dtype (_fsdp_state.py _cast_forward_inputs), keyword arguments included, and
    # megatron hands each layer its RoPE angles (rotary_pos_emb, fp32; cos/sin are taken inside
    # the layer) as one: at position 1000 bf16's spacing is 4 radians. DeepSpeed casts no inputs
    # (its bf16 module computes the angles from megatron's fp32 inv_freq, a plain attribute that
    # .bfloat16() leaves alone), and the hidden states reaching a layer are bf16 already (the
    # embedding's output), so nothing needs the cast.
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
          if mixed_bf16(cfg) else MixedPrecisionPolicy())
    # pin_memory needs an accelerator: on CPU the "offload" copies CPU to CPU and only runs the path.
    offload = CPUOffloadPolicy(pin_memory=not on_cpu) if cfg.offload else OffloadPolicy()
    return dict(mesh=mesh, reshard_after_forward=cfg.zero == 3, mp_policy=mp, offload_policy=offload)


def expert_shard_options(kw: dict, on_cpu: bool, ep: int) -> Optional[dict]:
    """fully_shard's arguments for the experts of an MoE layer at ep > 1 (None at ep 1: they are
    sharded with their layer, as every parameter is): the layer's, over a 1-D mesh of megatron's
    expert-data-parallel group, the dp / ep ranks that hold this rank's experts. Over the layer's
    data-parallel mesh FSDP2 would all-gather and average the ep ranks' different experts as one
    tensor. Hybrid sharding (dp_shard) is refused with ep > 1 (configure)."""
    if ep == 1:
        return None
    from megatron.core import parallel_state

    group = parallel_state.get_expert_data_parallel_group()
    return {**kw, "mesh": DeviceMesh.from_group(group, "cpu" if on_cpu else "cuda", mesh_dim_names=("edp",))}


def shard_layer(layer: torch.nn.Module, kw: dict, experts_kw: Optional[dict]) -> torch.nn.Module:
    """fully_shard one transformer layer as megatron has built it; at ep > 1 an MoE layer's experts
    (megatron's SequentialMLP, layer.mlp.experts) first, as their own group on `experts_kw`'s mesh.

    Their gradients are divided by the data-parallel size, not by the expert-data-parallel one
    FSDP2 reduces them over (_fsdp_collectives.py _get_gradient_divide_factors): megatron's
    all-to-all brought every ep rank's tokens to these experts, so the local gradient is already
    the sum over ep ranks, and only dividing by dp (= ep x expert-DP) makes it the mean over the
    data-parallel batch that ep=1 trains on (without it ep times too large)."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts_kw is not None and experts is not None:
        fully_shard(experts, **experts_kw)
        experts.set_gradient_divide_factor(float(kw["mesh"].size()))  # the layer's: dp
    return fully_shard(layer, **kw)


def make_optimizer(model: torch.nn.Module, on_cpu: bool) -> tuple[torch.optim.Optimizer, float]:
    """torch's AdamW with ds_configs/base.json's hyper-parameters (what every ZeRO trial runs) and its
    clipping threshold. Fused on GPU; on CPU the single-tensor path, as DeepSpeed's torch_adam there."""
    base = load_template("base")
    params = dict(base["optimizer"]["params"])
    params["betas"] = tuple(params["betas"])
    return torch.optim.AdamW(model.parameters(), **params, fused=None if on_cpu else True), base["gradient_clipping"]


# -- gradient clipping -----------------------------------------------------------------------------

def tp_split_names(cfg: BenchConfig) -> frozenset:
    """Parameters megatron splits over TP ranks (the others every TP rank holds whole: norms,
    row-parallel biases, positions), from the layout's list (models/params.py): the DTensors fully_shard
    registers lose megatron's tensor_model_parallel attribute (the live check: test_models.py)."""
    return frozenset(p.name for p in cfg.layout.params if p.tp_dim is not None)


def clip_grad_norm(named: list, max_norm: float, tp_rank: int, tp: int, tp_split: frozenset,
                   ep: int = 1) -> float:
    """The global L2 norm over DP shards and TP slices, then one scale on every rank.

    tp == 1: torch's clip_grad_norm_ (DTensor gradients: it reduces over the DP mesh). tp > 1: that
    would reduce over DP only and give each TP rank its own norm (the replicated LayerNorms then
    diverge); sum the local squares instead, TP duplicates on TP rank 0 only, over the whole world.
    ep > 1 (tp 1): torch's stacks the per-tensor norms and fails on two meshes ("All operands in
    aten.stack.default must have the same mesh": the experts' DTensors live on the
    expert-data-parallel one); the same plain sum over the world is the global norm, the world
    being the dp = ep x expert-DP ranks: DP shards, expert-DP shards and the ep ranks' experts
    are all disjoint. pp > 1: clip_pipeline_grad_norm."""
    named = [(n, p) for n, p in named if p.grad is not None]
    if tp == 1 and ep == 1:
        return float(torch.nn.utils.clip_grad_norm_([p for _, p in named], max_norm))
    sq = torch.zeros((), dtype=torch.float32, device=named[0][1].grad.device if named else None)
    for n, p in named:
        if tp_rank == 0 or n in tp_split:
            sq += local(p.grad).float().pow(2).sum()
    dist.all_reduce(sq)  # shards and experts are disjoint and TP duplicates counted once: a plain sum
    norm = float(sq.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for _, p in named:
            local(p.grad).mul_(coef)
    return norm


def pp1_names(stages: torch.nn.ModuleList) -> list:
    """(name, parameter) of a rank's stages under the names pp=1's GPTModel gives them (what
    tp_split_names lists): "1.gpt.decoder.layers.0.mlp..." of a stage from layer 2 on is
    "decoder.layers.2.mlp..."."""
    out = []
    for stage in stages:
        for name, p in stage.gpt.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(stage.chunk.first + int(parts[2]))
            out.append((".".join(parts), p))
    return out


def clip_pipeline_grad_norm(params: list, max_norm: float, pp_group) -> float:
    """torchtitan's clipping under a pipeline (torchtitan/distributed/utils.py clip_grad_norm_ with a pp
    mesh): torch's norm of this rank's gradients (DTensors: over the stage's data-parallel mesh), its
    square summed over the pipeline's ranks, then torch's clip_grads_with_norm_ with that norm: pp=1's
    torch functions on each stage, so the clip coefficient is computed the same way (tp 1, ep 1: the
    rest is refused under a pipeline)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    total = total ** 2
    dist.all_reduce(total, group=pp_group)
    total = total ** 0.5
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


# -- exact model states ----------------------------------------------------------------------------

def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t.to_local() if isinstance(t, DTensor) else t


def storages(tensors: Iterable[Optional[torch.Tensor]]) -> dict:
    """{storage address: bytes} of the local shards, each storage once. FSDP2 pads a shard to
    ceil(dim0 / dp) rows; its storage holds the padding, so this counts what is allocated."""
    return storage_bytes(map(local, tensors))


def count_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mixed: bool) -> ModelStates:
    """Bytes of this rank's model states, in the record engines/deepspeed.py's model_state_bytes fills.

    The optimizer updates the sharded parameters themselves: fp32, they are the params (master 0);
    with bf16 compute (`mixed`) they are the fp32 master and no 16-bit copy persists (the bf16
    parameters exist only while a group is gathered), so params 0. grads: what is still held (0
    after the step, as with ZeRO); the step's figure is the engine's grads_at_step."""
    params = list(model.parameters())
    p_map = storages(params)
    held = sum(p_map.values())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    g_map = {k: v for k, v in storages(p.grad for p in params).items() if k not in p_map}
    return ModelStates(params=0 if mixed else held, master=held if mixed else 0,
                       moments=sum(storages(state).values()), grads=sum(g_map.values()),
                       numel_local=sum(local(p).numel() for p in params))
