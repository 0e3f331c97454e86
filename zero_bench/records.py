"""The records that cross module and process seams, written once and read everywhere.

Between processes: the runner writes a `TrialSpec` (trial.json: the config, the plan of `Entry`s,
where to write; a test may add a `Fault`) and, for a pooled trial, a `PoolRequest`; each rank
writes a `RankRecord` per event (one JSON line in rank{R}.jsonl). Within the runner: outcome.py
turns a launch's rank records into one `TrialResult` per entry; sampler.py summarises its timeline
as one `DeviceMemStats` per device; search/maxbatch.py sums trials up in a `SearchResult`; store.py keeps
the last two; report/ reads them back. Every status, event and mode is an enum; every record
round-trips through JSON.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from zero_bench.config.schema import BenchConfig

# Exit code of a rank whose allocation failed: the runner reads it as "does not fit".
OOM_EXIT = 86


class Mode(StrEnum):
    """What a plan entry measures."""
    PROBE = "probe"  # steady peak memory: steps.probe optimizer steps, then one profiled step
    MEASURE = "measure"  # warm-up + timed steps (time/it), then the profiled step


class Dimension(StrEnum):
    """What a search grows until it no longer fits."""
    BATCH = "batch"  # maxbatch: the micro-batch per rank, at model.seq_len
    SEQ = "seq"  # maxseq: model.seq_len, at batch.micro


class Event(StrEnum):
    """What a RankRecord reports."""
    START = "start"  # the rank's identity (host, pid, GPU)
    BEGIN = "begin"  # a plan entry starts
    STEP = "step"  # rank 0 finished an optimizer step (the runner's sign of progress: time_limits.py)
    END = "end"  # a plan entry ended (status says how)
    INIT_FAILED = "init_failed"  # the trial failed before its first entry
    DONE = "done"  # the whole plan ran


class RankStatus(StrEnum):
    """How a plan entry ended on one rank."""
    OK = "ok"
    OVER_CAPACITY = "over_capacity"  # finished, but some rank's peak passed the capacity
    OOM = "oom"  # an allocation failed
    ERROR = "error"


class FaultKind(StrEnum):
    """Test-only faults a trial spec can carry (zero_bench.trial.faults)."""
    RAISE = "raise"  # an exception in the step
    OOM = "oom"  # a real allocator failure
    KILL = "kill"  # SIGKILL, as the kernel's OOM killer sends
    HANG = "hang"  # a rank that never finishes its step
    SLOW = "slow"  # a rank whose every step sleeps Fault.seconds per sample first (a slow machine)


@dataclass
class Entry:
    """One batch size of a launch's plan."""
    micro: int
    mode: Mode = Mode.PROBE

    def __post_init__(self) -> None:
        self.mode = Mode(self.mode)


@dataclass
class Fault:
    """A fault a test injects into a real trial: on `rank`, in every step of entries with micro >= min_micro."""
    kind: FaultKind
    rank: int = 1
    min_micro: int = 1
    seconds: float = 0.0  # SLOW: seconds per sample of the step's micro-batch

    def __post_init__(self) -> None:
        self.kind = FaultKind(self.kind)


@dataclass(frozen=True)
class Seed:
    """The estimate's first guess for a max-batch search (estimate.seed_micro): the largest micro
    predicted to fit, and the bytes one more sample adds there (None: not known)."""
    micro: int
    per_sample: Optional[int] = None


@dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank's model states, every tensor wherever it lives (device or host): as its
    engine counted them after an optimizer step (a trial's RankRecord.model_states, stored as
    to_dict(): the key names below, which old stores carry too; readers go through from_dict, so one
    place says what a missing key means), or as the estimate predicts them (estimate/states.py for
    DeepSpeed, estimate/fsdp2.py for FSDP2), which also says how many of them are on the host."""
    params: int = 0
    """What the module holds (ZeRO-3: its partition; FSDP2 with bf16 compute: 0, its fp32 shards are
    the master)."""
    master: int = 0
    """The tensors the optimizer updates when they are not the params (fp32 copies)."""
    moments: int = 0
    """The optimizer's own state (AdamW's moments), stored under "optimizer". Not the estimate's
    "optimizer" (estimate/states.py), which is master + moments."""
    grads: int = 0
    """Gradients still referenced when counted: after the step ZeRO and FSDP2 may have freed them."""
    numel_local: int = 0
    """Elements of this rank's parameters (its partitions or local shards)."""
    grads_at_step: Optional[int] = None
    """FSDP2: bytes of the sharded gradients the step read (grads is 0 after it); None: not counted
    (DeepSpeed), and then not stored."""
    host: Optional[int] = None
    """Bytes of the above in host memory (offloaded); the rest is on the device. None: not split
    (a trial counts every tensor together), and then not stored."""

    @property
    def total(self) -> int:
        """params + master + moments + grads: what the report compares with the estimate."""
        return self.params + self.master + self.moments + self.grads

    @property
    def optimizer(self) -> int:
        """What the optimizer keeps beside the params: master + moments (the estimate's and the
        report's "optimizer"; the stored key "optimizer" is the moments alone)."""
        return self.master + self.moments

    @property
    def device(self) -> int:
        """Bytes on the device: total - host (all of them where the split is not known)."""
        return self.total - (self.host or 0)

    def to_dict(self) -> dict:
        """The stored form: the keys (and their order) engines wrote before this record existed."""
        d = {"params": self.params, "master": self.master, "optimizer": self.moments, "grads": self.grads,
             "numel_local": self.numel_local}
        for key in ("grads_at_step", "host"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelStates":
        """A stored dict; a key it lacks counts 0 (grads_at_step: None), unknown keys are ignored."""
        return cls(params=d.get("params", 0), master=d.get("master", 0), moments=d.get("optimizer", 0),
                   grads=d.get("grads", 0), numel_local=d.get("numel_local", 0),
                   grads_at_step=d.get("grads_at_step"), host=d.get("host"))


@dataclass
class TrialSpec:
    """trial.json: everything a rank needs to run one trial's plan, written by the runner."""
    config: BenchConfig
    ds_config: str  # path of the DeepSpeed JSON
    out_dir: str  # where the ranks write rank{R}.jsonl
    plan: list[Entry]
    capacity_bytes: Optional[int] = None
    fault: Optional[Fault] = None  # tests only
    calibrate: bool = False  # `zero_bench calibrate`: GPU ranks also measure their fixed terms (calibration.py)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_dict()
        return json.dumps(d, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "TrialSpec":
        d = json.loads(text)
        return cls(config=BenchConfig.from_dict(d["config"]), ds_config=d["ds_config"], out_dir=d["out_dir"],
                   plan=[Entry(**e) for e in d["plan"]], capacity_bytes=d.get("capacity_bytes"),
                   fault=Fault(**d["fault"]) if d.get("fault") else None, calibrate=d.get("calibrate", False))


@dataclass
class PoolRequest:
    """reqNNNNN.json: the runner asks a pool's ranks to fork a child running one trial spec."""
    spec: str  # absolute path of trial.json (the ranks' working directory is the pool's)
    port: int  # the child's master port
    out_dir: str  # where the child's stdout.log / stderr.log go

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "PoolRequest":
        return cls(**json.loads(text))


class Status(StrEnum):
    """The outcome of one batch size tried for one configuration."""
    OK = "ok"  # every rank finished the entry within capacity
    OOM = "oom"  # an allocation failed, a rank was killed, or a peak passed the capacity
    ERROR = "error"  # anything else: a bigger batch will not fix it
    TIMEOUT = "timeout"  # no result within timeout_s (retried once in a fresh launch by the search)
    NOT_RUN = "not_run"  # the launch ended before this entry
    SKIPPED = "skipped"  # an invalid grid entry, recorded with its reason
    ESTIMATED_OOM = "estimated_oom"  # refused before launch: the estimate says the host cannot hold it

    @property
    def decides_fit(self) -> bool:
        """Evidence about fitting: ok says yes, oom says no; the rest say nothing."""
        return self in (Status.OK, Status.OOM)


class SearchStatus(StrEnum):
    """The outcome of one max-batch search."""
    DONE = "done"  # b fits and b + granularity fails, both in fresh processes
    ERROR = "error"
    TIMEOUT = "timeout"  # a batch size timed out twice
    CANNOT_INITIALIZE = "cannot_initialize"  # the smallest batch fails before the first step
    DOES_NOT_FIT = "does_not_fit"  # the smallest batch fails in a step
    INCOMPLETE = "incomplete"  # max_trials reached before the boundary was confirmed
    FLAKY = "flaky"  # a smaller batch failed and a larger one fitted, and re-tests agreed
    SKIPPED = "skipped"
    ESTIMATED_OOM = "estimated_oom"

    @property
    def finished(self) -> bool:
        """A resumed search does not run again once it ended with one of these."""
        return self in (SearchStatus.DONE, SearchStatus.CANNOT_INITIALIZE, SearchStatus.DOES_NOT_FIT,
                        SearchStatus.FLAKY, SearchStatus.TIMEOUT)


def _fields(cls, d: dict) -> dict:
    """The keys of `d` that are fields of `cls` (records written by older versions may carry more)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclass
class RankRecord:
    """One line of rank{R}.jsonl: what a rank saw of its own process."""
    rank: int
    event: Event
    time: float = field(default_factory=time.time)
    micro: Optional[int] = None
    mode: Optional[Mode] = None
    status: Optional[RankStatus] = None  # on END: any; on INIT_FAILED: OOM or ERROR
    error: str = ""
    traceback: str = ""
    loss: Optional[float] = None
    losses: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)  # the global gradient norm each step clipped with
    step_times: list = field(default_factory=list)
    time_per_step: Optional[float] = None
    step_seconds: Optional[float] = None  # on STEP: that step's seconds
    time_note: str = ""  # why time_per_step is None (e.g. every timed fp16 step overflowed)
    peak_rss_bytes: Optional[int] = None  # the rank process's RSS peak (ru_maxrss); CPU: up to the end of its
    # profiled step, the profiler's own bookkeeping after it left out (trial/worker.py profiled_step)
    runtime_bytes: Optional[int] = None  # the process before the model is built: RSS on CPU, outside the
    # allocator on GPU (interpreter, torch, deepspeed, megatron-core, the process group; the CUDA context)
    peak_live_bytes: Optional[int] = None  # live tensor bytes of one profiled step (CPU) / torch peak (GPU)
    peak_phase: str = ""
    stage: Optional[int] = None  # parallel.pp > 1: the pipeline stage (pipeline rank) of this rank, rank // (world / pp)
    # (ranks laid out tp fastest, then dp, then pp: megatron's order); None without a pipeline and in older records
    phase_live_bytes: dict = field(default_factory=dict)  # CPU: the profiled step's live peak per phase
    loss_scale: Optional[float] = None  # fp16's dynamic loss scale after the entry (None: no scaling)
    skipped_steps: Optional[int] = None  # optimizer steps of the entry skipped on overflow (excluded from time/it)
    compile_s: Optional[float] = None  # compile=true: the launch's first step beyond a steady step
    zero_init: Optional[bool] = None  # the model's parameters were partitioned as it was built
    # (deepspeed.zero.Init; FSDP2: each layer sharded as soon as it is built)
    build_bytes: Optional[int] = None  # the engine's build at its peak, above what the process held before
    # it: torch's peak allocated on GPU; on CPU peak RSS (VmHWM) after it, an upper bound (worker.build_peak)
    model_states: dict = field(default_factory=dict)  # ModelStates.to_dict() (read with ModelStates.from_dict)
    hpz_secondary: dict = field(default_factory=dict)  # ZeRO++ hpZ's second partitions, bytes, of the profiled
    # step: {"bwd_end": at the step's start, "after_step": once it ran}; {} without hpZ
    offloaded: dict = field(default_factory=dict)  # what the engine holds off the device: optimizer / params
    torch_peak_allocated: Optional[int] = None
    torch_peak_reserved: Optional[int] = None
    marks: list = field(default_factory=list)  # (unix time, phase) pairs
    # identity ("start" records) and the rank's own NVML view of its GPU
    pid: Optional[int] = None
    host: str = ""
    local_rank: Optional[int] = None
    node_rank: Optional[int] = None
    gpu_uuid: str = ""
    gpu_pci_bus_id: str = ""
    gpu_name: str = ""
    nvml_used_bytes: Optional[int] = None  # nvidia-smi's "used" (NVML v2), device-wide
    nvml_total_bytes: Optional[int] = None
    nvml_used_v1_bytes: Optional[int] = None  # NVML v1's used: v2's plus the driver's reserve
    nvml_reserved_bytes: Optional[int] = None  # the driver's reserve (None: the driver has no v2 call)
    nvml_v2: Optional[bool] = None  # memory was read with nvmlDeviceGetMemoryInfo_v2
    nvml_peak_bytes: Optional[int] = None  # the rank's own NVML sampling over the entry, less gpu_others_bytes
    gpu_card_bytes: Optional[int] = None  # the physical card (or MIG slice) total, NVML's
    cuda_total_bytes: Optional[int] = None  # CUDA's total (cudaMemGetInfo): the one torch's fraction multiplies
    memory_fraction: Optional[float] = None  # torch's allocator cap when a smaller card is emulated
    outside_bytes: Optional[int] = None  # the rank's device memory outside torch's allocator, now
    device_peak_bytes: Optional[int] = None  # torch's peak reserved + outside: compared with the capacity
    gpu_others_bytes: Optional[int] = None  # held by other processes before the rank started (not counted)
    gpu_processes: Optional[int] = None  # compute processes NVML lists on the device
    gpu_shared: Optional[bool] = None  # other processes use the GPU: NVML's device-wide figures include them
    # `zero_bench calibrate` on GPU only (calibration.FixedTermsProbe), measured at the rank's start:
    context_bytes: Optional[int] = None  # CUDA's used right after its initialisation, before any
    # communicator, less other processes' (the CUDA context alone)
    nccl_world_bytes: Optional[int] = None  # outside-the-allocator growth from the context alone to after
    # the world group's first all-reduce: one communicator of the world's size, connected
    nccl_all_to_all_bytes: Optional[int] = None  # outside-the-allocator growth over a new group of the world's
    # ranks and its first all-to-all: one all-to-all communicator of the world's size (Ulysses', MoE's)
    cublas_workspace_bytes: Optional[int] = None  # torch's allocated bytes a linear layer's forward (this
    # thread's cuBLAS handle) and backward (autograd's thread's) left behind: their workspaces
    nvml_error: str = ""

    def __post_init__(self) -> None:
        self.event = Event(self.event)
        self.mode = Mode(self.mode) if self.mode else None
        self.status = RankStatus(self.status) if self.status else None

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, "", [], {})
                or k in ("rank", "event")}

    @classmethod
    def from_dict(cls, d: dict) -> "RankRecord":
        return cls(**_fields(cls, d))

    def summary(self) -> "RankRecord":
        """What a TrialResult keeps: no traceback, the first and last phase mark only."""
        return dataclasses.replace(self, traceback="", marks=self.marks[:1] + self.marks[-1:] if self.marks else [])

    @property
    def t_begin(self) -> Optional[float]:
        return self.marks[0][0] if self.marks else None

    @property
    def t_end(self) -> Optional[float]:
        return self.marks[-1][0] if self.marks else None


class MemoryKind(StrEnum):
    """Whose memory a DeviceMemStats is."""
    rank = "rank"  # a rank process's RSS
    gpu = "gpu"  # a GPU's NVML used bytes
    disk = "disk"  # a rank's NVMe swap files (trial/swap.py)


@dataclass
class DeviceMemStats:
    """Peak memory of one device over a trial, from the sampler's timeline."""
    kind: MemoryKind
    id: int  # global rank, or CUDA index on its node
    peak_bytes: int
    total_bytes: Optional[int] = None
    phase: str = ""  # init / forward / backward / step / idle at the peak
    samples: int = 0
    uuid: str = ""  # a GPU's identity, from the rank that used it
    name: str = ""
    host: str = ""
    card_bytes: Optional[int] = None  # set when the capacity (total_bytes) emulates a smaller card

    def __post_init__(self) -> None:
        self.kind = MemoryKind(self.kind)  # stored records hold the plain value

    @property
    def key(self) -> tuple[str, int]:
        return self.kind, self.id

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceMemStats":
        return cls(**_fields(cls, d))


@dataclass
class TrialResult:
    """One batch size tried for one configuration (one plan entry of one launch)."""
    search_key: str
    trial_key: str
    label: str
    micro: int
    global_batch: int
    status: Status
    mode: Mode = Mode.PROBE
    fresh: bool = False  # first entry of its launch: no earlier batch size ran in its processes
    reason: str = ""
    phase: str = ""  # where a failure happened: "init" = before the first step
    time_per_step_s: Optional[float] = None
    samples_per_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    loss: Optional[float] = None
    loss_scale: Optional[float] = None  # fp16: rank 0's loss scale after the entry
    skipped_steps: Optional[int] = None  # fp16: steps skipped on overflow (not in time/it)
    compile_s: Optional[float] = None  # compile=true: compile time, apart from time/it
    capacity_bytes: Optional[int] = None
    ranks: list[RankRecord] = field(default_factory=list)
    devices: list[DeviceMemStats] = field(default_factory=list)
    duration_s: float = 0.0
    launch: int = 0  # trials sharing a launch id ran in one deepspeed launch
    run_dir: str = ""
    cmd: str = ""
    config: dict = field(default_factory=dict)
    ds_config: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)  # the machine: CPU/GPU, memory, library versions
    created: float = field(default_factory=time.time)

    @property
    def failed_initializing(self) -> bool:
        """Out of memory before the first step (phase "init"): the engine could not even be built."""
        return self.status in (Status.OOM, Status.ESTIMATED_OOM) and self.phase == "init"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ranks"] = [r.to_dict() for r in self.ranks]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=str)

    @classmethod
    def from_dict(cls, d: dict) -> "TrialResult":
        d = _fields(cls, d)
        d["status"] = Status(d["status"])
        d["mode"] = Mode(d.get("mode") or Mode.PROBE)
        d["ranks"] = [RankRecord.from_dict(r) for r in d.get("ranks") or []]
        devs = d.get("devices") or []
        if isinstance(devs, dict):  # schema 1 keyed devices by "rank0" / "gpu0"
            devs = [{"kind": k.rstrip("0123456789"), "id": int(k.lstrip("rankgpu")), **v} for k, v in devs.items()]
        d["devices"] = [DeviceMemStats.from_dict(x) for x in devs]
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "TrialResult":
        return cls.from_dict(json.loads(text))

    def devices_of(self, kind: MemoryKind) -> list[DeviceMemStats]:
        return sorted((x for x in self.devices if x.kind == kind), key=lambda x: x.id)


@dataclass
class SearchResult:
    """One max-batch search: the boundary, how it was found, and the measurement at it."""
    search_key: str
    label: str
    status: SearchStatus
    max_micro: Optional[int] = None
    max_global_batch: Optional[int] = None
    first_fail_micro: Optional[int] = None
    note: str = ""
    trials: int = 0
    launches: int = 0
    wall_s: float = 0.0
    strategy: str = ""
    config: dict = field(default_factory=dict)
    measure: Optional[TrialResult] = None  # the fresh full-step trial at max_micro (median of repeats)
    repeats: list = field(default_factory=list)  # time/step of each repeat at max_micro
    created: float = field(default_factory=time.time)
    dimension: Dimension = Dimension.BATCH  # what grew; SEQ: max_micro is batch.micro, held fixed
    max_seq_len: Optional[int] = None  # SEQ: the longest model.seq_len that fitted fresh
    first_fail_seq_len: Optional[int] = None  # SEQ: the next one on the grid, failed fresh

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["measure"] = self.measure.to_dict() if self.measure else None
        return json.dumps(d, default=str)

    @classmethod
    def from_json(cls, text: str) -> "SearchResult":
        d = _fields(cls, json.loads(text))
        d["status"] = SearchStatus(d["status"])
        d["dimension"] = Dimension(d.get("dimension", Dimension.BATCH))
        d["measure"] = TrialResult.from_dict(d["measure"]) if d.get("measure") else None
        return cls(**d)

