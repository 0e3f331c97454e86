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

Who measures the points: `zero_bench calibrate` times its own launch (one point for its engine and
stage, no extra launch), benchmarks/time_vs_cpu_trials.py times gpt-tiny at every engine and stage it
checks before its trials.
"""
from __future__ import annotations

from typing import Optional, Sequence

from zero_bench.config.schema import BenchConfig
from zero_bench.devices.rates import EnginePoint  # the measured record lives with the rates that carry it
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


def engine_term(bench: BenchConfig, points: Sequence[EnginePoint], micro: Optional[int] = None) -> Optional[TimeTerm]:
    """The configuration's engine time per step at `micro` (else batch.micro) from the points
    measured for its engine and stage,
    x grad_accum (each micro-step runs the hooks, casts and waits again; the calibration trials run
    grad_accum 1). None where none was measured, or with a pipeline."""
    mine = [p for p in points if p.key == engine_key(bench)]
    if not mine or bench.parallel.pp > 1:  # a pipeline's schedule: not what the points measured
        return None
    a, b, c = coefficients(mine)
    tensors, params, token_layers = engine_size(bench, micro)
    ga = bench.batch.grad_accum
    seconds = ga * (a * tensors + b * params + c * token_layers)
    fit = [f"{a * 1e3:.3f} ms/tensor x {tensors}"] + ([f"{b * 1e9:.2f} ns/param x {params:,.0f}"] if b else []) \
        + ([f"{c * 1e6:.2f} us/token-layer x {token_layers:,.0f}"] if c else [])
    said = ", ".join(f"{p.model} micro {p.micro} {p.measured_s:.3f} s measured - {p.kernels_s:.3f} s kernels"
                     for p in mine)
    return TimeTerm(ENGINE_TERM, seconds, True, f"{engine_key(bench)}: " + " + ".join(fit)
                    + (f", x {ga} micro-steps" if ga > 1 else "") + f"; measured on {said}")
