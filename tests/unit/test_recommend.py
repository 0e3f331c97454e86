"""The report's decision aids: cost arithmetic, the recommendation's rules, the report options.

Expected values are worked out here by hand from the inputs, not with the functions under test.
"""

import pandas as pd
import pytest

from zero_bench.config.configure import compose, report_from_cfg
from zero_bench.config.schema import ReportConfig
from zero_bench.errors import ConfigError
from zero_bench.report.costs import COST_COLUMNS, assumptions, tokens_text, with_costs
from zero_bench.report.recommend import fmt, recommend

SEQ = 64


def details(*configs: dict) -> pd.DataFrame:
    """A Details frame with only what the rules read: one dict per configuration."""
    base = {"Model": "GPT-demo", "num_layers": 4, "hidden_size": 768, "num_heads": 12, "device": "cpu",
            "# gpus": 2, "data parallel": 2, "model parallel": 1, "CPU Offload": "No", "precision": "bf16",
            "recompute": "none", "compile": "No", "ds preset": "default", "grad accum": 1, "status": "done",
            "Notes": ""}
    rows = []
    for c in configs:
        row = {**base, **c}
        sps = row.get("Throughput (samples/sec)")
        row.setdefault("tokens/s", None if sps is None else sps * SEQ)
        row.setdefault("config", f"GPT-demo dp{row['data parallel']} zero{row['ZeRO Stage']}")
        rows.append(row)
    return pd.DataFrame(rows)


DEMO = details({"ZeRO Stage": 0, "Max Global BSZ": 54, "Throughput (samples/sec)": 15.70},
               {"ZeRO Stage": 1, "Max Global BSZ": 94, "Throughput (samples/sec)": 17.83},
               {"ZeRO Stage": 3, "Max Global BSZ": 70, "Throughput (samples/sec)": 12.65})


# -- cost and time ---------------------------------------------------------------------------------

def test_cost_columns_follow_from_devices_price_and_measured_tokens_per_second():
    df = with_costs(details({"ZeRO Stage": 1, "# gpus": 8, "data parallel": 8, "Max Global BSZ": 512,
                             "Throughput (samples/sec)": 100_000 / SEQ}), price=2.5, train_tokens=1e12)
    row = df.iloc[0]
    # 8 devices x 2.5 = 20 per hour; 100,000 tokens/s = 360 M tokens per hour
    assert row["cost per hour"] == pytest.approx(20.0)
    assert row["cost per 1M tokens"] == pytest.approx(20 / 360)
    assert row["time to train (days)"] == pytest.approx(1e12 / 100_000 / 86_400)  # 115.7 days
    assert row["cost to train"] == pytest.approx(20 * 1e12 / 100_000 / 3600)  # 55,556
    cols = list(df.columns)
    assert cols[cols.index("cost per hour"):cols.index("cost per hour") + 4] == COST_COLUMNS
    assert cols.index("Notes") == cols.index("cost to train") + 1  # before Notes, after the measured columns


def test_cost_columns_need_their_inputs_and_a_measured_throughput():
    assert list(with_costs(DEMO, None, None).columns) == list(DEMO.columns)
    assert [c for c in with_costs(DEMO, 3.0, None).columns if c in COST_COLUMNS] == ["cost per hour",
                                                                                      "cost per 1M tokens"]
    assert [c for c in with_costs(DEMO, None, 1e9).columns if c in COST_COLUMNS] == ["time to train (days)"]
    failed = with_costs(details({"ZeRO Stage": 0, "Max Global BSZ": None, "Throughput (samples/sec)": None,
                                 "status": "cannot_initialize"}), 2.5, 1e9).iloc[0]
    assert all(pd.isna(failed[c]) for c in COST_COLUMNS)  # no throughput: no cost, not a zero cost


def test_what_the_costs_assume_is_said_in_one_line():
    assert assumptions(None, None) == ""
    text = assumptions(2.5, 1e9)
    assert text.startswith("Costs at 2.5 per device-hour") and "1B tokens" in text and text.endswith(".")
    assert [tokens_text(x) for x in (1e12, 1.5e12, 1e9, 3e6, 300_000)] == ["1T", "1.5T", "1B", "3M", "300,000"]


# -- the recommendation's rules ----------------------------------------------------------------------

def test_the_demo_recommendation_names_each_winner_with_its_numbers():
    (advice,) = recommend(with_costs(DEMO, 2.5, 1e9), train_tokens=1e9)
    assert advice.heading == "GPT-demo on 2 CPU ranks"
    largest, fastest, cheapest = advice.picks
    # 94 / 54 = 1.7407; 17.83 / 15.70 = 1.1357 -> 14 % faster
    assert largest.sentence == ("Largest batch: ZeRO-1 fits 94 samples, 1.74x ZeRO-0, and runs 14 % faster; "
                                "ZeRO-3 fits 70.")
    # 17.83 / 12.65 = 1.4095 -> 41 %; 1e9 tokens / (17.83 * 64 tokens/s) = 876,331 s = 10.14 days
    assert fastest.sentence == ("Fastest: ZeRO-1 runs 17.8 samples/s at its max batch of 94, 14 % more than ZeRO-0 "
                                "(15.7) and 41 % more than ZeRO-3 (12.7); it trains 1B tokens in 10.1 days.")
    # 5 per hour / (17.83 * 64 * 3600 tokens per hour) * 1e6 = 1.2171; ZeRO-0: 1.3823 (-12 %), ZeRO-3: 1.7155 (-29 %)
    assert cheapest.sentence == ("Cheapest: ZeRO-1 at 1.22 per 1M tokens (5.00 per hour for 2 devices), 12 % less "
                                 "than ZeRO-0 (1.38) and 29 % less than ZeRO-3 (1.72); training 1B tokens costs "
                                 "1,217 and takes 10.1 days.")
    assert {p.config for p in advice.picks} == {"GPT-demo dp2 zero1"}
    assert advice.unmeasured == ""


def test_without_a_price_there_is_no_cheapest_and_the_fastest_says_no_time():
    (advice,) = recommend(DEMO)
    assert [p.kind for p in advice.picks] == ["largest batch", "fastest"]
    assert "days" not in advice.picks[1].sentence


def test_more_devices_can_be_faster_yet_dearer_per_token():
    df = with_costs(details({"ZeRO Stage": 1, "Max Global BSZ": 94, "Throughput (samples/sec)": 17.83},
                            {"ZeRO Stage": 1, "# gpus": 4, "data parallel": 4, "Max Global BSZ": 188,
                             "Throughput (samples/sec)": 30.0}), price=2.5, train_tokens=None)
    largest, fastest, cheapest = recommend(df)[0].picks
    assert largest.config == fastest.config == "GPT-demo dp4 zero1"
    # 4 devices: 10 per hour / (30 * 64 * 3600) * 1e6 = 1.447; 2 devices: 1.217 -> 16 % less
    assert cheapest.config == "GPT-demo dp2 zero1"
    assert cheapest.sentence == ("Cheapest: ZeRO-1 dp2 at 1.22 per 1M tokens (5.00 per hour for 2 devices), 16 % less "
                                 "than ZeRO-1 dp4 (1.45).")
    assert largest.sentence.startswith("Largest batch: ZeRO-1 dp4 fits 188 samples, 2.00x ZeRO-1 dp2, and runs 68 %")


def test_when_the_baseline_fits_most_it_is_compared_with_the_runner_up():
    df = details({"ZeRO Stage": 0, "Max Global BSZ": 80, "Throughput (samples/sec)": 10.0},
                 {"ZeRO Stage": 2, "Max Global BSZ": 64, "Throughput (samples/sec)": 10.0},
                 {"ZeRO Stage": 3, "Max Global BSZ": 40, "Throughput (samples/sec)": 8.0})
    largest, fastest = recommend(df)[0].picks
    assert largest.sentence == "Largest batch: ZeRO-0 fits 80 samples, 1.25x ZeRO-2, and runs as fast; ZeRO-3 fits 40."
    assert fastest.config == "GPT-demo dp2 zero0"  # a tie on samples/s goes to the larger batch


def test_groups_by_model_and_device_and_says_what_did_not_fit():
    df = pd.concat([DEMO, details({"Model": "GPT-big", "ZeRO Stage": 0, "Max Global BSZ": None,
                                   "Throughput (samples/sec)": None, "status": "cannot_initialize"},
                                  {"Model": "GPT-big", "ZeRO Stage": 3, "Max Global BSZ": 8,
                                   "Throughput (samples/sec)": 2.0}),
                    details({"Model": "GPT-huge", "ZeRO Stage": 1, "Max Global BSZ": None,
                             "Throughput (samples/sec)": None, "status": "estimated_oom"})], ignore_index=True)
    demo, big, huge = recommend(df)
    assert [a.heading for a in (demo, big, huge)] == ["GPT-demo on 2 CPU ranks", "GPT-big on 2 CPU ranks",
                                                      "GPT-huge on 2 CPU ranks"]
    assert big.picks[0].sentence == "Only ZeRO-3 was measured: it fits 8 samples and runs 2.00 samples/s."
    assert big.unmeasured == "Without a measured max batch: ZeRO-0 (cannot initialize)."
    assert huge.picks[0].sentence == "No configuration fitted: ZeRO-1 (does not fit, estimated)."


def test_numbers_read_with_three_significant_digits():
    assert [fmt(x) for x in (1217.4, 17.83, 1.2171, 0.035135, 154.38)] == ["1,217", "17.8", "1.22", "0.0351", "154"]


# -- report options --------------------------------------------------------------------------------

def test_report_options_take_the_report_section():
    opts = report_from_cfg(compose(["store=results/demo.sqlite", "report.out=reports/demo.xlsx",
                                    "report.price_per_device_hour=2.5", "report.train_tokens=1e9"]))
    assert opts == ReportConfig(runs="results/demo.sqlite", out="reports/demo.xlsx", price_per_device_hour=2.5,
                                train_tokens=1e9)
    assert report_from_cfg(compose([])).price_per_device_hour is None


@pytest.mark.parametrize("overrides, message", [
    (["report.price_per_device_hour=-1"], "report.price_per_device_hour=-1: must be a number > 0"),
    (["report.price_per_device_hour=0"], "report.price_per_device_hour=0: must be a number > 0"),
    (["report.train_tokens=lots"], "report.train_tokens=lots: must be a number"),
    (["report.train_tokens=nan"], "report.train_tokens=nan: must be a number > 0"),
    (["report.prices=2"], "report.prices: unknown key"),
    (["report.out="], "report.out=: must be a path (the .csv and .md are written beside it)"),
])
def test_bad_report_options_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        report_from_cfg(compose(overrides))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_rows_apart_by_expert_parallelism_are_named_by_it():
    """Two MoE rows that differ only in parallel.ep read "ep1" / "ep2", not as one configuration twice."""
    (advice,) = recommend(details({"ZeRO Stage": 2, "expert parallel": 1, "Max Global BSZ": 8,
                                   "Throughput (samples/sec)": 9.0},
                                  {"ZeRO Stage": 2, "expert parallel": 2, "Max Global BSZ": 12,
                                   "Throughput (samples/sec)": 7.0}))
    text = " ".join(p.sentence for p in advice.picks)
    assert "ZeRO-2 ep2" in text and "ZeRO-2 ep1" in text, text


def test_the_offload_ladder_names_the_first_rung_that_fits_more_and_its_cost():
    """Measured on this machine (gpt-mini at hidden 512, ZeRO-3, 0.75 GiB per rank): no offload
    fits 8 at 3.21 samples/s, cpu offload 6 (on CPU it adds memory), NVMe 10 at 2.59: 19 % slower."""
    ladder = details({"ZeRO Stage": 3, "offload": "none", "Max Global BSZ": 8, "Throughput (samples/sec)": 3.21},
                     {"ZeRO Stage": 3, "offload": "cpu: optimizer+params", "CPU Offload": "Yes (+params)",
                      "Max Global BSZ": 6, "Throughput (samples/sec)": 2.36},
                     {"ZeRO Stage": 3, "offload": "nvme: optimizer+params", "CPU Offload": "NVMe (+params)",
                      "Max Global BSZ": 10, "Throughput (samples/sec)": 2.59})
    (advice,) = recommend(ladder)
    climb = [p for p in advice.picks if p.kind == "ladder"]
    assert [p.sentence for p in climb] == [
        "Offload ladder: ZeRO-3 fits up to 8 samples (3.21 samples/s); ZeRO-3 + offload (+params) fits no more (6); "
        "ZeRO-3 + NVMe offload (+params) is the first rung that fits 10 and runs 19 % slower."]
    assert all(p.kind != "ladder" for p in recommend(DEMO)[0].picks)


def test_the_longest_sequence_names_the_winners_sp_tiling_and_checkpoint_offload():
    """Issue 45: "at 8 GPUs, sp 8 with tiled MLP and checkpoint offload trains N tokens per
    sequence". Three stored maxseq answers of Llama-tiny on 8 GPUs (ZeRO-3): sp=8 tiled with checkpoint
    offload fits 131,072 tokens, sp=1 tiled and offloaded 65,536, sp=1 plain 16,384; read through
    the report's own Details frame (the settings come from each stored config, not from this test)."""
    from zero_bench.config.configure import from_cfg
    from zero_bench.records import Dimension, TrialResult
    from zero_bench.report.rows import Row
    from zero_bench.report.tables import Peaks, summary_frame

    offload = ["recompute=full", "recompute_offload=true"]
    rows = []
    tiled = ["tiled_mlp=auto", *offload]
    for seq, keys in ((131072, ["parallel.sp=8", *tiled]), (65536, tiled), (16384, [])):
        cfg = from_cfg(compose(["hardware=gpu", "parallel=dp8", "model=llama-tiny", "zero=3", "batch.micro=1",
                                f"model.seq_len={seq}", *keys]), here=False)
        m = TrialResult(search_key="seq-x", trial_key=cfg.trial_key(), label=cfg.label(), micro=1,
                        global_batch=cfg.global_batch, status="ok", mode="measure", time_per_step_s=2.0,
                        samples_per_s=cfg.global_batch / 2.0, tokens_per_s=cfg.global_batch / 2.0 * seq,
                        config=cfg.to_dict())
        rows.append(Row(config=cfg.to_dict(), label=cfg.label(), key=f"seq-{seq}", status="done", note="",
                        source="s.sqlite", measure=m, max_global_batch=cfg.global_batch, max_micro=1,
                        dimension=Dimension.SEQ, max_seq_len=seq))
    details = summary_frame(rows, Peaks(env={}))
    (advice,) = recommend(details)
    first = advice.picks[0].sentence
    assert first.startswith("At 8 GPUs, ZeRO-3 recompute full at sp 8 with tiled MLP and checkpoint offload trains "
                            "131,072 tokens per sequence (micro 1)"), first
    # the others by what sets them apart
    assert first.endswith(", 2.00x ZeRO-3 recompute full sp1 tiled MLP checkpoint offload (65,536), "
                          "8.00x ZeRO-3 recompute none sp1 (16,384)."), first
    (tiled,) = recommend(details.iloc[1:])
    assert tiled.picks[0].sentence.startswith("At 8 GPUs, ZeRO-3 recompute full at sp 1 with tiled MLP and "
                                              "checkpoint offload trains 65,536"), tiled.picks[0].sentence
    (plain,) = recommend(details.iloc[2:])  # a winner that runs neither saver says so
    assert plain.picks[0].sentence.startswith("At 8 GPUs, ZeRO-3 at sp 1 without tiled MLP or checkpoint offload "
                                              "trains 16,384"), plain.picks[0].sentence


# -- the time estimate's picks (issue 52): a store with no GPU rows ----------------------------------

def predicted(*configs: dict) -> pd.DataFrame:
    """DEMO's configurations with the time estimate's columns (tables.PREDICTED_TIME_COLUMNS)."""
    return details(*({"time/it (ms, predicted)": 1000 * c["Max Global BSZ"] / c["Throughput (samples/sec, predicted)"],
                      "tokens/s (predicted)": c["Throughput (samples/sec, predicted)"] * SEQ,
                      "dominant term (predicted)": "backward matmuls", **c} for c in configs))


PREDICTED = predicted({"ZeRO Stage": 0, "Max Global BSZ": 54, "Throughput (samples/sec)": 15.70,
                       "Throughput (samples/sec, predicted)": 20.0},
                      {"ZeRO Stage": 1, "Max Global BSZ": 94, "Throughput (samples/sec)": 17.83,
                       "Throughput (samples/sec, predicted)": 16.0},
                      {"ZeRO Stage": 3, "Max Global BSZ": 70, "Throughput (samples/sec, predicted)": 10.0})


def test_a_store_without_gpu_rows_is_ranked_by_predicted_throughput_and_cost_named_predicted():
    (a,) = recommend(with_costs(PREDICTED, price=2.0, train_tokens=None))
    picks = {p.kind: p for p in a.picks}
    fast, cheap = picks["fastest (predicted)"], picks["cheapest (predicted)"]
    # ZeRO-0: 20 predicted samples/s, 25 % more than ZeRO-1's 16 and 100 % more than ZeRO-3's 10 (which
    # no trial measured at its max batch: it fits, and the estimate ranks it too)
    assert fast.config == "GPT-demo dp2 zero0" and "(predicted" in fast.sentence
    assert "25 % more than ZeRO-1 (16.0)" in fast.sentence and "100 % more than ZeRO-3 (10.0)" in fast.sentence
    # 2 devices x 2.0 per hour / (20 x 64 tokens/s x 3600) x 1e6 = 0.868 per 1M tokens
    assert cheap.config == "GPT-demo dp2 zero0" and "0.868 per 1M tokens (predicted)" in cheap.sentence
    assert picks["fastest"].config == "GPT-demo dp2 zero1"  # the measured picks stay measured


def test_a_store_with_gpu_rows_keeps_to_what_was_measured():
    gpu = PREDICTED.assign(device="gpu")
    (a,) = recommend(gpu)
    assert not [p for p in a.picks if "predicted" in p.kind]
    (b,) = recommend(DEMO)  # no predicted columns: nothing predicted to rank
    assert not [p for p in b.picks if "predicted" in p.kind]
