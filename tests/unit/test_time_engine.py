"""The engine's own time per step (estimate/time/engine.py): measured on a calibration model's timed
trial (its time/it less its kernel terms), per engine and ZeRO stage, scaled per parameter tensor and
parameter to the configuration predicted; stored by calibrate, read back by the CPU rates. No launch:
the points are given."""
from __future__ import annotations

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.devices.rate_probes import RankRates
from zero_bench.devices.rates import cpu_rates
from zero_bench.estimate.time import calibration_point, predict_time
from zero_bench.estimate.time.engine import (ARCH_TERM, ENGINE_TERM, REFERENCE_ARCH, TP_TERM, ULYSSES_TERM,
                                             EnginePoint, arch_cost, call_cost, cause_terms, coefficients,
                                             engine_key, engine_size, engine_term)

RANKS = RankRates(2, 1, "bf16", 1e11, 5e9, 4e9, 2e9, 1e9, 5e8, 3e-4, 1e8, 2e-5, 1e-6).to_dict()
MEASURED = {"matmul_flops": {"bf16": 2e11}, "memory_bytes_per_s": 2e10, "ranks": RANKS, "said": "in a test"}


@pytest.fixture(autouse=True)
def no_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path))


def bench(*overrides, model="gpt-mini"):
    return from_cfg(compose([f"model={model}", "hardware=cpu", "parallel=dp2", "precision=bf16", *overrides]))


def point(key="deepspeed zero 2", tensors=28, params=169_728.0, measured=0.10, kernels=0.02, model="GPT-tiny"):
    return EnginePoint(key, model, tensors, params, measured, kernels)


def test_the_key_is_the_engine_and_its_stage_and_the_size_is_the_ranks_tensors_and_params():
    assert engine_key(bench("zero=2", "offload=true")) == "deepspeed zero 2" == engine_key(bench("zero=2"))
    assert engine_key(bench("engine=fsdp2", "zero=3")) == "fsdp2 zero 3"
    tiny, mini = engine_size(bench("batch.micro=4", model="gpt-tiny")), engine_size(bench("batch.micro=4"))
    assert tiny == (28, 169_728.0, 4 * 64 * 2) and mini == (52, 5_322_240.0, 4 * 256 * 4)  # micro x seq x layers
    assert engine_size(bench("parallel.sp=2", "batch.micro=4", model="llama-tiny"))[2] == 4 * bench(model="llama-tiny").model.seq_len / 2 \
        * bench(model="llama-tiny").model.num_layers
    assert engine_size(bench("zero=3"))[1] == mini[1]  # before ZeRO partitions them: each is fetched, cast


def test_one_point_gives_a_cost_per_tensor_unlike_points_a_cost_per_parameter_and_per_token_layer():
    assert coefficients([point()]) == (pytest.approx(0.08 / 28), 0.0, 0.0)
    # residual = 1 ms/tensor + 10 ns/param + 5 us/token-layer, on three models of 28 tensors
    pts = [EnginePoint("k", "m", 28, p, 28e-3 + 1e-8 * p + 5e-6 * tl, 0.0, tl) for p, tl in
           ((2e5, 512), (2e6, 512), (2e6, 2048))]
    a, b, c = coefficients(pts)
    assert (a, b, c) == (pytest.approx(1e-3), pytest.approx(1e-8), pytest.approx(5e-6))
    two = [point(params=p, measured=0.02 + 28e-3 + 1e-8 * p) for p in (2e5, 2e6)]  # no token-layers: none of them
    assert coefficients(two) == (pytest.approx(1e-3), pytest.approx(1e-8), 0.0)
    assert coefficients([]) == (0.0, 0.0, 0.0)
    # a larger model that cost less: no negative per-parameter cost
    a, b, c = coefficients([point(params=2e5, measured=0.2), point(params=2e6, measured=0.1)])
    assert b == 0.0 and a > 0 and c == 0.0
    assert point(measured=0.01, kernels=0.02).residual_s == 0.0  # never below zero


def test_the_term_scales_the_points_of_its_engine_and_stage_to_the_configuration():
    pts = (point(), point(key="deepspeed zero 3", measured=0.30))
    b = bench("zero=2")
    t = engine_term(b, pts)
    assert t.name == ENGINE_TERM and t.exposed and t.seconds == pytest.approx(0.08 / 28 * 52)
    assert "GPT-tiny" in t.source and "52" in t.source
    per_token = tuple(EnginePoint("deepspeed zero 2", "GPT-tiny", 28, 1.7e5, 0.02 + 0.02 + 2e-5 * tl, 0.02, tl, m)
                      for tl, m in ((512, 4), (2048, 16)))  # 20 ms + 20 us/token-layer
    p = predict_time(b, 4, cpu_rates(b, {**MEASURED, "engine": [x.to_dict() for x in per_token]}))
    assert p.term(ENGINE_TERM).seconds == pytest.approx(0.02 / 28 * 52 + 2e-5 * 4 * 256 * 4)  # at micro 4
    assert engine_size(b, 4)[2] == 4 * 256 * 4 and engine_size(b)[2] == b.batch.micro * 256 * 4
    assert engine_term(bench("zero=3"), pts).seconds == pytest.approx(0.28 / 28 * 52)
    assert engine_term(bench("zero=1"), pts) is None  # no point of its own stage
    assert engine_term(bench("zero=2", "batch.grad_accum=2"), pts).seconds == pytest.approx(2 * t.seconds)


def test_the_engine_term_replaces_the_assumed_step_overhead_where_measured():
    b = bench("zero=2")
    plain = predict_time(b, 4, cpu_rates(b, MEASURED))
    assert plain.term("step overhead").seconds == 0.01
    with_points = predict_time(b, 4, cpu_rates(b, {**MEASURED, "engine": [point().to_dict()]}))
    with pytest.raises(KeyError):
        with_points.term("step overhead")
    assert with_points.step_s == pytest.approx(plain.step_s - 0.01 + 0.08 / 28 * 52)
    other = bench("zero=1")  # its stage not measured: the assumed overhead stays
    assert predict_time(other, 4, cpu_rates(other, {**MEASURED, "engine": [point().to_dict()]})).term("step overhead")


def test_a_calibration_point_is_the_trials_time_less_its_kernel_terms():
    b = bench("zero=0", model="gpt-tiny")
    rates = cpu_rates(b, {**MEASURED, "engine": [point(key="deepspeed zero 0", measured=9.0).to_dict()]})
    p = calibration_point(b, 4, 0.05, rates)  # the rates' own points are not counted as kernels
    bare = predict_time(b, 4, cpu_rates(b, MEASURED))
    assert p.key == "deepspeed zero 0" and p.model == "GPT-tiny" and (p.tensors, p.params) == (28, 169_728.0)
    assert (p.micro, p.token_layers) == (4, 4 * 64 * 2)
    assert calibration_point(b, 16, 0.05, rates).token_layers == 16 * 64 * 2  # the micro it ran
    assert p.kernels_s == pytest.approx(bare.step_s - 0.01) and p.measured_s == 0.05
    assert EnginePoint.from_dict(p.to_dict()) == p


def test_calibrate_stores_its_launchs_point_keeps_others_and_prints_it(tmp_path):
    from zero_bench.commands.calibrate import engine_point, from_result, lines
    from zero_bench.devices import calibration
    from zero_bench.devices.calibration import cpu_key
    from zero_bench.devices.metrics import cpu_model
    from zero_bench.records import Event, RankRecord, Status, TrialResult
    from zero_bench.units import MiB

    def result(ranks):
        return TrialResult(search_key="k", trial_key="t", label="GPT-tiny", micro=4, global_batch=8,
                           status=Status.OK, ranks=ranks)

    b = bench("zero=1", model="gpt-tiny")
    stored = engine_point(b, 4, 0.06, {"memory_bytes_per_s": 2e10, "rank_rates": RANKS})
    assert stored["key"] == "deepspeed zero 1" and stored["measured_s"] == 0.06 and 0 < stored["kernels_s"] < 0.06
    ranks = [RankRecord(rank=r, event=Event.END, runtime_bytes=300 * MiB, peak_rss_bytes=480 * MiB,
                        peak_live_bytes=50 * MiB) for r in range(2)]

    def cal(points):
        return from_result(b, result(ranks), cpu_key(), cpu_model(), {}, {"bf16": 2e11},
                           {"memory_bytes_per_s": 2e10, "rank_rates": RANKS, "engine_points": points})
    calibration.save(cal([point(key="deepspeed zero 3").to_dict()]))
    path = calibration.save(cal([stored]))
    (entry,) = calibration.load().values()
    assert sorted(p["key"] for p in entry.engine_points) == ["deepspeed zero 1", "deepspeed zero 3"]
    assert any("engine beyond kernels (deepspeed zero 1)" in x for x in lines(entry, path))
    r = cpu_rates(bench("zero=1"))
    assert {p.key for p in r.engine_points} == {"deepspeed zero 1", "deepspeed zero 3"}
    assert predict_time(bench("zero=1"), 4, r).term(ENGINE_TERM).seconds > 0


def test_a_pipeline_keeps_the_assumed_overhead():
    import dataclasses

    b = bench("zero=1")
    b = dataclasses.replace(b, parallel=dataclasses.replace(b.parallel, pp=2, dp=1))
    assert engine_term(b, (point(key="deepspeed zero 1"),)) is None


# -- what tp, Ulysses and another layer cost beyond the stage's points (engine.py cause_terms) ----------

def stage(key="deepspeed zero 1"):
    """GPT-layer points of one stage whose residuals are exactly 1 ms/tensor + 10 ns/param + 5 us/token-layer."""
    return [EnginePoint(key, "GPT-tiny", 28, p, 0.02 + 28e-3 + 1e-8 * p + 5e-6 * tl, 0.02, tl, 4)
            for p, tl in ((2e5, 512), (2e6, 512), (2e6, 2048))]


def cause_point(tp=1, sp=1, arch=REFERENCE_ARCH, calls=0.0, extra=0.0, tl=1024.0, model="X"):
    """A point at tp / sp / another layer whose residual is the stage's fit at its size + `extra`."""
    base = 28e-3 + 1e-8 * 1e6 + 5e-6 * tl
    return EnginePoint("deepspeed zero 1", model, 28, 1e6, 0.02 + base + extra, 0.02, tl, 4, tp, sp, arch, calls)


def test_a_calibration_point_records_its_tp_sp_layer_and_collective_calls():
    from zero_bench.estimate.time.comm import tensor_parallel_calls, ulysses_calls

    rates = cpu_rates(bench(), MEASURED)
    tp = calibration_point(bench("parallel.tp=2", "parallel.dp=1", model="gpt-tiny"), 4, 0.1, rates)
    # megatron's sequence parallelism (on by default with tp): an all-gather and a reduce-scatter at each
    # of the 2L+1 points per pass, 2 passes
    assert (tp.tp, tp.sp, tp.arch, tp.calls) == (2, 1, REFERENCE_ARCH, 2 * (2 * 2 + 1) * 2)
    sp = calibration_point(bench("parallel.sp=2", model="llama-tiny"), 4, 0.1, rates)
    assert (sp.tp, sp.sp, sp.arch, sp.calls) == (1, 2, "rmsnorm swiglu rope sdpa", 4 * 4 * 2)  # q, k, v, out
    assert EnginePoint.from_dict(sp.to_dict()) == sp
    assert tensor_parallel_calls(bench("parallel.tp=2", "parallel.dp=1", "recompute=full")) == 2 * 9 * 3
    assert tensor_parallel_calls(bench("parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=false")) == 9 * 2
    assert ulysses_calls(bench("parallel.sp=2", "batch.grad_accum=2", model="llama-tiny")) == 16 * 2 * 2
    assert EnginePoint.from_dict({k: v for k, v in point().to_dict().items()
                                  if k not in ("tp", "sp", "arch", "calls")}).arch == ""  # stored before


def test_tp_sp_and_other_layers_points_leave_the_stages_term_alone():
    b = bench("zero=1")
    plain = engine_term(b, stage())
    more = stage() + [cause_point(tp=2, calls=10, extra=0.05), cause_point(sp=2, calls=16, extra=0.08),
                      cause_point(arch="rmsnorm swiglu rope sdpa", extra=0.03)]
    assert engine_term(b, more).seconds == pytest.approx(plain.seconds)
    assert cause_terms(b, more) == []  # gpt-mini at tp 1, sp 1: none of the causes


def test_another_layer_costs_its_excess_per_token_layer():
    llama = "rmsnorm swiglu rope sdpa"
    pts = stage() + [cause_point(arch=llama, tl=tl, extra=2e-6 * tl, model="Llama 2 layers") for tl in (512, 2048)]
    b = bench("zero=1", model="llama-tiny")
    (t,) = cause_terms(b, pts, 4)
    assert t.name == ARCH_TERM and t.exposed and "Llama 2 layers" in t.source
    assert t.seconds == pytest.approx(2e-6 * engine_size(b, 4)[2])
    assert cause_terms(bench("zero=1", "batch.grad_accum=2", model="llama-tiny"), pts, 4)[0].seconds == \
        pytest.approx(2 * t.seconds)
    # a layer cheaper than GPT's costs nothing more, never less
    cheap = stage() + [cause_point(arch=llama, extra=-0.01)]
    assert cause_terms(b, cheap, 4)[0].seconds == 0.0
    assert arch_cost(llama, stage()) is None and arch_cost(REFERENCE_ARCH, pts) is None


def test_tensor_parallel_and_ulysses_cost_their_excess_per_collective_call():
    from zero_bench.estimate.time.comm import tensor_parallel_calls, ulysses_calls

    llama = "rmsnorm swiglu rope sdpa"
    pts = stage() + [cause_point(tp=2, calls=10, extra=10 * 3e-3), cause_point(tp=2, calls=10, extra=10 * 5e-3),
                     cause_point(sp=2, calls=16, extra=16 * 1e-3)]
    tp = bench("zero=1", "parallel.tp=2", "parallel.dp=1")
    (t,) = cause_terms(tp, pts, 4)
    assert t.name == TP_TERM and t.seconds == pytest.approx(4e-3 * tensor_parallel_calls(tp))  # the mean slope
    p = predict_time(tp, 4, cpu_rates(tp, {**MEASURED, "engine": [x.to_dict() for x in pts]}))
    assert p.term(TP_TERM).seconds == pytest.approx(t.seconds)  # predict_time adds it on the step
    # llama-tiny at sp 2: its layer's cost per token-layer and Ulysses' per call, each from its own points;
    # an sp point of the llama layer pays the layer's cost before its calls are counted
    pts += [cause_point(arch=llama, tl=1024, extra=1024 * 2e-6),
            cause_point(sp=2, arch=llama, tl=512, calls=16, extra=512 * 2e-6 + 16 * 1e-3)]
    sp = bench("zero=1", "parallel.sp=2", model="llama-tiny")
    terms = {t.name: t.seconds for t in cause_terms(sp, pts, 4)}
    assert terms == {ARCH_TERM: pytest.approx(2e-6 * engine_size(sp, 4)[2]),
                     ULYSSES_TERM: pytest.approx(1e-3 * ulysses_calls(sp))}
    # without the stage's GPT points nothing can be subtracted: no per-call cost
    assert call_cost("tp", [x for x in pts if x.tp > 1]) is None


def test_no_cause_terms_without_the_stages_engine_term():
    tp = bench("zero=1", "parallel.tp=2", "parallel.dp=1")
    pts = [x.to_dict() for x in stage("deepspeed zero 2") + [cause_point(tp=2, calls=10, extra=0.05)]]
    p = predict_time(tp, 4, cpu_rates(tp, {**MEASURED, "engine": pts}))  # zero 1 has no stage points
    assert p.term("step overhead") and not any(t.name == TP_TERM for t in p.terms)


def test_a_stored_point_at_tp_2_keeps_the_stages_point_of_the_same_model():
    from zero_bench.devices.calibration import merged_points

    stage_pt, tp_pt = point(key="deepspeed zero 1").to_dict(), cause_point(tp=2, calls=20, model="GPT-tiny").to_dict()
    assert merged_points([stage_pt], [tp_pt]) == [stage_pt, tp_pt]
    assert merged_points([stage_pt, tp_pt], [dict(tp_pt, measured_s=1.0)]) == [stage_pt, dict(tp_pt, measured_s=1.0)]


def test_a_grad_accum_point_measures_which_share_of_the_per_parameter_time_each_micro_step_repeats():
    # the stage (1 ms/tensor + 10 ns/param + 5 us/token-layer) and a point of it at grad_accum 2 whose
    # residual repeats the token-layers' time and a quarter of the per-tensor and per-parameter time
    once, tl = 28e-3 + 1e-8 * 2e6, 512
    ga2 = EnginePoint("deepspeed zero 1", "GPT-tiny", 28, 2e6, 0.02 + 2 * 5e-6 * tl + 1.25 * once, 0.02, tl, 4,
                      grad_accum=2)
    pts = stage() + [ga2]
    b = bench("zero=1", "batch.grad_accum=3")
    tensors, params, token_layers = engine_size(b, 4)
    per_param = 1e-3 * tensors + 1e-8 * params
    t = engine_term(b, pts, 4)
    assert t.seconds == pytest.approx((1 + 0.25 * 2) * per_param + 3 * 5e-6 * token_layers)
    assert "0.25" in t.source
    # the grad_accum point is not one of the stage's own: grad_accum 1 is fitted as before
    assert engine_term(bench("zero=1"), pts, 4).seconds == pytest.approx(engine_term(bench("zero=1"), stage(), 4).seconds)
    # without such a point every micro-step repeats all of it
    assert engine_term(b, stage(), 4).seconds == pytest.approx(3 * (per_param + 5e-6 * token_layers))
    assert EnginePoint.from_dict(ga2.to_dict()) == ga2


def test_tp_points_of_two_depths_separate_a_cost_per_call_from_one_per_micro_step():
    # gpt-tiny at tp=2 with 2 layers (20 calls) and 4 layers (36 calls): the same excess at both depths
    # is no per-call cost but one per micro-step (the vocab-parallel cross-entropy's all-reduces)
    pts = stage() + [cause_point(tp=2, calls=20, extra=0.05), cause_point(tp=2, calls=36, extra=0.05)]
    tp = bench("zero=1", "parallel.tp=2", "parallel.dp=1")
    (t,) = cause_terms(tp, pts, 4)
    assert t.name == TP_TERM and t.seconds == pytest.approx(0.05)
    assert cause_terms(bench("zero=1", "parallel.tp=2", "parallel.dp=1", "batch.grad_accum=2"), pts, 4)[0].seconds \
        == pytest.approx(0.10)
    # an excess that grows with the calls is a cost per call (2 ms), with 10 ms a micro-step beside it
    pts = stage() + [cause_point(tp=2, calls=c, extra=0.01 + 2e-3 * c) for c in (20, 36)]
    from zero_bench.estimate.time.comm import tensor_parallel_calls
    assert cause_terms(tp, pts, 4)[0].seconds == pytest.approx(0.01 + 2e-3 * tensor_parallel_calls(tp))
