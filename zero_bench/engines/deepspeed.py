"""DeepSpeed's engine: ZeRO 0-3, CPU offload, and recompute=full through DeepSpeed's activation
checkpointing (so ds_config's activation_checkpointing applies, as in Megatron-DeepSpeed).
parallel.ep > 1: megatron's experts trained as DeepSpeed's own MoE under ZeRO 1-2 (deepspeed_moe)."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Optional

import deepspeed
import torch

from zero_bench.config.schema import BenchConfig, Device, Recompute
from zero_bench.engines.pipeline import PipelineEngine
from zero_bench.engines.storages import storage_bytes
from zero_bench.models.compiled import same_graphs_on_every_rank
from zero_bench.models.megatron import MpuAdapter, build_gpt, init_parallel, transformer_config
from zero_bench.models.shims import install_cpu_checkpoint
from zero_bench.records import ModelStates, TrialSpec


def init_distributed(cfg: BenchConfig, on_cpu: bool) -> None:
    """DeepSpeed's own: it picks the accelerator's backend (gloo on CPU, NCCL on GPU); the arguments
    are the registry's (specs.EngineSpec.init_distributed), unused here."""
    deepspeed.init_distributed()


class DeepSpeedEngine:
    """megatron's GPT under deepspeed.initialize (ZeRO-3: built under deepspeed.zero.Init)."""

    def __init__(self, spec: TrialSpec, on_cpu: bool):
        cfg = spec.config
        layout = cfg.layout  # the degrees, validated (config/layout.py)
        mpu = init_parallel(layout.tp, cfg.seed, on_cpu, layout.ep, layout.sp)
        ds_config = json.loads(Path(spec.ds_config).read_text())
        install_checkpointing(cfg, mpu, ds_config)
        config = transformer_config(cfg, on_cpu)
        if cfg.zero == 3:
            config.embedding_init_method = gathered(config.embedding_init_method)
        # ZeRO-3 partitions each parameter as its module is built: no rank ever holds the whole model.
        # Over the data-parallel group: zero.Init reads no group from mpu, and over its default (the
        # world) it broadcasts world rank 0's tensor-parallel slice to every TP rank (0.19.8's
        # _zero_init_param), so with tp > 1 the model trained was not the one built.
        with deepspeed.zero.Init(config_dict_or_path=ds_config, mpu=mpu, enabled=cfg.zero == 3,
                                 data_parallel_group=mpu.get_data_parallel_group()):
            model = build_gpt(cfg, config, on_cpu)
        self.zero_init = all(hasattr(p, "ds_id") for p in model.parameters())
        self.hpz = cfg.zeropp.hpz > 1
        self.hpz_secondary: dict = {}  # ZeRO++ hpZ's second partitions: bytes at backward's end, after the step
        if cfg.zero == 3 and cfg.compile:
            tied_weight_gathered_by_root(model)
        with deepspeed_moe(model, layout.ep) as parameters:
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters,
                                                   config=ds_config, mpu=mpu)

    def step(self, batches: list, mask: Optional[torch.Tensor], marks: Callable[[str], None]) -> list[float]:
        losses = []
        for inputs, pos, labels in batches:  # DeepSpeed applies the update at the last micro-step
            marks("forward")
            loss = self.engine(inputs, pos, mask, labels=labels).float().mean()
            marks("backward")
            self.engine.backward(loss)
            marks("step")
            before = self.secondary_bytes()
            self.engine.step()
            if before is not None:  # the last micro-step's, so the profiled step's
                self.hpz_secondary = {"bwd_end": before, "after_step": self.secondary_bytes()}
            losses.append(loss.item())
        return losses

    def secondary_bytes(self) -> Optional[int]:
        """Bytes of ZeRO++ hpZ's second partitions held now (None without hpZ): what the estimate
        counts as hpz_secondary (estimate/zeropp.py)."""
        if not self.hpz:
            return None
        return sum(storage_bytes([p.ds_secondary_tensor for p in self.engine.module.parameters()
                                  if getattr(p, "ds_secondary_tensor", None) is not None]).values())

    def was_step_applied(self) -> bool:
        return self.engine.was_step_applied()

    def grad_norm(self) -> Optional[float]:
        norm = self.engine.get_global_grad_norm()  # what the step clipped with (None: not computed)
        return None if norm is None else float(norm)

    def loss_scale(self) -> Optional[float]:
        return float(self.engine.optimizer.loss_scale) if self.engine.fp16_enabled() else None

    def model_states(self) -> ModelStates:
        return model_state_bytes(self.engine)

    def offloaded(self) -> dict:
        # DeepSpeed's ZeRO optimizers: stage 1/2 `cpu_offload`, stage 3 `offload_optimizer` and
        # `offload_param`; ZeRO-0's plain optimizer has none of them (nothing offloaded)
        opt = self.engine.optimizer
        return {"optimizer": bool(getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False)),
                "params": bool(getattr(opt, "offload_param", False))}

    def compile(self) -> None:
        same_graphs_on_every_rank()
        self.engine.compile()


class DeepSpeedPipelineEngine(PipelineEngine, DeepSpeedEngine):
    """parallel.pp > 1: one DeepSpeed engine over this rank's stages (models/stages.py; a ModuleList
    of its virtual stages), driven by torch's schedule (engines/pipeline.py), ZeRO 0-1.

    Not DeepSpeed's PipelineEngine: it trains a deepspeed.pipe.PipelineModule, a flat list of layers
    it partitions itself, not megatron's GPTModel with its own pre_process / post_process stages,
    and it runs its own schedules (1F1B-like TrainSchedule only: no GPipe, no interleaving). What
    DeepSpeed's PipelineEngine does around its schedule is done here around torch's, with the same
    calls: the schedule's backwards run outside engine.backward (torch.autograd.backward on each
    stage's output), with the accumulation boundary off so that ZeRO's gradient hooks reduce
    nothing in between; then, at the boundary, allreduce_gradients (ZeRO-1's reduce_gradients, ZeRO-0's
    bucketed all-reduce over the stage's data-parallel group) and _take_model_step (pipe/engine.py
    _exec_reduce_grads and _exec_optimizer_step, which force the boundary the same way). The
    gradient norm DeepSpeed clips with is summed over megatron's model-parallel group, tp x pp
    ranks (models/megatron.py PipelineMpu): the whole pipeline's. ZeRO-2/3 are refused (they
    partition the gradients in every backward; DeepSpeed's PipelineEngine refuses them too)."""

    def __init__(self, spec: TrialSpec, on_cpu: bool):
        from zero_bench.engines.pipeline import Pipeline
        from zero_bench.models.stages import build_stages

        cfg = spec.config
        layout = cfg.layout
        mpu = init_parallel(layout.tp, cfg.seed, on_cpu, layout.ep, layout.sp, layout.pp, layout.vpp)
        ds_config = json.loads(Path(spec.ds_config).read_text())
        stages = build_stages(cfg, transformer_config(cfg, on_cpu), on_cpu)
        module = torch.nn.ModuleList(stages)
        self.zero_init = False
        self.hpz, self.hpz_secondary = False, {}
        self.engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                               config=ds_config, mpu=mpu)
        self.engine.set_gradient_accumulation_boundary(False)
        device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        self.pipeline = Pipeline(cfg, list(self.engine.module), device)

    def step(self, batches: list, mask: Optional[torch.Tensor], marks: Callable[[str], None]) -> list[float]:
        losses = self.pipeline.step(batches, mask, marks)  # marks each stage's forwards and backwards
        marks("step")
        self.engine.set_gradient_accumulation_boundary(True)
        try:
            self.engine.allreduce_gradients()
            self.engine._take_model_step(None)
        finally:
            self.engine.set_gradient_accumulation_boundary(False)
        return losses


def model_state_bytes(engine) -> ModelStates:
    """Exact bytes of this rank's model states, by walking DeepSpeed's objects (after a step).

    params: what the module holds (ZeRO-3: its partition ds_tensor); master: the tensors the inner
    optimizer updates when they are not the params themselves (fp32 copies); moments: the inner
    optimizer's state (Adam moments); grads: gradients/partitions still referenced by the params
    or by ZeRO's flat partition buffers.
    """
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    p_map = storage_bytes(params)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    opt_params = [p for g in inner.param_groups for p in g["params"]]
    # ZeRO-3 hands its fp32 partitions to the inner optimizer only during step(); read them directly.
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        opt_params += list(getattr(engine.optimizer, attr, None) or [])
    m_map = {k: v for k, v in storage_bytes(opt_params).items() if k not in p_map}
    states = [v for s in inner.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    o_map = storage_bytes(states)
    grads = [p.grad for p in engine.module.parameters()] + [p.grad for p in opt_params]
    g_map = {k: v for k, v in storage_bytes(grads).items() if k not in p_map and k not in m_map}
    return ModelStates(params=sum(p_map.values()), master=sum(m_map.values()), moments=sum(o_map.values()),
                       grads=sum(g_map.values()), numel_local=sum(p.numel() for p in params))


# -- expert parallelism (parallel.ep > 1) ----------------------------------------------------------

@contextlib.contextmanager
def deepspeed_moe(model: torch.nn.Module, ep: int):
    """The parameters to hand deepspeed.initialize, under which DeepSpeed 0.19.8's ZeRO 1-2 reduce
    megatron's expert gradients over its expert-data-parallel group (the ranks holding the same
    experts), the rest over the data-parallel group. ep == 1: model.parameters(), nothing patched.

    ep > 1: megatron builds only this rank's experts and marks their parameters allreduce=False;
    DeepSpeed knows an expert parameter by that mark (moe/utils.py:27-30 is_moe_param) but takes
    its groups from the parameter's group_name (stage_1_and_2.py:1641, engine.py:2055) and only
    splits them into their own optimizer groups when it counted a layer of its own MoE class
    (engine.py:2100-2107 has_moe_layers; 2330 configure_moe_param_groups, which asserts a list:
    moe/utils.py:157). Without all that every rank's different experts were averaged over the
    data-parallel group as if they were one. The class test is widened to megatron's MoELayer for
    deepspeed.initialize only (engine.py reads it at 2102 and, ZeRO-3, 2209; configure refuses
    ZeRO-3 with ep > 1), then put back: the module is the process's, and nothing after this
    engine's build should count megatron's layers as DeepSpeed's."""
    if ep == 1:
        yield model.parameters()
        return
    import deepspeed.runtime.engine as ds_runtime_engine
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_layer import MoELayer

    name = register_expert_groups(ep, ps.get_expert_model_parallel_group(),
                                  ps.get_expert_data_parallel_group())
    tag_expert_params(model, name)
    counted = ds_runtime_engine.MoE
    ds_runtime_engine.MoE = (counted, MoELayer)
    try:
        yield list(model.parameters())
    finally:
        ds_runtime_engine.MoE = counted


def register_expert_groups(ep: int, ep_group, expert_dp_group) -> str:
    """megatron's expert-parallel and expert-data-parallel groups as DeepSpeed's, under the name
    DeepSpeed gives them (`ep_size_{ep}`: utils/groups.py:664-677 reads the size back from it).
    No new groups: megatron's alltoall dispatcher exchanges tokens over the same ranks ZeRO then
    reduces over. The tables are replaced, not added to: a forked trial inherits its parent's, and
    DeepSpeed reads every name in them (groups.py:664 the largest size, bf16_optimizer.py:148)."""
    from deepspeed.utils import groups

    name = f"ep_size_{ep}"
    tables = ((groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, ep_group),
              (groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, expert_dp_group))
    for table, ranks, group in tables:
        table.clear()
        ranks.clear()
        table[name] = group
        ranks[name] = torch.distributed.get_process_group_ranks(group)
    return name


def tag_expert_params(model: torch.nn.Module, name: str) -> int:
    """Name the expert group of every parameter megatron marked allreduce=False (its experts at
    ep > 1: tensor_parallel/layers.py:886, 1209), as DeepSpeed's own MoE does (moe/experts.py:26);
    give each megatron MoELayer the expert count DeepSpeed's engine lists (engine.py:2104).
    Returns how many parameters were tagged."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            module.num_experts = module.config.num_moe_experts
    tagged = [p for p in model.parameters() if getattr(p, "allreduce", True) is False]
    for p in tagged:
        p.group_name = name
    return len(tagged)


def install_checkpointing(cfg: BenchConfig, mpu: MpuAdapter, ds_config: dict) -> None:
    """The checkpoint function megatron-core calls for `recompute` (selective on GPU: megatron's own)."""
    if cfg.recompute in (Recompute.full, Recompute.block):
        use_deepspeed_checkpointing(mpu, ds_config, cfg.seed)
    elif cfg.recompute == Recompute.selective and cfg.hardware.device == Device.cpu:
        install_cpu_checkpoint()  # megatron's saves CUDA's RNG state; this one the CPU tracker's


def use_deepspeed_checkpointing(mpu: MpuAdapter, ds_config: dict, seed: int) -> None:
    """recompute=full as Megatron-DeepSpeed runs it: DeepSpeed's checkpoint function replaces
    megatron's, so ds_config's activation_checkpointing (partition_activations, cpu_checkpointing,
    contiguous_memory_optimization) applies. Megatron-DeepSpeed sets mpu.checkpoint the same way;
    megatron-core's TransformerBlock looks tensor_parallel.checkpoint up at each call."""
    from megatron.core import tensor_parallel

    deepspeed.checkpointing.configure(mpu, deepspeed_config=ds_config)
    use_deepspeed_rng_tracker(seed)

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


def use_deepspeed_rng_tracker(seed: int) -> None:
    """Attention dropout draws from megatron's RNG tracker, but DeepSpeed's checkpoint restores *its
    own* tracker's streams for the recompute, not megatron's: with dropout the recomputed masks would
    differ from the forward's (33 % wrong gradients measured, on GPU as on CPU). Megatron's modules
    look tensor_parallel.get_cuda_rng_tracker up at each forward, so pointing it at DeepSpeed's
    tracker, seeded with DeepSpeed's model_parallel_cuda_manual_seed (megatron's offsets: seed +
    2718 + tp rank), makes full recompute bit-identical to none. That seeding also seeds the
    default generator with `seed`, as init_parallel did: the weights drawn next are unchanged."""
    from megatron.core import tensor_parallel

    deepspeed.checkpointing.model_parallel_cuda_manual_seed(seed)
    tensor_parallel.get_cuda_rng_tracker = deepspeed.checkpointing.get_cuda_rng_tracker


def tied_weight_gathered_by_root(model: torch.nn.Module) -> None:
    """ZeRO-3 with compile=true: the tied embedding / output weight registered as the root module's
    external parameter, so that DeepSpeed's pre-forward hook of the root gathers it.

    GPTModel.forward reads the shared weight itself and hands it to the output layer. In eager mode
    that read goes through DeepSpeed's parameter getter (parameter_offload.py ZeROOrderedDict
    __getitem__), which gathers the partition and registers it as an external parameter of the
    module in forward (FWD_MODULE_STACK[-1]: the root). Under torch.compile the getter returns the
    partition untouched (`if torch.compiler.is_compiling(): return param`), and megatron's output
    layer got a (0,)-shaped weight ("supplied weight's shape is (0,), not (8192, 256)"). Registered
    up front, the same parameter is gathered by the same module as in eager mode."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        deepspeed.zero.register_external_parameter(model, model.shared_embedding_or_output_weight())


def gathered(init):
    """An init method that works on a parameter deepspeed.zero.Init has already partitioned.

    megatron-core initialises the learned position table after its nn.Embedding was built, and
    zero.Init partitions a module's parameters as soon as it is built: the init then writes into an
    empty partition (the table keeps nn.Embedding's N(0, 1)) and every later layer draws different
    random numbers. Gathered, rank 0 initialises the whole table (as Megatron-DeepSpeed does), and
    the weights equal those built without zero.Init (tests/integration/test_trial.py)."""

    def gathered_init(weight):
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
            init(weight)

    return gathered_init
