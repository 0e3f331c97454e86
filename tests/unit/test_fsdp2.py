"""engine=fsdp2 without launching anything: its refusals, how it enters the label and the keys, and
its estimate against what issue 29's prototype measured on CPU (2 ranks, gloo, torch 2.13)."""
from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import CONF_DIR, ConfigError
from zero_bench.estimate import estimate
from zero_bench.estimate.fsdp2 import groups, layer_phases, model_states
from zero_bench.search.preflight import skipped_search
from zero_bench.search.sweeps import sweep_size

from conftest import cpu_cfg, model
from measured import llama_tiny_peaks, prototype_peaks
from zero_bench.models.params import num_params


def bench(*overrides: str):
    return from_cfg(compose(["hardware=cpu", *overrides]))


@pytest.mark.parametrize("overrides, message", [
    (["zero=1"], "zero=1: engine=fsdp2 always shards parameters; allowed with fsdp2: zero=2"),
    (["zero=0"], "engine=deepspeed for zero=0/1"),
    (["precision=fp16"], "precision=fp16: engine=fsdp2 has no dynamic loss scaling wired in"),
    (["zero=3", "offload=true", "offload_param=false"], "offload_param=false: engine=fsdp2 offloads parameters, "
                                                        "gradients and optimizer states together"),
    (["ds_preset=megatron_deepspeed"], "ds_preset=megatron_deepspeed: DeepSpeed settings; engine=fsdp2 reads no"),
    (["+ds.zero_optimization.reduce_bucket_size=5"], "ds: DeepSpeed settings; engine=fsdp2"),
])
def test_what_fsdp2_cannot_run_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        bench("engine=fsdp2", *overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_engine_choices():
    with pytest.raises(ConfigError, match="^engine=fsdp1: allowed values are deepspeed, fsdp2$"):
        bench("engine=fsdp1")


def test_what_fsdp2_runs():
    for ov in (("zero=2",), ("zero=3",), ("zero=3", "offload=true"), ("zero=2", "offload=true"),
               ("precision=bf16",), ("recompute=full",), ("recompute=selective",), ("parallel=tp2",)):
        b = bench("engine=fsdp2", *ov)
        assert b.engine == "fsdp2"
        assert b.offload_param == b.offload  # CPUOffloadPolicy moves the parameters with the optimizer states


def test_engine_is_in_the_label_and_keys_and_deepspeed_keys_did_not_move():
    ds, fs = bench("zero=3", "precision=fp32"), bench("zero=3", "precision=fp32", "engine=fsdp2")
    assert ds.label() == "GPT-mini tp1 dp2 zero3 fp32" and fs.label() == "GPT-mini tp1 dp2 zero3 fp32 fsdp2"
    assert ds.search_key() != fs.search_key() and ds.trial_key() != fs.trial_key()
    # a store written before `engine` existed resumes: DeepSpeed's keys hash what they hashed then
    assert "engine" not in ds._key_dict() and fs._key_dict()["engine"] == "fsdp2"
    assert fs.search_key() == fs.with_micro(9).search_key()


def test_engine_sweeps_and_skipped_entries_stay_apart():
    assert sweep_size(["engine=deepspeed,fsdp2", "zero=3"]) == 2
    c = bench("zero=3", "precision=fp32").to_dict()
    a, b = skipped_search(c, "why"), skipped_search({**c, "engine": "fsdp2"}, "why")
    assert a.search_key != b.search_key and b.label.endswith("fp32 fsdp2")
    assert a.search_key == skipped_search({k: v for k, v in c.items() if k != "engine"}, "why").search_key


# -- the estimate against the prototype's CPU measurements ------------------------------------------

# Rank 0's exact counts (engines/fsdp2.count_states, taken at the step): params or master, AdamW's
# state, sharded gradients (/work/proto/fsdp2/results.jsonl; both ranks equal).
MEASURED_STATES = {"gpt-tiny": (339_456, 679_024, 339_456), "gpt-mini": (10_644_480, 21_289_168, 10_644_480),
                   "gpt-small": (138_771_456, 277_543_312, 138_771_456)}


@pytest.mark.parametrize("name", list(MEASURED_STATES))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_states_are_the_measured_bytes(name, precision):
    held, optimizer, grads = MEASURED_STATES[name]
    for rank in (0, 1):
        s = model_states(RankLayout(dp=2, model=model(name)), precision=precision, rank=rank)
        assert (s.params + s.master, s.moments, s.grads) == (held, optimizer, grads)
        assert (s.params == 0) == (precision == "bf16")  # no 16-bit copy persists
    e = estimate(cpu_cfg(name, engine="fsdp2", zero=3, precision=precision))
    assert e.persistent == held + optimizer  # 12P/dp between steps
    assert e.states_on_rank == held + optimizer + grads  # 16P/dp at the step


def test_shards_are_padded_to_whole_rows_and_offload_moves_them_all():
    m = dataclasses.replace(model("gpt-tiny"), seq_len=7)  # the position table's 7 rows do not split evenly
    two = RankLayout(dp=2, model=m)
    r0, r1 = (model_states(two, rank=r) for r in (0, 1))
    assert r0.grads == r1.grads  # padded to ceil(7/2) rows on both
    assert r0.moments - r1.moments == 8 * m.hidden_size  # AdamW's state covers the real rows only
    off = model_states(two, offload=True)
    assert off.device == 0 and off.host == r0.device


PRESETS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem != "hf")


@pytest.mark.parametrize("name", PRESETS)
def test_every_family_is_estimated_from_the_one_parameter_list(name):
    """`estimate engine=fsdp2` used to exit with a traceback on every non-GPT preset: its shapes
    were a second copy of GPT's. Now they are models/params.py's: each layer its own group, the
    rest in the root, and the states at dp 8 are 16 bytes per parameter over 8 (+ padding)."""
    m = model(name)
    g = groups(RankLayout(model=m))
    assert list(g) == ["root"] + [f"layer{i}" for i in range(m.num_layers)]
    assert sum(p.numel for ps in g.values() for p in ps) == num_params(m)
    e = estimate(from_cfg(compose([f"model={name}", "engine=fsdp2", "zero=3", "parallel=dp8", "hardware=h100_80gb"]), here=False))
    assert e.states_on_rank == pytest.approx(16 * num_params(m) / 8, rel=0.002)
    assert e.peak_bytes(1) > e.states_on_rank


def test_untied_models_hold_the_output_layers_gradient_not_the_embeddings():
    """FSDP2 reduce-scatters the root's gradients after the whole backward: the output layer's
    unsharded gradient is held through it; an untied model's word embedding gets its own only at
    the end. llama-tiny: V x h = 1024 x 256, plus the final RMSNorm's 256."""
    e = estimate(cpu_cfg("llama-tiny", engine="fsdp2", zero=3))
    assert e.prediction.buffer("root_grads").bytes == 4 * (1024 * 256 + 256)
    tied = estimate(cpu_cfg("gpt-tiny", engine="fsdp2", zero=3))
    assert tied.prediction.buffer("root_grads").bytes == 4 * (1024 * 64 + 2 * 64)  # word embedding + LayerNorm


# Peak live tensor bytes of the profiled step (MiB, rank 0), measured by issue 29's prototype's harness
# (the worker's profiled_step), stored with where and how in tests/data/measured/fsdp2_live_peaks.json:
# (model, precision, zero, micro) -> MiB.
MEASURED_PEAK_MIB = prototype_peaks()


# GPT-tiny's and GPT-mini's peaks are the end of the forward (bf16: the 16-bit logits beside
# megatron's fp32 softmax, the last layer's all-gather output not yet freed) or the output layer's
# backward (fp32): the formula's phases hold them to the rounding of the figures (0.01 MiB of 2.93).
# GPT-small's at micro 2 fall in a layer's backward or at its end, where the formula leaves out the
# gradients inside the layer (-4.0 % at worst: bf16 zero=2 micro 2). Before the phases followed
# the step (issue 51): fp32 -5.5 % to -0.1 %, bf16 -2.5 % to +12.6 % (6 % and 13 % allowed).
PEAK_TOL = {"gpt-tiny": 0.005, "gpt-mini": 0.005, "gpt-small": 0.045}


@pytest.mark.parametrize("key", list(MEASURED_PEAK_MIB))
def test_peak_model_reproduces_the_measured_live_peaks(key):
    name, precision, zero, micro = key
    e = estimate(cpu_cfg(name, engine="fsdp2", zero=zero, precision=precision))
    live = (e.peak_bytes(micro) - e.overhead) / 2**20
    assert live == pytest.approx(MEASURED_PEAK_MIB[key], rel=PEAK_TOL[name])


# llama-tiny at micro 2, FSDP2, rank 0's live peak of the worker's profiled step (MiB), measured in real
# 2-rank trials (gloo, run_launch probes at micro 2 and 4, children of one pool) on this machine
# (2-core AMD EPYC, torch 2.13.0+cpu) on 2026-11-28: overrides -> MiB. Rank 1 differed in three:
# recompute=full 48.67, grad_accum 2 zero=3 84.98 and zero=2 89.63, bf16 loss=chunked 54.13.
# llama-tiny's peaks (rank 0, micro 2) from real 2-rank trials, stored with where and how in
# tests/data/measured/fsdp2_live_peaks.json; a configuration run twice is kept twice.
LLAMA_TINY = llama_tiny_peaks()


@pytest.mark.parametrize("peak", LLAMA_TINY, ids=lambda p: " ".join(p.overrides) + f" ({p.mib:.2f} MiB)")
def test_the_formula_meets_llama_tinys_measured_peaks(peak):
    """Within 4 % (grad_accum 2: -3.5 %, the rest -2.1 % to +0.4 %); recompute=full 5.5 % (its two
    runs, 48.67 and 51.36 MiB, differ by one fp32 layer, 2.69 MiB, gloo's second all-gather buffer
    while a rebuilt layer is gathered again, not a tensor the formula names: +0.2 % / -5.1 %).
    Before issue 51 the formula was -11 % / -12 % with grad_accum 2 (the first micro-batch's sharded
    gradients), +19 % with recompute=block (a rebuilt layer at every phase), +7.5 % with loss=chunked
    (the whole logits beside the chunk)."""
    assert peak.micro == 2
    e = estimate(from_cfg(compose(["hardware=cpu", "model=llama-tiny", "engine=fsdp2", *peak.overrides])))
    tol = 0.055 if "recompute=full" in peak.overrides else 0.04
    assert e.allocated_bytes(2) / 2**20 == pytest.approx(peak.mib, rel=tol)


def test_peak_phases_and_max_micro():
    assert layer_phases(1) == {} and layer_phases(2) == {"layer_last": 1}
    assert layer_phases(12) == {"layer_last": 11, "layer_next": 10, "layer_first": 1}
    # recompute=block of 4: where the rebuilt layers end and the whole ones begin
    assert layer_phases(12, 4) == {"layer_last": 11, "layer_next": 10, "layer_first": 1,
                                   "layer_recomputed_top": 3, "layer_kept_lowest": 4}
    assert layer_phases(4, 2) == {"layer_last": 3, "layer_next": 2, "layer_first": 1}  # 1 and 2 kept already
    # recompute=full, 3 layers per checkpoint: the top checkpoint's lowest layer, the lowest one's top
    assert layer_phases(12, 0, 3) == {"layer_last": 11, "layer_next": 10, "layer_first": 1,
                                      "layer_chunk_lowest": 9, "layer_first_chunk_top": 2}
    z3, z2 = (estimate(cpu_cfg("gpt-small", engine="fsdp2", zero=z)) for z in (3, 2))
    # zero=2 holds every layer gathered at the end of forward: more memory, same states
    assert z2.peak_bytes(2) > z3.peak_bytes(2) and z2.persistent == z3.persistent
    for e in (z2, z3):
        cap = e.peak_bytes(5) + 1
        assert e.max_micro(cap) == 5 and e.peak_bytes(6) > cap
    # the activations of the layer phases grow by fewer layers than backward_start's
    assert z3.per_sample("layer_first") < z3.per_sample("backward_start") == z3.act_per_sample
    full = estimate(cpu_cfg("gpt-small", engine="fsdp2", zero=3, recompute="full"))
    assert full.act_per_sample < z3.act_per_sample and full.persistent == z3.persistent


def test_fsdp2_states_below_zero3_in_fp32():
    """DeepSpeed's ZeRO-3 clones an fp32 master even for fp32 parameters (20P/dp at the step);
    FSDP2's optimizer updates its fp32 shards in place (16P/dp)."""
    ds = estimate(cpu_cfg("gpt-small", zero=3))
    fs = estimate(cpu_cfg("gpt-small", zero=3, engine="fsdp2"))
    assert fs.states_on_rank == pytest.approx(ds.states_on_rank * 16 / 20, rel=0.001)
    assert fs.row()["config"] == "fsdp2 zero3" and ds.row()["config"] == "zero3"


# -- the report --------------------------------------------------------------------------------------

def test_report_shows_the_engine_and_what_changing_it_buys(tmp_path, monkeypatch):
    from zero_bench import report
    from zero_bench.config.schema import ReportConfig
    from zero_bench.records import SearchResult
    from zero_bench.store import Store

    from synthetic import GPT345, measured

    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path / "cache"))
    store = Store(tmp_path / "s.sqlite")
    zero3 = dataclasses.replace(GPT345, zero=3)
    for cfg, micro, step_s, used in ((zero3, 32, 1.9, 30000), (dataclasses.replace(zero3, engine="fsdp2"), 48, 2.6,
                                                                   31000)):
        t = measured(cfg, micro, step_s, [used] * 8)
        store.put_search(SearchResult(search_key=cfg.search_key(), label=cfg.label(), status="done", max_micro=micro,
                                      max_global_batch=t.global_batch, config=cfg.to_dict(), measure=t))
    xlsx, csv, md, *_ = report.write_reports(ReportConfig(runs=store.path, out=tmp_path / "r.xlsx"))
    details = pd.read_csv(csv)
    assert sorted(details["engine"]) == ["deepspeed", "fsdp2"]
    assert details.loc[details["engine"] == "fsdp2", "config"].item() == "GPT-345M tp1 dp8 zero3 bf16 fsdp2"
    buys = pd.read_excel(xlsx, sheet_name="What each optimization buys")
    assert list(buys["change"]) == ["baseline", "engine: deepspeed -> fsdp2"]
    assert buys["max batch Δ %"].iloc[1] == pytest.approx(50)
    text = md.read_text()
    assert "| engine | ZeRO Stage |" in text and "ZeRO-3 on FSDP2 fits 384 samples" in text


# -- the engine's process group -------------------------------------------------------------------------

@pytest.mark.parametrize("device, offload, backend", [("cpu", False, "gloo"), ("cpu", True, "gloo"),
                                                      ("gpu", False, "nccl"), ("gpu", True, "cpu:gloo,cuda:nccl")])
def test_fsdp2_process_group_backend(monkeypatch, device, offload, backend):
    """Not DeepSpeed's init_distributed (its CPU shm op is JIT-built and unused by FSDP2); on GPU the
    device is set first, and offload adds gloo for the gradient norm of host-resident shards."""
    import deepspeed
    import torch

    from zero_bench.engines.base import init_distributed

    calls = {}
    monkeypatch.setattr(deepspeed, "init_distributed", lambda *a, **k: calls.setdefault("deepspeed", True))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda b: calls.setdefault("backend", b))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("device", d))
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = cpu_cfg(engine="fsdp2", zero=3, offload=offload, offload_param=offload)
    init_distributed(cfg, on_cpu=device == "cpu")
    assert calls.get("backend") == backend and "deepspeed" not in calls
    assert calls.get("device") == (1 if device == "gpu" else None)
    calls.clear()
    init_distributed(cpu_cfg(zero=3), on_cpu=True)
    assert calls == {"deepspeed": True}


@pytest.mark.parametrize("overrides, message", [
    (["engine=fsdp2", "parallel.dp=4", "parallel.dp_shard=3"], "parallel.dp_shard=3: must divide parallel.dp=4"),
    (["parallel.dp=4", "parallel.dp_shard=2"], "parallel.dp_shard=2: hybrid sharding runs with engine=fsdp2"),
    # one group of all dp ranks: DeepSpeed trained as if the key were absent
    (["engine=deepspeed", "parallel.dp=2", "parallel.dp_shard=2"], "parallel.dp_shard=2: hybrid sharding runs with "
                                                                   "engine=fsdp2"),
    (["engine=fsdp2", "parallel=tp2dp2", "parallel.dp_shard=1"], "parallel.dp_shard=1: hybrid sharding is modelled "
                                                                   "at parallel.tp=1"),
])
def test_hybrid_sharding_refusals(overrides, message):
    with pytest.raises(ConfigError) as err:
        bench(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_hybrid_sharding_keys_labels_and_states():
    plain, hybrid = bench("engine=fsdp2", "parallel.dp=4"), bench("engine=fsdp2", "parallel.dp=4", "parallel.dp_shard=2")
    assert "dp_shard" not in plain._key_dict()["parallel"] and hybrid._key_dict()["parallel"]["dp_shard"] == 2
    assert hybrid.label().endswith("fsdp2 dp_shard=2") and "dp_shard" not in plain.label()
    assert estimate(hybrid).states.params == 2 * estimate(plain).states.params
    same = bench("engine=fsdp2", "parallel.dp=4", "parallel.dp_shard=4")  # one group: plain FSDP2
    assert estimate(same).states == estimate(plain).states
