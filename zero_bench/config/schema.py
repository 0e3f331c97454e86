"""What the user can ask for: one dataclass per section of the composed config, each field with its
default and a docstring. This is the one source of defaults: Hydra composes conf/ (presets and
sweeps) over this schema (registered in Hydra's ConfigStore below), so conf/ only says what a
preset changes. zero_bench.config.configure composes and checks it into a BenchConfig (one line per bad
input); zero_bench.search.preflight checks that against this machine.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional

from zero_bench.config.checked import known_only, migrated, structured
from zero_bench.config.choices import (DEFAULT_ENGINE, Device, EngineName, Launcher, Loss, ModuleLoading, OffloadDevice,
                                        PipelineSchedule, Precision, Recompute, States, Strategy)
from zero_bench.config.command import ReportConfig, SearchConfig
from zero_bench.config.layout import RankLayout
from zero_bench.engines.specs import tag
from zero_bench.errors import ConfigError
from zero_bench.models import ModelConfig
from zero_bench.models.description import key_fields

__all__ = ["ConfigError", "BenchConfig", "EngineName", "ModelConfig", "ParallelConfig", "HardwareConfig",
           "BatchConfig", "StepsConfig", "ZeroppConfig", "PipelineSchedule", "SearchConfig", "ReportConfig", "Config", "CONF_DIR", "structured"]

_CHECKOUT = Path(__file__).resolve().parents[2]  # zero_bench/config/schema.py -> the checkout
CONF_DIR = _CHECKOUT / "conf"
DS_TEMPLATES = _CHECKOUT / "ds_configs"
ZERO_STAGES = (0, 1, 2, 3)


# -- the schema ------------------------------------------------------------------------------------

@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree (megatron-core); must divide heads, hidden size and vocabulary."""
    dp: int = 2
    """Data-parallel degree (DeepSpeed); ZeRO partitions over these ranks."""
    dp_shard: Optional[int] = None
    """Hybrid sharding (torchtitan's data_parallel_shard_degree): shard the model states within
    groups of dp_shard data-parallel ranks and replicate them across the dp / dp_shard groups, so
    the all-gathers stay inside a group (a node) and only gradients cross it. engine=fsdp2 (a 2-D
    device mesh, HSDP), tp 1; must divide dp. None: shard over all dp ranks."""
    ep: int = 1
    """Expert-parallel degree (megatron-core's expert_model_parallel_size) of a mixture of experts:
    each group of ep data-parallel ranks splits the experts (num_experts / ep each) and exchanges
    tokens by all-to-all (megatron's alltoall dispatcher); the ranks that hold the same experts
    (dp / ep of them) shard those experts' states. Must divide dp and num_experts; tp 1; DeepSpeed
    ZeRO 1-2 (its expert-data-parallel groups) and FSDP2 zero 2-3."""
    sequence_parallel: Optional[bool] = None
    """Megatron's sequence parallelism at tp > 1 (Korthikanti et al. 2022), as Megatron and
    torchtitan users run tensor parallelism: the norms, dropouts and residuals hold seq_len / tp
    tokens per rank, gathered before and reduce-scattered after each tp-split matmul; seq_len must
    be a multiple of tp. false: every tp rank holds the whole sequence there. Nothing at tp 1.
    null: true at tp > 1, but false under ds_preset=megatron_deepspeed (its 2021 reference setup
    predates it)."""
    sp: int = 1
    """Ulysses sequence-parallel degree (DeepSpeed's DistributedAttention): each group of sp
    consecutive data-parallel ranks splits every sequence (seq_len / sp tokens each) and exchanges
    sequence shards for head shards by all-to-all around attention. Part of dp, not on top of it: the
    ranks are tp x dp, dp / sp sequences a micro-step, and ZeRO / FSDP2 shard the states over all dp
    ranks. Must divide dp and the heads per tp rank; key/value heads fewer than sp must divide it
    (they are replicated); model.seq_len divisible by tp x sp. 1: every rank holds whole sequences."""
    pp: int = 1
    """Pipeline-parallel degree: the layers split into pp stages (the embedding on the first, the
    output layer and the loss on the last), each stage on its own tp x dp ranks, activations sent
    between stages point to point (torch.distributed.pipelining). The world is tp x dp x pp; the
    micro-batches of one step (batch.grad_accum) flow through the stages by pp_schedule."""
    pp_schedule: str = PipelineSchedule.one_f_one_b.value
    """The pipeline schedule at pp > 1: gpipe (all forwards, then all backwards), 1f1b (one forward,
    one backward: at most pp - stage micro-batches in flight on a stage), interleaved_1f1b (vpp
    virtual stages per rank, a smaller bubble). A string (OmegaConf takes an enum's member names, and
    "1f1b" is no identifier); configure checks it against config.choices.PipelineSchedule."""
    vpp: int = 1
    """Virtual pipeline stages per rank with pp_schedule=interleaved_1f1b (Megatron's
    virtual_pipeline_model_parallel_size): the layers split into pp x vpp chunks, rank r holding
    chunks r, r + pp, ... ; 1 otherwise."""

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def sequence_sharded(self) -> bool:
        """Whether megatron's sequence parallelism runs: asked for or left out (configure.resolve
        makes it false under a preset from before it), and tp > 1 to shard over."""
        return self.sequence_parallel is not False and self.tp > 1


@dataclass
class HardwareConfig:
    device: Device = Device.auto
    """auto: CUDA when torch sees a GPU, else DeepSpeed's CPU accelerator; cpu; gpu. A BenchConfig
    holds the resolved device."""
    memory_gb: Optional[float] = None
    """Per-rank capacity in GiB (see capacity.py): on GPU an emulated smaller card, on CPU the budget
    a rank's peak RSS is compared with; None: the card, or the host's RAM per rank. On GPU a card's
    marketed size (40, 80, 141) is not its total: a warning names the preset that has it."""
    memory_mib: Optional[int] = None
    """Per-rank capacity in MiB as nvidia-smi shows a card's total (an A100-40GB: 40537); exclusive
    with memory_gb. On a larger card it is emulated (see capacity.py)."""
    devices: Optional[str] = None
    """GPUs to run on, as CUDA_VISIBLE_DEVICES spells them (indices, UUIDs, MIG UUIDs), the first
    tp*dp per node are used; None: the launching shell's CUDA_VISIBLE_DEVICES, else 0..N-1."""
    hostfile: Optional[str] = None
    """DeepSpeed hostfile for multi-node launches (`host slots=N` lines); "slurm": this allocation's nodes."""
    num_nodes: int = 1
    """Nodes of the hostfile to use."""
    launcher: Launcher = Launcher.pdsh
    """DeepSpeed's multi-node launcher."""
    cuda_module_loading: ModuleLoading = ModuleLoading.lazy
    """How CUDA loads kernels, which sets the CUDA context's size (estimate/gpu.py): lazy, the default
    since CUDA 11.7 with torch 1.13; eager, as software before that did. GPU ranks run with
    CUDA_MODULE_LOADING set to it, so a trial measures what the estimate assumes."""
    card: Optional[str] = None
    """The GPU the preset describes, as words of its NVML name ("A100 40GB" names "NVIDIA
    A100-SXM4-40GB"): the estimate uses this machine's calibration (`zero_bench calibrate`) only when
    its GPU's name holds every word; None: whatever GPU this machine has. Not part of a trial's key."""


@dataclass
class BatchConfig:
    micro: int = 2
    """Micro-batch per data-parallel rank."""
    grad_accum: int = 1
    """Micro-steps per optimizer step: global batch = micro x grad_accum x dp."""


@dataclass
class StepsConfig:
    warmup: int = 2
    """Optimizer steps before timing (a measurement)."""
    timed: int = 5
    """Optimizer steps timed; time/it is their median."""
    probe: int = 1
    """Optimizer steps of a memory probe before its profiled step (optimizer state is allocated
    lazily at the first step; docs/verified.md, "Probe length", says how many steps the peak needs
    to settle). 0: a probe after another entry of its launch profiles its first step at its size
    (the launch's first entry still runs the one step that allocates the optimizer state; what
    that changes: docs/measuring.md)."""


@dataclass
class ZeroppConfig:
    """ZeRO++ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant
    Model Training", arXiv:2306.10209), DeepSpeed ZeRO-3 only (the `zeropp:` section). What each
    costs and saves: zero_bench/estimate/zeropp.py."""
    qwz: bool = False
    """qwZ: the parameters all-gathered as int8 with a scale per group (DeepSpeed's
    zero_quantized_weights); needs DeepSpeed's quantizer kernel (CUDA: refused on CPU)."""
    qgz: bool = False
    """qgZ: the gradients reduce-scattered as int4 by an all-to-all within, then across nodes
    (DeepSpeed's zero_quantized_gradients); DeepSpeed 0.19.8 uses it only across nodes
    (stage3.py: num_nodes > 1), one node reduce-scatters as plain ZeRO-3; CUDA only."""
    hpz: int = 1
    """hpZ: a second copy of the parameters partitioned within groups of hpz consecutive ranks, so
    that backward's all-gathers stay inside a group (DeepSpeed's zero_hpz_partition_size); must
    divide the ranks per node, tp 1; 1: off. Runs on CPU."""

    @property
    def active(self) -> bool:
        return self.qwz or self.qgz or self.hpz > 1

    def tag(self) -> str:
        """How labels name it: "zeropp=qwz+qgz+hpz2"; "" when off."""
        parts = [n for n, on in (("qwz", self.qwz), ("qgz", self.qgz)) if on]
        parts += [f"hpz{self.hpz}"] if self.hpz > 1 else []
        return "zeropp=" + "+".join(parts) if parts else ""


@dataclass
class BenchConfig:
    """One trial's configuration, everything but which batch sizes to try. Built by from_cfg, whose
    result has device, precision, offload_param and, at tp > 1, parallel.sequence_parallel resolved
    (no "auto", no None)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    engine: EngineName = DEFAULT_ENGINE
    """What shards the model: deepspeed (ZeRO 0-3) or fsdp2 (PyTorch's fully_shard on every
    transformer layer and the root; zero=3 reshards after forward, zero=2 keeps the gathered
    parameters from forward to backward; fp32 or bf16; no DeepSpeed config)."""
    zero: int = 2
    """ZeRO stage 0-3 (engine=fsdp2: 2 or 3)."""
    offload: bool = False
    """Optimizer states (and the gradients they read) to host memory; ZeRO 1-3. engine=fsdp2: the
    parameters, gradients and optimizer states together (CPUOffloadPolicy)."""
    offload_param: Optional[bool] = None
    """Parameters to host memory (or NVMe, with offload_device=nvme); ZeRO-3 only. None: follow
    `offload` with ZeRO-3 (engine=fsdp2: always follows `offload`)."""
    offload_device: Optional[OffloadDevice] = None
    """Where offloaded states go, the rungs of ZeRO's memory ladder: none, cpu (host memory) or nvme
    (DeepSpeed's ZeRO-Infinity: the optimizer states, and with offload_param the parameters, in files
    under nvme_path, read and written through its async_io op (libaio) via pinned host buffers;
    engine=deepspeed, ZeRO-3). None: follow `offload` (true: cpu, false: none); given, it sets
    `offload` (offload=true with offload_device=none is refused). A BenchConfig holds the resolved one."""
    nvme_path: Optional[str] = None
    """With offload_device=nvme: the folder DeepSpeed's swapper writes into, on a filesystem that takes
    O_DIRECT (not tmpfs); each launch swaps in a folder of its own under it, removed after the launch
    (and by the next start if the launch was killed). None: `nvme` under the launch's run directory."""
    precision: Precision = Precision.auto
    """fp32, bf16, fp16 (GPU only) or auto: on CPU bf16 where this CPU computes it natively (x86:
    avx512_bf16 or amx_bf16 with torch's CPU capability AVX512 and ONEDNN_MAX_CPU_ISA, if set, naming
    a bf16 ISA; arm: bf16 in its Features; `zero_bench doctor` says which), else fp32; on GPU bf16
    where the card has it (compute capability 8.0+), else fp16. A BenchConfig holds the resolved one."""
    states: States = States.mixed
    """Where the precision of the model states lives (with precision=bf16; fp32 and fp16 train
    `mixed`): mixed (fp32 master weights, gradients reduced in fp32, fp32 AdamW moments); bf16
    (pure bf16 as torchtune and LitGPT's bf16-true train: weights, gradients and AdamW's moments in
    bf16, no fp32 copy; engine=fsdp2 builds the model in bf16, engine=deepspeed sets DeepSpeed's
    bf16_master_weights_and_grads and bf16_optimizer_states, ZeRO 1-3 without offload); adam8bit
    (torchao's AdamW8bit: int8 moments with an fp32 scale per 256 values, fp32 master; estimated
    only, torchao is not installed)."""
    loss: Loss = Loss.megatron
    """How the loop turns the last hidden states into the loss (zero_bench/models/loss.py): megatron
    (its vocab-parallel cross entropy: 16-bit logits, the fp32 softmax kept); bf16 (torch's cross
    entropy on the logits as made: a 16-bit log-softmax kept); fp32 (upcast first, Hugging Face's
    and torchtitan's loops: an fp32 log-softmax kept); chunked (the output layer and the loss 256
    tokens at a time under a checkpoint, Liger's and torchtune's way: no logits kept). tp 1 for all
    but megatron."""
    recompute: Recompute = Recompute.none
    """Activation recompute (megatron-core's recompute_granularity): none; selective (core attention);
    full (every layer's input kept, the layer recomputed in backward, through DeepSpeed's
    activation checkpointing so that ds.activation_checkpointing.* apply, as Megatron-DeepSpeed);
    block (megatron's recompute_method=block: the first recompute_layers layers recomputed as with
    full, the others keep everything; the memory of torchtitan's every-N-th-layer checkpointing
    with recompute_layers = layers / N); op (torchtitan's per-op selective checkpointing, its
    default `selective` option: each layer under torch's checkpoint keeps its input, the outputs of
    every other matmul (QKV and fc1) and of the attention kernel, and recomputes the rest;
    models/op_recompute.py)."""
    recompute_layers: int = 1
    """With recompute=full: layers per checkpoint (megatron's recompute_num_layers, method uniform);
    with recompute=block: how many layers, from the first, are recomputed (method block)."""
    # -- long sequences (issue 45 items 3-4: models/sequence.py) --
    tiled_mlp: Optional[str] = None
    """The MLP run one sequence tile at a time and recomputed in backward (DeepSpeed's TiledMLP, ALST):
    the number of tiles, or auto (DeepSpeed's ceil(seq_len / hidden_size)); one tile's MLP
    intermediates are alive instead of the whole sequence's. null: untiled. Dense models, recompute
    none / selective / full / block."""
    recompute_offload: bool = False
    """With recompute=full or block: each checkpointed layer input lives in host memory between the
    forward and the backward (DeepSpeed's cpu_checkpointing, at megatron's checkpoint for both
    engines); the device keeps none, the host RAM per node grows by them (the estimate's host term)."""
    ds_preset: str = "default"
    """The ds_configs/ template set: default (buckets scaled to the model on CPU) or
    megatron_deepspeed (the reference table's buckets, overlap_comm, fp16 loss scaling, activation
    checkpointing; with CPU offload or ZeRO-3 its offload/zero3 templates too)."""
    zeropp: ZeroppConfig = field(default_factory=ZeroppConfig)
    """ZeRO++ at ZeRO-3 (engine=deepspeed): zeropp.qwz, zeropp.qgz, zeropp.hpz."""
    compile: bool = False
    """DeepSpeed's engine.compile() (torch.compile); compile time is reported apart from time/it."""
    fusions: bool = True
    """megatron's jit-fused bias-dropout-add and bias-activation (SwiGLU, biased GeLU) on GPU, as
    megatron's own training scripts run: plain torch under megatron's jit_fuser, which is
    torch.compile, so each GPU rank compiles them with inductor and Triton in its first step (a C
    compiler, Python's headers and libcuda needed: `zero_bench doctor` checks). false: megatron's
    eager ops, nothing compiled; the estimate then counts the eager SwiGLU (5 intermediates of
    ffn per token, 3 fused). true also keeps unfused attention's softmax in 16 bits, as megatron's
    fused softmax kernel does (2 bytes per score kept where the fp32 upcast keeps 6). CPU runs always take the eager ops (a compile there costs minutes per
    shape), so on CPU this key changes nothing, trial keys included. A gated MoE model with biases
    runs eager on GPU too (megatron's fused SwiGLU for experts has no bias: models/megatron.py)."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    steps: StepsConfig = field(default_factory=StepsConfig)
    timeout_s: float = 60.0
    """The least time a trial may go without finishing a step before it is called hung and killed;
    the limit grows with the time per sample this search measured (4x the expected step, 3x more
    for an entry's first step; 10x timeout_s for the start-up): see zero_bench/trial/time_limits.py."""
    seed: int = 1234
    """Seeds the weights and the tokens: identical across runs and ZeRO stages."""
    ds: dict = field(default_factory=dict)
    """Raw DeepSpeed keys merged last, e.g. +ds.zero_optimization.reduce_bucket_size=5e7 (checked
    with DeepSpeed's own config model before any launch)."""

    def __post_init__(self) -> None:
        # Values given as plain strings (tests, stored records) become the enums the schema types.
        self.precision, self.recompute = Precision(self.precision), Recompute(self.recompute)
        self.engine, self.states, self.loss = EngineName(self.engine), States(self.states), Loss(self.loss)
        if self.offload_device is not None:
            self.offload_device = OffloadDevice(self.offload_device)
        if self.tiled_mlp is not None:
            self.tiled_mlp = str(self.tiled_mlp)  # 4 from Python or YAML, "4" from the command line

    @property
    def rung(self) -> OffloadDevice:
        """The offload rung, also for a config built by hand or stored before offload_device existed."""
        if self.offload_device is not None:
            return self.offload_device
        return OffloadDevice.cpu if self.offload or self.offload_param else OffloadDevice.none

    @property
    def nvme(self) -> bool:
        return self.offload_device == OffloadDevice.nvme

    @functools.cached_property
    def layout(self) -> RankLayout:
        """The ranks' layout (config/layout.py): the parallel degrees validated against the model,
        the groups, where each parameter lives and the parameter list one rank holds. Built on
        first use and kept (a BenchConfig is not changed after from_cfg; dataclasses.replace makes a
        new one, with its own); raises the ConfigError of a degree the model does not allow."""
        return RankLayout.of(self.parallel, self.model)

    @property
    def global_batch(self) -> int:
        return self.batch.micro * self.batch.grad_accum * self.parallel.dp // self.parallel.sp

    def with_micro(self, micro: int) -> "BenchConfig":
        return dataclasses.replace(self, batch=dataclasses.replace(self.batch, micro=micro))

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))  # enums as their plain values

    @classmethod
    def from_dict(cls, d: dict) -> "BenchConfig":
        """A stored config (TrialResult.config, a trial spec) -> BenchConfig; keys written by other
        versions of zero_bench are mapped (migrated) or dropped, missing ones take the schema's defaults."""
        return structured(cls, known_only(migrated(d), cls))

    def search_key(self) -> str:
        """Stable id of everything but the batch, with the software that runs it: one search per key,
        so a resume never mixes trials of different torch / deepspeed / megatron-core versions."""
        d = self._key_dict()
        d["batch"] = {"grad_accum": self.batch.grad_accum}
        for k in ("steps", "timeout_s"):
            d.pop(k)
        d["software"] = software_versions()
        return _hash(d)

    def trial_key(self) -> str:
        return _hash(self._key_dict())

    def _key_dict(self) -> dict:
        """to_dict() without the keys added later while they hold their defaults (the model's later
        fields, engine=deepspeed, states=mixed): a configuration keeps the key it had before they existed, so old
        stores resume and their rows stay one row."""
        d = self.to_dict()
        d["model"] = key_fields(d["model"])
        if d["engine"] == DEFAULT_ENGINE:
            d.pop("engine")
        if d["states"] == States.mixed:
            d.pop("states")
        if d["loss"] == Loss.megatron:
            d.pop("loss")
        for k in ("tiled_mlp", "recompute_offload"):  # long-sequence keys, off: the keys from before
            if not d[k]:
                d.pop(k)
        if d["fusions"] or d["hardware"]["device"] == Device.cpu:
            d.pop("fusions")  # CPU runs eager whatever the key says
        d["hardware"].pop("card", None)  # names the card for the estimate; the trial is the same
        if d.get("offload_device") != OffloadDevice.nvme:
            d.pop("offload_device", None)  # none / cpu: `offload` says it, as before the key existed
        if d.get("nvme_path") is None:
            d.pop("nvme_path", None)
        if d["parallel"].get("dp_shard") is None:
            d["parallel"].pop("dp_shard", None)
        if d["parallel"].get("ep") == 1:
            d["parallel"].pop("ep")
        if not self.zeropp.active:
            d.pop("zeropp")  # off: the keys configurations had before ZeRO++ was a dimension
        if not self.parallel.sequence_sharded:  # tp 1, or tp > 1 as it ran before the key existed
            d["parallel"].pop("sequence_parallel", None)
        if d["parallel"].get("sp") == 1:
            d["parallel"].pop("sp")
        if d["parallel"].get("pp", 1) == 1:  # no pipeline: the keys configurations had before parallel.pp
            for k in ("pp", "pp_schedule", "vpp"):
                d["parallel"].pop(k, None)
        return d

    def label(self) -> str:
        shard = self.parallel.dp_shard
        extras = [f"dp_shard={shard}" if shard and shard != self.parallel.dp else "",
                  "sequence_parallel=false" if self.parallel.tp > 1 and not self.parallel.sequence_sharded else "",
                  f"ep={self.parallel.ep}" if self.parallel.ep > 1 else "",
                  f"sp={self.parallel.sp}" if self.parallel.sp > 1 else "",
                  pipeline_tag(self.parallel),
                  f"states={self.states}" if self.states != States.mixed else "",
                  f"loss={self.loss}" if self.loss != Loss.megatron else "", self.zeropp.tag(),
                  f"recompute={self.recompute}" if self.recompute not in ("none", "block") else "",
                  f"recompute=block({self.recompute_layers})" if self.recompute == Recompute.block else "",
                  f"tiled_mlp={self.tiled_mlp}" if self.tiled_mlp is not None else "",
                  "recompute_offload" if self.recompute_offload else "",
                  "" if self.ds_preset == "default" else self.ds_preset, "compile" if self.compile else "",
                  "fusions=false" if not self.fusions and self.hardware.device != Device.cpu else ""]
        return " ".join([make_label(self.model.name, self.parallel.tp, self.parallel.dp, self.zero,
                                    "nvme" if self.nvme else self.offload, self.precision, self.engine)] + [x for x in extras if x])


def pipeline_tag(p: ParallelConfig) -> str:
    """How a label names a pipeline: "pp=4", with the schedule where it is not 1f1b and the virtual
    stages ("pp=4 gpipe", "pp=4 interleaved_1f1b vpp=2"); "" at pp 1."""
    if p.pp == 1:
        return ""
    schedule = "" if p.pp_schedule == PipelineSchedule.one_f_one_b else f" {p.pp_schedule}"
    return f"pp={p.pp}{schedule}" + (f" vpp={p.vpp}" if p.vpp > 1 else "")


def make_label(model: str, tp: int, dp: int, zero: Any, offload: Any, precision: str,
               engine: str = DEFAULT_ENGINE) -> str:
    """E.g. "GPT-mini tp1 dp2 zero3 fp32", "GPT-mini tp1 dp2 zero3+nvme fp32 fsdp2": DeepSpeed's labels read as
    they did before there was a choice of engine. offload: a bool, or "nvme" for the NVMe rung."""
    tail = f" {tag(engine)}" if tag(engine) else ""
    rung = "+nvme" if offload == "nvme" else ("+offload" if offload else "")
    return f"{model} tp{tp} dp{dp} zero{zero}{rung} {precision}{tail}"


@dataclass
class Config(BenchConfig):
    """The whole composed config: a trial's keys, plus what the sub-command does with them."""
    command: str = "run"
    """The sub-command (the console script sets it): run, maxbatch, maxseq, report, estimate, doctor, status,
    calibrate."""
    search: SearchConfig = field(default_factory=SearchConfig)
    store: str = "results/zero_bench.sqlite"
    """Every trial and search result, written as soon as known."""
    force: bool = False
    """Measure again even if the store has this configuration; launch what the estimate refuses."""
    repeats: int = 1
    """Full-step measurements at the found batch (median, min and max reported)."""
    estimate_first: bool = True
    """Seed the search with the analytic estimate's predicted max batch. (The pre-flight check, which
    refuses what the estimate says cannot fit this host, runs either way; force=true skips it.)"""
    json: bool = False
    """estimate, calibrate: print JSON instead of the table / the lines (also `--json`)."""
    traced: bool = False
    """estimate, report: beside the formula, the peak per rank traced by running the real engine's step
    under FakeTensorMode on a fake world of tp x dp ranks (torch 2.13's FSDPMemTracker; engine=fsdp2;
    seconds per configuration; docs/estimate.md, "The traced prediction")."""
    report: ReportConfig = field(default_factory=ReportConfig)
    status_dir: Optional[str] = None
    """status: the sweep directory (`zero_bench status DIR` sets it)."""


def _register() -> None:
    """The schema under conf/config.yaml's defaults (`- zero_bench_schema`). Non-frozen dataclasses:
    Hydra merges presets and overrides into it, which read-only nodes would refuse."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="zero_bench_schema", node=Config)


_register()


@functools.lru_cache(maxsize=1)
def software_versions() -> tuple:
    """(package, version or None) of the software that runs a trial: what a search key, a
    calibration's key and the recorded environment (devices/environment.py) name."""
    from importlib import metadata

    out = []
    for pkg in ("torch", "deepspeed", "megatron-core"):
        try:
            out.append((pkg, metadata.version(pkg)))
        except metadata.PackageNotFoundError:
            out.append((pkg, None))
    return tuple(out)


def _hash(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
