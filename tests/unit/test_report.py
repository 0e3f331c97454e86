"""zero_bench report: stores -> .xlsx / .csv / .md, read back with openpyxl and pandas.

Two real CPU searches (one module fixture, marked slow) give the measured rows; failed, skipped and
GPU configurations are added to the store directly, since they only test how a report renders them.
"""
import dataclasses
import shutil
from pathlib import Path

import openpyxl
import pandas as pd
import pytest
from omegaconf import OmegaConf

from zero_bench import report
from zero_bench.config.schema import ConfigError, ReportConfig
from zero_bench.devices.metrics import mfu_hfu
from zero_bench.records import ModelStates
from zero_bench.store import Store

from synthetic import GPT345, MiB, add_synthetic

@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def synthetic(tmp_path) -> Path:
    store = Store(tmp_path / "synthetic.sqlite")
    add_synthetic(store)
    return store.path


# -- fast: rendering, atomic writes, inputs ---------------------------------------------------------

def test_crash_mid_export_keeps_the_previous_report(synthetic, tmp_path, monkeypatch):
    out = tmp_path / "reports" / "r.xlsx"
    paths = report.write_reports(ReportConfig(runs=synthetic, out=out))
    before = {p: p.read_bytes() for p in paths}

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report.xlsx, "charts_sheet", boom)  # after the Summary sheet is already written
    with pytest.raises(RuntimeError):
        report.write_reports(ReportConfig(runs=synthetic, out=out))
    assert {p: p.read_bytes() for p in paths} == before
    assert openpyxl.load_workbook(out).sheetnames[0] == "Summary"
    files = ["r.csv", "r.md", "r.xlsx", "r_max_batch.png", "r_memory.png", "r_throughput.png", "r_tradeoff.png"]
    assert sorted(p.name for p in out.parent.iterdir()) == files  # no temp left

    monkeypatch.undo()
    monkeypatch.setattr(pd.DataFrame, "to_csv", boom)
    with pytest.raises(RuntimeError):
        report.write_reports(ReportConfig(runs=synthetic, out=out))
    assert paths[1].read_bytes() == before[paths[1]]
    assert sorted(p.name for p in out.parent.iterdir()) == files


def test_gpu_rows_get_mfu_from_the_datasheet_peak(synthetic):
    rows = report.rows_of(report.load([synthetic]))
    df = report.summary_frame(rows, report.Peaks({"gpu": "NVIDIA A100-SXM4-40GB", "gpu count": 8}))
    row = df[df["search key"] == GPT345.search_key()].iloc[0]
    m = GPT345.model
    sps = 512 / 3.330348869
    assert row["Throughput (samples/sec)"] == pytest.approx(sps)
    assert row["MFU"] == pytest.approx(mfu_hfu(m, sps, 8, 312e12)[0])
    assert row["model TFLOP/s per GPU"] == pytest.approx(row["MFU"] * 312)
    assert [row[f"Dev{i} used MiB"] for i in range(8)] == [35786] + [36074] * 6 + [35786]
    assert row["Dev7 total MiB"] == 40537
    assert row["peak memory used"] == pytest.approx(36074 / 40537)
    assert (row["time/it median (ms)"], row["time/it min (ms)"], row["time/it max (ms)"], row["repeats"]) == \
        pytest.approx((3330.348869, 3310, 3350, 3))
    unknown = report.summary_frame(rows, report.Peaks({"gpu": "none visible"}))
    assert unknown["MFU"].isna().all()  # no peak known: left empty, never a made-up figure


def test_a_failing_estimate_is_shown_not_dropped(synthetic, monkeypatch):
    """An estimate that raises leaves its columns in place, empty, and says why in Notes: a report
    (or a test reading it) cannot mistake it for a configuration the estimate does not cover."""
    # where the report's call lands for engine=deepspeed (its spec's stored_states)
    import zero_bench.estimate.states as estimate

    rows = report.rows_of(report.load([synthetic]))
    peaks = report.Peaks({"gpu": "none visible"})
    monkeypatch.setattr(estimate, "model_states_bytes", lambda *a, **k: 1 / 0)
    df = report.summary_frame(rows, peaks)
    measured = df[df[report.ESTIMATE_COLUMNS[1]].notna()]
    assert len(measured) and measured[report.ESTIMATE_COLUMNS[0]].isna().all()
    assert measured["Notes"].str.contains("model states estimate failed: ZeroDivisionError").all()
    monkeypatch.setattr(estimate, "model_states_bytes", lambda *a, **k: ModelStates(params=1300 * MiB, host=0))
    df = report.summary_frame(rows, peaks)
    row = df[df["search key"] == GPT345.search_key()].iloc[0]
    assert (row[report.ESTIMATE_COLUMNS[1]], row[report.ESTIMATE_COLUMNS[2]]) == pytest.approx((1300, 0))


def test_runs_may_be_a_store_a_directory_or_a_glob(synthetic, tmp_path):
    nested = tmp_path / "runs" / "sweep1"
    nested.mkdir(parents=True)
    shutil.copy(synthetic, nested / "a.sqlite")
    assert report.find_stores(synthetic) == [synthetic]
    assert report.find_stores(tmp_path / "runs") == [nested / "a.sqlite"]
    assert report.find_stores(str(tmp_path / "*.sqlite")) == [synthetic]
    with pytest.raises(ConfigError, match="no store"):
        report.write_reports(ReportConfig(runs=tmp_path / "nothing-here", out=tmp_path / "x.xlsx"))


def test_the_report_subcommand_prints_the_paths(synthetic, tmp_path, capsys):
    from zero_bench.commands import subcommands as commands

    cfg = OmegaConf.create({"store": str(synthetic), "report": {"runs": None, "out": str(tmp_path / "o.xlsx"),
                                                                "compare": None}})
    assert commands.report(cfg, commands.Invocation(out=tmp_path)) == 0
    names = ["o.xlsx", "o.csv", "o.md", "o_max_batch.png", "o_throughput.png", "o_memory.png", "o_tradeoff.png"]
    assert capsys.readouterr().out.split() == [w for n in names for w in ("wrote", str(tmp_path / n))]


# -- slow: two real CPU searches (dp=2 and dp=1, the latter with 2 repeats) ---------------------------



# -- what a stakeholder opens first ----------------------------------------------------------------

def test_summary_reads_like_the_reference_table(synthetic, tmp_path):
    from zero_bench.report import views

    wb = openpyxl.load_workbook(report.write_reports(ReportConfig(runs=synthetic, out=tmp_path / "r.xlsx"))[0])
    assert wb.sheetnames[:4] == ["Summary", "Details", "What each optimization buys", "Memory breakdown"]
    ws = wb["Summary"]
    assert ws["A1"].value == "Recommendation"  # above the table: what to pick, per model and device
    top = next(r for r in range(1, 40) if ws.cell(r, 1).value == "Model")
    header = [c.value for c in ws[top]]
    assert header[:12] == views.LEAD and header[-2:] == ["Notes", "config"]
    assert header[12:-2] == [x for i in range(8) for x in (f"GPU{i} Memory Usage", f"GPU{i} used MiB")]
    rows = {r[header.index("config")]: r for r in ws.iter_rows(min_row=top + 1, values_only=True)}
    gpt345 = rows[GPT345.label()]
    assert gpt345[header.index("GPU1 Memory Usage")] == "36074MiB / 40537MiB"  # the table's own cell
    assert gpt345[header.index("GPU1 used MiB")] == 36074 and gpt345[header.index("Max Global BSZ")] == 512
    col = {name: header.index(name) + 1 for name in header}
    assert ws.cell(top + 1, col["time/it (ms)"]).number_format == "#,##0.0"
    assert ws.cell(top + 1, col["Throughput (samples/sec)"]).number_format == "#,##0.00"
    assert ws.cell(top + 1, col["GPU0 used MiB"]).number_format == "#,##0"
    setup = ws.page_setup
    assert (setup.orientation, setup.fitToWidth, setup.fitToHeight) == ("landscape", 1, 0)
    assert ws.sheet_properties.pageSetUpPr.fitToPage and ws.print_title_rows == f"${top}:${top}"
    assert top > 12 and ws.freeze_panes is None  # a long recommendation is not frozen in view
    charts = wb["Charts"]._charts
    assert len(charts) == 5 and all(c.y_axis.scaling.min == 0 and not c.y_axis.delete for c in charts)
    assert charts[3].grouping == "stacked" and charts[4].tagname == "scatterChart"
    assert charts[4].x_axis.scaling.min == 0


def test_what_each_optimization_buys(synthetic, tmp_path):
    xlsx = report.write_reports(ReportConfig(runs=synthetic, out=tmp_path / "r.xlsx"))[0]
    buys = pd.read_excel(xlsx, sheet_name="What each optimization buys")
    assert list(buys["change"]) == ["baseline", "ZeRO Stage: 1 -> 3"]
    base, zero3 = 512 / 3.330348869, 256 / 1.9
    assert buys["throughput Δ %"].iloc[1] == pytest.approx((zero3 - base) / base * 100)
    assert buys["max batch Δ %"].iloc[1] == pytest.approx(-50)
    assert buys["max memory MiB"].tolist() == [36074, 30000]


def test_markdown_embeds_its_png_charts(synthetic, tmp_path):
    from matplotlib.image import imread

    paths = report.write_reports(ReportConfig(runs=synthetic, out=tmp_path / "r.xlsx"))
    md = paths[2].read_text()
    pngs = [p for p in paths if p.suffix == ".png"]
    assert [p.name for p in pngs] == ["r_max_batch.png", "r_throughput.png", "r_memory.png", "r_tradeoff.png"]
    for p in pngs:
        assert f"]({p.name})" in md
        height, width, _ = imread(p).shape
        assert height > 300 and width > 500
    assert "## What each optimization buys" in md and "| 36074MiB / 40537MiB |" in md


# -- cost, recommendation, breakdown, layout (issue 28) ----------------------------------------------

def test_costs_and_the_recommendation_reach_every_output(synthetic, tmp_path):
    
    opts = ReportConfig(runs=str(synthetic), out=str(tmp_path / "r.xlsx"), price_per_device_hour=2.5,
                         train_tokens=1e12)
    xlsx, csv, md, *pngs = report.write_reports(opts)
    tokens_s = 512 / 3.330348869 * 1024  # GPT-345M ZeRO-1: 512 samples of 1024 tokens per 3.33 s
    per_m = 8 * 2.5 / (tokens_s * 3600) * 1e6
    details = pd.read_csv(csv)
    row = details[details["search key"] == GPT345.search_key()].iloc[0]
    assert row["cost per hour"] == pytest.approx(20.0)
    assert row["cost per 1M tokens"] == pytest.approx(per_m)
    assert row["time to train (days)"] == pytest.approx(1e12 / tokens_s / 86400)
    assert row["cost to train"] == pytest.approx(20 * 1e12 / tokens_s / 3600)
    ws = openpyxl.load_workbook(xlsx)["Summary"]
    top = next(r for r in range(1, 40) if ws.cell(r, 1).value == "Model")
    header = [c.value for c in ws[top]]
    assert header[header.index("Notes") + 1:] == ["cost per hour", "cost per 1M tokens", "time to train (days)",
                                                  "cost to train", "config"]
    preface = [ws.cell(r, 1).value for r in range(1, top - 1)]
    assert preface[0] == "Recommendation" and "GPT-345M on 8 GPUs" in preface and preface[-1].startswith("Costs at 2.5")
    assert any(str(x).startswith(f"Cheapest: ZeRO-1 at {per_m:.3g} per 1M tokens (20.0 per hour") for x in preface)
    buys = pd.read_excel(xlsx, sheet_name="What each optimization buys")
    assert buys["cost per 1M tokens"].iloc[0] == pytest.approx(per_m)
    zero3 = 8 * 2.5 / (256 / 1.9 * 1024 * 3600) * 1e6
    assert buys["cost Δ %"].iloc[1] == pytest.approx((zero3 - per_m) / per_m * 100)
    text = md.read_text()
    assert text.index("## Recommendation") < text.index("## Summary") < text.index("## What each optimization buys")
    assert "- Largest batch: ZeRO-1 fits 512 samples, 2.00x ZeRO-3, and runs 14 % faster." in text
    assert "| cost per 1M tokens |" in text and f"| {per_m:,.3f} |" in text
    assert [p.name for p in pngs][-2:] == ["r_tradeoff.png", "r_cost.png"]
    charts = openpyxl.load_workbook(xlsx)["Charts"]._charts
    assert [c.tagname for c in charts[-2:]] == ["scatterChart", "scatterChart"]
    assert len(charts[-1].series) == 2  # one labelled point per measured configuration


def test_the_report_subcommand_takes_price_and_tokens(synthetic, tmp_path):
    from zero_bench.commands import subcommands as commands

    section = {"runs": None, "out": str(tmp_path / "o.xlsx"), "compare": None, "price_per_device_hour": 2.5,
               "train_tokens": 1e9}
    commands.report(OmegaConf.create({"store": str(synthetic), "report": section}), tmp_path)
    assert "cost to train" in pd.read_csv(tmp_path / "o.csv").columns
    bad = OmegaConf.create({"store": str(synthetic), "report": {**section, "price_per_device_hour": -1}})
    with pytest.raises(ConfigError, match=r"^report.price_per_device_hour=-1: must be a number > 0$"):
        commands.report(bad, tmp_path)


def _row(cfg, micro, peak_mib, states_mib, runtime_mib=None):
    from synthetic import measured
    from zero_bench.report.rows import Row

    t = measured(cfg, micro, 2.0, [peak_mib] * cfg.parallel.dp)
    for rec in t.ranks:
        rec.model_states = {"params": states_mib * MiB, "master": 0, "optimizer": 0, "grads": 0}
        if runtime_mib is not None:
            rec.runtime_bytes = runtime_mib * MiB
    return Row(config=t.config, label=t.label, key=t.search_key, status="done", note="", source="s",
               measure=t, max_micro=micro, max_global_batch=t.global_batch)


def test_breakdown_takes_activations_from_one_source_for_every_stage():
    from synthetic import gpu_cfg
    from zero_bench.config.schema import BenchConfig
    from zero_bench.estimate import estimate
    from zero_bench.report.views import OTHER, breakdown_frame

    cfgs = [gpu_cfg("GPT-345M", 24, 1024, 16, zero=z) for z in (0, 1, 3)]
    rows = [_row(cfgs[0], 8, 30000, 5000), _row(cfgs[1], 16, 36000, 2000, runtime_mib=900),
            _row(cfgs[2], 12, 20000, 700)]
    df = breakdown_frame(rows).set_index("config")
    assert (df["micro batch"] == 8).all()  # the smallest max micro: every configuration fitted it
    est = {c.label(): estimate(BenchConfig.from_dict(c.with_micro(1).to_dict())) for c in cfgs}
    per_sample = est[cfgs[0].label()].act_per_sample
    assert all(e.act_per_sample == per_sample for e in est.values())  # the same model and batch
    assert df["activations MiB"].tolist() == pytest.approx([8 * per_sample / MiB] * 3)
    assert (df["activations from"] == "estimate").all()
    z0, z1, z3 = (df.loc[c.label()] for c in cfgs)
    assert z0["runtime MiB"] == est[cfgs[0].label()].overhead / MiB  # the named fixed terms (estimate/gpu.py)
    assert z0["runtime from"] == "estimate (fixed cost per process)"
    assert z1["runtime MiB"] == 900 and z1["runtime from"] == "measured before the model was built"
    # other: the peak at the configuration's own max micro minus everything else at that micro
    b1 = est[cfgs[1].label()].buffers_total / MiB
    assert z1[OTHER] == pytest.approx(36000 - 2000 - b1 - 900 - 16 * per_sample / MiB)
    assert z3[OTHER] < 0  # the estimate overcounts this made-up peak: shown, not clamped
    for r in (z0, z1, z3):
        parts = r[["model states MiB", "activations MiB", "buffers MiB", "runtime MiB", OTHER]]
        assert r["total MiB"] == pytest.approx(parts.sum())
    assert z0["total MiB"] == pytest.approx(30000)  # at its own max micro the total is the measured peak


def test_every_sheet_fits_its_content_and_sizes_its_wrapped_rows(synthetic, tmp_path):
    """What LibreOffice showed wrong (issue 28): a header row too short for its wrapped header, numbers
    wider than their column, long text running into its neighbour."""
    from zero_bench.report.layout import BOLD, CHAR, INDENT, PAD, display_text, wrapped_lines

    xlsx = report.write_reports(ReportConfig(runs=str(synthetic), out=str(tmp_path / "r.xlsx"),
                                                     price_per_device_hour=2.5, train_tokens=1e9))[0]
    wb = openpyxl.load_workbook(xlsx)
    for name in ("Summary", "Details", "What each optimization buys", "Memory breakdown", "Trials"):
        ws = wb[name]
        top = next(r for r in range(1, 40) if ws.cell(r, 2).value is not None)
        df = pd.read_excel(xlsx, sheet_name=name, skiprows=top - 1)
        letters = [openpyxl.utils.get_column_letter(j) for j in range(1, len(df.columns) + 1)]
        widths = [ws.column_dimensions[x].width for x in letters]
        need = max(wrapped_lines(str(c), w, BOLD, INDENT) for c, w in zip(df.columns, widths))
        assert ws.row_dimensions[top].height >= 15 * need, name  # explicit, tall enough for its header
        for j, (col, width) in enumerate(zip(df.columns, widths), start=1):
            for i, v in enumerate(df[col]):
                cell = ws.cell(top + 1 + i, j)
                text = display_text(col, v)
                if isinstance(v, str) and len(text) * CHAR + PAD + INDENT > width + 1e-6:
                    assert cell.alignment.wrap_text, (name, col)  # wraps rather than runs over
                    assert ws.row_dimensions[top + 1 + i].height >= 15 * wrapped_lines(text, width, CHAR, INDENT)
                elif not isinstance(v, str) and text:
                    assert len(text) * CHAR + PAD <= width + 1e-6, (name, col, text)  # no "###"


def test_predicted_vs_measured_names_the_term_that_is_off(synthetic):
    """GPU records (synthetic: no GPU here) at their max batch: each term of the estimate beside the
    figure the ranks measured, per rank."""
    from zero_bench.estimate import estimate
    from zero_bench.report.predicted import predicted_frame

    rows = report.rows_of(report.load([synthetic]))
    row = next(r for r in rows if r.key == GPT345.search_key())
    t = row.measure
    for r in t.ranks:
        r.torch_peak_allocated, r.torch_peak_reserved, r.nvml_peak_bytes = 30000 * MiB, 33000 * MiB, 36074 * MiB
    df = predicted_frame([row]).set_index("term")
    est = estimate(GPT345)
    assert df.loc["allocator peak (torch max allocated)", "measured MiB"] == 30000
    assert df.loc["allocator peak (torch max allocated)", "predicted MiB"] == pytest.approx(
        est.allocated_bytes(t.micro) / MiB)
    assert df.loc["fragmentation (reserved - allocated)", "measured MiB"] == 3000
    assert df.loc["outside the allocator (NVML used - reserved)", "measured MiB"] == 36074 - 33000
    assert df.loc["outside the allocator (NVML used - reserved)", "predicted MiB"] == pytest.approx(est.overhead / MiB)
    peak = df.loc["device peak (NVML used, as nvidia-smi)"]
    assert peak["error (%)"] == pytest.approx((peak["predicted MiB"] - 36074) / 36074 * 100)
    assert "NCCL buffers" in df.loc["outside the allocator (NVML used - reserved)", "predicted from"]


def test_predicted_vs_measured_puts_the_time_estimate_beside_the_measured_time_per_step(synthetic):
    """Issue 52: the sheet's time columns, on each configuration's first line: the time estimate at
    the measured micro-batch, the trial's median time/it, the error, the terms' hardware and the
    dominant term."""
    from zero_bench.estimate import estimate
    from zero_bench.report.predicted import predicted_frame

    rows = report.rows_of(report.load([synthetic]))
    row = next(r for r in rows if r.key == GPT345.search_key())
    h100 = {**row.config, "hardware": {**row.config["hardware"], "card": "NVIDIA H100 80GB HBM3"}}
    row = dataclasses.replace(row, config=h100)  # the synthetic GPU rows name no card: no rates
    t = row.measure
    df = predicted_frame([row])
    first = df.iloc[0]
    p = estimate(row.bench).time_at(t.micro)
    assert first["predicted time/it (ms)"] == pytest.approx(p.step_s * 1e3)
    assert first["measured time/it (ms)"] == pytest.approx(t.time_per_step_s * 1e3)
    assert first["time/it error (%)"] == pytest.approx((p.step_s / t.time_per_step_s - 1) * 100)
    assert p.dominant.name in first["time predicted from"]
    assert df.iloc[1:]["predicted time/it (ms)"].isna().all()  # one figure per configuration


def test_details_carry_the_time_estimate_named_predicted_and_its_costs(synthetic, monkeypatch):
    """Every row with a max batch gets the time estimate's figures, each column named predicted, and
    with a price the predicted cost per 1M tokens beside the measured one."""
    from zero_bench.devices.rates import gpu_rates

    monkeypatch.setattr("zero_bench.estimate.time.rates_for", lambda b: gpu_rates("H100"))  # no card in the rows
    rep = report.build(synthetic, options=ReportConfig(price_per_device_hour=2.0, train_tokens=1e9))
    d = rep.summary
    from zero_bench.report.tables import PREDICTED_TIME_COLUMNS

    assert all("predicted" in c for c in PREDICTED_TIME_COLUMNS) and set(PREDICTED_TIME_COLUMNS) <= set(d.columns)
    row = d[d["search key"] == GPT345.search_key()].iloc[0]
    assert row["tokens/s (predicted)"] == pytest.approx(row["tokens/s per GPU (predicted)"] * row["# gpus"])
    assert row["cost per 1M tokens (predicted)"] == pytest.approx(
        row["# gpus"] * 2.0 / (row["tokens/s (predicted)"] * 3600) * 1e6)
    assert "cost per 1M tokens (predicted)" in rep.sheets()["Summary"].columns
    assert "named predicted" in rep.assumptions


def test_a_mixture_of_experts_names_its_active_parameters(tmp_path, monkeypatch):
    """Total and active parameters side by side where a row is an MoE (FLOPs and MFU count the
    active ones); a report of dense models keeps the reference table's columns."""
    from zero_bench import report
    from zero_bench.config.schema import ReportConfig
    from zero_bench.records import SearchResult
    from zero_bench.store import Store

    from conftest import model
    from synthetic import GPT345, measured

    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path / "cache"))

    def write(cfgs, name):
        store = Store(tmp_path / f"{name}.sqlite")
        for cfg in cfgs:
            t = measured(cfg, 4, 2.0, [30000] * 8)
            store.put_search(SearchResult(search_key=cfg.search_key(), label=cfg.label(), status="done", max_micro=4,
                                          max_global_batch=t.global_batch, config=cfg.to_dict(), measure=t))
        csv = report.write_reports(ReportConfig(runs=store.path, out=tmp_path / f"{name}.xlsx"))[1]
        return pd.read_csv(csv)

    dense = write([GPT345], "dense")
    assert "active params" not in dense.columns
    moe = dataclasses.replace(GPT345, model=model("mixtral-8x7b"))
    both = write([GPT345, moe], "moe")
    cols = list(both.columns)
    assert cols.index("active params") == cols.index("num params") + 1
    row = both[both["Model"] == "Mixtral-8x7B"].iloc[0]
    assert (row["num params"], row["active params"]) == (46_702_792_704, 12_879_925_248)
    assert pd.isna(both[both["Model"] != "Mixtral-8x7B"]["active params"]).all()


def test_a_pipelines_row_shows_each_stages_measured_peak_from_the_ranks_records():
    """parallel.pp > 1: the schedule, each stage's peak (the largest of its ranks, each rank's stage as
    its record says: RankRecord.stage) and the stage the estimate puts the peak on."""
    from synthetic import gpu_cfg
    from zero_bench.config.schema import ParallelConfig
    from zero_bench.records import RankRecord
    from zero_bench.report.tables import _pipeline

    cfg = dataclasses.replace(gpu_cfg("GPT-345M", 24, 1024, 16, zero=1),
                              parallel=ParallelConfig(tp=1, dp=1, pp=2, pp_schedule="gpipe"))
    from synthetic import measured
    from zero_bench.report.rows import Row

    t = measured(cfg, 2, 2.0, [300, 500])
    row = Row(config=t.config, label=t.label, key=t.search_key, status="done", note="", source="s", measure=t,
              max_micro=2, max_global_batch=t.global_batch)
    for rec in row.measure.ranks:
        rec.stage = rec.rank
    got = _pipeline(row)
    assert got["pp schedule"] == "gpipe"
    assert got["stage peaks (MiB)"] == "0: 300 | 1: 500 (peak: stage 1)"
    assert got["peak stage est."].startswith("stage ")
    # a record written before RankRecord.stage existed loads without it (the layout's order is used)
    old = {k: v for k, v in RankRecord(rank=1, event="end").to_dict().items() if k != "stage"}
    assert RankRecord.from_dict(old).stage is None
    for rec in row.measure.ranks:
        rec.stage = None
    assert _pipeline(row)["stage peaks (MiB)"] == "0: 300 | 1: 500 (peak: stage 1)"
