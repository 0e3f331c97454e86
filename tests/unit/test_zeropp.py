"""ZeRO++ as a dimension (issue 46 item 2): zeropp.qwz / qgz / hpz as DeepSpeed's ZeRO-3 keys, the
bad input refused in one line before any launch, qwZ / qgZ refused on CPU (DeepSpeed's CPU
accelerator has no quantizer kernel) and estimated, the label. The hpZ trials on CPU:
tests/integration/test_fsdp2_trials.py (beside the ZeRO-3 run they are compared with)."""
from __future__ import annotations

import dataclasses

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.schema import BenchConfig, ConfigError, ZeroppConfig
from zero_bench.engines import ds_config
from zero_bench.estimate import estimate
from zero_bench.estimate import zeropp as zpp
from zero_bench.estimate.prediction import Phase
from zero_bench.search.preflight import skipped_search, validate_machine
from zero_bench.units import BYTES


def bench(*overrides: str, here: bool = False) -> BenchConfig:
    return from_cfg(compose(["hardware=cpu", "precision=fp32", "model=llama-tiny", *overrides]), here=here)


def test_the_keys_are_deepspeeds_zero3_keys_and_deepspeed_accepts_them():
    b = bench("zero=3", "zeropp.qwz=true", "zeropp.qgz=true", "zeropp.hpz=2")
    zero = ds_config.build(b)["zero_optimization"]
    assert (zero["zero_quantized_weights"], zero["zero_quantized_gradients"], zero["zero_hpz_partition_size"]) == \
        (True, True, 2)
    ds = ds_config.build(b)
    ds["train_batch_size"] = ds["train_micro_batch_size_per_gpu"]
    parsed = DeepSpeedConfig(ds).zero_config
    assert (parsed.zero_quantized_weights, parsed.zero_quantized_gradients, parsed.zero_hpz_partition_size) == \
        (True, True, 2)


def test_without_zeropp_the_json_and_the_keys_are_what_they_were():
    plain, off = bench("zero=3"), bench("zero=3", "zeropp.hpz=1", "zeropp.qwz=false")
    assert ds_config.build(plain) == ds_config.build(off)
    assert not any(k.startswith(("zero_quantized", "zero_hpz")) for k in ds_config.build(plain)["zero_optimization"])
    assert "zeropp" not in plain._key_dict() and plain.search_key() == off.search_key()
    hpz = bench("zero=3", "zeropp.hpz=2")
    assert hpz.search_key() != plain.search_key() and hpz.trial_key() != plain.trial_key()


def test_the_label_names_the_settings():
    assert bench("zero=3", "zeropp.qwz=true", "zeropp.hpz=2").label().endswith(" zero3 fp32 zeropp=qwz+hpz2")
    assert "zeropp" not in bench("zero=3").label()
    entry = {"model": {"name": "Llama-tiny"}, "parallel": {"tp": 1, "dp": 2}, "zero": 2, "offload": False,
             "precision": "fp32", "batch": {}, "zeropp": {"hpz": 2}}
    assert skipped_search(entry, "why").label.endswith("zero2 fp32 zeropp=hpz2")


@pytest.mark.parametrize("overrides, line", [
    (["zero=2", "zeropp.qwz=true"], "zeropp.qwz=true: ZeRO++ is DeepSpeed's ZeRO-3 (got zero=2); allowed: zero=3"),
    (["zero=1", "zeropp.hpz=2"], "zeropp.hpz=2: ZeRO++ is DeepSpeed's ZeRO-3 (got zero=1)"),
    (["engine=fsdp2", "zero=3", "zeropp.qgz=true"], "zeropp.qgz=true: ZeRO++ is DeepSpeed's"),
    (["zero=3", "zeropp.hpz=4"], "zeropp.hpz=4: must divide the ranks per node (2: hpZ's second copy is sharded "
                                 "within a node); allowed: 1, 2"),
    (["zero=3", "parallel=dp4", "zeropp.hpz=3"], "zeropp.hpz=3: must divide the ranks per node (4"),
    (["zero=3", "parallel.tp=2", "parallel.dp=2", "zeropp.hpz=2"], "zeropp.hpz=2: DeepSpeed groups hpZ's ranks"),
    (["zero=3", "parallel.tp=2", "parallel.dp=2", "zeropp.qgz=true"], "zeropp.qgz=true: DeepSpeed builds qgZ's "
                                                                       "all-to-all groups from world ranks per node"),
    (["zero=3", "zeropp.hpz=0"], "zeropp.hpz=0: must be an integer >= 1"),
    (["zero=3", "zeropp.hpz=two"], "zeropp.hpz=two: must be an integer"),
    (["zero=3", "zeropp.foo=1"], "zeropp.foo"),
])
def test_bad_input_is_one_line_naming_the_key(overrides, line):
    with pytest.raises(ConfigError) as e:
        bench(*overrides)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_hpz_over_the_ranks_of_a_node_is_accepted():
    assert bench("zero=3", "parallel=dp4", "zeropp.hpz=2").zeropp.hpz == 2
    assert bench("zero=3", "parallel=dp4", "zeropp.hpz=4").zeropp.hpz == 4


@pytest.mark.parametrize("key", ["qwz", "qgz"])
def test_quantized_collectives_are_refused_on_cpu_before_any_launch_and_hpz_is_not(key):
    """Asked of DeepSpeed's CPU accelerator itself: its QuantizerBuilder is NotImplementedBuilder."""
    with pytest.raises(ConfigError) as e:
        validate_machine(bench("zero=3", f"zeropp.{key}=true", here=True))
    msg = str(e.value)
    assert msg.startswith(f"zeropp.{key}=true: DeepSpeed's CPU accelerator has no quantizer kernel") and "\n" not in msg
    validate_machine(bench("zero=3", "zeropp.hpz=2", here=True))  # hpZ runs on CPU


def test_the_estimate_counts_hpzs_second_partition_after_the_activations_peak():
    plain, hpz = bench("zero=3"), bench("zero=3", "zeropp.hpz=2")
    e0, e = estimate(plain), estimate(hpz)
    thr = ds_config.build(hpz)["zero_optimization"]["stage3_param_persistence_threshold"]
    want = BYTES["fp32"] * sum(-(-p.numel // 2) * 2 // 2 for p in hpz.layout.params if p.numel > thr)
    got = e.prediction.buffer("hpz_secondary")
    assert (got.bytes, got.phases) == (want, (Phase.bwd_end, Phase.step))
    assert e.phase_bytes(Phase.step) == e0.phase_bytes(Phase.step) + want and e.phase_bytes(Phase.act) == e0.phase_bytes(Phase.act)
    # zero.Init gives every parameter, persistent ones too, a copy as it partitions it
    assert e.prediction.init_peak == e0.prediction.init_peak + BYTES["fp32"] * sum(-(-p.numel // 2) for p in hpz.layout.params)
    assert e.row()["config"] == "zero3 zeropp=hpz2"


def test_qwz_and_qgz_are_estimated_where_they_live():
    gpu = ["hardware=h100_80gb", "precision=bf16", "parallel=dp8", "zero=3"]
    one = estimate(bench(*gpu, "zeropp.qwz=true", "zeropp.qgz=true"))
    assert one.prediction.buffer("qwz_int8_gather").phases == (Phase.act,)
    live = one.prediction.buffer("live_params").bytes // BYTES["bf16"]
    assert live < one.prediction.buffer("qwz_int8_gather").bytes < live * 1.01  # int8 + an fp32 scale per group
    assert "qgz_int4_reduce" not in one.prediction.buffers_detail()  # one node: DeepSpeed reduce-scatters as ZeRO-3
    two = estimate(bench(*gpu, "hardware.num_nodes=2", "zeropp.qgz=true"))
    assert two.prediction.buffer("qgz_int4_reduce").bytes > 0


def test_the_communication_is_the_papers_ratio():
    nodes = ["hardware=h100_80gb", "precision=bf16", "parallel=dp8", "zero=3", "hardware.num_nodes=2"]
    every = zpp.communication(bench(*nodes, "zeropp.qwz=true", "zeropp.qgz=true", "zeropp.hpz=4"))
    assert (every["total_M"], every["vs_zero3"]) == (0.75, 0.25)  # the paper's 3M -> 0.75M, "4x less"
    assert zpp.communication(bench(*nodes, "zeropp.hpz=4"))["total_M"] == 2.0
    assert zpp.communication(bench(*nodes, "zeropp.qwz=true"))["total_M"] == 2.0  # both gathers int8
    assert zpp.communication(bench(*nodes[:-1], "zeropp.qgz=true"))["total_M"] == 3.0  # one node: none
    assert "arXiv:2306.10209" in every["source"]


def test_the_zeropp_section_is_a_dataclass_with_a_docstring_per_field():
    from zero_bench.config.configure import field_docs

    docs = field_docs(ZeroppConfig)
    assert {f.name for f in dataclasses.fields(ZeroppConfig)} == set(docs) and all(docs.values())


def test_the_report_tells_zeropp_rows_apart():
    """A stored config's ZeRO++ is its own column (and part of what Compare matches), "none" for
    records stored before it; the recommendation's names say it where it varies."""
    import pandas as pd

    from zero_bench.report.recommend import config_names
    from zero_bench.config.stored import stored_config
    from zero_bench.report.tables import CONFIG_KEY, zeropp_text

    stored = bench("zero=3", "zeropp.qwz=true", "zeropp.hpz=2").to_dict()
    assert zeropp_text(stored_config(stored)) == "qwz+hpz2" and "ZeRO++" in CONFIG_KEY
    old = {k: v for k, v in bench("zero=3").to_dict().items() if k != "zeropp"}
    assert zeropp_text(stored_config(old)) == "none"
    g = pd.DataFrame([{"ZeRO Stage": 3, "ZeRO++": "none", "config": "a"}, {"ZeRO Stage": 3, "ZeRO++": "hpz2", "config": "b"}])
    assert list(config_names(g).values()) == ["ZeRO-3", "ZeRO-3 + ZeRO++ hpz2"]
