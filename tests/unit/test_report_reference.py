"""The report against the reference table itself, not against the product's own constants.

tests/data/seeds/zero_table_8xA100.md is a verbatim copy of the seed (shared/seeds/, which a clone of
this repository alone may not have): its header row, as written there, must appear in the report's
Summary sheet, its Markdown and its Details sheet / CSV, in the seed's order. The seed's per-GPU
columns ("GPU0 Memory Usage" ... "GPU7 Memory Usage") are one column per device; the report writes
one per device of the run: "GPU<i> Memory Usage" (NVML; "Rank<i>" for CPU RSS) on the Summary sheet
and in the Markdown, each followed by its number "GPU<i> used MiB", and "Dev<i> used MiB" /
"Dev<i> total MiB" on the Details sheet and in the CSV. Those stand in the seed's place: after the
throughput, before Notes, as many as the run has devices (the synthetic GPT-345M row: 8, as the seed's).
"""
from __future__ import annotations

import re
from pathlib import Path

import matplotlib.figure
import openpyxl
import pandas as pd
import pytest

from zero_bench import report
from zero_bench.config.schema import ReportConfig
from zero_bench.store import Store

from synthetic import add_synthetic

SEED = Path(__file__).resolve().parents[1] / "data" / "seeds" / "zero_table_8xA100.md"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "seeds" / "zero_table_8xA100.md"
DEVICES = "<one column per device>"
SEED_DEVICE = re.compile(r"GPU\d+ Memory Usage")


def seed_header() -> list[str]:
    """The seed's first table row, its cells stripped and markdown's backslash escapes undone."""
    line = next(x for x in SEED.read_text().splitlines() if x.lstrip().startswith("|"))
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [re.sub(r"\\(.)", r"\1", c).strip() for c in cells]


def collapse(header: list[str], device: re.Pattern) -> tuple[list[str], int]:
    """The header with each run of per-device columns as one DEVICES entry; and how many devices."""
    out, n = [], 0
    for col in header:
        m = device.fullmatch(str(col))
        if m:
            n += m.groupdict().get("extra") is None  # count a device once (its text column or its number)
            if out[-1:] != [DEVICES]:
                out.append(DEVICES)
        else:
            out.append(col)
    return out, n


def first_missing(want: list[str], header: list[str]):
    """The first of `want` not found in `header` after the ones before it (None: all, in order)."""
    it = iter(header)
    return next((w for w in want if not any(col == w for col in it)), None)


def test_the_copy_is_the_seed_and_its_header_is_read_as_written():
    if SHARED.exists():
        assert SEED.read_bytes() == SHARED.read_bytes(), "tests/data/seeds/ differs from shared/seeds/"
    header = seed_header()
    # spot checks of the parser (escapes undone, the seed's own capitals), not of the report
    assert header[:5] == ["Model", "num_layers", "hidden_size", "num_heads", "# gpus"]
    assert {"ZeRO Stage", "CPU Offload", "Throughput (samples/sec)", "Notes"} <= set(header)
    want, n = collapse(header, SEED_DEVICE)
    assert n == 8 and want[-2:] == [DEVICES, "Notes"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    store = Store(tmp / "synthetic.sqlite")
    add_synthetic(store)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZERO_BENCH_CACHE", str(tmp / "cache"))
        figures = []
        save = matplotlib.figure.Figure.savefig

        def record(fig, *a, **k):  # observe each PNG chart's axes as it is saved; nothing replaced
            figures.append((Path(a[0]).name if a else "", [(ax.get_title(), ax.get_xlim(), ax.get_ylim(),
                                                            ax.get_xscale(), ax.get_yscale()) for ax in fig.axes]))
            return save(fig, *a, **k)

        mp.setattr(matplotlib.figure.Figure, "savefig", record)
        paths = report.write_reports(ReportConfig(runs=store.path, out=tmp / "r.xlsx", price_per_device_hour=2.0))
    return {p.suffix: p for p in paths if p.suffix != ".png"}, figures


def expected() -> list[str]:
    return collapse(seed_header(), SEED_DEVICE)[0]


@pytest.mark.parametrize("where", ["Summary sheet", "Markdown", "Details sheet", "CSV"])
def test_report_headers_hold_the_seed_columns_in_the_seeds_order(written, where):
    files, _ = written
    if where == "Summary sheet":
        ws = openpyxl.load_workbook(files[".xlsx"])["Summary"]
        top = next(r for r in range(1, 60) if ws.cell(r, 1).value == "Model")
        header = [c.value for c in ws[top]]
    elif where == "Markdown":
        line = next(x for x in files[".md"].read_text().splitlines() if x.startswith("| Model |"))
        header = [c.strip() for c in line.strip().strip("|").split("|")]
    elif where == "Details sheet":
        header = list(pd.read_excel(files[".xlsx"], sheet_name="Details", nrows=0).columns)
    else:
        header = list(pd.read_csv(files[".csv"], nrows=0).columns)
    if where in ("Summary sheet", "Markdown"):
        device = re.compile(r"(?:GPU|Rank|Device)\d+ (?:Memory Usage|(?P<extra>used MiB))")
    else:
        device = re.compile(r"Dev\d+ (?:used MiB|(?P<extra>total MiB))")
    got, n = collapse(header, device)
    missing = first_missing(expected(), got)
    assert missing is None, f"{where}: seed column {missing!r} missing or out of order in {header}"
    assert n == 8  # GPT-345M on 8 GPUs, as the seed's rows


def test_every_png_chart_starts_its_value_axis_at_zero(written):
    """Heights and distances compare as the numbers do only from zero: every saved figure's y axis
    (and the trade-off charts' x axis, max global batch) starts at 0, on a linear scale."""
    _, figures = written
    # saved under a temporary name beside the file (.r_memory.<pid>.tmp.png), then moved over it
    names = sorted(re.sub(r"^\.(.*)\.\d+\.tmp\.png$", r"\1.png", n) for n, _ in figures)
    assert names == ["r_cost.png", "r_max_batch.png", "r_memory.png", "r_throughput.png", "r_tradeoff.png"], names
    for name, axes in figures:
        assert axes, name
        for title, xlim, ylim, xscale, yscale in axes:
            assert yscale == "linear" and ylim[0] == 0 and ylim[1] > 0, (name, title, ylim)
            if "against max global batch" in title:
                assert xscale == "linear" and xlim[0] == 0, (name, title, xlim)
