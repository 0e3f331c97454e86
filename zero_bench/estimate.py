"""Memory per device before launching anything: model states, activations, DeepSpeed's buffers.

`zero_bench estimate` prints, per ZeRO stage x offload (or the one stage given with zero=...), the
bytes one rank needs and the largest micro-batch the capacity allows. The same arithmetic seeds the
max-batch search (`seed_micro`) and lets the pre-flight refuse a trial the host cannot hold.

Sources
- Model states: the ZeRO paper (Rajbhandari et al. 2020), mixed-precision Adam, K = 12:
  stage 0: 16P, stage 1: 4P + 12P/dp, stage 2: 2P + 14P/dp, stage 3: 16P/dp.
  fp32 training follows what DeepSpeed allocates (checked against the worker's exact counts):
  stage 0: 16P, stage 1: 8P + 12P/dp, stage 2: 4P + 16P/dp, stage 3: 20P/dp (see model_states_bytes).
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", without dropout (zero_bench's GPT has none), for recompute none / selective / full:
  see activation_bytes_per_sample.
- Buffers: DeepSpeed's own, sized from the ds_config a trial runs with (zero_bench.ds_config.build).

A rank's peak, as the search compares it with the capacity (RSS on CPU, reserved bytes on GPU):
  fixed overhead + model states (incl. gradients) + max(buffers alive in backward + activations(micro),
  buffers of the optimizer step), and at least the peak of deepspeed.initialize.
On CPU, everything (offloaded states too) lives in the same host memory, in fp32 by default.

How close this is to measurements on CPU: README.md, "Measured on this machine" (one place, so
the figures cannot drift); tests/integration/test_estimate_vs_measured.py checks them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Optional

from zero_bench import ds_config
from zero_bench.capacity import device_capacity, local_ranks
from zero_bench.config import BenchConfig
from zero_bench.models import ModelConfig, param_numels
from zero_bench.units import GiB, MiB

__all__ = ["BYTES", "Estimate", "GiB", "MiB", "activation_bytes_per_sample", "deepspeed_buffers", "estimate",
           "model_states_bytes", "param_numels", "seed_micro"]

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Fixed cost of one rank before any model tensor: python + torch + deepspeed + megatron imports,
# gloo, allocator arenas (RSS of a GPT-tiny rank on this machine: ~410 MiB). On GPU: the CUDA
# context and cuBLAS/NCCL workspaces (~500 MiB per device).
CPU_RANK_OVERHEAD = 410 * MiB
GPU_RANK_OVERHEAD = 500 * MiB

# Per-sample activation memory of a CPU rank's RSS relative to the formula (whose live tensor bytes
# it matches within 4 %), fitted on model=gpt-mini (2 ranks, fp32, ZeRO-2 micro 2/4/8: 31.7 MiB/sample
# of RSS vs 36.5 by the formula). gpt-small ZeRO-3 micro 1->2 gave 75 MiB/sample vs 70.8 (1.06):
# glibc's arenas reuse freed blocks unevenly, so the factor is a CPU fit, not a law.
CPU_ACTIVATION_FACTOR = 0.87
GPU_ACTIVATION_FACTOR = 1.0

# DeepSpeed defaults for keys the ds_config leaves out (deepspeed/runtime/zero/config.py, engine.py).
DS_DEFAULTS = {
    "reduce_bucket_size": int(5e8),
    "allgather_bucket_size": int(5e8),
    "stage3_prefetch_bucket_size": int(5e7),
    "stage3_max_live_parameters": int(1e9),
    "stage3_param_persistence_threshold": int(1e5),
    "overlap_comm_stage3": True,  # stage 3 turns overlap_comm on unless told otherwise
}
ZERO0_ALLREDUCE_ELEMENTS = 500_000_000  # engine.MEMORY_OPT_ALLREDUCE_SIZE: flat copy of the grads

# ---------------------------------------------------------------------------------------------
# Model states
# ---------------------------------------------------------------------------------------------
def model_states_bytes(num_params: float, zero_stage: int, dp: int, tp: int = 1, precision: str = "bf16",
                       offload_optimizer: bool = False, offload_param: bool = False) -> dict:
    """Bytes of model states per rank for Adam, split as ZeRO partitions them.

    num_params: parameters of the WHOLE model (all tensor-parallel shards together); this function
    uses P = num_params / tp, the parameters of one tensor-parallel shard. (To use megatron's exact
    shard, whose LayerNorms and row biases are replicated, pass ModelConfig.params_per_shard(tp)
    with tp=1.)

    Mixed precision (bf16/fp16; 2-byte params and grads, fp32 master + Adam m, v: K = 12), the ZeRO
    paper:
        stage 0: params 2P,    grads 2P,    optimizer 12P        = 16P
        stage 1: params 2P,    grads 2P,    optimizer 12P/dp     = 4P + 12P/dp
        stage 2: params 2P,    grads 2P/dp, optimizer 12P/dp     = 2P + 14P/dp
        stage 3: params 2P/dp, grads 2P/dp, optimizer 12P/dp     = 16P/dp
    fp32 (4-byte params and grads; what DeepSpeed allocates, checked with the worker's counts):
        stage 0: params 4P,    grads 4P,    optimizer 8P (m, v; the params are the master) = 16P
        stage 1: params 4P,    grads 4P,    optimizer 12P/dp (stage 1/2 clone an fp32 master
                                            partition even when the params are fp32)    = 8P + 12P/dp
        stage 2: params 4P,    grads 4P/dp, optimizer 12P/dp                           = 4P + 16P/dp
        stage 3: params 4P/dp, grads 4P/dp, optimizer 12P/dp (DeepSpeed 0.19 clones the fp32
                                            partition as master here too)              = 20P/dp
    Measured (worker's exact counts after the first step, GPT-small, P = 69,385,728, DP=2; the
    gradients are freed by then, so params + master + moments): stage 0: 12P, stage 1/2: 4P + 12P/2,
    stage 3: 16P/2 -- equal to these formulas to the byte (+4 bytes per Adam step counter).
    (The field notes' 77.7M-parameter figures, 889 / 741 / 445 MiB, match stages 0-2; their stage-3
    figure, 6P, predates the master clone seen here.)

    Offload (stages 1-3): offload_optimizer moves the optimizer part (master + moments) to the host,
    together with the gradient partition the host optimizer reads, kept in fp32 (4P/dp; stage 1
    still holds its full gradients on the device); offload_param (stage 3) moves the parameter
    partition to the host too.

    Returns {"params", "grads", "master", "moments", "optimizer" (= master + moments): bytes per
    rank wherever they live; "gpu": bytes on the device; "cpu": bytes of host memory per rank}.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage}: allowed 0, 1, 2, 3")
    if precision not in BYTES:
        raise ValueError(f"precision={precision}: allowed {', '.join(BYTES)}")
    if dp < 1 or tp < 1:
        raise ValueError("dp and tp must be >= 1")
    P = num_params / tp
    b = BYTES[precision]
    mixed = b == 2
    params = b * P / (dp if zero_stage == 3 else 1)
    grads = b * P / (dp if zero_stage >= 2 else 1)
    moments = 8 * P / (dp if zero_stage >= 1 else 1)
    if mixed:
        master = 4 * P / (dp if zero_stage >= 1 else 1)
    elif zero_stage >= 1:
        master = 4 * P / dp
    else:
        master = 0.0
    gpu = params + grads + master + moments
    cpu = 0.0
    if offload_optimizer and zero_stage >= 1:
        gpu -= master + moments
        cpu += master + moments
        if zero_stage >= 2:  # the device keeps no gradient partition, only its reduce buckets
            gpu -= grads
            grads = 4 * P / dp
        else:
            grads = b * P + 4 * P / dp
        cpu += 4 * P / dp
    if offload_param and zero_stage == 3:
        gpu -= params
        cpu += params
    out = {"params": params, "grads": grads, "master": master, "moments": moments,
           "optimizer": master + moments, "gpu": gpu, "cpu": cpu}
    return {k: int(round(v)) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------
def activation_bytes_per_sample(model: ModelConfig, tp: int = 1, precision: str = "bf16", recompute: str = "none",
                                checkpointing: Optional[Mapping] = None) -> dict:
    """Activation bytes one sample (sequence) adds to a rank's peak.

    Per transformer layer, Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", eq. 2, tensor parallel t, no sequence parallelism), 16-bit:
    s*h*(10 + 24/t + 5*a*s/(h*t)), of which the dropout masks (2 s*h, a*s^2) and dropout's output
    (2 a*s^2) exist only with dropout. zero_bench's GPT runs without dropout, so:
        none:      s*h*(8 + 24/t + 2*a*s/(h*t))  per layer (2*a*s^2: the softmax output)
        selective: s*h*(8 + 24/t)                per layer, + one layer's attention while recomputed
        full:      2*s*h per layer (its input, kept), /t with partition_activations, in host memory
                   with cpu_checkpointing, + one layer's activations while it is recomputed
    Embedding and output: the final LayerNorm's and the output projection's inputs: 4*s*h. Logits
    (megatron's vocab-parallel cross entropy): the projection's output in the training dtype plus
    its fp32 softmax: s*V/t*(bytes + 4), V padded. fp32 doubles every 16-bit term.
    Measured live tensor bytes per sample on CPU (8 layers, h 128, s 256, fp32; README): none,
    selective and full within 4 % of this.
    checkpointing: the ds_config's activation_checkpointing section (recompute=full only).
    Returns bytes: per_layer, layers (what L layers keep), recomputed (one layer, in backward),
    embedding, logits, host (on the host: cpu_checkpointing), total (the rank's device).
    """
    s, h, a, L = model.seq_len, model.hidden_size, model.num_heads, model.num_layers
    V = model.padded_vocab(tp)
    b = BYTES[precision]
    scale = b / 2
    attention = 2 * a * s * s / tp * scale
    layer = s * h * (8 + 24 / tp) * scale + attention
    ck = checkpointing or {}
    host = 0.0
    if recompute == "full":
        kept = 2 * s * h * scale / (tp if ck.get("partition_activations") else 1)
        layers, recomputed = L * kept, layer
        if ck.get("partition_activations") and ck.get("cpu_checkpointing"):
            layers, host = 0.0, L * kept
    elif recompute == "selective":
        layers, recomputed = L * (layer - attention), attention
    else:
        layers, recomputed = L * layer, 0.0
    embed = 4 * s * h * scale
    logits = s * V / tp * (b + 4)
    out = {"per_layer": layer, "layers": layers, "recomputed": recomputed, "embedding": embed,
           "logits": logits, "host": host, "total": layers + recomputed + embed + logits}
    return {k: int(v) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# DeepSpeed's buffers
# ---------------------------------------------------------------------------------------------
def _zero_cfg(bench: BenchConfig) -> dict:
    return ds_config.build(bench).get("zero_optimization") or {}


def deepspeed_buffers(bench: BenchConfig, ds: Optional[Mapping] = None) -> dict:
    """Bytes of the buffers DeepSpeed (and the optimizer) allocate beyond the model states, per rank.

    Each entry: {"bytes", "phases"}, the phases it is alive in: "act" (forward and the start of the
    backward pass, with the activations), "bwd_end" (gradients complete, being reduced), "step"
    (the optimizer step). Sizes come from the ds_config (`ds`: its zero_optimization section;
    default zero_bench.ds_config.build(bench)) and DeepSpeed's defaults for keys it leaves out.
    - ZeRO-0: the engine all-reduces the gradients through a flat copy of up to 5e8 elements.
    - ZeRO-1/2: the contiguous-gradient reduce bucket (reduce_bucket_size elements, two with
      overlap_comm); ZeRO-1 reduces into an fp32 gradient partition (4P/dp) while the full
      gradients are alive; at the step both flatten the gradient partition into a new fp32 tensor
      (4P/dp). allgather_bucket_size is not allocated: DeepSpeed all-gathers the updated
      partitions in place (all_gather_into_tensor), listed as 0.
    - ZeRO-3: the reduce bucket; the gathered (live) parameters: the largest parameter plus the
      prefetch bucket, capped by stage3_max_live_parameters (never below one whole parameter) -- on
      CPU the whole shard, as measured (see the comment below); the
      parameters below stage3_param_persistence_threshold that every rank keeps whole.
    - fp16 at ZeRO-0: DeepSpeed's FP16_Optimizer builds fp32 copies of the gradients at the step (8P).
    - torch's (non-fused) Adam, which the CPU ds_config selects (torch_adam), makes one temporary
      the size of the fp32 partition it updates (sqrt of the second moment); fused/CPU Adam: none.
    """
    zc = dict(_zero_cfg(bench) if ds is None else ds)
    full = ds_full(bench) if ds is None else {}
    stage, dp, tp = bench.zero, bench.parallel.dp, bench.parallel.tp
    b = BYTES[bench.precision]
    P = bench.model.params_per_shard(tp)
    get = lambda k: int(float(zc.get(k, DS_DEFAULTS[k])))  # noqa: E731
    part = P // dp if stage >= 1 else P
    out: dict[str, tuple[int, tuple]] = {}
    if stage == 0:
        out["allreduce_flat"] = (min(P, ZERO0_ALLREDUCE_ELEMENTS) * b, ("bwd_end",))
        if bench.precision == "fp16":
            # FP16_Optimizer.step (runtime/fp16/fused_optimizer.py) casts every fp16 gradient to
            # fp32 in a list, then flattens the list into the master's .grad: 4P + 4P at once.
            out["fp32_grads"] = (8 * P, ("step",))
    elif stage in (1, 2):
        n = 2 if zc.get("overlap_comm") else 1
        red_b = 4 if stage == 1 else b  # ZeRO-1 stages the fp32 accumulator
        bucket = n * get("reduce_bucket_size") * red_b if zc.get("contiguous_gradients", True) else 0
        out["reduce_bucket"] = (bucket, ("act", "bwd_end"))
        out["allgather_bucket"] = (0, ("step",))
        if stage == 1 and not bench.offload:
            out["grad_partition_fp32"] = (4 * part, ("bwd_end", "step"))
        out["grad_flat_fp32"] = (4 * part, ("step",))
    else:
        out["reduce_bucket"] = (get("reduce_bucket_size") * b, ("act", "bwd_end"))
        numels = param_numels(bench.model, tp)
        largest = max(numels)
        live = max(largest, min(get("stage3_max_live_parameters"), largest + get("stage3_prefetch_bucket_size")))
        if bench.hardware.device == "cpu":
            # Measured on CPU (GPT-small, DP=2): the forward/backward peak holds about one whole
            # copy of the parameters, not the max_live/prefetch bound (module not built under zero.Init).
            live = P
        out["live_params"] = (min(live, P) * b, ("act",))
        thr = get("stage3_param_persistence_threshold")
        out["persistent_params"] = (sum(x for x in numels if x <= thr) * b, ("act", "bwd_end", "step"))
    torch_adam = bool(((full.get("optimizer") or {}).get("params") or {}).get("torch_adam"))
    if ds is None and torch_adam:
        out["adam_temp"] = (4 * part, ("step",))
    return {k: {"bytes": int(v), "phases": list(ph)} for k, (v, ph) in out.items()}


def ds_full(bench: BenchConfig) -> dict:
    return ds_config.build(bench)


# ---------------------------------------------------------------------------------------------
# One configuration
# ---------------------------------------------------------------------------------------------
@dataclass
class Estimate:
    """Everything predicted for one configuration, per rank (bytes).

    Peak model: overhead + persistent states (params, master, moments) + the largest phase:
      act:     gradients allocated up front + buffers alive in forward/backward + micro x act/sample
               (ZeRO-0/1: the first gradient of the backward pass, the tied embedding's, is there too)
      bwd_end: all gradients + the reduction buffers
      step:    the gradients the optimizer reads + the step's temporaries
    and at least the peak of deepspeed.initialize (the model plus its flat / partitioned copy).
    """
    label: str
    device: str
    precision: str
    zero: int
    offload_optimizer: bool
    offload_param: bool
    dp: int
    tp: int
    num_params: int
    params_per_shard: int
    states: dict  # model_states_bytes
    buffers: dict  # deepspeed_buffers
    activations: dict  # activation_bytes_per_sample
    act_per_sample: int  # calibrated for the device
    overhead: int
    init_peak: int
    grads_phase: dict  # gradient bytes counted in each phase (in the memory the capacity is about)
    local_ranks: int = 1
    capacity: Optional[int] = None

    @property
    def states_on_rank(self) -> int:
        """Model-state bytes in the memory the capacity is about (CPU: device + host; GPU: device)."""
        return self.states["gpu"] + (self.states["cpu"] if self.device == "cpu" else 0)

    @property
    def persistent(self) -> int:
        """States that live through the whole step: everything but the gradients."""
        dev_grads = self.states["grads"] if self.device == "cpu" else self._dev_grads()
        return self.states_on_rank - dev_grads

    def _dev_grads(self) -> int:
        s = self.states
        if not self.offload_optimizer:
            return s["grads"]
        return 0 if self.zero >= 2 else s["grads"] - 4 * self.params_per_shard // self.dp

    def phase_bytes(self, phase: str) -> int:
        """Gradients + buffers of one phase (no activations, no persistent states)."""
        return self.grads_phase[phase] + sum(v["bytes"] for v in self.buffers.values() if phase in v["phases"])

    @property
    def buffers_total(self) -> int:
        """The buffers of the phase with the most (what the table shows)."""
        return max(sum(v["bytes"] for v in self.buffers.values() if ph in v["phases"])
                   for ph in ("act", "bwd_end", "step"))

    def fixed_bytes(self) -> int:
        """Per-rank peak without activations."""
        return self.peak_bytes(0)

    def peak_bytes(self, micro: int) -> int:
        """Predicted per-rank peak at this micro-batch (RSS on CPU, device memory on GPU)."""
        steady = self.overhead + self.persistent + max(self.phase_bytes("act") + micro * self.act_per_sample,
                                                       self.phase_bytes("bwd_end"), self.phase_bytes("step"))
        return max(steady, self.overhead + self.init_peak)

    def cannot_initialize(self, capacity: Optional[int] = None) -> bool:
        """The model states alone (or deepspeed.initialize's peak) exceed the capacity."""
        cap = capacity if capacity is not None else self.capacity
        return bool(cap) and self.fixed_bytes() > cap

    def max_micro(self, capacity: Optional[int] = None) -> Optional[int]:
        """Largest micro-batch whose predicted peak fits `capacity` (0: not even one sample)."""
        cap = capacity if capacity is not None else self.capacity
        if cap is None or self.act_per_sample <= 0:
            return None
        if self.peak_bytes(1) > cap:
            return 0
        base = self.overhead + self.persistent + self.phase_bytes("act")
        return max(1, int((cap - base) // self.act_per_sample))

    def host_bytes(self) -> int:
        """Host memory the offloaded states need on one node (all its ranks)."""
        return self.states["cpu"] * self.local_ranks

    def row(self) -> dict:
        s = self.states
        m = self.max_micro()
        return {
            "config": f"zero{self.zero}" + ("+offload" if self.offload_optimizer else "")
                      + ("+param" if self.offload_param else ""),
            "params": s["params"], "grads": s["grads"], "optimizer": s["optimizer"],
            "device_states": s["gpu"], "host_states": s["cpu"],
            "buffers": self.buffers_total, "act_per_sample": self.act_per_sample,
            "overhead": self.overhead, "peak_micro1": self.peak_bytes(1),
            "host_needed": self.host_bytes(), "capacity": self.capacity,
            "max_micro": m, "max_global_batch": None if m is None else m * self.dp,
        }

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["row"] = self.row()
        return d


def estimate(bench: BenchConfig, capacity: Optional[int] = None, ds: Optional[Mapping] = None) -> Estimate:
    """The prediction for one BenchConfig (its device, precision, stage, offload, dp, tp)."""
    m, tp, dp = bench.model, bench.parallel.tp, bench.parallel.dp
    P = m.params_per_shard(tp)
    states = model_states_bytes(P, bench.zero, dp, 1, bench.precision,
                                bench.offload, bench.offload_param and bench.zero == 3)
    on_cpu = bench.hardware.device == "cpu"
    checkpointing = ds_full(bench).get("activation_checkpointing") if ds is None else None
    act = activation_bytes_per_sample(m, tp, bench.precision, bench.recompute, checkpointing)
    factor = CPU_ACTIVATION_FACTOR if on_cpu else GPU_ACTIVATION_FACTOR
    per_sample = act["total"] + (act["host"] if on_cpu else 0)  # on CPU the host is the device
    b = BYTES[bench.precision]
    grads = states["grads"]
    if not on_cpu and bench.offload:  # the host part of the gradients is not on the device
        grads = 0 if bench.zero >= 2 else b * P
    first = b * max(param_numels(m, tp))  # ZeRO-0/1: the tied embedding's gradient comes first
    grads_phase = {"act": first if bench.zero <= 1 else grads, "bwd_end": grads,
                   "step": 0 if bench.zero == 1 and not bench.offload else grads}
    return Estimate(
        label=bench.label(), device=bench.hardware.device, precision=bench.precision, zero=bench.zero,
        offload_optimizer=bench.offload, offload_param=bench.offload_param, dp=dp, tp=tp,
        num_params=m.num_params, params_per_shard=P, states=states, buffers=deepspeed_buffers(bench, ds),
        activations=act, act_per_sample=int(per_sample * factor),
        overhead=CPU_RANK_OVERHEAD if on_cpu else GPU_RANK_OVERHEAD, init_peak=_init_peak(bench, P),
        grads_phase={k: int(v) for k, v in grads_phase.items()},
        local_ranks=local_ranks(bench),
        capacity=capacity if capacity is not None else device_capacity(bench))


def _init_peak(bench: BenchConfig, P: int) -> int:
    """Bytes deepspeed.initialize holds at its peak: the model plus its flat (ZeRO-1/2) copy. ZeRO-3
    builds the model under deepspeed.zero.Init, which partitions each module's parameters as soon
    as the module is built: its partition plus the largest parameter, whole, while it is initialised
    (on the host instead with offload_param)."""
    b, dp = BYTES[bench.precision], bench.parallel.dp
    if bench.zero == 3:
        whole = b * max(param_numels(bench.model, bench.parallel.tp))
        return whole + (0 if bench.offload_param and bench.hardware.device != "cpu" else b * P // dp)
    return b * P + {0: 0, 1: b * P, 2: b * P}[bench.zero]


def seed_micro(bench: BenchConfig) -> Optional[int]:
    """First guess for the max-batch search: the predicted largest micro-batch for the capacity.

    None when the estimate cannot say (no capacity known, or not even micro=1 predicted to fit:
    the search then starts from its minimum).
    """
    try:
        m = estimate(bench).max_micro()
    except Exception:  # noqa: BLE001 - a first guess must never stop a search
        return None
    return m if m else None
