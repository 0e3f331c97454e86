"""What the user asked for, as one typed object; every bad input fails here with one line.

Hydra composes conf/ into a DictConfig; `from_cfg` turns it into a BenchConfig and `validate`
checks it against the machine before anything is launched.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ZERO_STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "gpu")
LAUNCHERS = ("pdsh", "openmpi", "mvapich", "slurm", "mpich", "impi")
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class ConfigError(ValueError):
    """A bad key or value; its message is the one line the user sees."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int

    @property
    def num_params(self) -> int:
        """Parameters of megatron's GPTModel (local spec, tied embeddings, learned positions).

        Per layer: QKV 3h^2+3h, projection h^2+h, MLP 8h^2+5h, two LayerNorms 4h -> 12h^2+13h.
        Plus word embeddings V*h (shared with the output layer), positions S*h, final LayerNorm 2h.
        """
        h, L = self.hidden_size, self.num_layers
        return L * (12 * h * h + 13 * h) + self.vocab_size * h + self.seq_len * h + 2 * h

    def params_per_shard(self, tp: int) -> int:
        """Parameters one tensor-parallel rank holds (LayerNorms, row biases and positions replicate)."""
        h, L = self.hidden_size, self.num_layers
        split = L * (12 * h * h + 7 * h) + self.vocab_size * h  # QKV, fc1 (+biases), proj, fc2, embedding
        replicated = L * (6 * h) + self.seq_len * h + 2 * h  # LayerNorms, proj/fc2 biases, positions, final LN
        return split // tp + replicated

    def flops_per_sample(self) -> float:
        """Training FLOPs per sequence (fwd + bwd, no recompute): 3 x (2 N S + 4 L h S^2)."""
        s = self.seq_len
        return 3 * (2 * self.num_params * s + 4 * self.num_layers * self.hidden_size * s * s)


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    dp: int = 2

    @property
    def world_size(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True)
class HardwareConfig:
    device: str = "cpu"  # resolved: "cpu" or "gpu"
    memory_gb: Optional[float] = None  # per-rank capacity; None = whole card / host share
    hostfile: Optional[str] = None
    num_nodes: int = 1
    launcher: str = "pdsh"


@dataclass(frozen=True)
class BatchConfig:
    micro: int = 2
    grad_accum: int = 1


@dataclass(frozen=True)
class StepsConfig:
    warmup: int = 2
    timed: int = 5


@dataclass(frozen=True)
class BenchConfig:
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    hardware: HardwareConfig = HardwareConfig()
    zero: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    precision: str = "fp32"
    batch: BatchConfig = BatchConfig()
    steps: StepsConfig = StepsConfig()
    timeout_s: float = 600.0
    seed: int = 1234
    ds: dict = field(default_factory=dict)  # raw DeepSpeed keys merged last

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
        """Stable id of everything but the batch: one max-batch search per key."""
        d = self.to_dict()
        d["batch"] = {"grad_accum": self.batch.grad_accum}
        d.pop("steps")
        d.pop("timeout_s")
        return _hash(d)

    def trial_key(self) -> str:
        return _hash(self.to_dict())

    def label(self) -> str:
        off = "+offload" if self.offload_optimizer else ""
        return (f"{self.model.name} tp{self.parallel.tp} dp{self.parallel.dp} "
                f"zero{self.zero}{off} {self.precision}")


def _hash(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_group_overrides(overrides: list[str]) -> None:
    """Hydra's own error for an unknown option is a multi-line traceback; say it in one line."""
    for ov in overrides:
        key, _, value = ov.lstrip("~+").partition("=")
        if key in ("model", "parallel", "hardware", "sweep") and value and "," not in value:
            if value not in group_options(key):
                raise ConfigError(f"{key}={value}: unknown option; allowed: {', '.join(group_options(key))}")


def _choice(key: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        raise ConfigError(f"{key}={value}: allowed values are {', '.join(map(str, allowed))}")
    return value


def _positive_int(key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}={value}: must be an integer >= 1")
    return value


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(device: str) -> str:
    _choice("hardware.device", device, DEVICES)
    if device == "auto":
        return "gpu" if cuda_available() else "cpu"
    if device == "gpu" and not cuda_available():
        raise ConfigError("hardware.device=gpu: no CUDA device is visible; allowed here: cpu, auto")
    return device


def from_cfg(cfg: Any) -> BenchConfig:
    """Hydra DictConfig (or plain dict) -> validated BenchConfig."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg
    hw = c["hardware"]
    device = resolve_device(hw.get("device", "auto"))
    zero = _choice("zero", c["zero"], ZERO_STAGES)
    offload = c.get("offload", False)
    _choice("offload", offload, (False, True))
    offload_param = c.get("offload_param")
    if offload_param is None:
        offload_param = bool(offload and zero == 3)
    _choice("offload_param", offload_param, (None, False, True))
    precision = c.get("precision", "auto")
    if precision == "auto":
        precision = "bf16" if device == "gpu" else "fp32"
    bench = BenchConfig(
        model=ModelConfig(**c["model"]),
        parallel=ParallelConfig(tp=_positive_int("parallel.tp", c["parallel"]["tp"]),
                                dp=_positive_int("parallel.dp", c["parallel"]["dp"])),
        hardware=HardwareConfig(device=device, memory_gb=hw.get("memory_gb"), hostfile=hw.get("hostfile"),
                                num_nodes=_positive_int("hardware.num_nodes", hw.get("num_nodes", 1)),
                                launcher=_choice("hardware.launcher", hw.get("launcher", "pdsh"), LAUNCHERS)),
        zero=zero,
        offload_optimizer=bool(offload),
        offload_param=bool(offload_param),
        precision=_choice("precision", precision, PRECISIONS),
        batch=BatchConfig(micro=_positive_int("batch.micro", c["batch"]["micro"]),
                          grad_accum=_positive_int("batch.grad_accum", c["batch"]["grad_accum"])),
        steps=StepsConfig(warmup=_positive_int("steps.warmup", c["steps"]["warmup"]),
                          timed=_positive_int("steps.timed", c["steps"]["timed"])),
        timeout_s=float(c.get("timeout_s", 600)),
        seed=int(c.get("seed", 1234)),
        ds=dict(c.get("ds") or {}),
    )
    validate_static(bench)
    return bench


def validate_static(b: BenchConfig) -> None:
    """Checks that need only the config (also used for grids: a bad combination is 'skipped')."""
    m, tp = b.model, b.parallel.tp
    if m.num_heads % tp:
        raise ConfigError(f"parallel.tp={tp}: must divide model.num_heads={m.num_heads}")
    if m.hidden_size % tp:
        raise ConfigError(f"parallel.tp={tp}: must divide model.hidden_size={m.hidden_size}")
    if m.vocab_size % tp:
        raise ConfigError(f"parallel.tp={tp}: must divide model.vocab_size={m.vocab_size}")
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.num_heads={m.num_heads}: must divide model.hidden_size={m.hidden_size}")
    if b.offload_optimizer and b.zero == 0:
        raise ConfigError("offload=true: needs ZeRO stage 1, 2 or 3 (got zero=0); allowed with zero=0: false")
    if b.offload_param and b.zero != 3:
        raise ConfigError(f"offload_param=true: needs zero=3 (got zero={b.zero})")
    if b.precision == "fp16" and b.hardware.device == "cpu":
        raise ConfigError("precision=fp16: not supported by DeepSpeed's CPU accelerator; allowed on cpu: fp32, bf16")
    if b.hardware.memory_gb is not None and b.hardware.memory_gb <= 0:
        raise ConfigError(f"hardware.memory_gb={b.hardware.memory_gb}: must be > 0 or null")


def available_devices(device: str) -> int:
    if device == "gpu":
        import torch

        return torch.cuda.device_count()
    return os.cpu_count() or 1


def validate_machine(b: BenchConfig) -> None:
    """Checks against this machine: device count, bf16 support."""
    if b.hardware.hostfile:
        from zero_bench.launch import check_hostfile

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
