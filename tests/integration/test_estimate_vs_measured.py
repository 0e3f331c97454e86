"""The estimate against real CPU trials (gpt-small, ZeRO 0-3 and FSDP2 zero 2/3, DP=2; and llama-tiny,
a model none of the estimate's CPU constants was fitted on, with ZeRO-2 and with FSDP2 zero=3 in
the recipes whose phases issue 51 fixed). The figures measured are in docs/verified.md
("Measured on this machine") and docs/engines.md ("The estimate for FSDP2"); these tests hold them to
their tolerances.

Each launch measures two micro-batches (MICROS, in one process), so what a sample adds is measured,
in bytes, not only the peak at micro 1 that the fixed terms dominate. The CPU constants and where
they came from (zero_bench/estimate/__init__.py): CPU_RANK_OVERHEAD, the RSS of a GPT-tiny rank;
CPU_ACTIVATION_FACTOR, RSS per sample on GPT-mini (and GPT-small ZeRO-3). llama-tiny (SwiGLU, GQA,
RMSNorm, RoPE, untied, sdpa) is neither. An estimate that raises fails these tests (nothing skips).
"""
from __future__ import annotations

import dataclasses

import pytest

from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import BatchConfig
from zero_bench.estimate import CPU_RANK_OVERHEAD, estimate
from zero_bench.estimate.fsdp2 import model_states
from zero_bench.models.params import layer_numels
from zero_bench.records import Entry
from zero_bench.trial.launch import LaunchOptions, run_launch

from conftest import cpu_cfg

pytestmark = pytest.mark.slow

FSDP2 = ["fsdp2_zero2", "fsdp2_zero3"]
# FSDP2 on llama-tiny where the formula had a phase wrong (issue 51): grad_accum > 1 holds the
# sharded gradients of the micro-batch before; recompute=block rebuilds only the recomputed layers;
# loss=chunked keeps no logits (all zero=3, beside the plain step of each precision)
FSDP2_LLAMA = {"fsdp2_llama": {}, "fsdp2_llama_accum": {"batch": BatchConfig(micro=2, grad_accum=2)},
               "fsdp2_llama_block": {"recompute": "block", "recompute_layers": 2},
               "fsdp2_llama_bf16": {"precision": "bf16"},
               "fsdp2_llama_chunked": {"precision": "bf16", "loss": "chunked"}}
ZERO = [0, 1, 2, 3, "llama"]
MICROS = (1, 4)
# What one more sample may differ by between the profiled steps' live tensor peaks and the formula
# (bytes per sample, as a fraction of the formula's): the formula matches live tensors of llama-tiny to
# 0.2 % and GPT-small's within 5 % (docs/verified.md); 8 % leaves room for the profiler's allocation
# events and for the phase the peak falls in, and none for a term per layer (1 / num_layers >= 12 % here).
SLOPE_TOL = 0.08
# Where the estimate puts the peak in a phase without activations (GPT-small ZeRO 0-2 up to micro 4),
# the profiled peak still moves by up to ~16 MiB between entries (measured: -9 to +17 MiB; ZeRO-2's
# backward and step peaks lie within a few MiB of each other): an eighth of a sample per sample
# (8 MiB here) tells "flat" from "grows by a sample per sample" (64 MiB) with room for that.
FLAT_TOL = 0.125
# A slope says which phase holds the peak only where the estimate's phases do not cross between the
# two micro-batches: each must lie at least half a sample from the crossing. GPT-small ZeRO-2 crosses
# at micro 3.9 (its activation phase is 0.12 sample above its step phase at 4): a 10-28 MiB error in
# where the phases meet (measured: 10 here, 28 on an AVX2-only CPU, rank 1's backward peak) then reads
# as 3-9 MiB per sample. Such a configuration also runs LATE_MICROS, where activations decide.
LATE_MICROS = (6, 9)
MARGIN_SAMPLES = 0.5
# steps.probe=0: a probe after a trial's first profiles its first step at its size (the optimizer
# states exist from the first probe's step), not a second one. Measured against steps.probe=1
# (2026-11-28, two runs each, every configuration here): live tensor peaks at the later sizes within
# 0.75 MiB, each in the same phase (in one run GPT-small ZeRO-2 rank 0 +27.8 MiB at micro 4, in its
# step phase, which moves as much from run to run with either: micro 1, run alike by both, read
# 1059.5 to 1107.5 MiB over the four runs; llama-tiny FSDP2 rank 0 up to 2.7 MiB lower in one run,
# the fp32 layer gloo holds or not from run to run; llama-tiny bf16 at micro 4: forward and backward
# within 0.5 MiB); peak RSS within 1 % (llama-tiny bf16 at micro 4: -6 MiB of 536; GPT-small ZeRO-2
# at micro 9: +13 of 1,733). The 0.75 MiB is GPT-small's at micro 4, every engine: micro 1's
# attention scores in megatron's global memory buffer, which the first step at 4 regrows; that
# block came from the first probe's unprofiled step, so the profiler never sees it freed (at 6 and
# 9, +0.0: the block it drops there was allocated under the profiler). llama-tiny's sdpa keeps no
# such buffer (test_activations_vs_measured.py's unfused variants do). That leaves 14 of the
# module's 52 steps out: 47.6 s of the 170 s the module took with them (the probe steps' times),
# 128 s without, back to back on a busy 2-core machine.
PROBE_STEPS = 0


def with_formula(e, formula: int):
    """`e` with `formula` bytes per sample in its activation phase (not the RSS-fitted CPU factor)."""
    phases = {ph: dataclasses.replace(v, per_sample=formula) if v.per_sample else v
              for ph, v in e.prediction.phases.items()}
    return dataclasses.replace(e, prediction=dataclasses.replace(e.prediction, phases=phases, act_per_sample=formula))


def growth_margin(e, micro: int) -> float:
    """How far (in samples of the formula's bytes) the estimate's growing phase lies above (+) or
    below (-) its flat ones at this micro-batch."""
    formula = e.prediction.activations["total"] + e.prediction.activations["host"]
    live = with_formula(e, formula)
    grow = max(live.phase_bytes(p) + micro * live.per_sample(p) for p in e.phases if live.per_sample(p))
    flat = max([live.phase_bytes(p) for p in e.phases if not live.per_sample(p)] or [0])
    return (grow - flat) / formula


def one_regime(e, micros: tuple) -> bool:
    margins = [growth_margin(e, m) for m in micros]
    return all(abs(x) >= MARGIN_SAMPLES for x in margins) and len({x > 0 for x in margins}) == 1


def slope_micros(b) -> tuple:
    """The two micro-batches whose slope this configuration is judged by."""
    if b.engine != "deepspeed" or one_regime(estimate(b), MICROS):
        return MICROS
    assert one_regime(estimate(b), LATE_MICROS), b.label()
    return LATE_MICROS


@pytest.fixture(scope="module")
def measured(tmp_path_factory, pools):
    """Each configuration's two probes run one after the other in one trial, a fresh child forked from
    the pool (conftest.pools: one deepspeed launch for the seven, as a search runs its trials): a forked
    child's figures are a launch of its own's (tests/integration/test_pool_cpu.py: peak RSS within 1 %,
    live tensors within 0.1 %, model states and losses identical), and the pool saves six launches'
    start-up (~9 s of imports each) that none of these figures depends on. Each probe after a
    trial's first profiles its first step at its size (PROBE_STEPS)."""
    out = {}
    configs = {z: cpu_cfg("gpt-small", zero=z) for z in range(4)}
    configs.update({name: cpu_cfg("gpt-small", zero=int(name[-1]), engine="fsdp2") for name in FSDP2})
    configs["llama"] = cpu_cfg("llama-tiny", zero=2)
    configs.update({name: cpu_cfg("llama-tiny", zero=3, engine="fsdp2", **kw) for name, kw in FSDP2_LLAMA.items()})
    for key, b in configs.items():
        b = dataclasses.replace(b, steps=dataclasses.replace(b.steps, probe=PROBE_STEPS))
        micros = sorted(set(MICROS) | set(slope_micros(b)))
        res = run_launch(b, [Entry(m, "probe") for m in micros], tmp_path_factory.mktemp(f"z{key}"),
                         LaunchOptions(pools=pools))
        assert [r.status for r in res] == ["ok"] * len(micros), [(r.status, r.reason) for r in res]
        # the first probe's step that allocates the optimizer states, then one profiled step each
        assert [len(r.ranks[0].losses) for r in res] == [2] + [1] * (len(micros) - 1), key
        out[key] = (b, dict(zip(micros, res)))
    return out


@pytest.mark.parametrize("zero", ZERO)
def test_model_states_match_worker(measured, zero):
    b, res = measured[zero]
    e = estimate(b)
    for rank in res[MICROS[0]].ranks:
        ms = rank.model_states
        got = ms["params"] + ms["master"] + ms["optimizer"] + ms["grads"]
        # after the step the gradients are freed: compare the persistent states
        assert got == pytest.approx(e.persistent, rel=0.01)
        assert ms["params"] == pytest.approx(e.states.params, rel=0.001)
        assert ms["master"] + ms["optimizer"] == pytest.approx(e.states.optimizer, rel=0.001)


@pytest.mark.parametrize("micro", MICROS)
@pytest.mark.parametrize("zero", ZERO)
def test_peak_rss_near_estimate(measured, zero, micro):
    b, res = measured[zero]
    pred = estimate(b).peak_bytes(micro)
    for rank in res[micro].ranks:
        assert pred == pytest.approx(rank.peak_rss_bytes, rel=0.12), (pred / 2**20, rank.peak_rss_bytes / 2**20)


# Found by this test (2026-11-23): on GPT-small ZeRO-3 the profiled step's peak at micro 1 is in the
# optimizer step (1088 / 1103 MiB live on ranks 0 / 1), which the estimate puts below the activation
# phase, so the measured growth from micro 1 to 4 is 39-53 MiB per sample (three runs) against the formula's
# 63.9 (the micro-4 peak, 1247 MiB, is in backward). Strict: when the estimate's step phase is fixed
# this passes, and the mark must go.
ZERO3_STEP_PHASE = pytest.mark.xfail(strict=True, reason="ZeRO-3's step phase outgrows the estimate's at micro 1")


# Found by this test (2026-11-24) once its slopes stayed within one regime: GPT-small ZeRO-2 from micro
# 6 to 12, rank 0's backward peak grows by the formula's 63.9 MiB per sample (to the byte), rank 1's by
# 53.6, from 88 MiB higher at micro 6 (1181 vs 1093 MiB live): rank 1 peaks later in backward, with
# some activations freed and more of its gradient partition and reduce bucket held, a phase the
# estimate does not have. At micro 4, where the estimate's phases cross, it put rank 1's peak 10 MiB
# (here) to 28 MiB (an AVX2-only CPU) above the estimate: the machine-dependent failure of the
# earlier (1, 4) slope. Strict: when the estimate gets that phase, this passes and the mark must go.
ZERO2_LATE_BACKWARD = pytest.mark.xfail(strict=True, reason="ZeRO-2 rank 1's late backward phase is not in the estimate")


@pytest.mark.parametrize("zero", [pytest.param(z, marks=ZERO3_STEP_PHASE) if z == 3 else
                                  pytest.param(z, marks=ZERO2_LATE_BACKWARD) if z == 2 else z for z in ZERO])
def test_bytes_per_sample_match_the_formula(measured, zero):
    """What more samples add to the profiled step's live tensor peak between two micro-batches in one
    of the estimate's regimes (slope_micros), per sample, against the estimate's tensor peak there with the formula's bytes per
    sample (activation_bytes_per_sample, not the RSS-fitted CPU factor): absolute bytes, each rank.
    Where the estimate puts the peak in a phase without activations the measured peak must not grow
    either; where activations decide it, it must grow by the formula's bytes per sample."""
    b, res = measured[zero]
    e = estimate(b)
    formula = e.prediction.activations["total"] + e.prediction.activations["host"]
    live = with_formula(e, formula)
    lo, hi = slope_micros(b)
    want = (live.allocated_bytes(hi) - live.allocated_bytes(lo)) / (hi - lo)
    if growth_margin(e, lo) > 0:  # activations decide the peak at both sizes: the slope is the formula's
        assert want == pytest.approx(formula, rel=0.01)
        tol = SLOPE_TOL
    else:  # GPT-small ZeRO 0-1 up to micro 4: the gradients and the optimizer step's buffers do: flat
        assert want < 0.1 * formula
        tol = FLAT_TOL
    for r_lo, r_hi in zip(res[lo].ranks, res[hi].ranks):
        got = (r_hi.peak_live_bytes - r_lo.peak_live_bytes) / (hi - lo)
        assert abs(got - want) <= tol * formula, (got / 2**20, want / 2**20, formula / 2**20)


@pytest.mark.parametrize("micro", MICROS)
def test_cpu_overhead_on_a_model_it_was_not_taken_from(measured, micro):
    """CPU_RANK_OVERHEAD (what a GPT-tiny rank's RSS holds besides tensors) on llama-tiny: each rank's
    peak RSS less its profiled step's live tensor peak. (Not runtime_bytes, the RSS before the model
    is built: ~302 MiB here; DeepSpeed's engine, gloo's buffers and the allocator's arenas come after.)"""
    _, res = measured["llama"]
    for rank in res[micro].ranks:
        rest = rank.peak_rss_bytes - rank.peak_live_bytes
        assert rest == pytest.approx(CPU_RANK_OVERHEAD, rel=0.12), rest / 2**20


@pytest.mark.parametrize("name", FSDP2)
def test_fsdp2_model_states_are_exact(measured, name):
    b, res = measured[name]
    e = estimate(b)
    for rank in res[MICROS[0]].ranks:
        ms = rank.model_states
        want = model_states(RankLayout(dp=b.parallel.dp, model=b.model), rank=rank.rank)
        assert (ms["params"], ms["master"], ms["optimizer"], ms["grads_at_step"]) == (
            want.params, want.master, want.moments, want.grads)
        # the step's gradients are freed: what persists is the estimate's 12P/dp, to the byte on rank 0
        total = ms["params"] + ms["master"] + ms["optimizer"] + ms["grads"]
        assert total == e.persistent if rank.rank == 0 else total <= e.persistent


# FSDP2's live tensor peak against the formula's (issue 51 fixed its phases; 5 % was allowed before
# for GPT-small). Measured 2026-11-28 in this test: GPT-small zero=3 +0.1 % / +0.2 % at micro 1 / 4,
# zero=2 -3.1 % / -0.0 % (micro 1's peak is in a layer's backward, whose inner gradients the formula
# leaves out). llama-tiny (FSDP2_LLAMA): -6.9 % with bf16 loss=chunked at micro 1 (42.31 MiB against
# 39.41; the trace reads 38.6: not explained), the plain step and recompute=block -3.2 % to +0.5 %.
# grad_accum 2 varies from run to run by one fp32 layer of llama-tiny (2.69 MiB, the size of a
# layer's reduce-scatter input; neither the formula nor the trace holds it): -4.4 % and -8.3 % at
# micro 1 in two runs (62.37 and 65.06 MiB against 59.64), -1.6 % / -5.4 % at micro 4 (ranks 0 / 1).
# The formula before issue 51 was -15 % / -18 % with grad_accum 2 at micro 1, +16 % / +24 % with
# recompute=block (micro 1 / 4), +9.5 % with loss=chunked at micro 4.
GPT_SMALL_LIVE_TOL = 0.04
# GPT-small FSDP2 zero=2 at micro 1, whose peak is in a layer's backward, measured 837.5 MB on most
# runs and 861.1 MB on two (2026-11-27's first run, 2026-11-28's first run: the pool and the code
# unchanged between runs; 23.6 MB held or not, as FSDP2 on gloo holds one layer's buffer more or less
# from run to run on llama-tiny): -3.1 % and -5.8 % of the formula's 811.2 MB; held to 6.5 %
RUN_TO_RUN_LIVE_TOL = {("fsdp2_zero2", 1): 0.065}
LLAMA_LIVE_TOL = {"fsdp2_llama_accum": 0.1}  # the others 0.075


@pytest.mark.parametrize("micro", MICROS)
@pytest.mark.parametrize("name", FSDP2)
def test_fsdp2_peaks_near_estimate(measured, name, micro):
    """The RSS margin the ZeRO stages meet (12 %); the live tensor peak, which the memory model
    describes without the process's fixed cost, within GPT_SMALL_LIVE_TOL (RUN_TO_RUN_LIVE_TOL where
    the measured peak moves from run to run)."""
    b, res = measured[name]
    e = estimate(b)
    for rank in res[micro].ranks:
        assert e.peak_bytes(micro) == pytest.approx(rank.peak_rss_bytes, rel=0.12)
        tol = RUN_TO_RUN_LIVE_TOL.get((name, micro), GPT_SMALL_LIVE_TOL)
        assert e.peak_bytes(micro) - e.overhead == pytest.approx(rank.peak_live_bytes, rel=tol), (
            (e.peak_bytes(micro) - e.overhead) / 2**20, rank.peak_live_bytes / 2**20)


def test_zero2_rank0_grows_by_the_formula_where_activations_decide(measured):
    """What ZERO2_LATE_BACKWARD leaves standing: GPT-small ZeRO-2's rank 0 peaks in the estimate's
    activation phase, and grows by the formula's bytes per sample between LATE_MICROS."""
    b, res = measured[2]
    e = estimate(b)
    formula = e.prediction.activations["total"] + e.prediction.activations["host"]
    lo, hi = slope_micros(b)
    assert (lo, hi) == LATE_MICROS and growth_margin(e, lo) > 0
    r_lo, r_hi = res[lo].ranks[0], res[hi].ranks[0]
    assert r_lo.rank == 0 and r_hi.peak_phase == "backward"
    got = (r_hi.peak_live_bytes - r_lo.peak_live_bytes) / (hi - lo)
    assert abs(got - formula) <= SLOPE_TOL * formula, (got / 2**20, formula / 2**20)


@pytest.mark.parametrize("micro", MICROS)
@pytest.mark.parametrize("name", list(FSDP2_LLAMA))
def test_fsdp2_llama_tiny_peaks_near_estimate(measured, name, micro):
    """The live tensor peak of each rank within LLAMA_LIVE_TOL of the formula's. Before its phases
    followed FSDP2's step (issue 51) the formula left out the first micro-batch's sharded gradients
    (grad_accum 2), counted a rebuilt layer at every phase (recompute=block) and the whole logits
    beside the chunk (loss=chunked)."""
    b, res = measured[name]
    e = estimate(b)
    tol = LLAMA_LIVE_TOL.get(name, 0.075)
    # FSDP2 on gloo holds one fp32 layer's buffer more or less from run to run (48.67 / 51.36 MiB for
    # recompute=full, tests/data/measured/fsdp2_live_peaks.json): a measurement may exceed the
    # formula by that layer too, never fall below it by more than tol (the old formula's misses were
    # over-predictions here, and grad_accum's -15 % / -18 % stay past tol plus a layer)
    # Those buffers are gloo's: its background thread drops its references to a collective's tensors
    # when the work completes, so a busy machine raises a rank's measured peak, never lowers it (five
    # fresh launches of grad_accum 2 at micro 1, 2026-11-28: 59.68 to 64.37 MiB per rank; CI's clone
    # once read 71.06 on one rank). The formula must not exceed any rank's peak, and must reach the
    # least of them (both ranks run the same layers on equal shards) within tol plus one layer.
    held = 4 * sum(layer_numels(b.model))
    pred = e.allocated_bytes(micro)
    got = [rank.peak_live_bytes for rank in res[micro].ranks]
    assert pred <= min(got) * (1 + tol), (pred / 2**20, [g / 2**20 for g in got])
    assert min(got) * (1 - tol) - held <= pred, (pred / 2**20, [g / 2**20 for g in got], held / 2**20)
