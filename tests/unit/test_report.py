"""zero_bench report: stores -> .xlsx / .csv / .md, read back with openpyxl and pandas.

Two real CPU searches (one module fixture, marked slow) give the measured rows; failed, skipped and
GPU configurations are added to the store directly, since they only test how a report renders them.
"""
import shutil
from pathlib import Path

import openpyxl
import pandas as pd
import pytest
from omegaconf import OmegaConf

from zero_bench import report
from zero_bench.config import ConfigError
from zero_bench.metrics import mfu_hfu
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
    paths = report.write_reports(runs=synthetic, out=out)
    before = {p: p.read_bytes() for p in paths}

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report.xlsx, "_charts_sheet", boom)  # after the Summary sheet is already written
    with pytest.raises(RuntimeError):
        report.write_reports(runs=synthetic, out=out)
    assert {p: p.read_bytes() for p in paths} == before
    assert openpyxl.load_workbook(out).sheetnames[0] == "Summary"
    files = ["r.csv", "r.md", "r.xlsx", "r_max_batch.png", "r_memory.png", "r_throughput.png"]
    assert sorted(p.name for p in out.parent.iterdir()) == files  # no temp left

    monkeypatch.undo()
    monkeypatch.setattr(pd.DataFrame, "to_csv", boom)
    with pytest.raises(RuntimeError):
        report.write_reports(runs=synthetic, out=out)
    assert paths[1].read_bytes() == before[paths[1]]
    assert sorted(p.name for p in out.parent.iterdir()) == files


def test_gpu_rows_get_mfu_from_the_datasheet_peak(synthetic):
    rows = report.rows_of(report.load([synthetic]))
    df = report.summary_frame(rows, report.Peaks({"gpu": "NVIDIA A100-SXM4-40GB", "gpu count": 8}))
    row = df[df["search key"] == GPT345.search_key()].iloc[0]
    m = GPT345.model
    sps = 512 / 3.330348869
    assert row["throughput (samples/s)"] == pytest.approx(sps)
    assert row["MFU"] == pytest.approx(mfu_hfu(m.num_params, m.num_layers, m.hidden_size, m.seq_len, sps, 8,
                                               312e12)[0])
    assert row["model TFLOP/s per GPU"] == pytest.approx(row["MFU"] * 312)
    assert [row[f"Dev{i} used MiB"] for i in range(8)] == [35786] + [36074] * 6 + [35786]
    assert row["Dev7 total MiB"] == 40537
    assert row["peak memory used"] == pytest.approx(36074 / 40537)
    assert (row["time/it median (ms)"], row["time/it min (ms)"], row["time/it max (ms)"], row["repeats"]) == \
        pytest.approx((3330.348869, 3310, 3350, 3))
    unknown = report.summary_frame(rows, report.Peaks({"gpu": "none visible"}))
    assert unknown["MFU"].isna().all()  # no peak known: left empty, never a made-up figure


def test_estimate_columns_are_skipped_when_the_estimate_fails(synthetic, monkeypatch):
    import zero_bench.report.tables as estimate  # where the report calls the estimate's model_states_bytes

    rows = report.rows_of(report.load([synthetic]))
    peaks = report.Peaks({"gpu": "none visible"})
    monkeypatch.setattr(estimate, "model_states_bytes", lambda *a, **k: 1 / 0, raising=False)
    assert report.ESTIMATE_COLUMNS[0] not in report.summary_frame(rows, peaks).columns
    monkeypatch.setattr(estimate, "model_states_bytes", lambda *a, **k: {"gpu": 1300 * MiB, "cpu": 0, "grads": 0},
                        raising=False)
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
        report.write_reports(runs=tmp_path / "nothing-here", out=tmp_path / "x.xlsx")


def test_the_report_subcommand_prints_the_paths(synthetic, tmp_path, capsys):
    from zero_bench import commands

    cfg = OmegaConf.create({"store": str(synthetic), "report": {"runs": None, "out": str(tmp_path / "o.xlsx"),
                                                                "compare": None}})
    assert commands.report(cfg, commands.Invocation(out=tmp_path)) == 0
    names = ["o.xlsx", "o.csv", "o.md", "o_max_batch.png", "o_throughput.png", "o_memory.png"]
    assert capsys.readouterr().out.split() == [w for n in names for w in ("wrote", str(tmp_path / n))]


# -- slow: two real CPU searches (dp=2 and dp=1, the latter with 2 repeats) ---------------------------



# -- what a stakeholder opens first ----------------------------------------------------------------

def test_summary_reads_like_the_reference_table(synthetic, tmp_path):
    from zero_bench.report import views

    wb = openpyxl.load_workbook(report.write_reports(runs=synthetic, out=tmp_path / "r.xlsx")[0])
    assert wb.sheetnames[:4] == ["Summary", "Details", "What each optimization buys", "Memory breakdown"]
    ws = wb["Summary"]
    header = [c.value for c in ws[1]]
    assert header[:12] == views.LEAD and header[-2:] == ["Notes", "config"]
    assert header[12:-2] == [x for i in range(8) for x in (f"GPU{i} Memory Usage", f"GPU{i} used MiB")]
    rows = {r[header.index("config")]: r for r in ws.iter_rows(min_row=2, values_only=True)}
    gpt345 = rows[GPT345.label()]
    assert gpt345[header.index("GPU1 Memory Usage")] == "36074MiB / 40537MiB"  # the table's own cell
    assert gpt345[header.index("GPU1 used MiB")] == 36074 and gpt345[header.index("Max Global BSZ")] == 512
    col = {name: header.index(name) + 1 for name in header}
    assert ws.cell(2, col["time/it (ms)"]).number_format == "#,##0.0"
    assert ws.cell(2, col["Throughput (samples/sec)"]).number_format == "#,##0.00"
    assert ws.cell(2, col["GPU0 used MiB"]).number_format == "#,##0"
    setup = ws.page_setup
    assert (setup.orientation, setup.fitToWidth, setup.fitToHeight) == ("landscape", 1, 0)
    assert ws.sheet_properties.pageSetUpPr.fitToPage and ws.print_title_rows == "$1:$1" and ws.freeze_panes == "B2"
    charts = wb["Charts"]._charts
    assert len(charts) == 4 and all(c.y_axis.scaling.min == 0 and not c.y_axis.delete for c in charts)
    assert charts[-1].grouping == "stacked"


def test_what_each_optimization_buys(synthetic, tmp_path):
    xlsx = report.write_reports(runs=synthetic, out=tmp_path / "r.xlsx")[0]
    buys = pd.read_excel(xlsx, sheet_name="What each optimization buys")
    assert list(buys["change"]) == ["baseline", "ZeRO stage: 1 -> 3"]
    base, zero3 = 512 / 3.330348869, 256 / 1.9
    assert buys["throughput Δ %"].iloc[1] == pytest.approx((zero3 - base) / base * 100)
    assert buys["max batch Δ %"].iloc[1] == pytest.approx(-50)
    assert buys["max memory MiB"].tolist() == [36074, 30000]


def test_markdown_embeds_its_png_charts(synthetic, tmp_path):
    from matplotlib.image import imread

    paths = report.write_reports(runs=synthetic, out=tmp_path / "r.xlsx")
    md = paths[2].read_text()
    pngs = [p for p in paths if p.suffix == ".png"]
    assert [p.name for p in pngs] == ["r_max_batch.png", "r_throughput.png", "r_memory.png"]
    for p in pngs:
        assert f"]({p.name})" in md
        height, width, _ = imread(p).shape
        assert height > 300 and width > 500
    assert "## What each optimization buys" in md and "| 36074MiB / 40537MiB |" in md
