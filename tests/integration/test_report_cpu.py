"""zero_bench report: stores -> .xlsx / .csv / .md, read back with openpyxl and pandas.

Two real CPU searches (one module fixture, marked slow) give the measured rows; failed, skipped and
GPU configurations are added to the store directly, since they only test how a report renders them.
"""
import dataclasses

import openpyxl
import pandas as pd
import pytest

from zero_bench import report
from zero_bench.config.schema import (BenchConfig, HardwareConfig, ParallelConfig, ReportConfig, SearchConfig,
                                      StepsConfig)
from zero_bench.devices.metrics import cpu_peak_flops
from zero_bench.models.flops import model_flops_per_seq
from zero_bench.search.maxbatch import SearchOptions, run_search
from zero_bench.store import Store

from synthetic import EXPECTED_NOTES, GPT345, NUMERIC, TINY, add_synthetic, row_of, summary_of
from zero_bench.models.params import num_params

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZERO_BENCH_CACHE", str(tmp / "cache"))
        store = Store(tmp / "cpu.sqlite")
        cfg = BenchConfig(model=TINY, zero=1, precision="fp32", hardware=HardwareConfig(device="cpu", memory_gb=1),
                          steps=StepsConfig(warmup=1, timed=2), timeout_s=300)
        # the cap (4), not the budget, ends both searches: 1 GiB is twice a gpt-tiny rank's ~430 MiB at micro 4,
        # so a heavier runtime on another machine cannot turn the answer into "cannot initialize"
        spec = SearchConfig(max=4, strategy="doubling")
        dp2 = run_search(cfg, spec, store, tmp / "run-dp2", SearchOptions(progress=lambda s: None))
        dp1 = run_search(dataclasses.replace(cfg, parallel=ParallelConfig(tp=1, dp=1)), spec, store, tmp / "run-dp1",
                         SearchOptions(repeats=2, progress=lambda s: None))
        assert dp2.status == dp1.status == "done", (dp2.note, dp1.note)
        lone = add_synthetic(store)
        paths = report.write_reports(ReportConfig(runs=store.path, out=tmp / "reports" / "zero_bench.xlsx"))
        yield dict(store=store, dp2=dp2, dp1=dp1, lone=lone, paths=paths, tmp=tmp)


@pytest.mark.slow
def test_every_configuration_has_a_row(real):
    df = summary_of(real)
    expected = {real["dp2"].search_key, real["dp1"].search_key, *EXPECTED_NOTES, *real["lone"]}
    assert sorted(df["search key"]) == sorted(expected)
    assert list(df.columns[:len(report.SEED_COLUMNS)]) == report.SEED_COLUMNS
    assert {"Dev0 used MiB", "Dev0 total MiB", "Dev7 used MiB", "Notes"} <= set(df.columns)


@pytest.mark.slow
def test_cells_hold_numbers_not_text(real):
    df = summary_of(real)
    for col in NUMERIC + [c for c in df.columns if c.startswith("Dev")]:
        assert pd.api.types.is_numeric_dtype(df[col]), col
    ws = openpyxl.load_workbook(real["paths"][0])["Details"]
    header = [c.value for c in ws[1]]
    for col in NUMERIC:
        cells = [r[header.index(col)] for r in ws.iter_rows(min_row=2, values_only=True)]
        assert all(v is None or isinstance(v, (int, float)) for v in cells), (col, cells)
        assert any(isinstance(v, (int, float)) for v in cells), col


@pytest.mark.slow
def test_failed_configurations_keep_their_reason(real):
    df = summary_of(real)
    for key, text in EXPECTED_NOTES.items():
        assert text in row_of(df, key)["Notes"]
    for key in list(EXPECTED_NOTES)[:-1]:  # all but the GPT-345M search that succeeded
        assert pd.isna(row_of(df, key)["Max Global BSZ"])
    skipped = row_of(df, "skip-0123456789ab")
    assert (skipped["model parallel"], skipped["CPU Offload"], skipped["precision"]) == (3, "Yes", "auto")
    oom_run = row_of(df, [k for k, s in real["lone"].items() if s == "estimated_oom"][0])
    assert oom_run["Notes"] == "does not fit (estimated): model states 70 GiB > 40 GiB"


@pytest.mark.slow
def test_measured_rows_carry_the_search_results(real):
    df = summary_of(real)
    for res in (real["dp2"], real["dp1"]):
        row, m = row_of(df, res.search_key), res.measure
        assert row["Max Global BSZ"] == res.max_global_batch and row["micro batch"] == res.max_micro
        assert row["time/it (ms)"] == pytest.approx(m.time_per_step_s * 1e3)
        assert row["Throughput (samples/sec)"] == pytest.approx(m.samples_per_s)
        assert row["tokens/s per GPU"] == pytest.approx(m.tokens_per_s / res.config["parallel"]["dp"])
        # MFU: the model's FLOPs per sequence x the measured samples/s over (ranks x the CPU peak the
        # report measured, cached under ZERO_BENCH_CACHE); no recompute, so HFU = MFU
        flops = model_flops_per_seq(TINY)
        assert 6 * num_params(TINY) * TINY.seq_len <= flops <= 1.5 * 6 * num_params(TINY) * TINY.seq_len
        peak = cpu_peak_flops("fp32")["flops"]
        world = res.config["parallel"]["dp"] * res.config["parallel"]["tp"]
        assert row["MFU"] == pytest.approx(flops * m.samples_per_s / (world * peak), rel=1e-6)
        assert 0 < row["MFU"] < 1 and row["HFU"] == row["MFU"]
        assert row["num params"] == num_params(TINY)
        assert row["memory of"] == "rank RSS" and row["Dev0 total MiB"] == 1024
        assert row["Dev0 used MiB"] == pytest.approx(m.devices_of("rank")[0].peak_bytes / 2**20)
    dp1 = row_of(df, real["dp1"].search_key)
    times = sorted(t * 1e3 for t in real["dp1"].repeats)
    assert dp1["repeats"] == 2 == len(times)
    assert (dp1["time/it min (ms)"], dp1["time/it max (ms)"]) == pytest.approx((times[0], times[-1]))
    assert not pd.isna(row_of(df, real["dp2"].search_key)["Dev1 used MiB"])
    assert pd.isna(dp1["Dev1 used MiB"])  # one rank, one device


@pytest.mark.slow
def test_sheets_are_formatted_for_a_reader(real):
    wb = openpyxl.load_workbook(real["paths"][0])
    # models differ here, so no "What each optimization buys" sheet
    assert wb.sheetnames == ["Summary", "Details", "Memory breakdown", "Predicted vs measured", "Trials", "Charts",
                             "Environment", "Scaling"]
    ws = wb["Details"]
    header = [c.value for c in ws[1]]
    assert ws.freeze_panes == "B2" and ws.auto_filter.ref == ws.dimensions
    assert ws.cell(2, header.index("MFU") + 1).number_format == "0.00%"
    assert ws.cell(2, header.index("time/it (ms)") + 1).number_format == "#,##0.0"
    letter = openpyxl.utils.get_column_letter(header.index("peak memory used") + 1)
    (rng,) = [str(cf.sqref) for cf in ws.conditional_formatting]
    assert rng == f"{letter}2:{letter}{ws.max_row}"
    assert all(ws.column_dimensions[openpyxl.utils.get_column_letter(i)].width >= 8 for i in range(1, 10))


@pytest.mark.slow
def test_charts_point_at_the_summary_columns(real):
    wb = openpyxl.load_workbook(real["paths"][0])
    ws = wb["Summary"]
    top = next(r for r in range(1, 40) if ws.cell(r, 1).value == "Model")  # below the recommendation
    header = [c.value for c in ws[top]]
    last = ws.max_row

    def ref(col):
        letter = openpyxl.utils.get_column_letter(header.index(col) + 1)
        return f"'Summary'!${letter}${top + 1}:${letter}${last}"

    charts = wb["Charts"]._charts
    assert [c.title.tx.rich.p[0].r[0].t for c in charts][:3] == [
        "Max global batch per configuration", "Throughput per configuration",
        "Peak memory per device per configuration (at its max batch)"]
    assert [s.val.numRef.f for s in charts[0].series] == [ref("Max Global BSZ")]
    assert [s.val.numRef.f for s in charts[1].series] == [ref("Throughput (samples/sec)")]
    assert [s.val.numRef.f for s in charts[2].series] == [ref(f"Device{i} used MiB") for i in range(8)]
    # bars are labelled by short names the Charts sheet holds, one per configuration
    labels = {s.cat.strRef.f for c in charts[:3] for s in c.series}
    assert len(labels) == 1 and labels.pop().startswith("'Charts'!")


@pytest.mark.slow
def test_trials_sheet_lists_every_trial(real):
    trials = pd.read_excel(real["paths"][0], sheet_name="Trials")
    stored = real["store"].trials()
    assert len(trials) == len(stored)
    assert set(trials["outcome"]) == {t.status for t in stored}
    ok_real = trials[(trials["outcome"] == "ok") & trials["config"].str.startswith("GPT-tiny")]
    assert len(ok_real) and ok_real["Dev0 peak MiB"].gt(300).all() and ok_real["duration (s)"].gt(0).all()
    assert sorted(ok_real["micro batch"].unique()) == [1, 2, 4]


@pytest.mark.slow
def test_environment_sheet_says_what_ran_where(real):
    ws = openpyxl.load_workbook(real["paths"][0])["Environment"]
    text = "\n".join(str(v) for row in ws.iter_rows(values_only=True) for v in row if v is not None)
    import torch
    assert torch.__version__ in text and "deepspeed" in text and "megatron-core" in text
    assert "matmul microbenchmark" in text  # where the CPU peak came from
    for res in (real["dp2"], real["dp1"]):
        assert res.measure.cmd in text
        assert '"stage": 1' in text


@pytest.mark.slow
def test_scaling_sheet_compares_world_sizes(real):
    sc = pd.read_excel(real["paths"][0], sheet_name="Scaling")
    assert list(sc["data parallel"]) == [1, 2]
    t1, t2 = real["dp1"].measure.samples_per_s, real["dp2"].measure.samples_per_s
    assert list(sc["speedup"]) == pytest.approx([1.0, t2 / t1])
    assert list(sc["scaling efficiency"]) == pytest.approx([1.0, t2 / t1 / 2])


@pytest.mark.slow
def test_csv_and_markdown_carry_the_same_rows(real):
    xlsx, csv, md = real["paths"][:3]
    summary = summary_of(real)
    from_csv = pd.read_csv(csv)
    assert list(from_csv.columns) == list(summary.columns)
    pd.testing.assert_series_equal(from_csv["Max Global BSZ"], summary["Max Global BSZ"])
    text = md.read_text()
    main, scaling = text.split("## Scaling")
    table = main.split("## Summary")[1].strip().split("\n\n")[0].splitlines()
    assert len(table) == len(summary) + 2  # header, rule, one line per configuration
    assert len([line for line in scaling.splitlines() if line.startswith("| ")]) == 2 + 2
    assert "| Device0 Memory Usage |" in table[0] and "36074MiB / 40537MiB" in text
    for note in EXPECTED_NOTES.values():
        assert note in text


@pytest.mark.slow
def test_compare_sheet_shows_deltas_and_ratios(real):
    tmp = real["tmp"]
    other = Store(tmp / "h100.sqlite")
    faster = {real["dp2"].search_key: 2.0, GPT345.search_key(): 4.0}
    for s in real["store"].searches():
        if s.search_key in faster:  # same configurations, measured faster elsewhere
            f = faster[s.search_key]
            m = dataclasses.replace(s.measure, samples_per_s=s.measure.samples_per_s * f,
                                    tokens_per_s=s.measure.tokens_per_s * f, time_per_step_s=s.measure.time_per_step_s / f)
            other.put_search(dataclasses.replace(s, measure=m, max_global_batch=s.max_global_batch * 2))
    xlsx = report.write_reports(ReportConfig(runs=real["store"].path, out=tmp / "cmp" / "a_vs_b.xlsx", compare=other.path))[0]
    cmp = pd.read_excel(xlsx, sheet_name="Compare")
    base = summary_of(real)
    assert len(cmp) == len(base)  # every configuration of either side, matched where both have it
    for key, factor in faster.items():
        b = row_of(base, key)
        (i,) = cmp.index[(cmp["Model"] == b["Model"]) & (cmp["ZeRO Stage"] == b["ZeRO Stage"])
                         & (cmp["data parallel"] == b["data parallel"])]
        r = cmp.loc[i]
        assert r["Throughput (samples/sec) [cpu]"] == pytest.approx(b["Throughput (samples/sec)"])
        assert r["Throughput (samples/sec) [h100]"] == pytest.approx(b["Throughput (samples/sec)"] * factor)
        assert r["Throughput (samples/sec) Δ"] == pytest.approx(b["Throughput (samples/sec)"] * (factor - 1))
        assert r["Throughput (samples/sec) ratio"] == pytest.approx(factor)
        assert r["time/it (ms) ratio"] == pytest.approx(1 / factor)
        assert r["Max Global BSZ ratio"] == pytest.approx(2.0)
    assert cmp["Throughput (samples/sec) [h100]"].notna().sum() == len(faster)  # the rest: this side only
    # a report already written can be the other side too
    again = report.write_reports(ReportConfig(runs=real["store"].path, out=tmp / "cmp" / "self.xlsx", compare=xlsx))[0]
    same = pd.read_excel(again, sheet_name="Compare")
    assert same["Throughput (samples/sec) ratio"].dropna().tolist() == pytest.approx([1.0] * 4)


@pytest.mark.slow
def test_estimate_matches_the_counted_model_states(real):
    """An estimate that raises leaves the error column empty (and a note): this fails, never skips."""
    df = summary_of(real)
    for res in (real["dp2"], real["dp1"]):
        row = row_of(df, res.search_key)
        assert "estimate failed" not in str(row["Notes"]), row["Notes"]
        assert abs(row[report.ESTIMATE_COLUMNS[2]]) < 5


@pytest.mark.slow
def test_predicted_vs_measured_for_cpu_runs(real):
    """Each measured CPU configuration at its max batch: the estimate's terms beside the ranks' own
    figures; model states are exact, the runtime before the model is the process's measured RSS."""
    sheet = pd.read_excel(real["paths"][0], sheet_name="Predicted vs measured")
    cpu = {real["dp2"].label, real["dp1"].label}
    df = sheet[sheet["config"].isin(cpu)]
    assert set(df["config"]) == cpu
    # the synthetic GPU rows measured (GPT-345M) get the GPU terms instead, CPU rows never do
    assert "allocator peak (torch max allocated)" in set(sheet[~sheet["config"].isin(cpu)]["term"])
    assert set(df["term"]) == {"runtime before the model (RSS)", "model states (exact count after a step)",
                               "tensors at the peak (live)", "peak RSS"}
    states = df[df["term"] == "model states (exact count after a step)"]
    assert (states["error (%)"].abs() < 0.01).all(), states
    assert df["measured MiB"].notna().all() and (df["measured MiB"] > 0).all()
    runtime = df[df["term"] == "runtime before the model (RSS)"]
    assert ((runtime["measured MiB"] > 100) & (runtime["measured MiB"] < 1000)).all(), runtime
