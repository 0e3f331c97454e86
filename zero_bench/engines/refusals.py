"""What each engine cannot run, per concern (engines.specs.Concern): one function per engine, named by
its spec's `refusals`, each raising ConfigError with one line naming the key and what is allowed.
configure.validate_static asks at the place it checks that concern's shared conditions."""
from __future__ import annotations

from zero_bench.config.hosts import local_ranks
from zero_bench.config.schema import BenchConfig, Device, Recompute
from zero_bench.engines.specs import Concern
from zero_bench.errors import ConfigError


def deepspeed(b: BenchConfig, concern: Concern) -> None:
    """DeepSpeed's limits on shared features (its own ZeRO 0-3 and fp16 need no refusal)."""
    if concern == Concern.states and b.states == "bf16":
        if b.zero == 0:
            raise ConfigError("states=bf16: DeepSpeed keeps bf16 master weights and optimizer states with "
                              "ZeRO 1-3 only (bf16_master_weights_and_grads); allowed with zero=0: states=mixed")
        if b.offload:
            raise ConfigError("states=bf16: DeepSpeed offloads bf16 optimizer states only to its CPUAdam "
                              "(fp32_optimizer_states=false), which zero_bench does not run; allowed with "
                              "offload=true: states=mixed")
    if concern == Concern.hybrid:
        # MiCS, DeepSpeed's sharding within groups, is gone from 0.19 (its keys raise
        # DeepSpeedConfigError); ZeRO++ hpZ runs here but keeps every state sharded over all dp ranks.
        raise ConfigError(f"parallel.dp_shard={b.parallel.dp_shard}: hybrid sharding runs with engine=fsdp2 (a 2-D "
                          "device mesh); DeepSpeed 0.19 removed MiCS, its sharding within groups, and ZeRO++ hpZ "
                          "still shards the states over all dp ranks; allowed with engine=deepspeed: "
                          "parallel.dp_shard=null")
    if concern == Concern.expert_parallel and b.zero in (0, 3):
        why = ("DeepSpeed refuses its MoE with ZeRO stage 3 (engine.py: 'Native DeepSpeed MoE is not "
               "supported with ZeRO Stage 3')" if b.zero == 3 else
               "DeepSpeed's ZeRO-0 clips the gradients by the ranks' averaged norm, not the whole "
               "model's, when each rank holds other experts")
        raise ConfigError(f"parallel.ep={b.parallel.ep}: {why}; allowed with parallel.ep > 1: zero=1, zero=2, "
                          "or engine=fsdp2")
    if concern == Concern.offload_param and b.offload_param and b.zero != 3:
        raise ConfigError(f"offload_param=true: needs zero=3 (got zero={b.zero})")
    if concern == Concern.zeropp:
        zeropp(b)
    if concern == Concern.offload_device and b.nvme and b.zero != 3:
        # stage_1_and_2.py: any offload_optimizer.device but none sets cpu_offload, and nothing there
        # swaps; only stage3.py builds an optimizer swapper (swap_optimizer = device == nvme)
        raise ConfigError(f"offload_device=nvme: DeepSpeed 0.19.8 swaps to NVMe at ZeRO-3 only (ZeRO 1-2 keep "
                          f"'nvme' optimizer states in host memory, as cpu); allowed with zero={b.zero}: "
                          "offload_device=none, cpu")
    if concern == Concern.ignored:
        ds_keys_read(b)
        partitioned_activations(b)
    if concern == Concern.pipeline and b.zero > 1:
        raise ConfigError(f"zero={b.zero}: under a pipeline (parallel.pp={b.parallel.pp}) DeepSpeed trains ZeRO 0-1 "
                          "(ZeRO-2/3 partition the gradients in every micro-batch's backward, which its own "
                          "PipelineEngine refuses too); allowed with parallel.pp > 1: zero=0, zero=1, or "
                          "engine=fsdp2 zero=2/3")


def partitioned_activations(b: BenchConfig) -> None:
    """DeepSpeed's activation_checkpointing.partition_activations (the megatron_deepspeed preset)
    splits each checkpointed layer input over the tp ranks and all-gathers it back in backward, as
    if the input were the same on every tp rank: with megatron's sequence parallelism each rank's is
    its own sequence shard, and the gathered input would be the other ranks' pieces."""
    if not (b.parallel.sequence_sharded and b.recompute in (Recompute.full, Recompute.block)):
        return
    from zero_bench.engines import ds_config

    if (ds_config.build(b).get("activation_checkpointing") or {}).get("partition_activations"):
        raise ConfigError("parallel.sequence_parallel=true: DeepSpeed's activation_checkpointing.partition_activations "
                          "splits each checkpointed input as if every tp rank held the same one, but each holds its own "
                          "sequence shard; allowed with it: parallel.sequence_parallel=false "
                          "(or +ds.activation_checkpointing.partition_activations=false)")


def first_zeropp_key(b: BenchConfig) -> str:
    """The first ZeRO++ key switched on, as the user typed it (zeropp.qwz=true, zeropp.hpz=2)."""
    z = b.zeropp
    return next(f"zeropp.{k}={v}" for k, v, on in (("qwz", "true", z.qwz), ("qgz", "true", z.qgz),
                                                      ("hpz", z.hpz, z.hpz > 1)) if on)


def zeropp(b: BenchConfig) -> None:
    """ZeRO++ is ZeRO-3's (DeepSpeed reads its keys in stage3.py and zero.Init only). hpZ's groups
    are consecutive global ranks (utils/groups.py _create_zero_param_parallel_group), a node's
    ranks when hpz divides them, as the paper means it; at tp > 1 they would pair tensor-parallel
    peers, whose partitions differ. qgZ's all-to-all groups are built the same way, from world ranks
    per node and across nodes (utils/groups.py _get_local_all_to_all_group), without megatron's
    groups: across nodes they reduce different tensor-parallel shards together (stage3.py
    __avg_scatter_grads; on one node qgZ is plain reduce-scatter, nothing quantized)."""
    if b.zero != 3:
        raise ConfigError(f"{first_zeropp_key(b)}: ZeRO++ is DeepSpeed's ZeRO-3 (got zero={b.zero}); allowed: zero=3, "
                          "or leave zeropp.* out")
    if b.zeropp.qgz and b.parallel.tp > 1:
        raise ConfigError(f"zeropp.qgz=true: DeepSpeed builds qgZ's all-to-all groups from world ranks per node, which "
                          f"at parallel.tp={b.parallel.tp} reduce different tensor-parallel shards together across "
                          "nodes; allowed with tp > 1: zeropp.qgz=false")
    hpz = b.zeropp.hpz
    if hpz == 1:
        return
    if b.parallel.tp > 1:
        raise ConfigError(f"zeropp.hpz={hpz}: DeepSpeed groups hpZ's ranks consecutively, which at parallel.tp="
                          f"{b.parallel.tp} pairs tensor-parallel peers; allowed with tp > 1: zeropp.hpz=1")
    per_node = local_ranks(b)
    if per_node % hpz:
        allowed = ", ".join(str(d) for d in range(1, per_node + 1) if per_node % d == 0)
        raise ConfigError(f"zeropp.hpz={hpz}: must divide the ranks per node ({per_node}: hpZ's second copy is "
                          f"sharded within a node); allowed: {allowed}")


def quantizer_missing(b: BenchConfig) -> str:
    """One line when qwZ / qgZ are asked on a device whose DeepSpeed accelerator has no quantizer
    kernel, "" otherwise. Asked of the accelerator itself: 0.19.8's CPU accelerator answers
    QuantizerBuilder with its NotImplementedBuilder, whose load() raises (zero.Init builds the
    quantizer for qwZ at once; qgZ's all-to-all loads it at its first multi-node reduction)."""
    z = b.zeropp
    if not (z.qwz or z.qgz) or b.hardware.device != Device.cpu:
        return ""
    import logging

    before = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the import announces the accelerator; bad input stays one line
    try:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    finally:
        logging.disable(before)
    builder = CPU_Accelerator().get_op_builder("QuantizerBuilder")
    if builder is not None and builder.__name__ != "NotImplementedBuilder":
        return ""
    key = "zeropp.qwz=true" if z.qwz else "zeropp.qgz=true"
    return (f"{key}: DeepSpeed's CPU accelerator has no quantizer kernel (QuantizerBuilder is not implemented on "
            "CPU); `zero_bench estimate` models it and launch/gpu_validate.sh runs it on GPUs; allowed on cpu: "
            "zeropp.qwz=false zeropp.qgz=false (zeropp.hpz runs)")


def ds_keys_read(b: BenchConfig) -> None:
    """`ds.*` keys DeepSpeed accepts and then ignores at this stage or recompute, refused in one line:
    its ZeRO-3 keys (DeepSpeedZeroConfig's fields whose name or alias starts with stage3_, read by
    stage 3 alone) below stage 3, optimizer offload at stage 0 (no ZeRO optimizer), and
    activation_checkpointing without recompute=full/block (zero_bench calls DeepSpeed's checkpointing
    only for those: engines/deepspeed.py install_checkpointing)."""
    zero_keys = set((b.ds.get("zero_optimization") or {}).keys())
    if zero_keys and b.zero != 3:
        stage3 = zero_keys & stage3_zero_keys()
        if stage3:
            key = sorted(stage3)[0]
            raise ConfigError(f"ds.zero_optimization.{key}: DeepSpeed reads it at ZeRO stage 3 only (got zero={b.zero}); "
                              "leave it out or set zero=3")
    if "offload_optimizer" in zero_keys and b.zero == 0:
        raise ConfigError("ds.zero_optimization.offload_optimizer: DeepSpeed offloads the optimizer with ZeRO 1-3 "
                          "only (got zero=0); use zero=1, 2 or 3 (or offload=true)")
    if "activation_checkpointing" in b.ds and b.recompute not in (Recompute.full, Recompute.block):
        raise ConfigError(f"ds.activation_checkpointing: read only with recompute=full or recompute=block (got "
                          f"recompute={b.recompute}: DeepSpeed's checkpointing is not called); leave it out here")


def stage3_zero_keys() -> set:
    """DeepSpeed's ZeRO-3-only keys, from its own config model (deepspeed/runtime/zero/config.py),
    by field name and alias; offload_param too (ZeRO-3's parameter offload, its docstring). DeepSpeed's
    import logs which accelerator it picked: held back, so that bad input stays one line."""
    import logging

    before = logging.root.manager.disable
    logging.disable(logging.WARNING)  # its logger is made, at INFO, by the import itself
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    finally:
        logging.disable(before)

    keys = {"offload_param"}
    for name, f in DeepSpeedZeroConfig.model_fields.items():
        if name.startswith("stage3_") or (f.alias or "").startswith("stage3_"):
            keys |= {name, f.alias} - {None}
    return keys


def fsdp2(b: BenchConfig, concern: Concern) -> None:
    """What engine=fsdp2 cannot run, each in one line with the nearest choices; it runs every shared
    feature (bf16 states with offload, hybrid sharding, ep at any stage, offload_param at zero=2)."""
    if concern == Concern.zeropp:
        raise ConfigError(f"{first_zeropp_key(b)}: ZeRO++ is DeepSpeed's (ZeRO-3's quantized and hierarchical "
                          "collectives); engine=fsdp2 runs none of it; allowed: engine=deepspeed zero=3, or leave "
                          "zeropp.* out")
    if concern == Concern.offload_device:
        raise ConfigError("offload_device=nvme: engine=fsdp2 offloads to host memory only (CPUOffloadPolicy); "
                          "allowed with fsdp2: offload_device=none, cpu (or engine=deepspeed zero=3)")
    if concern != "engine":
        return
    if b.zero not in (2, 3):
        raise ConfigError(f"zero={b.zero}: engine=fsdp2 always shards parameters; allowed with fsdp2: zero=2 "
                          "(gathered parameters kept from forward to backward) or zero=3 (resharded after "
                          "forward); engine=deepspeed for zero=0/1")
    if b.precision == "fp16":
        raise ConfigError("precision=fp16: engine=fsdp2 has no dynamic loss scaling wired in (torch's "
                          "ShardedGradScaler), and unscaled fp16 gradients under- and overflow; allowed with "
                          "fsdp2: fp32, bf16")
    if b.offload_param != b.offload:
        raise ConfigError(f"offload_param={str(b.offload_param).lower()}: engine=fsdp2 offloads parameters, "
                          "gradients and optimizer states together (CPUOffloadPolicy); set offload=true or "
                          "false alone")
    if b.ds_preset != "default" or b.ds:  # reads_ds_config=False
        key = f"ds_preset={b.ds_preset}" if b.ds_preset != "default" else "ds"
        raise ConfigError(f"{key}: DeepSpeed settings; engine=fsdp2 reads no DeepSpeed config; allowed with "
                          "fsdp2: ds_preset=default and no ds.* keys")
