"""`zero_bench estimate` answers the setup asked (issue 35 item 4): the peak per rank at the configured
batch.micro, printed and in the JSON, equals Estimate's arithmetic (Estimate.at_micro), and "fits"
flips exactly past max micro. No launch."""
from __future__ import annotations

import json

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.estimate import GiB, estimate
from zero_bench.estimate.table import estimate_report

ALL = ["model=llama3-8b", "parallel=dp8", "hardware=h100_80gb", "recompute=full"]
GPU = [*ALL, "zero=3"]
CPU = ["model=gpt-mini", "hardware=cpu", "zero=2"]


@pytest.fixture(autouse=True)
def no_calibration(tmp_path, monkeypatch):
    """The published / built-in fixed terms, whatever this machine's cache holds."""
    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path))


def _est(overrides):
    return estimate(from_cfg(compose(overrides), here=False))


def _doc(overrides, explicit=frozenset({"zero"})) -> dict:
    return json.loads(estimate_report(compose([*overrides, "json=true"]), explicit))


def _line(text: str, config: str) -> list[str]:
    """The row of `config` in the table under "peak per rank at batch.micro=..."."""
    below = text[text.index("peak per rank at batch.micro="):].splitlines()
    return next(line.split() for line in below[2:] if line.split() and line.split()[0] == config)


def test_gpu_json_and_table_at_micro_2_are_the_estimates_arithmetic():
    e = _est([*GPU, "batch.micro=2"])
    alloc = e.allocated_bytes(2)
    doc = _doc([*GPU, "batch.micro=2"])
    (c,) = doc["configs"]
    assert doc["micro"] == 2 and c["config"] == "zero3"
    assert c["at_micro"] == {"micro": 2, "allocated_bytes": alloc, "reserved_bytes": int(e.fragmentation * alloc),
                             "device_peak_bytes": e.peak_bytes(2), "capacity_bytes": e.capacity, "fits": True}
    assert e.fragmentation > 1 and c["at_micro"]["device_peak_bytes"] == e.overhead + c["at_micro"]["reserved_bytes"]
    assert c["peak_micro1"] == e.peak_bytes(1) < e.peak_bytes(2)  # the micro-1 column is kept as it was
    text = estimate_report(compose([*GPU, "batch.micro=2"]), frozenset({"zero"}))
    assert "micro 2 x grad_accum 1" in text.splitlines()[0]
    assert "allocated GiB reserved GiB device peak GiB fits" in text
    figures = [f"{b / GiB:.2f}" for b in (alloc, int(e.fragmentation * alloc), e.peak_bytes(2))]
    assert _line(text, "zero3") == ["zero3", *figures, "yes"]


def test_cpu_json_and_table_at_micro_2_are_live_tensors_and_rss():
    e = _est([*CPU, "batch.micro=2"])
    (c,) = _doc([*CPU, "batch.micro=2"])["configs"]
    assert c["at_micro"] == {"micro": 2, "live_tensors_bytes": e.allocated_bytes(2), "peak_rss_bytes": e.peak_bytes(2),
                             "capacity_bytes": e.capacity, "fits": e.peak_bytes(2) <= e.capacity}
    assert c["at_micro"]["peak_rss_bytes"] == e.overhead + e.allocated_bytes(2)  # no fragmentation on CPU
    text = estimate_report(compose([*CPU, "batch.micro=2"]), frozenset({"zero"}))
    assert "live tensors GiB peak RSS GiB fits" in text and "reserved" not in text.split("peak per rank at")[1]
    assert _line(text, "zero2")[1:3] == [f"{e.allocated_bytes(2) / GiB:.2f}", f"{e.peak_bytes(2) / GiB:.2f}"]


@pytest.mark.parametrize("overrides", [GPU, CPU, [*CPU, "hardware.memory_gb=2"]], ids=["gpu", "cpu", "cpu-2gb"])
def test_fits_flips_exactly_past_max_micro(overrides):
    e = _est(overrides)
    m = e.max_micro()
    assert m and m >= 1
    assert [e.at_micro(k)["fits"] for k in range(1, m + 3)] == [True] * m + [False] * 2
    for micro, said in ((m, "yes"), (m + 1, "no")):
        assert _doc([*overrides, f"batch.micro={micro}"])["configs"][0]["at_micro"]["fits"] is (said == "yes")
        text = estimate_report(compose([*overrides, f"batch.micro={micro}"]), frozenset({"zero"}))
        assert _line(text, _doc(overrides)["configs"][0]["config"])[-1] == said


def test_every_stage_gets_its_line_and_grad_accum_changes_nothing():
    one = _doc([*ALL, "batch.micro=3"], frozenset())
    four = _doc([*ALL, "batch.micro=3", "batch.grad_accum=4"], frozenset())
    assert four["grad_accum"] == 4 and len(one["configs"]) == 7
    assert [c["at_micro"] for c in one["configs"]] == [c["at_micro"] for c in four["configs"]]
    text = estimate_report(compose([*ALL, "batch.micro=3"]), frozenset())
    assert all(_line(text, c["config"]) for c in one["configs"])
    assert "grad_accum" in text.split("peak per rank at")[1]


def test_fsdp2_holds_the_sharded_gradients_through_the_next_micro_batch():
    """FSDP2 accumulates each micro-batch's reduce-scattered gradients into the sharded ones
    (torch's _fsdp_collectives.py foreach_reduce), so with grad_accum > 1 the last micro-batch's
    forward and backward hold all of them: the peak at micro rises by at most the sharded gradients
    (the layer phases held those of the layers above already), and the table says why."""
    fsdp2 = [*ALL, "engine=fsdp2", "zero=3", "batch.micro=2"]
    one, two = _est(fsdp2), _est([*fsdp2, "batch.grad_accum=2"])
    assert one.states == two.states
    assert one.allocated_bytes(2) < two.allocated_bytes(2) <= one.allocated_bytes(2) + two.states.grads
    text = estimate_report(compose([*fsdp2, "batch.grad_accum=2"]), frozenset({"zero"}))
    assert "(grad_accum 2: the sharded gradients of the micro-batches before held)" in text
    assert "FSDP2 holds the sharded gradients" in text


def test_without_a_capacity_fits_is_unknown():
    e = _est(CPU)
    e.capacity = None
    assert e.at_micro(2)["fits"] is None and e.at_micro(2)["capacity_bytes"] is None
