"""The workbook's Charts sheet: openpyxl charts drawn from the sheets' own cells.

Bars per configuration (max global batch, throughput, peak memory per device, memory by kind at a
common batch) and the trade-off: each configuration a labelled point, throughput (and, with a price,
cost per 1M tokens) against max global batch. Every value axis starts at zero, so heights and
distances compare as the numbers do; a page break keeps each chart whole on paper.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd

from zero_bench.report.charts import short_labels
from zero_bench.report.costs import COST_PER_MTOK
from zero_bench.report.views import PARTS

WIDTH_CM, HEIGHT_CM = 18, 10.5
ROWS_PER_CHART = 24  # a chart 10.5 cm high spans about 20 rows of 15 pt; plus a gap
CHARTS_PER_PAGE = 2


LABELS_COLUMN = 13  # column M: right of the charts (18 cm: columns A-K)


@dataclass(frozen=True)
class Labels:
    ref: object  # Reference to the short labels' cells
    common: str  # the words every label shares


@dataclass(frozen=True)
class Table:
    """Where a DataFrame was written: its sheet and the row of its header (1-based)."""
    ws: object
    df: pd.DataFrame
    header_row: int = 1

    def ref(self, col: str, first: Optional[int] = None, last: Optional[int] = None):
        from openpyxl.chart import Reference

        c = self.df.columns.get_loc(col) + 1
        return Reference(self.ws, min_col=c, min_row=first or self.header_row, max_row=last or self.last_row)

    @property
    def last_row(self) -> int:
        return self.header_row + len(self.df)

    def row_of(self, i: int) -> int:
        """The sheet row of the frame's i-th row (by position)."""
        return self.header_row + 1 + i


def charts_sheet(book, summary: Table, breakdown: Optional[Table]) -> None:
    ws = book.create_sheet("Charts")
    if summary.df.empty:
        ws["A1"] = "no configurations"
        return
    labels = _labels(ws, summary, LABELS_COLUMN)
    used = [c for c in summary.df.columns if c.endswith(" used MiB")]
    charts = [_bars(summary, labels, "Max global batch per configuration", "global batch", ["Max Global BSZ"]),
              _bars(summary, labels, "Throughput per configuration", "samples/s", ["Throughput (samples/sec)"]),
              _bars(summary, labels, "Peak memory per device per configuration (at its max batch)", "MiB", used)]
    if breakdown is not None and len(breakdown.df):
        charts.append(_stacked(breakdown, _labels(ws, breakdown, LABELS_COLUMN + 3)))
    charts.append(_tradeoff(summary, "Throughput (samples/sec)", "Throughput", "samples/s"))
    if COST_PER_MTOK in summary.df.columns and summary.df[COST_PER_MTOK].notna().any():
        charts.append(_tradeoff(summary, COST_PER_MTOK, "Cost per 1M tokens", "cost per 1M tokens"))
    _place(ws, charts)


def _labels(ws, src: Table, column: int) -> Labels:
    """The charts' category labels, beside the charts (outside the print area): what tells the
    configurations apart, the full label next to it. Full labels on the axis, rotated, took most of
    the chart; LibreOffice reads categories from cells only (it ignores literal ones)."""
    from openpyxl.chart import Reference
    from openpyxl.styles import Font
    from openpyxl.utils import get_column_letter

    common, names = short_labels(list(src.df["config"]))
    for c, title in ((column, f"chart label ({src.ws.title})"), (column + 1, "configuration")):
        ws.cell(1, c, title).font = Font(name="Calibri", bold=True)
    for i, (name, full) in enumerate(zip(names, src.df["config"]), start=2):
        ws.cell(i, column, name)
        ws.cell(i, column + 1, full)
    ws.column_dimensions[get_column_letter(column)].width = max(len(n) for n in names + ["chart label"]) + 4
    ws.column_dimensions[get_column_letter(column + 1)].width = max(len(str(f)) for f in src.df["config"]) + 3
    return Labels(Reference(ws, min_col=column, min_row=2, max_row=len(names) + 1), common)


def _place(ws, charts: list) -> None:
    from openpyxl.worksheet.pagebreak import Break

    for i, chart in enumerate(charts):
        ws.add_chart(chart, f"A{1 + i * ROWS_PER_CHART}")
        if i % CHARTS_PER_PAGE == CHARTS_PER_PAGE - 1 and i + 1 < len(charts):
            ws.row_breaks.append(Break(id=(i + 1) * ROWS_PER_CHART))
    ws.print_area = f"A1:K{len(charts) * ROWS_PER_CHART}"


def _bars(src: Table, labels: Labels, title: str, y_title: str, cols: list[str]):
    """Bars from the table's cells, one group per configuration; the words all labels share go to
    the axis title."""
    from openpyxl.chart import BarChart
    from openpyxl.chart.data_source import AxDataSource, StrRef

    chart = BarChart()
    chart.type, chart.title, chart.y_axis.title = "col", title, y_title
    chart.x_axis.title = f"configuration: {labels.common}" if labels.common else "configuration"
    _axes_from_zero(chart)
    for c in cols:
        chart.add_data(src.ref(c), titles_from_data=True)
    for series in chart.series:  # text labels: a string reference (openpyxl's default is a number one)
        series.cat = AxDataSource(strRef=StrRef(f=str(labels.ref)))
    chart.width, chart.height = max(WIDTH_CM, 2.2 * len(src.df)), HEIGHT_CM
    return chart


def _stacked(src: Table, labels: Labels):
    """The explained kinds stacked, the total at that batch a marker above them: the gap is "other"
    (a marker inside the stack: the kinds overcount the measured peak)."""
    from openpyxl.chart import LineChart

    micro = int(src.df["micro batch"].iloc[0])
    title = f"Memory per device at micro-batch {micro}, by kind (marker: total from the measured peak)"
    chart = _bars(src, labels, title, "MiB", list(PARTS[:-1]))
    chart.grouping, chart.overlap = "stacked", 100
    total = LineChart()
    total.add_data(src.ref("total MiB"), titles_from_data=True)
    line = total.series[0]
    _marker(line, "dash", 16, "000000")
    chart += total
    return chart


def _tradeoff(src: Table, y_col: str, what: str, y_title: str):
    """One series per configuration (a marker, no line) named by its short label, shown beside it."""
    from openpyxl.chart import ScatterChart, Series
    from openpyxl.chart.label import DataLabelList

    df = src.df
    common, names = short_labels(list(df["config"]))
    chart = ScatterChart()
    chart.title = f"{what} against max global batch"
    chart.x_axis.title = "max global batch (samples)" + (f" - {common}" if common else "")
    chart.y_axis.title = y_title
    chart.style, chart.legend = 13, None
    _axes_from_zero(chart)
    for i, name in enumerate(names):
        if pd.isna(df["Max Global BSZ"].iloc[i]) or pd.isna(df[y_col].iloc[i]):
            continue
        row = src.row_of(i)
        s = Series(src.ref(y_col, row, row), src.ref("Max Global BSZ", row, row), title=name)
        _marker(s, "circle", 9, "4472C4")
        s.dLbls = DataLabelList(showSerName=True, showVal=False, showLegendKey=False, showCatName=False,
                                showPercent=False, dLblPos="r")
        chart.series.append(s)
    chart.width, chart.height = WIDTH_CM, HEIGHT_CM
    return chart


def _marker(series, symbol: str, size: int, colour: str) -> None:
    """A filled marker and no line (LibreOffice draws an unfilled marker as nothing)."""
    from openpyxl.chart.shapes import GraphicalProperties

    series.marker.symbol, series.marker.size = symbol, size
    series.marker.graphicalProperties = GraphicalProperties(solidFill=colour)
    series.marker.graphicalProperties.line.solidFill = colour
    series.graphicalProperties.line.noFill = True


def _axes_from_zero(chart) -> None:
    chart.y_axis.scaling.min = 0
    if getattr(chart.x_axis, "scaling", None) is not None and chart.tagname == "scatterChart":
        chart.x_axis.scaling.min = 0
    chart.x_axis.delete = chart.y_axis.delete = False  # openpyxl 3.1 hides both axes by default
