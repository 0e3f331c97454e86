"""Pipeline parallelism in the estimate (issue 53 items 3-5): each stage's parameters and activations
(config/layout.py RankLayout.at_stage, estimate/pipeline.py), the micro-batches in flight per
schedule, the peak stage named, the time's bubble and sends (estimate/time/pipeline.py), labels and
keys; `zero_bench estimate` answers for a 70B on 32 H100s with pp 4 though no pipeline trial runs yet."""
from __future__ import annotations

import dataclasses
import json

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import ConfigError
from zero_bench.estimate import estimate
from zero_bench.estimate.pipeline import in_flight, later_in_flight, stage_bench
from zero_bench.estimate.table import estimate_report
from zero_bench.estimate.time import predict_time
from zero_bench.estimate.time.pipeline import stage_share
from zero_bench.estimate.traced import refusal
from zero_bench.models.params import params_per_shard

from conftest import model

H100_70B = ["model=llama3.1-70b", "hardware=h100_80gb", "parallel.tp=8", "parallel.dp=1", "parallel.pp=4",
            "hardware.num_nodes=4", "precision=bf16", "recompute=full", "batch.micro=1", "batch.grad_accum=8"]


def bench(overrides: list[str]):
    """A config as `zero_bench estimate` reads it: validated for the estimate, not for a trial."""
    return from_cfg(compose(overrides), here=False, training=False)


@pytest.mark.parametrize("name, tp, pp, vpp", [("gpt-mini", 1, 2, 1), ("gpt-mini", 2, 4, 1), ("gpt-mini", 1, 2, 2),
                                               ("llama-tiny", 1, 4, 1), ("llama-tiny", 2, 2, 2)])
def test_the_stages_hold_the_whole_model_and_the_tied_copy(name, tp, pp, vpp):
    m = model(name)
    lay = RankLayout(tp=tp, pp=pp, vpp=vpp, model=m)
    stages = [lay.at_stage(s) for s in range(pp)]
    word = m.padded_vocab(tp) // tp * m.hidden_size
    assert sum(s.held_params for s in stages) == params_per_shard(m, tp) + (word if m.tie_embeddings else 0)
    layers = sorted(i for s in stages for i in s.stage_layers())
    assert layers == list(range(m.num_layers))  # each layer on exactly one stage
    names = [{p.name for p in s.params} for s in stages]
    assert "embedding.word_embeddings.weight" in names[0] and "decoder.final_layernorm.weight" in names[-1]
    assert all("embedding.word_embeddings.weight" not in n for n in names[1:])
    assert ("output_layer.weight" in names[-1]) and all("output_layer.weight" not in n for n in names[:-1])
    assert len(lay.params) == sum(len(n) for n in names) - (1 if m.tie_embeddings else 0)


def test_interleaved_chunks_are_megatrons_virtual_stages():
    lay = RankLayout(pp=2, vpp=2, model=model("gpt-mini"))  # 4 layers: chunks of one layer
    assert [lay.stage_layers(s) for s in (0, 1)] == [(0, 2), (1, 3)]
    one = RankLayout(pp=2, model=model("gpt-mini"))
    assert [one.stage_layers(s) for s in (0, 1)] == [(0, 1), (2, 3)]
    assert one.spans["dp"] == one.tp * one.dp and one.groups["pp"] == 2  # data-parallel groups within a stage
    with pytest.raises(ValueError):
        one.at_stage(2)


def test_micro_batches_in_flight_per_schedule():
    pp, m = 4, 8
    assert [in_flight("1f1b", pp, 1, s, m) for s in range(pp)] == [4, 3, 2, 1]  # min(pp - stage, m)
    assert [in_flight("1f1b", pp, 1, s, 2) for s in range(pp)] == [2, 2, 2, 1]
    assert [in_flight("gpipe", pp, 1, s, m) for s in range(pp)] == [8] * 4
    for vpp in (2, 4):  # Korthikanti et al. 2022, sec. 4.2.3: the first stage's pp x (1 + (pp - 1) / (pp vpp))
        assert in_flight("interleaved_1f1b", pp, vpp, 0, 64) == pytest.approx(pp * (1 + (pp - 1) / (pp * vpp)))
    assert in_flight("interleaved_1f1b", pp, 2, 0, 2) == 2  # capped by the micro-batches (m x vpp chunks)
    assert in_flight("1f1b", 1, 1, 0, 8) == 1


def test_each_stage_keeps_its_own_activations():
    b = bench(["model=llama-tiny", "hardware.device=cpu", "parallel.dp=1", "parallel.pp=2", "batch.grad_accum=4",
               "zero=1", "precision=fp32"])
    first, last = (estimate(stage_bench(b, s)) for s in (0, 1))
    whole = estimate(dataclasses.replace(b, parallel=dataclasses.replace(b.parallel, pp=1)))
    assert first.activations["logits"] == 0 and last.activations["logits"] == whole.activations["logits"]
    assert last.activations["embedding"] < whole.activations["embedding"]  # no token ids, no embedding dropout
    assert first.activations["layers"] == pytest.approx(whole.activations["layers"] / 2, abs=2)
    assert (first.activations["pipeline_in_flight"], last.activations["pipeline_in_flight"]) == (2, 1)
    # stage 0 holds one more micro-batch's saved tensors than it has in backward
    scratch = first.activations["scratch"]
    assert first.activations["pipeline_extra_in_flight"] == first.activations["saved"] - scratch
    # p2p: stage 0 receives 4 gradients, stage 1 the activations of the 3 micro-batches not in flight
    per = b.model.seq_len * b.model.hidden_size * 4  # one sample's hidden states in fp32
    assert (first.activations["p2p_buffers"], last.activations["p2p_buffers"]) == (4 * per, 3 * per)


def test_the_70b_on_32_h100s_with_pp4_answers_per_stage():
    b = bench(H100_70B + ["zero=1"])
    assert b.layout.world_size == 32
    e = estimate(b)
    assert len(e.stages) == 4 and e.max_micro() == min(s.max_micro() for s in e.stages)
    assert e.peak_bytes(1) == max(s.peak_bytes(1) for s in e.stages)
    assert e.stage_name == "stage 0 of 4"  # the most micro-batches in flight
    rows = e.stage_rows()
    assert [r["layers"] for r in rows] == ["0-19", "20-39", "40-59", "60-79"]
    assert [r["in_flight"] for r in rows] == [4, 3, 2, 1]
    assert e.row()["peak_stage"] == "stage 0 of 4"
    assert e.row()["max_global_batch"] == e.max_micro() * 8 * 1  # micro x grad_accum x dp


def test_zero_bench_estimate_prints_and_writes_the_stages():
    cfg = compose(H100_70B + ["zero=1"])
    text = estimate_report(cfg, frozenset({"zero"}))
    assert "pp=4 (1f1b; 32 ranks)" in text and "per pipeline stage" in text and "stage 0 of 4" in text
    assert "pipeline bubble" in text
    doc = json.loads(estimate_report(compose(H100_70B + ["zero=1", "json=true"]), frozenset({"zero"})))
    assert doc["pp"] == 4 and doc["world_size"] == 32
    stages = doc["configs"][0]["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2, 3] and doc["configs"][0]["peak_stage"] == "stage 0 of 4"
    # without zero=...: the stages DeepSpeed runs under a pipeline (ZeRO 0-1), no ZeRO-2/3 line
    every = estimate_report(compose(H100_70B), frozenset())
    assert "zero1" in every and "zero2" not in every and "zero3" not in every


def test_deepspeed_zero3_under_a_pipeline_is_one_line():
    with pytest.raises(ConfigError) as err:
        estimate_report(compose(H100_70B + ["zero=3"]), frozenset({"zero"}))
    assert str(err.value).startswith("zero=3: DeepSpeed runs pipeline parallelism at ZeRO 0-1 only")
    assert "\n" not in str(err.value)
    fsdp2 = estimate(bench(H100_70B + ["engine=fsdp2", "zero=3", "parallel.dp=2", "hardware.num_nodes=8"]))
    assert {"pipeline_unsharded_params", "pipeline_unsharded_grads"} <= set(fsdp2.prediction.buffers_detail())


def test_the_traced_prediction_refuses_a_pipeline_in_one_line():
    b = bench(H100_70B + ["engine=fsdp2", "zero=3"])
    why = refusal(b)
    assert why.startswith("parallel.pp=4: traced=true") and "\n" not in why


def test_the_bubble_and_the_sends():
    b = bench(H100_70B + ["zero=1"])
    t = predict_time(b, 1)
    names = {x.name: x for x in t.terms}
    assert {"pipeline bubble", "pipeline sends"} <= set(names)
    share = stage_share(b, 3)  # the last stage, with the output layer, is the slowest
    assert share > stage_share(b, 0) and share == pytest.approx(0.25, rel=0.05)
    work = sum(x.seconds for x in t.terms if x.exposed and x.name.startswith(
        ("forward", "backward", "recompute", "tensor-parallel")))
    assert names["pipeline bubble"].seconds == pytest.approx(work * 3 / 8)  # (pp - 1) / m
    assert "inter-node" in names["pipeline sends"].source  # neighbouring stages 8 ranks apart, 8 GPUs a node
    inter = bench(H100_70B + ["zero=1", "parallel.pp_schedule=interleaved_1f1b", "parallel.vpp=2"])
    ti = {x.name: x for x in predict_time(inter, 1).terms}
    assert ti["pipeline bubble"].seconds == pytest.approx(names["pipeline bubble"].seconds / 2, rel=1e-6)
    one = bench([a for a in H100_70B if not a.startswith(("parallel.pp", "hardware.num_nodes"))]
                + ["zero=1", "parallel.tp=8"])
    assert not {"pipeline bubble", "pipeline sends"} & {x.name for x in predict_time(one, 1).terms}
    # tokens/s per device divides by tp x dp x pp
    assert t.tokens_per_s_per_device == pytest.approx(8 * b.model.seq_len / (t.step_s * 32))


def test_labels_and_keys_name_the_pipeline():
    b = bench(H100_70B + ["zero=1"])
    assert " pp=4" in b.label() and "gpipe" not in b.label()
    g = bench(H100_70B + ["zero=1", "parallel.pp_schedule=gpipe"])
    assert "pp=4 gpipe" in g.label() and g.search_key() != b.search_key()
    i = bench(H100_70B + ["zero=1", "parallel.pp_schedule=interleaved_1f1b", "parallel.vpp=2"])
    assert "pp=4 interleaved_1f1b vpp=2" in i.label()
    one = from_cfg(compose(["model=gpt-tiny", "hardware.device=cpu"]), here=False)
    assert "pp" not in one.label().split()[-1] and "pp" not in one._key_dict()["parallel"]
    assert "pp_schedule" not in one._key_dict()["parallel"]  # a search keeps the key it had before parallel.pp


def test_a_trial_still_asks_check_pipeline():
    """The training side's own check (configure.check_pipeline) stays what from_cfg asks for a trial;
    the estimate asks check_pipeline_estimate in its place."""
    from zero_bench.config import configure

    called = []
    real = configure.check_pipeline
    try:
        configure.check_pipeline = lambda b: called.append(b.parallel.pp)
        from_cfg(compose(H100_70B + ["zero=1"]), here=False)
    finally:
        configure.check_pipeline = real
    assert called == [4]


def test_interleaving_keeps_one_micro_batchs_logits_on_the_last_rank():
    """With interleaving the last rank's warm-up runs its first chunk: the chunk with the loss holds one
    micro-batch when the first backward starts, however many chunk micro-batches are in flight."""
    from zero_bench.estimate.pipeline import chunks_in_flight

    assert chunks_in_flight("interleaved_1f1b", 4, 2, 3, 16) == [4, 1]  # (vpp - 1) pp + 1 forwards
    assert chunks_in_flight("interleaved_1f1b", 4, 2, 0, 16) == [7, 4]  # 2 (pp - 1) + (vpp - 1) pp + 1
    b = bench(["model=gpt-mini", "hardware.device=cpu", "parallel.dp=1", "parallel.pp=2", "batch.grad_accum=8",
               "zero=1", "precision=fp32", "parallel.pp_schedule=interleaved_1f1b", "parallel.vpp=2"])
    last = estimate(stage_bench(b, 1)).activations
    counts = chunks_in_flight("interleaved_1f1b", 2, 2, 1, 8)
    assert counts == [2, 1]
    assert last["pipeline_extra_in_flight"] == pytest.approx(last["layers"] / 2, abs=2)  # one more chunk, no logits


def test_too_few_micro_batches_is_one_line_naming_the_key():
    """torch's Schedule1F1B needs at least pp micro-batches, ScheduleInterleaved1F1B rounds of equal size:
    the estimate refuses what the schedule would (configure.check_pipeline_estimate)."""
    for extra, start in ((["batch.grad_accum=2"], "batch.grad_accum=2: the micro-batches of a pipeline step"),
                         (["batch.grad_accum=9", "parallel.pp_schedule=interleaved_1f1b", "parallel.vpp=2"],
                          "batch.grad_accum=9: parallel.pp_schedule=interleaved_1f1b runs")):
        with pytest.raises(ConfigError) as err:
            bench(H100_70B + ["zero=1"] + extra)
        assert str(err.value).startswith(start) and "\n" not in str(err.value)
    assert bench(H100_70B + ["zero=1", "batch.grad_accum=2", "parallel.pp_schedule=gpipe"]).layout.pp == 4


def test_the_report_shows_the_pipeline_and_each_stages_peak(tmp_path, monkeypatch):
    """A pipeline row: pp, the schedule, each stage's measured peak (its tp x dp ranks; ranks laid out
    tp fastest, then dp, then pp) and the stage the estimate puts the peak on; a report without a
    pipeline keeps its columns."""
    import pandas as pd

    from zero_bench import report
    from zero_bench.config.schema import ReportConfig
    from zero_bench.records import SearchResult
    from zero_bench.store import Store

    from synthetic import GPT345, measured

    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path / "cache"))

    def write(cfgs, name):
        store = Store(tmp_path / f"{name}.sqlite")
        for cfg in cfgs:
            t = measured(cfg, 4, 2.0, [30000, 30500, 20000, 21000][:cfg.parallel.world_size]
                         if cfg.parallel.pp > 1 else [30000] * 8)
            store.put_search(SearchResult(search_key=cfg.search_key(), label=cfg.label(), status="done", max_micro=4,
                                          max_global_batch=t.global_batch, config=cfg.to_dict(), measure=t))
        return pd.read_csv(report.write_reports(ReportConfig(runs=store.path, out=tmp_path / f"{name}.xlsx"))[1])

    assert "pipeline parallel" not in write([GPT345], "flat").columns
    piped = dataclasses.replace(GPT345, parallel=dataclasses.replace(GPT345.parallel, dp=2, pp=2),
                                batch=dataclasses.replace(GPT345.batch, grad_accum=4))
    both = write([GPT345, piped], "piped")
    cols = list(both.columns)
    assert cols.index("pipeline parallel") == cols.index("model parallel") + 1
    row = both[both["pipeline parallel"] == 2].iloc[0]
    assert row["# gpus"] == 4 and row["pp schedule"] == "1f1b" and " pp=2" in row["config"]
    assert row["stage peaks (MiB)"] == "0: 30,500 | 1: 21,000 (peak: stage 0)"
    assert row["peak stage est."] == "stage 0 of 2"
    assert row["Max Global BSZ"] == 4 * 4 * 2  # micro x grad_accum x dp


def test_a_later_backward_runs_beside_the_accumulated_gradients():
    """FSDP2 under torch's pipelining (estimate/pipeline.py): the first backward gathers layer by
    layer as at pp = 1; a later one holds the stage's unsharded gradients (and, with no forward in
    between to reshard them, its unsharded parameters). Measured on llama-tiny pp=2 micro 1:
    stage 0 peaks in its first backward, stage 1 (F0 B0 F1 B1) in its second
    (tests/integration/test_pipeline_trials.py holds both to 5 %)."""
    # (micro-batches in flight at the second backward, a forward in between)
    assert later_in_flight("1f1b", 2, 1, 0, 2) == ([1], False)  # F0 F1 B0 B1
    assert later_in_flight("1f1b", 2, 1, 1, 2) == ([1], True)  # F0 B0 F1 B1
    assert later_in_flight("1f1b", 4, 1, 0, 8) == ([4], True)  # the steady state
    assert later_in_flight("gpipe", 2, 1, 1, 4) == ([3], False)
    assert later_in_flight("1f1b", 2, 1, 0, 1) == ([], False)  # one backward
    fsdp2 = estimate(bench(H100_70B + ["engine=fsdp2", "zero=3", "parallel.dp=2", "hardware.num_nodes=8"]))
    for e in fsdp2.stages:
        where = {b.name: set(b.phases) for b in e.prediction.buffers}
        assert "pipeline_backward" in e.prediction.phases
        assert where["pipeline_unsharded_grads"] == {"pipeline_backward", "pipeline_reduce"}
        # 8 micro-batches > in flight on every stage: a forward between backwards reshards (zero=3)
        assert where["pipeline_unsharded_params"] == {"pipeline_reduce"}
        assert "pipeline_backward" in where["layer_gathered"]
        assert "held_reduce_scatter_input" not in where
