"""DataFrames -> the .xlsx workbook: sheets, number formats, widths, colour scale, charts."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import pandas as pd

from zero_bench.report.formats import number_format

BUYS, BREAKDOWN = "What each optimization buys", "Memory breakdown"
PARTS = ("model states MiB", "activations MiB", "buffers MiB", "other MiB")

@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; move it over `path` only if the block finishes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


FIRST = ("Summary", "Details", BUYS, BREAKDOWN, "Trials")


def write_xlsx(path: Path, sheets: dict[str, pd.DataFrame], environment: list[tuple[str, pd.DataFrame]]) -> None:
    """Summary (the reference table's columns), Details, what each optimization buys and the memory
    breakdown when there are any, Trials, Charts, Environment, then Scaling / Compare when present."""
    with replacing(path) as tmp:
        with pd.ExcelWriter(tmp, engine="openpyxl") as xw:
            for name in FIRST:
                if name in sheets:
                    _table_sheet(xw, name, sheets[name])
            _memory_colour_scale(xw.sheets["Details"], sheets["Details"])
            _charts_sheet(xw.book, sheets["Summary"], sheets.get(BREAKDOWN))
            _environment_sheet(xw, environment)
            for name, df in sheets.items():
                if name not in FIRST:
                    _table_sheet(xw, name, df)


def _table_sheet(xw: pd.ExcelWriter, name: str, df: pd.DataFrame) -> None:
    df.to_excel(xw, sheet_name=name, index=False)
    ws = xw.sheets[name]
    _style_header(ws, 1)
    ws.freeze_panes = "B2"  # header and the first (Model / config) column stay in view
    ws.auto_filter.ref = ws.dimensions
    _format_columns(ws, df, first_row=2)
    _page_setup(ws)


def _page_setup(ws) -> None:
    """Printed: landscape, one page wide (as many pages long as needed), the header on every page."""
    ws.page_setup.orientation = "landscape"
    ws.page_setup.fitToWidth, ws.page_setup.fitToHeight = 1, 0
    ws.sheet_properties.pageSetUpPr.fitToPage = True
    ws.print_title_rows = "1:1"


def _style_header(ws, row: int) -> None:
    from openpyxl.styles import Alignment, Font, PatternFill

    for cell in ws[row]:
        cell.font = Font(bold=True)
        cell.fill = PatternFill("solid", fgColor="DDEBF7")
        cell.alignment = Alignment(wrap_text=True, vertical="top")


def _format_columns(ws, df: pd.DataFrame, first_row: int) -> None:
    from openpyxl.utils import get_column_letter

    last = first_row + len(df) - 1
    for i, col in enumerate(df.columns, start=1):
        fmt = number_format(str(col))
        if fmt:
            for (cell,) in ws.iter_rows(min_row=first_row, max_row=last, min_col=i, max_col=i):
                cell.number_format = fmt
        ws.column_dimensions[get_column_letter(i)].width = _width(col, df[col])


def _width(col, values: pd.Series) -> float:
    """Wide enough for the header's longest word and typical values; long text is capped."""
    header = max((len(w) for w in str(col).split()), default=4)
    sample = values.dropna().astype(str).str.len()
    body = int(sample.quantile(0.9)) if len(sample) else 0
    return min(max(header, body, 6) + 2, 60)


def _memory_colour_scale(ws, df: pd.DataFrame) -> None:
    """Green (room left) -> yellow -> red (at capacity) on each configuration's fullest device."""
    from openpyxl.formatting.rule import ColorScaleRule
    from openpyxl.utils import get_column_letter

    if "peak memory used" not in df.columns or df.empty:
        return
    letter = get_column_letter(df.columns.get_loc("peak memory used") + 1)
    rule = ColorScaleRule(start_type="num", start_value=0, start_color="63BE7B", mid_type="num", mid_value=0.8,
                          mid_color="FFEB84", end_type="num", end_value=1, end_color="F8696B")
    ws.conditional_formatting.add(f"{letter}2:{letter}{len(df) + 1}", rule)


def _charts_sheet(book, summary: pd.DataFrame, breakdown: Optional[pd.DataFrame]) -> None:
    """Bar charts drawn from the sheets' own cells, one bar group per configuration; every value
    axis starts at zero, so bar heights compare as the numbers do."""
    ws = book.create_sheet("Charts")
    n = len(summary)
    if n == 0:
        ws["A1"] = "no configurations"
        return
    used = [c for c in summary.columns if c.endswith(" used MiB")]
    specs = [("Max global batch per configuration", "global batch", ["Max Global BSZ"]),
             ("Throughput per configuration", "samples/s", ["Throughput (samples/sec)"]),
             ("Peak memory per device per configuration (at its max batch)", "MiB", used)]
    for i, (title, y_title, cols) in enumerate(specs):
        ws.add_chart(_bar_chart(book["Summary"], summary, title, y_title, cols), f"A{1 + i * 22}")
    if breakdown is not None and len(breakdown):
        micro = int(breakdown["micro batch"].iloc[0])
        chart = _bar_chart(book[BREAKDOWN], breakdown, f"Memory per device at micro-batch {micro}, by kind", "MiB",
                           list(PARTS))
        chart.grouping, chart.overlap = "stacked", 100
        ws.add_chart(chart, f"A{1 + len(specs) * 22}")


def _bar_chart(src, df: pd.DataFrame, title: str, y_title: str, cols: list[str]):
    from openpyxl.chart import BarChart, Reference
    from openpyxl.chart.data_source import AxDataSource, StrRef

    n = len(df)
    col = {c: df.columns.get_loc(c) + 1 for c in df.columns}
    chart = BarChart()
    chart.type, chart.title, chart.y_axis.title = "col", title, y_title
    chart.x_axis.title = "configuration"
    chart.y_axis.scaling.min = 0
    chart.x_axis.delete = chart.y_axis.delete = False  # openpyxl 3.1 hides both axes by default
    for c in cols:
        chart.add_data(Reference(src, min_col=col[c], min_row=1, max_row=n + 1), titles_from_data=True)
    labels = Reference(src, min_col=col["config"], min_row=2, max_row=n + 1)
    for series in chart.series:  # the labels are text: a string reference, not openpyxl's default number one
        series.cat = AxDataSource(strRef=StrRef(f=str(labels)))
    chart.width, chart.height = max(16, 2.2 * n), 10
    return chart


def _environment_sheet(xw: pd.ExcelWriter, tables: list[tuple[str, pd.DataFrame]]) -> None:
    from openpyxl.styles import Font
    from openpyxl.utils import get_column_letter

    row = 0
    for title, df in tables:
        df.to_excel(xw, sheet_name="Environment", index=False, startrow=row + 1)
        ws = xw.sheets["Environment"]
        ws.cell(row=row + 1, column=1, value=title).font = Font(bold=True, size=12)
        _style_header(ws, row + 2)
        for i, col in enumerate(df.columns, start=1):
            fmt = number_format(str(col))
            for r in range(row + 3, row + 3 + len(df)):
                if fmt:
                    ws.cell(row=r, column=i).number_format = fmt
        row += len(df) + 3
    ws = xw.sheets["Environment"]
    for i, width in enumerate((34, 60, 22, 22, 90, 90), start=1):
        ws.column_dimensions[get_column_letter(i)].width = width
