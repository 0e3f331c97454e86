"""DataFrames -> the .xlsx workbook: sheets, number formats, widths and heights, colour scale, charts.

Laid out to read cleanly in Excel and LibreOffice alike (benchmarks/workbook_pages.py renders it):
every header row has an explicit height for the lines it wraps to, every column fits its content up
to a cap beyond which text wraps (with the row's height set), and each printed page names its sheet.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pandas as pd

from zero_bench.report.files import replacing
from zero_bench.report.formats import number_format
from zero_bench.report.layout import BOLD, CHAR, INDENT, column_width, indent_of, needs_wrap, row_height, wrapped_lines
from zero_bench.report.sheet_charts import Table, charts_sheet

BUYS, BREAKDOWN, PREDICTED = "What each optimization buys", "Memory breakdown", "Predicted vs measured"
FIRST = ("Summary", "Details", BUYS, BREAKDOWN, PREDICTED, "Trials")
FONT = "Calibri"  # named, or LibreOffice draws a bold header in its default serif
MAX_FROZEN_ROWS = 12  # a longer preface scrolls away rather than fill the screen
ENVIRONMENT_WIDTHS = (34, 60, 22, 22, 90, 90)


def write_xlsx(path: Path, sheets: dict[str, pd.DataFrame], environment: list[tuple[str, pd.DataFrame]],
               preface: Sequence[tuple[str, str]] = ()) -> None:
    """Summary (the recommendation `preface` as (style, text) lines above the reference table's
    columns), Details, what each optimization buys and the memory breakdown when there are any,
    Trials, Charts, Environment, then Scaling / Compare when present."""
    with replacing(path) as tmp:
        with pd.ExcelWriter(tmp, engine="openpyxl") as xw:
            tables = {name: _table_sheet(xw, name, sheets[name], preface if name == "Summary" else ())
                      for name in FIRST if name in sheets}
            _memory_colour_scale(tables["Details"])
            charts_sheet(xw.book, tables["Summary"], tables.get(BREAKDOWN))
            _page_setup(xw.book["Charts"], title_row=None, landscape=False)
            _environment_sheet(xw, environment)
            for name, df in sheets.items():
                if name not in FIRST:
                    _table_sheet(xw, name, df)


def _table_sheet(xw: pd.ExcelWriter, name: str, df: pd.DataFrame, preface: Sequence[tuple[str, str]] = ()) -> Table:
    header_row = len(preface) + 2 if preface else 1  # a blank row between the preface and the table
    df.to_excel(xw, sheet_name=name, index=False, startrow=header_row - 1)
    ws = xw.sheets[name]
    table = Table(ws, df, header_row)
    widths = _format_columns(table)
    _align_body(table, widths)
    if preface:
        _write_preface(ws, preface, sum(widths))
    frozen = header_row <= MAX_FROZEN_ROWS
    ws.freeze_panes = ("B2" if header_row == 1 else f"A{header_row + 1}") if frozen else None
    ws.auto_filter.ref = f"A{header_row}:{ws.cell(table.last_row, max(1, len(df.columns))).coordinate}"
    _page_setup(ws, title_row=header_row)
    return table


def _page_setup(ws, title_row=1, landscape: bool = True) -> None:
    """Printed: one page wide (as many long as needed), the header on every page, the sheet's name
    at the top of each page (which sheet a printed page belongs to; workbook_pages.py reads it)."""
    ws.page_setup.orientation = "landscape" if landscape else "portrait"
    ws.page_setup.fitToWidth, ws.page_setup.fitToHeight = 1, 0
    ws.sheet_properties.pageSetUpPr.fitToPage = True
    if title_row:
        ws.print_title_rows = f"{title_row}:{title_row}"
    ws.oddHeader.center.text = "&A"
    ws.oddFooter.center.text = "page &P of &N"


def _format_columns(table: Table) -> list[float]:
    from openpyxl.utils import get_column_letter

    widths = []
    for i, col in enumerate(table.df.columns, start=1):
        widths.append(column_width(col, table.df[col]))
        ws = table.ws
        ws.column_dimensions[get_column_letter(i)].width = widths[-1]
        fmt = number_format(str(col))
        if fmt:
            for (cell,) in ws.iter_rows(min_row=table.header_row + 1, max_row=table.last_row, min_col=i, max_col=i):
                cell.number_format = fmt
    return widths


def _style_header(ws, row: int, widths: list[float]) -> None:
    from openpyxl.styles import Alignment, Font, PatternFill

    lines = 1
    for cell, width in zip(ws[row], widths):
        cell.font = Font(name=FONT, bold=True)
        cell.fill = PatternFill("solid", fgColor="DDEBF7")
        cell.alignment = Alignment(wrap_text=True, vertical="top", horizontal="left", indent=INDENT)
        lines = max(lines, wrapped_lines(str(cell.value or ""), width, BOLD, INDENT))
    ws.row_dimensions[row].height = row_height(lines)


def _align_body(table: Table, widths: list[float]) -> None:
    """Every cell at the top of its row; text one character in, wrapped where it is wider than its
    capped column, each row as high as its longest cell; then the header."""
    from openpyxl.styles import Alignment

    df, ws = table.df, table.ws
    lines = [1] * len(df)
    indents = [indent_of(df[col]) for col in df.columns]
    for j, (col, width, indent) in enumerate(zip(df.columns, widths, indents), start=1):
        wrap = needs_wrap(col, df[col], width)
        align = Alignment(vertical="top", wrap_text=wrap, indent=indent, horizontal="left" if indent else None)
        for i, v in enumerate(df[col]):
            ws.cell(table.row_of(i), j).alignment = align
            if wrap:
                lines[i] = max(lines[i], wrapped_lines("" if pd.isna(v) else str(v), width, CHAR, indent))
    for i, n in enumerate(lines):  # every row: left to itself, LibreOffice sizes wrapped rows its own way
        ws.row_dimensions[table.row_of(i)].height = row_height(n)
    _style_header(ws, table.header_row, widths)


def _write_preface(ws, lines: Sequence[tuple[str, str]], width: float) -> None:
    """(style, text) lines above the table, each merged across the table's width and wrapped."""
    from openpyxl.styles import Alignment, Font

    fonts = {"title": Font(name=FONT, bold=True, size=13), "group": Font(name=FONT, bold=True),
             "pick": Font(name=FONT), "note": Font(name=FONT, italic=True, color="595959")}
    last = ws.cell(1, max(1, ws.max_column)).column_letter
    for r, (style, text) in enumerate(lines, start=1):
        cell = ws.cell(r, 1, value=text)
        cell.font = fonts.get(style, fonts["pick"])
        cell.alignment = Alignment(wrap_text=True, vertical="top")
        ws.merge_cells(f"A{r}:{last}{r}")
        scale = 13 / 11 if style == "title" else 1
        ws.row_dimensions[r].height = row_height(wrapped_lines(text, width, BOLD if style != "pick" else CHAR)) * scale


def _memory_colour_scale(table: Table) -> None:
    """Green (room left) -> yellow -> red (at capacity) on each configuration's fullest device."""
    from openpyxl.formatting.rule import ColorScaleRule
    from openpyxl.utils import get_column_letter

    df = table.df
    if "peak memory used" not in df.columns or df.empty:
        return
    letter = get_column_letter(df.columns.get_loc("peak memory used") + 1)
    rule = ColorScaleRule(start_type="num", start_value=0, start_color="63BE7B", mid_type="num", mid_value=0.8,
                          mid_color="FFEB84", end_type="num", end_value=1, end_color="F8696B")
    table.ws.conditional_formatting.add(f"{letter}{table.header_row + 1}:{letter}{table.last_row}", rule)


def _environment_sheet(xw: pd.ExcelWriter, tables: list[tuple[str, pd.DataFrame]]) -> None:
    """Titled tables one under another, in fixed widths (long commands and JSON wrap)."""
    from openpyxl.styles import Font
    from openpyxl.utils import get_column_letter

    row = 0
    for title, df in tables:
        df.to_excel(xw, sheet_name="Environment", index=False, startrow=row + 1)
        ws = xw.sheets["Environment"]
        ws.cell(row=row + 1, column=1, value=title).font = Font(name=FONT, bold=True, size=12)
        table = Table(ws, df, row + 2)
        _align_body(table, list(ENVIRONMENT_WIDTHS[:len(df.columns)]))
        for i, col in enumerate(df.columns, start=1):
            fmt = number_format(str(col))
            for r in range(table.header_row + 1, table.last_row + 1):
                if fmt:
                    ws.cell(row=r, column=i).number_format = fmt
        row += len(df) + 3
    ws = xw.sheets["Environment"]
    for i, width in enumerate(ENVIRONMENT_WIDTHS, start=1):
        ws.column_dimensions[get_column_letter(i)].width = width
    _page_setup(ws, title_row=None)
