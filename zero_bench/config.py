"""What the user asked for, as typed objects; every bad input fails here with one line.

Hydra composes conf/ into a DictConfig; `from_cfg` turns the trial part into a BenchConfig and
`search_from_cfg` the search part into a SearchConfig, checking every key's type and range;
`validate_machine` checks a BenchConfig against this machine before anything is launched.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from zero_bench.errors import ConfigError

__all__ = ["ConfigError", "BenchConfig", "ModelConfig", "ParallelConfig", "HardwareConfig", "BatchConfig",
           "StepsConfig", "SearchConfig", "from_cfg", "search_from_cfg", "validate_static", "validate_machine"]

ZERO_STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "gpu")
LAUNCHERS = ("pdsh", "openmpi", "mvapich", "slurm", "mpich", "impi")
STRATEGIES = ("fit", "doubling")
RECOMPUTE = ("none", "selective", "full")
FAULT_KINDS = ("raise", "oom", "kill", "hang")
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass(frozen=True)
class ModelConfig:
    name: str
    """Display name, as the report's Model column shows it."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Width h of the residual stream; divisible by num_heads and by tp."""
    num_heads: int
    """Attention heads a; divisible by tp."""
    seq_len: int
    """Sequence length s of every sample (and of the learned position table)."""
    vocab_size: int
    """Vocabulary V of the tokenizer (GPT-2: 50257); tokens are drawn from it."""
    pad_vocab_to: int = 1
    """The embedding / output layer has padded_vocab(tp) rows: V rounded up to a multiple of
    pad_vocab_to x tp, as Megatron's --make-vocab-size-divisible-by (128: 50304 at tp 1, 51200 at tp 8)."""

    def padded_vocab(self, tp: int = 1) -> int:
        step = self.pad_vocab_to * tp
        return -(-self.vocab_size // step) * step

    @property
    def num_params(self) -> int:
        """Parameters of megatron's GPTModel (local spec, tied embeddings, learned positions).

        Per layer: QKV 3h^2+3h, projection h^2+h, MLP 8h^2+5h, two LayerNorms 4h -> 12h^2+13h.
        Plus word embeddings V*h (shared with the output layer; V padded as at tp 1), positions S*h,
        final LayerNorm 2h.
        """
        h, L = self.hidden_size, self.num_layers
        return L * (12 * h * h + 13 * h) + self.padded_vocab(1) * h + self.seq_len * h + 2 * h

    def params_per_shard(self, tp: int) -> int:
        """Parameters one tensor-parallel rank holds (LayerNorms, row biases and positions replicate)."""
        h, L = self.hidden_size, self.num_layers
        split = L * (12 * h * h + 7 * h) + self.padded_vocab(tp) * h  # QKV, fc1 (+biases), proj, fc2, embedding
        replicated = L * (6 * h) + self.seq_len * h + 2 * h  # LayerNorms, proj/fc2 biases, positions, final LN
        return split // tp + replicated

    def flops_per_sample(self) -> float:
        """Training FLOPs per sequence (fwd + bwd, no recompute): 3 x (2 N S + 4 L h S^2)."""
        s = self.seq_len
        return 3 * (2 * self.num_params * s + 4 * self.num_layers * self.hidden_size * s * s)


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree (megatron-core); must divide heads, hidden size and vocabulary."""
    dp: int = 2
    """Data-parallel degree (DeepSpeed); ZeRO partitions over these ranks."""

    @property
    def world_size(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True)
class HardwareConfig:
    device: str = "cpu"
    """Resolved device: "cpu" (DeepSpeed's CPU accelerator, gloo) or "gpu" (CUDA, NCCL)."""
    memory_gb: Optional[float] = None
    """Per-rank capacity in GiB (see capacity.py); None: the card, or the host's RAM per rank."""
    memory_mib: Optional[int] = None
    """Per-rank capacity in MiB as nvidia-smi shows a card's total (an A100-40GB: 40537); exclusive
    with memory_gb. On a larger card it is emulated (see capacity.py)."""
    devices: Optional[str] = None
    """GPUs to run on, as CUDA_VISIBLE_DEVICES spells them (indices, UUIDs, MIG UUIDs), the first
    tp*dp per node are used; None: the launching shell's CUDA_VISIBLE_DEVICES, else 0..N-1."""
    hostfile: Optional[str] = None
    """DeepSpeed hostfile for multi-node launches (`host slots=N` lines)."""
    num_nodes: int = 1
    """Nodes of the hostfile to use."""
    launcher: str = "pdsh"
    """DeepSpeed's multi-node launcher: pdsh, openmpi, mvapich, slurm, mpich, impi."""


@dataclass(frozen=True)
class BatchConfig:
    micro: int = 2
    """Micro-batch per data-parallel rank."""
    grad_accum: int = 1
    """Micro-steps per optimizer step: global batch = micro x grad_accum x dp."""


@dataclass(frozen=True)
class StepsConfig:
    warmup: int = 2
    """Optimizer steps before timing (a measurement)."""
    timed: int = 5
    """Optimizer steps timed; time/it is their median."""
    probe: int = 1
    """Optimizer steps of a memory probe before its profiled step (optimizer state is allocated
    lazily at the first step; README.md says how many steps the peak needs to settle)."""


@dataclass(frozen=True)
class BenchConfig:
    """One trial's configuration, everything but which batch sizes to try."""
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    hardware: HardwareConfig = HardwareConfig()
    zero: int = 2
    """ZeRO stage 0-3."""
    offload_optimizer: bool = False
    """Optimizer states (and the gradients they read) to host memory; ZeRO 1-3."""
    offload_param: bool = False
    """Parameters to host memory; ZeRO-3 only."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (fp16: GPU only; dynamic loss scaling, skipped steps recorded)."""
    recompute: str = "none"
    """Activation recompute (megatron-core's recompute_granularity): none; selective (core attention);
    full (every layer's input kept, the layer recomputed in backward, through DeepSpeed's
    activation checkpointing so that ds.activation_checkpointing.* apply, as Megatron-DeepSpeed)."""
    recompute_layers: int = 1
    """With recompute=full: layers per checkpoint (megatron's recompute_num_layers, method uniform)."""
    ds_preset: str = "default"
    """The ds_configs/ template set: default (buckets scaled to the model on CPU) or
    megatron_deepspeed (the reference table's buckets, overlap_comm, fp16 loss scaling, activation
    checkpointing)."""
    compile: bool = False
    """DeepSpeed's engine.compile() (torch.compile); compile time is reported apart from time/it."""
    batch: BatchConfig = BatchConfig()
    steps: StepsConfig = StepsConfig()
    timeout_s: float = 600.0
    """Per batch size of a launch: the clock restarts whenever a rank finishes an entry."""
    seed: int = 1234
    """Seeds the weights and the tokens: identical across runs and ZeRO stages."""
    ds: dict = field(default_factory=dict)
    """Raw DeepSpeed keys merged last (checked with DeepSpeed's own config model)."""
    fault: Optional[dict] = None
    """Tests only: {rank, kind: raise|oom|kill|hang, min_micro}; not part of any key."""

    @property
    def global_batch(self) -> int:
        return self.batch.micro * self.batch.grad_accum * self.parallel.dp

    def with_micro(self, micro: int) -> "BenchConfig":
        return dataclasses.replace(self, batch=dataclasses.replace(self.batch, micro=micro))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BenchConfig":
        d = dict(d)
        return cls(
            model=ModelConfig(**d.pop("model")),
            parallel=ParallelConfig(**d.pop("parallel")),
            hardware=HardwareConfig(**d.pop("hardware")),
            batch=BatchConfig(**d.pop("batch")),
            steps=StepsConfig(**d.pop("steps")),
            **d,
        )

    def search_key(self) -> str:
        """Stable id of everything but the batch, with the software that runs it: one search per key,
        so a resume never mixes trials of different torch / deepspeed / megatron-core versions."""
        d = self.to_dict()
        d["batch"] = {"grad_accum": self.batch.grad_accum}
        for k in ("steps", "timeout_s", "fault"):
            d.pop(k)
        d["software"] = software_versions()
        return _hash(d)

    def trial_key(self) -> str:
        d = self.to_dict()
        d.pop("fault")
        return _hash(d)

    def label(self) -> str:
        extras = [f"recompute={self.recompute}" if self.recompute != "none" else "",
                  "" if self.ds_preset == "default" else self.ds_preset, "compile" if self.compile else ""]
        return " ".join([make_label(self.model.name, self.parallel.tp, self.parallel.dp, self.zero,
                                    self.offload_optimizer, self.precision)] + [x for x in extras if x])


def make_label(model: str, tp: int, dp: int, zero: Any, offload: bool, precision: str) -> str:
    return f"{model} tp{tp} dp{dp} zero{zero}{'+offload' if offload else ''} {precision}"


@dataclass(frozen=True)
class SearchConfig:
    """How `zero_bench maxbatch` searches (conf/config.yaml `search:`)."""
    min: int = 1
    """Smallest micro-batch tried."""
    max: int = 4096
    """Largest micro-batch tried."""
    granularity: int = 1
    """The boundary is confirmed to this step: b fits and b + granularity does not, both fresh."""
    max_trials: int = 24
    """Trials one invocation may run (a resumed search gets a new allowance)."""
    strategy: str = "fit"
    """fit: grow by measured memory per sample; doubling: plain doubling + bisection."""
    multi: bool = True
    """Bracket with several ascending sizes per launch (the answer is still decided fresh)."""
    cpu_budget_gb: float = 0.75
    """Per-rank budget on CPU when hardware.memory_gb is null."""
    pool: bool = True
    """Start the ranks once per search and fork a fresh process per trial (zero_bench.pool);
    false: a deepspeed launch per trial. Either way each trial's ranks are fresh processes."""


@functools.lru_cache(maxsize=1)
def software_versions() -> tuple:
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


# -- typed checks, one line each ----------------------------------------------------------------

def choice(key: str, value: Any, allowed: tuple) -> Any:
    if not any(value == a and type(value) is type(a) for a in allowed):  # True is not the stage 1
        raise ConfigError(f"{key}={value}: allowed values are {', '.join(map(str, allowed))}")
    return value


def integer(key: str, value: Any, lo: int = 1, hi: Optional[int] = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{key}={value}: must be an integer {rng}")
    return value


def number(key: str, value: Any, lo: float = 0.0) -> float:
    """A number strictly greater than `lo`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > lo:
        raise ConfigError(f"{key}={value}: must be a number > {lo:g}")
    return float(value)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(device: str) -> str:
    choice("hardware.device", device, DEVICES)
    if device == "auto":
        return "gpu" if cuda_available() else "cpu"
    if device == "gpu" and not cuda_available():
        raise ConfigError("hardware.device=gpu: no CUDA device is visible; allowed here: cpu, auto")
    return device


def _model(c: dict) -> ModelConfig:
    m = c["model"]
    dims = {k: integer(f"model.{k}", m.get(k)) for k in ("num_layers", "hidden_size", "num_heads", "seq_len",
                                                         "vocab_size")}
    return ModelConfig(name=str(m.get("name", "?")), **dims,
                       pad_vocab_to=integer("model.pad_vocab_to", m.get("pad_vocab_to", 1)))


def _hardware(hw: dict, device: str) -> HardwareConfig:
    gb, mib = hw.get("memory_gb"), hw.get("memory_mib")
    if gb is not None and mib is not None:
        raise ConfigError(f"hardware.memory_mib={mib}: give memory_gb or memory_mib, not both (memory_gb={gb})")
    devices = hw.get("devices")
    return HardwareConfig(device=device, memory_gb=None if gb is None else number("hardware.memory_gb", gb),
                          memory_mib=None if mib is None else integer("hardware.memory_mib", mib),
                          devices=None if devices is None else ",".join(str(devices).replace(" ", "").split(",")),
                          hostfile=hw.get("hostfile"),
                          num_nodes=integer("hardware.num_nodes", hw.get("num_nodes", 1)),
                          launcher=choice("hardware.launcher", hw.get("launcher", "pdsh"), LAUNCHERS))


def _fault(f: Any) -> Optional[dict]:
    if not f:
        return None
    choice("fault.kind", f.get("kind"), FAULT_KINDS)
    return dict(f)


def ds_presets() -> tuple:
    return tuple(sorted(p.stem for p in (CONF_DIR / "ds_preset").glob("*.yaml")))


def preset_name(p: Any) -> Any:
    """The ds_preset group composes to {name: ...}; a plain string is accepted too (stores, tests)."""
    return p.get("name") if isinstance(p, dict) else ("default" if p is None else p)


def from_cfg(cfg: Any) -> BenchConfig:
    """Hydra DictConfig (or plain dict) -> validated BenchConfig."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg
    device = resolve_device(c["hardware"].get("device", "auto"))
    zero = choice("zero", c["zero"], ZERO_STAGES)
    offload = choice("offload", c.get("offload", False), (False, True))
    offload_param = choice("offload_param", c.get("offload_param"), (None, False, True))
    if offload_param is None:
        offload_param = bool(offload and zero == 3)
    precision = c.get("precision", "auto")
    if precision == "auto":
        precision = "bf16" if device == "gpu" else "fp32"
    st = c["steps"]
    bench = BenchConfig(
        model=_model(c),
        parallel=ParallelConfig(tp=integer("parallel.tp", c["parallel"]["tp"]),
                                dp=integer("parallel.dp", c["parallel"]["dp"])),
        hardware=_hardware(c["hardware"], device),
        zero=zero, offload_optimizer=offload, offload_param=offload_param,
        precision=choice("precision", precision, PRECISIONS),
        recompute=choice("recompute", c.get("recompute", "none"), RECOMPUTE),
        recompute_layers=integer("recompute_layers", c.get("recompute_layers", 1)),
        ds_preset=choice("ds_preset", preset_name(c.get("ds_preset")), ds_presets()),
        compile=choice("compile", c.get("compile", False), (False, True)),
        batch=BatchConfig(micro=integer("batch.micro", c["batch"]["micro"]),
                          grad_accum=integer("batch.grad_accum", c["batch"]["grad_accum"])),
        steps=StepsConfig(warmup=integer("steps.warmup", st["warmup"], lo=0),
                          timed=integer("steps.timed", st["timed"]),
                          probe=integer("steps.probe", st.get("probe", 1))),
        timeout_s=number("timeout_s", c.get("timeout_s", 600)),
        seed=integer("seed", c.get("seed", 1234), lo=0),
        ds=dict(c.get("ds") or {}),
        fault=_fault(c.get("fault")),
    )
    validate_static(bench)
    return bench


def search_from_cfg(cfg: Any) -> SearchConfig:
    """The `search:` section -> SearchConfig; bounds that contradict each other are refused."""
    from omegaconf import OmegaConf

    s = OmegaConf.to_container(cfg.search, resolve=True) if not isinstance(cfg, dict) else dict(cfg["search"])
    unknown = set(s) - {f.name for f in dataclasses.fields(SearchConfig)}
    if unknown:
        raise ConfigError(f"search.{sorted(unknown)[0]}: unknown key; allowed: "
                          + ", ".join(f.name for f in dataclasses.fields(SearchConfig)))
    lo = integer("search.min", s.get("min", 1))
    hi = integer("search.max", s.get("max", 4096))
    if hi < lo:
        raise ConfigError(f"search.max={hi}: must be >= search.min={lo}")
    return SearchConfig(min=lo, max=hi, granularity=integer("search.granularity", s.get("granularity", 1)),
                        max_trials=integer("search.max_trials", s.get("max_trials", 24), lo=2),
                        strategy=choice("search.strategy", s.get("strategy", "fit"), STRATEGIES),
                        multi=choice("search.multi", s.get("multi", True), (False, True)),
                        cpu_budget_gb=number("search.cpu_budget_gb", s.get("cpu_budget_gb", 0.75)),
                        pool=choice("search.pool", s.get("pool", True), (False, True)))


def validate_static(b: BenchConfig) -> None:
    """Checks that need only the config (also used for grids: a bad combination is 'skipped')."""
    m, tp = b.model, b.parallel.tp
    if m.num_heads % tp:
        raise ConfigError(f"parallel.tp={tp}: must divide model.num_heads={m.num_heads}")
    if m.hidden_size % tp:
        raise ConfigError(f"parallel.tp={tp}: must divide model.hidden_size={m.hidden_size}")
    if b.recompute == "full" and m.num_layers % b.recompute_layers:
        raise ConfigError(f"recompute_layers={b.recompute_layers}: must divide model.num_layers={m.num_layers} "
                          "(megatron's uniform recompute)")
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.num_heads={m.num_heads}: must divide model.hidden_size={m.hidden_size}")
    if b.offload_optimizer and b.zero == 0:
        raise ConfigError("offload=true: needs ZeRO stage 1, 2 or 3 (got zero=0); allowed with zero=0: false")
    if b.offload_param and b.zero != 3:
        raise ConfigError(f"offload_param=true: needs zero=3 (got zero={b.zero})")
    if b.precision == "fp16" and b.hardware.device == "cpu":
        raise ConfigError("precision=fp16: not supported by DeepSpeed's CPU accelerator; allowed on cpu: fp32, bf16")


def available_devices(device: str) -> int:
    if device == "gpu":
        import torch

        return torch.cuda.device_count()
    return os.cpu_count() or 1


def _check_devices(b: BenchConfig) -> None:
    """Every rank of a node needs its own GPU from the list the user gave."""
    from zero_bench.capacity import local_ranks
    from zero_bench.hosts import device_tokens

    tokens = device_tokens(b) if b.hardware.device == "gpu" else None
    if tokens is not None and len(tokens) < local_ranks(b):
        key = "hardware.devices" if b.hardware.devices is not None else "CUDA_VISIBLE_DEVICES"
        raise ConfigError(f"{key}={','.join(tokens)}: lists {len(tokens)} GPUs but {local_ranks(b)} ranks per node "
                          "need one each")


def validate_machine(b: BenchConfig) -> None:
    """Checks against this machine: device count, bf16 support, hostfile, DeepSpeed's view of `ds`."""
    from zero_bench.ds_config import check_with_deepspeed

    _check_devices(b)
    check_with_deepspeed(b)
    if b.hardware.hostfile:
        from zero_bench.hosts import check_hostfile

        check_hostfile(b)  # ranks live on the hostfile's hosts, not here
        return
    have = available_devices(b.hardware.device)
    # CPU ranks are processes: allow two per core before calling it a mistake.
    limit = have if b.hardware.device == "gpu" else 2 * have
    if b.parallel.world_size > limit:
        raise ConfigError(f"parallel.dp={b.parallel.dp}: world size tp*dp={b.parallel.world_size} exceeds the "
                          f"{have} {b.hardware.device.upper()} devices here (max {limit})")
    if b.precision == "bf16" and b.hardware.device == "gpu":
        import torch

        if not torch.cuda.is_bf16_supported():
            raise ConfigError("precision=bf16: this GPU has no bf16; allowed here: fp32, fp16")
