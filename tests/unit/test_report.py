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
from zero_bench.results import Store

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
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.csv", "r.md", "r.xlsx"]  # no temp left

    monkeypatch.undo()
    monkeypatch.setattr(pd.DataFrame, "to_csv", boom)
    with pytest.raises(RuntimeError):
        report.write_reports(runs=synthetic, out=out)
    assert paths[1].read_bytes() == before[paths[1]]
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.csv", "r.md", "r.xlsx"]


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
    import zero_bench.estimate as estimate

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
    commands.report(cfg, tmp_path)
    assert capsys.readouterr().out.split() == ["wrote", str(tmp_path / "o.xlsx"), "wrote", str(tmp_path / "o.csv"),
                                               "wrote", str(tmp_path / "o.md")]


# -- slow: two real CPU searches (dp=2 and dp=1, the latter with 2 repeats) ---------------------------

