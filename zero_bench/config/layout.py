"""Where a trial's ranks sit and where each parameter's states live: one RankLayout, in the spirit of
torchtitan's ParallelDims (torchtitan/distributed/parallel_dims.py: a dataclass of every degree,
validated once in __post_init__, with properties for the derived sizes and the meshes).

The degrees: tp (megatron's tensor parallelism), dp (the data-parallel ranks ZeRO or FSDP2
partitions over), dp_shard (FSDP2's hybrid sharding: groups of dp_shard ranks each hold one copy of
the sharded states), ep (megatron's expert parallelism: each group of ep data-parallel ranks splits
a mixture of experts' experts), sp (Ulysses sequence parallelism: each group of sp consecutive
data-parallel ranks splits every sequence, models/ulysses.py; part of dp, not on top of it); pp is
the pipeline-parallel degree (pp groups of tp x dp ranks, each a stage of num_layers / pp layers;
vpp virtual stages per rank when interleaved). Validated once, against the model where one
is given: every refusal that is about the degrees alone (tp dividing the heads, the hidden size,
the query groups and the MLP, and with megatron's sequence parallelism the sequence; ep dividing
the experts and dp; dp_shard dividing dp; sp dividing dp, the heads and the sequence) is raised
here, as one line naming the key (zero_bench.errors.ConfigError). What an engine cannot run stays
in engines/refusals.py; configure.validate_static asks both.

Derived: the world and every group's size (`groups`), the expert-data-parallel size (dp / ep), the
shard group (dp_shard or dp), the experts one rank holds (num_experts / ep), the parameter list one
rank holds (models/params.py, built once per layout) and its counts, and where each parameter's
states live (`partition_ranks`: whole on every rank of the group under ZeRO-0, else partitioned
over dp ranks, dp_shard ranks with hybrid sharding, or dp / ep ranks for a routed expert at ep > 1).
Configure, the estimate (estimate/), the engines' setup and the report ask it: this module is the
one place the degrees are divided (tests/unit/test_rank_layout.py holds the package to that).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

from zero_bench.errors import ConfigError
from zero_bench.models.description import ModelConfig
from zero_bench.models.params import ROOT, Param, params as param_list


@dataclass(frozen=True)
class RankLayout:
    """The degrees of one trial, validated once (see the module's docstring)."""
    tp: int = 1
    """Tensor-parallel degree (megatron-core): each rank holds 1 / tp of the split weights."""
    dp: int = 1
    """Data-parallel degree: the ranks ZeRO partitions the states over (FSDP2: unless dp_shard)."""
    dp_shard: Optional[int] = None
    """FSDP2's hybrid sharding: states sharded within groups of dp_shard ranks, replicated across
    the dp / dp_shard groups. None (or dp): shard over all dp ranks."""
    ep: int = 1
    """Expert-parallel degree: each group of ep data-parallel ranks splits the routed experts;
    the dp / ep ranks that hold the same experts shard their states."""
    sp: int = 1
    """Ulysses sequence-parallel degree: each group of sp consecutive data-parallel ranks splits
    every sequence (seq_len / sp tokens a rank) and all-to-alls heads for sequence around
    attention. Within dp (the world stays tp x dp): ZeRO / FSDP2 shard over all dp ranks."""
    pp: int = 1
    """Pipeline-parallel degree: the layers split into pp stages over pp groups of tp x dp ranks."""
    vpp: int = 1
    """Virtual stages per pipeline rank (interleaved 1F1B): pp x vpp chunks of layers."""
    sequence_parallel: bool = False
    """megatron's sequence parallelism runs (parallel.sequence_parallel at tp > 1): the norms,
    dropouts and residuals hold seq_len / tp tokens per rank (seq_shard). False at tp 1."""
    model: Optional[ModelConfig] = None
    """The model the degrees are validated against and whose parameters the layout places. None:
    the degrees alone (the ZeRO paper's formula on a bare parameter count, a stored calibration)."""
    stage: Optional[int] = None
    """At pp > 1, the pipeline stage (0-based, the pipeline rank) whose ranks this layout describes:
    `params` and every count derived from it are that stage's (stage_params). None: the whole model,
    as at pp = 1 (a layout built from a config; the estimate asks each stage with at_stage)."""

    def __post_init__(self) -> None:
        for key in ("tp", "dp", "ep", "sp", "pp", "vpp") + (("dp_shard",) if self.dp_shard is not None else ()):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"parallel.{key}={value}: must be an integer >= 1")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true: shards the sequence over tp ranks; at parallel.tp=1 "
                              "RankLayout takes sequence_parallel=False")
        self._check_hybrid()
        self._check_experts()
        self._check_tensor_parallel()
        self._check_sequence()
        self._check_pipeline()
        if self.stage is not None and not (isinstance(self.stage, int) and 0 <= self.stage < self.pp):
            raise ValueError(f"RankLayout.stage={self.stage}: a pipeline stage in 0 .. pp - 1 = {self.pp - 1}")

    @classmethod
    def of(cls, degrees: Any, model: Optional[ModelConfig]) -> "RankLayout":
        """The layout of `degrees` (anything with tp, dp, dp_shard, ep and sequence_sharded:
        config.schema's ParallelConfig) for `model`."""
        sequence_parallel = bool(getattr(degrees, "sequence_sharded", False))
        return cls(tp=degrees.tp, dp=degrees.dp, dp_shard=degrees.dp_shard, ep=degrees.ep,
                   sequence_parallel=sequence_parallel, sp=getattr(degrees, "sp", 1), pp=getattr(degrees, "pp", 1),
                   vpp=getattr(degrees, "vpp", 1), model=model)

    # -- validation: one line per refusal, the key first ----------------------------------------
    def _check_hybrid(self) -> None:
        """parallel.dp_shard: FSDP2's hybrid sharding, over megatron's DP ranks at tp 1."""
        shard, dp = self.dp_shard, self.dp
        if not self.hybrid:
            return
        if dp % shard:
            raise ConfigError(f"parallel.dp_shard={shard}: must divide parallel.dp={dp} (groups of dp_shard ranks "
                              "each hold one copy of the sharded states)")
        if self.tp > 1:
            raise ConfigError(f"parallel.dp_shard={shard}: hybrid sharding is modelled at parallel.tp=1 (megatron's "
                              f"DP groups at tp {self.tp} are not one mesh); allowed with tp > 1: "
                              "parallel.dp_shard=null")

    def _check_experts(self) -> None:
        """parallel.ep: megatron's expert parallelism, over the DP ranks at tp 1."""
        ep, dp, m = self.ep, self.dp, self.model
        if ep == 1:
            return
        if m is not None and not m.is_moe:
            raise ConfigError(f"parallel.ep={ep}: expert parallelism splits a mixture of experts' experts; "
                              f"{m.name or 'this model'} has none (model.num_experts is null); allowed: parallel.ep=1")
        if m is not None and m.num_experts % ep:
            raise ConfigError(f"parallel.ep={ep}: must divide model.num_experts={m.num_experts}")
        if dp % ep:
            raise ConfigError(f"parallel.ep={ep}: must divide parallel.dp={dp} (the experts are split over "
                              "ep of the data-parallel ranks)")
        if self.hybrid:
            raise ConfigError(f"parallel.ep={ep}: hybrid sharding with expert parallelism is not modelled; "
                              "allowed with parallel.ep > 1: parallel.dp_shard=null")

    def _check_tensor_parallel(self) -> None:
        """parallel.tp against the model's widths (megatron splits heads, query groups and the MLP)."""
        m, tp = self.model, self.tp
        if m is None:
            return
        if m.num_heads % tp:
            raise ConfigError(f"parallel.tp={tp}: must divide model.num_heads={m.num_heads}")
        if m.hidden_size % tp:
            raise ConfigError(f"parallel.tp={tp}: must divide model.hidden_size={m.hidden_size}")
        # megatron replicates K/V heads when g < tp (an all-gather inside attention), but then a rank's
        # K/V memory and FLOPs are not g/tp of the model's: not modelled, so refused.
        if m.query_groups % tp:
            raise ConfigError(f"parallel.tp={tp}: must divide the query groups (model.num_query_groups="
                              f"{m.query_groups})")
        if m.ffn % tp:
            raise ConfigError(f"parallel.tp={tp}: must divide model.ffn_hidden_size={m.ffn}")
        if self.sequence_parallel and m.seq_len % tp:  # megatron splits the sequence in equal shards
            raise ConfigError(f"model.seq_len={m.seq_len}: must be a multiple of parallel.tp={tp} with "
                              "parallel.sequence_parallel=true (each tp rank holds seq_len / tp tokens); "
                              "allowed: a multiple of tp, or parallel.sequence_parallel=false")
        if m.is_moe and tp > 1:  # moe_layer.py MoELayer.forward refuses tp > 1 without sequence parallelism
            raise ConfigError(f"parallel.tp={tp}: megatron-core's MoE layer at tp > 1 (with sequence parallelism, "
                              "expert tensor parallelism) is not modelled; allowed with model.num_experts: parallel.tp=1")

    def _check_sequence(self) -> None:
        """parallel.sp: DeepSpeed's DistributedAttention splits heads evenly over the group
        (deepspeed/sequence/layer.py asserts it), and each rank keeps seq_len / sp tokens."""
        sp, dp, m = self.sp, self.dp, self.model
        if sp == 1:
            return
        if dp % sp:
            raise ConfigError(f"parallel.sp={sp}: must divide parallel.dp={dp} (each group of sp data-parallel "
                              "ranks splits one sequence)")
        if self.ep > 1:
            raise ConfigError(f"parallel.sp={sp}: with expert parallelism not modelled; allowed with parallel.sp > 1: "
                              "parallel.ep=1")
        if m is None:
            return
        heads, groups = m.num_heads // self.tp, m.query_groups // self.tp
        if heads % sp:
            raise ConfigError(f"parallel.sp={sp}: must divide the attention heads per tensor-parallel rank "
                              f"(model.num_heads={m.num_heads} / tp {self.tp} = {heads})")
        # DeepSpeed's rule (ulysses_sp.py): fewer key/value heads than sp are replicated sp / g times
        if (groups % sp) if groups >= sp else (sp % groups):
            raise ConfigError(f"parallel.sp={sp}: the key/value heads per tensor-parallel rank (model.num_query_groups="
                              f"{m.query_groups} / tp {self.tp} = {groups}) must be a multiple of sp or divide it")
        if m.seq_len % (self.tp * sp):
            raise ConfigError(f"parallel.sp={sp}: model.seq_len={m.seq_len} must be divisible by tp x sp = "
                              f"{self.tp * sp}")

    def _check_pipeline(self) -> None:
        """parallel.pp / parallel.vpp: the layers split evenly into pp x vpp chunks (megatron's
        uniform split: get_num_layers_to_build), at least one layer each."""
        pp, vpp, m = self.pp, self.vpp, self.model
        if vpp > 1 and pp == 1:
            raise ConfigError(f"parallel.vpp={vpp}: virtual stages split a pipeline; allowed at parallel.pp=1: "
                              "parallel.vpp=1")
        if m is None or pp == 1:
            return
        if m.num_layers % (pp * vpp):
            raise ConfigError(f"parallel.pp={pp}: pp x vpp = {pp * vpp} must divide model.num_layers={m.num_layers} "
                              "(each stage holds num_layers / (pp x vpp) layers)")

    # -- sizes and groups -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Every rank of the trial: tp x dp x pp, as ParallelConfig.world_size; the sp ranks are
        data-parallel ranks."""
        return self.tp * self.dp * self.pp

    @property
    def sequences(self) -> int:
        """Different sequences a micro-step trains over the dp ranks: dp / sp."""
        return self.dp // self.sp

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence one rank holds outside attention: seq_len / sp."""
        if self.model is None:
            raise ValueError("RankLayout.local_seq_len: the layout has no model")
        return self.model.seq_len // self.sp

    @property
    def shard_size(self) -> int:
        """The ranks that partition one copy of the dense states: dp, or dp_shard with hybrid sharding."""
        return self.dp_shard or self.dp

    @property
    def seq_shard(self) -> int:
        """The ranks one sequence's norms, dropouts and residuals are split over: tp with sequence
        parallelism, else 1 (each rank holds them whole)."""
        return self.tp if self.sequence_parallel else 1

    @property
    def hybrid(self) -> bool:
        """Hybrid sharding: the states sharded within groups smaller than dp, replicated across them."""
        return self.shard_size != self.dp

    @property
    def replicas(self) -> int:
        """Copies of the sharded states across the dp ranks: dp / dp_shard (1 without hybrid sharding)."""
        return self.dp // self.shard_size

    @property
    def expert_data_parallel(self) -> int:
        """The ranks that hold the same experts and partition their states: dp / ep (megatron's
        expert-data-parallel group; dp at ep 1)."""
        return self.dp // self.ep

    @property
    def groups(self) -> dict[str, int]:
        """The process groups a rank is in, name -> ranks: the world, the data-parallel and the
        tensor-parallel group; with ep > 1 the expert-parallel group (the dispatcher's all-to-all)
        and the expert-data-parallel group (the experts' reduce-scatters and all-gathers); with
        hybrid sharding the shard group and the replicate group (FSDP2's 2-D mesh); with sp > 1 the
        sequence-parallel group (attention's all-to-all); with pp > 1 the pipeline group (the
        stages' point-to-point sends). dp, tp, ... are the groups within one stage."""
        out = {"world": self.world_size, "dp": self.dp, "tp": self.tp}
        if self.sp > 1:
            out.update(sp=self.sp)
        if self.ep > 1:
            out.update(ep=self.ep, expert_dp=self.expert_data_parallel)
        if self.hybrid:
            out.update(shard=self.shard_size, replicate=self.replicas)
        if self.pp > 1:
            out.update(pp=self.pp)
        return out

    def stage_of(self, rank: int) -> Optional[int]:
        """The pipeline stage world rank `rank` runs (megatron's pipeline rank: the ranks laid out tp
        fastest, then dp, then pp, so each stage holds tp x dp consecutive ranks); None at pp 1."""
        return rank // (self.tp * self.dp) if self.pp > 1 else None

    @property
    def spans(self) -> dict[str, int]:
        """Consecutive ranks each of `groups` spans, the ranks laid out tp fastest, then dp (sp and ep
        groups consecutive data-parallel ranks): a group whose span fits in a node's ranks never
        leaves the node (the time estimate's intra- vs inter-node bandwidth, estimate/time/comm.py). The ranks are laid
        out tp fastest, then dp, then pp (megatron's order): the data-parallel groups stay within one
        stage's tp x dp ranks; pp_hop is the span of one p2p send between neighbouring stages."""
        stage = self.tp * self.dp  # one pipeline stage's ranks: the whole world at pp 1
        out = {"world": self.world_size, "dp": stage, "tp": self.tp}
        if self.sp > 1:
            out.update(sp=self.tp * self.sp)
        if self.ep > 1:
            out.update(ep=self.tp * self.ep, expert_dp=stage)
        if self.hybrid:
            out.update(shard=self.tp * self.shard_size, replicate=stage)
        if self.pp > 1:  # the stages' neighbours are tp x dp ranks apart: a p2p hop spans stage + 1 ranks
            out.update(pp=self.world_size, pp_hop=stage + 1)
        return out

    def expert_rank(self, rank: int) -> int:
        """A data-parallel rank's index among the ranks holding its experts: megatron's layout at tp 1
        (parallel_state: ep consecutive ranks split the experts, so ranks r, r + ep, ... hold the same)."""
        return rank // self.ep

    # -- where each parameter lives ---------------------------------------------------------------
    def partition_ranks(self, p: Param) -> int:
        """The ranks one parameter's states are partitioned over where ZeRO (the states its stage
        partitions) or FSDP2 shards them: the shard group (dp, or dp_shard with hybrid sharding), or,
        for a routed expert's at ep > 1, the dp / ep ranks that hold the same experts. Until then
        each of those ranks holds p as models/params.py shapes it: whole, or its tp slice (p.tp_dim)."""
        return self.expert_data_parallel if self.ep > 1 and p.expert else self.shard_size

    def partition_index(self, p: Param, rank: int) -> int:
        """`rank`'s (a data-parallel rank's) index in the group that partitions p (partition_ranks)."""
        return self.expert_rank(rank) if self.ep > 1 and p.expert else rank

    @property
    def experts_per_rank(self) -> Optional[int]:
        """Routed experts of each MoE layer one rank holds: num_experts / ep (None: a dense model)."""
        m = self.model
        return m.num_experts // self.ep if m is not None and m.is_moe else None

    @functools.cached_property
    def params(self) -> tuple[Param, ...]:
        """Every parameter one rank holds (its tensor-parallel shard, its experts_per_rank routed
        experts of each MoE layer), in GPTModel.named_parameters() order: models/params.py's list,
        built once per layout."""
        if self.model is None:
            raise ValueError("RankLayout.params: the layout has no model")
        every = tuple(param_list(self.model, self.tp, experts=self.experts_per_rank))
        return every if self.stage is None or self.pp == 1 else self.stage_params(self.stage, every)

    # -- pipeline stages ---------------------------------------------------------------------------
    def at_stage(self, stage: int) -> "RankLayout":
        """This layout for the ranks of pipeline stage `stage` (its params, counts and partitions)."""
        return dataclasses.replace(self, stage=stage)

    @property
    def layers_per_chunk(self) -> int:
        """Layers of one model chunk: num_layers / (pp x vpp) (megatron's uniform split)."""
        if self.model is None:
            raise ValueError("RankLayout.layers_per_chunk: the layout has no model")
        return self.model.num_layers // (self.pp * self.vpp)

    def stage_layers(self, stage: Optional[int] = None) -> tuple[int, ...]:
        """The (global) indices of the layers pipeline rank `stage` holds (default: this layout's
        stage; None there: every layer). Megatron's assignment (get_transformer_layer_offset): model
        chunk c of pipeline rank r is virtual stage c x pp + r, holding num_layers / (pp x vpp)
        consecutive layers; without interleaving (vpp 1) rank r holds layers r x L/pp .. (r+1) x L/pp - 1."""
        stage = self.stage if stage is None else stage
        if self.model is None:
            raise ValueError("RankLayout.stage_layers: the layout has no model")
        if stage is None or self.pp == 1:
            return tuple(range(self.model.num_layers))
        n = self.layers_per_chunk
        return tuple(i for c in range(self.vpp) for i in range((c * self.pp + stage) * n, (c * self.pp + stage + 1) * n))

    @property
    def largest_stage(self) -> "RankLayout":
        """The layout of the pipeline stage that holds the most parameters (the earlier of equals);
        itself at pp 1 or where a stage is set."""
        if self.pp == 1 or self.stage is not None:
            return self
        return max((self.at_stage(s) for s in range(self.pp)), key=lambda x: (x.held_params, -x.stage))

    @property
    def first_stage(self) -> bool:
        """This layout's ranks hold the embedding (the first stage; every rank at pp 1)."""
        return self.pp == 1 or self.stage in (None, 0)

    @property
    def last_stage(self) -> bool:
        """This layout's ranks hold the final norm, the output layer and the loss (the last stage)."""
        return self.pp == 1 or self.stage in (None, self.pp - 1)

    def stage_params(self, stage: int, every: Optional[tuple[Param, ...]] = None) -> tuple[Param, ...]:
        """The parameters pipeline rank `stage` holds, of `every` (the whole model's list): its
        layers (stage_layers), the embeddings on the first stage, the final norm and the output
        layer on the last. Tied embeddings (GPT presets): megatron-core's last stage, which is not
        the first, allocates its own output_layer.weight [V/tp, h] (GPTModel builds the output
        layer with skip_weight_param_allocation only where pre_process holds the embedding) and
        keeps it equal to the word embedding by an all-reduce of their gradients over the embedding
        group (LanguageModule.setup_embeddings_and_output_layer): a second copy, counted here. The
        names stay the whole model's (decoder.layers.{global index})."""
        every = every if every is not None else tuple(param_list(self.model, self.tp, experts=self.experts_per_rank))
        layers = {f"layer{i}" for i in self.stage_layers(stage)}
        first, last = stage == 0, stage == self.pp - 1
        out = []
        for p in every:
            if p.group in layers:
                out.append(p)
            elif p.group == ROOT:
                embedding = p.name.startswith("embedding.")
                if (embedding and first) or (not embedding and last):
                    out.append(p)
        if last and not first and self.model.tie_embeddings:
            word = next(p for p in every if p.name == "embedding.word_embeddings.weight")
            out.append(dataclasses.replace(word, name="output_layer.weight"))
        return tuple(out)

    @functools.cached_property
    def _split(self) -> tuple[int, int]:
        dense = expert = 0
        for p in self.params:
            if p.expert:
                expert += p.numel
            else:
                dense += p.numel
        return dense, expert

    @property
    def held_params(self) -> int:
        """Parameters one rank holds whole before any ZeRO / FSDP2 partitioning: its tensor-parallel
        shard (replicated norms and row biases included), with its experts_per_rank routed experts."""
        return sum(self._split)

    @property
    def dense_params(self) -> int:
        """The held parameters that are no routed expert's (every rank holds them whatever ep)."""
        return self._split[0]

    @property
    def held_expert_params(self) -> int:
        """The routed experts' parameters one rank holds (experts_per_rank of each MoE layer)."""
        return self._split[1]

    @property
    def tp_shard_expert_params(self) -> int:
        """Every routed expert's parameters in this tensor-parallel shard (all ep ranks' together)."""
        return self.held_expert_params * self.ep

    @property
    def tp_shard_params(self) -> int:
        """This tensor-parallel rank's shard of the whole model, every expert once: what the data-parallel
        ranks' partitions split between them (held_params at ep 1)."""
        return self.dense_params + self.tp_shard_expert_params

    # -- ZeRO's optimizer param groups ------------------------------------------------------------
    def held_whole(self, total: float, experts: float = 0) -> float:
        """Of `total` parameters of one tensor-parallel rank, `experts` of them the routed experts
        (all E of each MoE layer), those one rank holds whole: total at ep 1; at ep > 1 the dense
        ones and 1 / ep of the experts."""
        experts = experts if self.ep > 1 else 0
        return total - experts + experts / self.ep

    def zero_groups(self, total: float, experts: float = 0) -> list[float]:
        """Each ZeRO optimizer param group's partition on one rank, as the fraction the paper's formula
        takes (estimate/states.py), for the counts held_whole takes: [held / dp] at ep 1; at ep > 1
        the dense group over the dp ranks and the rank's experts over the dp / ep ranks holding
        them (DeepSpeed's expert-data-parallel group): [dense / dp, (experts / ep) / (dp / ep)],
        which add up to total / dp."""
        if self.ep == 1:
            return [self.held_whole(total, experts) / self.dp]
        return [(total - experts) / self.dp, experts / self.ep / self.expert_data_parallel]

    @property
    def zero_partitions(self) -> list[int]:
        """Elements of each ZeRO-1/2 optimizer param group's flat partition on one rank, of the
        model's exact counts: [held // dp] at ep 1; at ep > 1 [dense // dp, held experts // (dp / ep)]."""
        if self.ep == 1:
            return [self.held_params // self.dp]
        return [self.dense_params // self.dp, self.held_expert_params // self.expert_data_parallel]
