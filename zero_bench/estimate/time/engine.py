"""The engine's own time per step: what DeepSpeed (or FSDP2) spends around the model's kernels on a
CPU rank - its per-parameter hooks, the 16-bit <-> fp32 bookkeeping copies, ZeRO-3's fetch and release
machinery, FSDP2's per-unit work, the collectives' waits for the other rank, Python and autograd.

Measured, not assumed: an EnginePoint is one real trial of a calibration model (gpt-tiny, never the
model a prediction is checked against) at one engine and ZeRO stage, timed, less what the kernel
terms predict for it at the same rates (its residual). From the points of one engine and stage
(`engine_key`), coefficients() takes a cost per parameter tensor and, where points differ in
parameters per tensor or in tokens, a cost per parameter and per token-layer; a configuration's
engine term is those coefficients times its own tensors, parameters and token-layers (engine_size).
The calibration models keep gpt-mini's head size or larger shapes where they vary tokens (a longer
gpt-tiny sequence runs 16-wide attention heads far below the probes' matmul rate: kernel shape, not
engine; docs/estimate.md). With the term the assumed step overhead goes: the residual
holds it. Where no point was measured for the engine and stage (GPU, or a CPU without them), the
step overhead stays the stated 10 ms.

What a configuration runs that the stage's points (tp 1, sp 1, GPT's layer) did not, one term per
cause, each from calibration points of its own (cause_terms): another layer architecture (llama's
RMSNorm, SwiGLU, RoPE, sdpa: more small ops per token) per token-layer, megatron's tensor-parallel
collectives and Ulysses' all-to-alls per call (the ranks wait for each other in lockstep at each,
beyond comm.py's latency and bandwidth). A cause's point (gpt-tiny at tp=2 or sp=2, a 2-layer llama)
costs its residual less the stage's coefficients at its size; nothing is fitted to a checked trial.

Who measures the points: `zero_bench calibrate` times its own launch (one point for its engine and
stage, no extra launch; no cause points: each would need a launch of its own tp / sp layout or model,
~10 s, and a stage fit of several sizes to subtract), benchmarks/time_vs_cpu_trials.py times gpt-tiny
at every engine and stage it checks, and its CAUSE_MODELS, before its trials.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from zero_bench.config.schema import BenchConfig
from zero_bench.devices.rates import EnginePoint  # the measured record lives with the rates that carry it
from zero_bench.estimate.time.comm import tensor_parallel_calls, ulysses_calls
from zero_bench.estimate.time.record import TimeTerm

ENGINE_TERM = "engine overhead"



def engine_key(bench: BenchConfig) -> str:
    """What an engine overhead is measured per: the engine and its ZeRO stage (deepspeed zero 0-3,
    fsdp2 zero 2/3). Offload, recompute, tp and sp share their stage's."""
    return f"{bench.engine} zero {bench.zero}"


def engine_size(bench: BenchConfig, micro: Optional[int] = None) -> tuple[int, float, float]:
    """(parameter tensors, parameters, token-layers) a rank's engine handles per micro-step: every
    tensor of its model (its hooks, casts and fetches are per tensor at every stage), the parameters
    of its tp shard before ZeRO partitions them (each is cast, gathered or copied once a step), and
    the tokens its layers see (micro, else batch.micro, x seq_len / sp) x the layers (what autograd's
    and the hooks' work on activations scales with)."""
    layout, m = bench.layout, bench.model
    tokens = (micro or bench.batch.micro) * m.seq_len / bench.parallel.sp
    return len(layout.params), float(layout.tp_shard_params), tokens * m.num_layers


# which of (per tensor, per parameter, per token-layer) a fit may use, in the order preferred
# where several fit the points equally well (one point: a cost per tensor alone)
SUBSETS = ((0,), (0, 1), (0, 2), (0, 1, 2), (1,), (2,), (1, 2))


def coefficients(points: Sequence[EnginePoint]) -> tuple[float, float, float]:
    """(seconds per tensor, seconds per parameter, seconds per token-layer) from the points of one
    engine and stage: residual = a x tensors + b x params + c x token_layers, least squares with
    every coefficient >= 0 over the subsets of the three (SUBSETS: among equal fits the first).
    One point gives a cost per tensor alone; points that differ in parameters per tensor give the
    per-parameter cost (casts, copies, gathers), points that differ in tokens (micro) the cost per
    token and layer (autograd's and the hooks' work on activations) beside it."""
    import numpy as np

    if not points:
        return 0.0, 0.0, 0.0
    x = np.array([p.features() for p in points], dtype=float)
    y = np.array([p.residual_s for p in points], dtype=float)
    scale = np.where(x.max(axis=0) > 0, x.max(axis=0), 1.0)  # columns of one order, for lstsq
    best, best_err = (0.0, 0.0, 0.0), None
    for cols in SUBSETS:
        if not all(x[:, c].any() for c in cols):
            continue
        sol, *_ = np.linalg.lstsq(x[:, cols] / scale[list(cols)], y, rcond=None)
        if (sol < 0).any():
            continue
        coef = [0.0, 0.0, 0.0]
        for c, v in zip(cols, sol):
            coef[c] = float(v / scale[c])
        err = float(((x @ np.array(coef) - y) ** 2).sum())
        if best_err is None or err < best_err - 1e-12 * max(1e-30, float((y ** 2).sum())):
            best, best_err = tuple(coef), err
    return best


def layer_arch(model) -> str:
    """What a layer runs besides its matmuls, as a calibration point records it: the norm, the MLP's
    activation, the positions, the attention kernel (and qk-norm). Two models of one architecture
    differ only in sizes, which the engine term's features scale."""
    return f"{model.normalization} {model.activation} {model.position_embedding} {model.attention}" \
        + (" qk-norm" if model.qk_norm else "")


# GPT's layer (conf/model/gpt-tiny.yaml: description.py's defaults): what the stage's calibration
# models run; points stored before the architecture was recorded ("") were all gpt-tiny's
REFERENCE_ARCH = "layernorm gelu learned unfused"


def stage_points(key: str, points: Sequence[EnginePoint]) -> list[EnginePoint]:
    """The points the stage's own coefficients come from: its engine and stage at tp 1, sp 1 and
    grad_accum 1, on GPT's layer where there are such (else on whatever layer was measured: then no
    architecture term)."""
    plain = [p for p in points if p.key == key and p.tp == 1 and p.sp == 1 and p.grad_accum == 1]
    return [p for p in plain if p.arch in ("", REFERENCE_ARCH)] or plain


def fitted(p: EnginePoint, coef: tuple[float, float, float]) -> float:
    """What the stage's coefficients give for point p's own size."""
    return sum(c * x for c, x in zip(coef, p.features()))


def repeated_share(key: str, points: Sequence[EnginePoint], coef: tuple[float, float, float]) -> Optional[float]:
    """Of the stage's per-tensor and per-parameter time, the share each further micro-step runs again,
    from the stage's points at grad_accum > 1 (GPT's layer, tp 1, sp 1); None where none was measured.
    The per-token-layer time (autograd's and the hooks' work on activations) is every micro-step's;
    the per-parameter time mixes what every micro-step does (ZeRO-2's reduce hooks and bucket copies,
    stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads) with what only the step does
    (flattening the partition's gradients, their fp32 cast and clip, the 16-bit copy and all-gather of
    the updated partition, zero_grad). A point's share: its residual less grad_accum x its token-layer
    time less one step's per-tensor and per-parameter time, over (grad_accum - 1) x the latter;
    the points' mean, within [0, 1]."""
    a, b, c = coef
    shares = []
    for p in points:
        if p.key != key or p.grad_accum < 2 or p.tp != 1 or p.sp != 1 or p.arch not in ("", REFERENCE_ARCH):
            continue
        once = a * p.tensors + b * p.params
        if once > 0:
            shares.append((p.residual_s - p.grad_accum * c * p.token_layers - once) / ((p.grad_accum - 1) * once))
    return min(1.0, max(0.0, sum(shares) / len(shares))) if shares else None


def engine_term(bench: BenchConfig, points: Sequence[EnginePoint], micro: Optional[int] = None) -> Optional[TimeTerm]:
    """The configuration's engine time per step at `micro` (else batch.micro) from the points
    measured for its engine and stage: the per-token-layer time x grad_accum, the per-tensor and
    per-parameter time once plus, for each further micro-step, the share a grad_accum > 1 point of the
    stage measured repeating (repeated_share; all of it where no such point was measured). None where
    none was measured, or with a pipeline."""
    key = engine_key(bench)
    mine = stage_points(key, points)
    if not mine or bench.parallel.pp > 1:  # a pipeline's schedule: not what the points measured
        return None
    a, b, c = coefficients(mine)
    tensors, params, token_layers = engine_size(bench, micro)
    ga = bench.batch.grad_accum
    measured_share = repeated_share(key, points, (a, b, c)) if ga > 1 else None
    share = 1.0 if measured_share is None else measured_share
    seconds = (1 + share * (ga - 1)) * (a * tensors + b * params) + ga * c * token_layers
    fit = [f"{a * 1e3:.3f} ms/tensor x {tensors}"] + ([f"{b * 1e9:.2f} ns/param x {params:,.0f}"] if b else []) \
        + ([f"{c * 1e6:.2f} us/token-layer x {token_layers:,.0f}"] if c else [])
    said = ", ".join(f"{p.model} micro {p.micro} {p.measured_s:.3f} s measured - {p.kernels_s:.3f} s kernels"
                     for p in mine)
    repeat = "" if ga == 1 else (f", x {ga} micro-steps" if measured_share is None else
                                 f", token-layers x {ga} micro-steps, tensors and params x (1 + {share:.2f} x {ga - 1}) "
                                 f"(the share a grad_accum > 1 point repeats)")
    return TimeTerm(ENGINE_TERM, seconds, True, f"{key}: " + " + ".join(fit) + repeat + f"; measured on {said}")


# -- what tp > 1, Ulysses sp > 1 and another layer architecture cost beyond the stage's term ---------
# One term per cause, each from calibration points of its own (benchmarks/time_vs_cpu_trials.py
# CAUSE_MODELS: gpt-tiny variants at tp=2 and at sp=2, a 2-layer llama-architecture model), never the
# checked models: a point's excess is its residual less what the stage's coefficients (and, for a tp or
# sp point of another architecture, that architecture's cost) give for its size; the cost per unit is
# the least-squares slope through zero of excess on units, never below zero.
ARCH_TERM = "layer architecture overhead"
TP_TERM = "tensor-parallel per-call overhead"
ULYSSES_TERM = "Ulysses per-call overhead"


@dataclass(frozen=True)
class CauseCost:
    """One cause's measured cost per unit (seconds per token-layer, per collective call), per
    micro-step where its points separate one (call_cost), and the points it was measured on."""
    per_unit: float
    points: tuple[EnginePoint, ...]
    per_micro_step: float = 0.0

    def said(self) -> str:
        return ", ".join(f"{p.model} tp {p.tp} sp {p.sp} micro {p.micro}: {p.measured_s:.3f} s measured - "
                         f"{p.kernels_s:.3f} s kernels" for p in self.points)


def slope(pairs: Sequence[tuple[float, float]]) -> float:
    """Least squares of y = k x through zero over (x, y), k >= 0 (0 without any x)."""
    xx = sum(x * x for x, _ in pairs)
    return max(0.0, sum(x * y for x, y in pairs) / xx) if xx else 0.0


def excess(p: EnginePoint, points: Sequence[EnginePoint], arch_cost: float = 0.0) -> Optional[float]:
    """Point p's residual beyond its stage's engine term at its own size (and arch_cost per
    token-layer); None where its stage has no GPT-layer points to subtract."""
    base = stage_points(p.key, points)
    if not base or any(q.arch not in ("", REFERENCE_ARCH) for q in base):
        return None
    return p.residual_s - fitted(p, coefficients(base)) - arch_cost * p.token_layers


def arch_cost(arch: str, points: Sequence[EnginePoint]) -> Optional[CauseCost]:
    """Seconds per token-layer a layer of `arch` spends beyond GPT's (RMSNorm, SwiGLU, RoPE, sdpa run
    other small ops per token than LayerNorm, GeLU and learned positions), from points of that
    architecture at tp 1 and sp 1; None for GPT's own layer or where none was measured."""
    if arch in ("", REFERENCE_ARCH):
        return None
    mine = [p for p in points if p.arch == arch and p.tp == 1 and p.sp == 1]
    pairs = [(p.token_layers, e) for p in mine if (e := excess(p, points)) is not None]
    return CauseCost(slope(pairs), tuple(mine)) if pairs else None


def per_call_and_micro_step(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(seconds per call, seconds per micro-step) from (calls, micro-steps, excess) rows: least squares
    of excess = k calls + k0 micro-steps, both >= 0, where the rows differ in calls per micro-step
    (else, or where the pair fit goes negative, the better of the two alone)."""
    import numpy as np

    x = np.array([[c, m] for c, m, _ in rows], dtype=float)
    y = np.array([e for *_, e in rows], dtype=float)
    fits = [(slope([(c, e) for c, _, e in rows]), 0.0), (0.0, slope([(m, e) for _, m, e in rows]))]
    if len({round(c / m, 9) for c, m, _ in rows}) > 1:
        sol, *_ = np.linalg.lstsq(x, y, rcond=None)
        if (sol >= 0).all():
            fits.insert(0, (float(sol[0]), float(sol[1])))
    return min(fits, key=lambda f: float(((x @ np.array(f) - y) ** 2).sum()))


def call_cost(dim: str, points: Sequence[EnginePoint]) -> Optional[CauseCost]:
    """Seconds per tensor-parallel (dim "tp") or Ulysses ("sp") collective call beyond comm.py's
    latency and bandwidth - the ranks wait for each other in lockstep at every call, and megatron's /
    DeepSpeed's layers around it run Python and copies per call - and, where the points differ in
    layers (calls per micro-step), what the degree costs per micro-step whatever the layers: at tp > 1
    megatron's vocab-parallel cross-entropy all-reduces the logits' max, the target's logit and the
    sum of exponentials across the tp ranks in every forward (tensor_parallel/cross_entropy.py), none
    of them among comm.py's 2L+1 points. From points at that degree > 1 (the other at 1), their excess
    less their architecture's cost."""
    other = "sp" if dim == "tp" else "tp"
    mine = [p for p in points if getattr(p, dim) > 1 and getattr(p, other) == 1 and p.calls]
    rows = []
    for p in mine:
        arch = arch_cost(p.arch, points)
        e = excess(p, points, arch.per_unit if arch else 0.0)
        if e is not None and (arch is not None or p.arch in ("", REFERENCE_ARCH)):
            rows.append((p.calls, float(p.grad_accum), e))
    if not rows:
        return None
    per_call, per_micro_step = per_call_and_micro_step(rows)
    return CauseCost(per_call, tuple(mine), per_micro_step)


def cause_terms(bench: BenchConfig, points: Sequence[EnginePoint], micro: Optional[int] = None) -> list[TimeTerm]:
    """The terms of what the configuration runs that the stage's points did not: another layer
    architecture (per token-layer x grad_accum), tensor-parallel and Ulysses collective calls (per
    call, comm.py's counts). Only beside the stage's engine term (engine_term not None)."""
    out = []
    arch = layer_arch(bench.model)
    got = arch_cost(arch, points)
    if got is not None:
        tl = engine_size(bench, micro)[2] * bench.batch.grad_accum
        out.append(TimeTerm(ARCH_TERM, got.per_unit * tl, True, f"{arch}: {got.per_unit * 1e6:.3f} us/token-layer "
                            f"beyond GPT's layer x {tl:,.0f}; measured on {got.said()}"))
    ga = bench.batch.grad_accum
    for dim, name, calls in (("tp", TP_TERM, tensor_parallel_calls(bench)), ("sp", ULYSSES_TERM, ulysses_calls(bench))):
        cost = call_cost(dim, points) if calls else None
        if cost is not None:
            step = f" + {cost.per_micro_step * 1e3:.3f} ms/micro-step x {ga}" if cost.per_micro_step else ""
            out.append(TimeTerm(name, cost.per_unit * calls + cost.per_micro_step * ga, True,
                                f"{cost.per_unit * 1e3:.3f} ms/call beyond latency and bandwidth x {calls:g} calls"
                                f"{step}; measured on {cost.said()}"))
    return out
