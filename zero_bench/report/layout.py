"""Column widths and row heights for the workbook: neither Excel nor openpyxl sizes rows, and
LibreOffice keeps a row's default height under a wrapped header, drawing the header over the first
data row. So every width is sized to its content and every wrapped row gets its height set here.

Widths are in Excel's unit (the width of "0" in Calibri 11). Measured in LibreOffice (DejaVu Sans
standing in for Calibri), a column W wide holds about W - 1 regular characters and W / 1.15 bold
ones; Calibri's capitals are about 1.15 "0"s wide in Excel. The factors below cover both, so a text
that fits in one fits in the other (checked with benchmarks/workbook_pages.py).
"""
from __future__ import annotations

import math

import pandas as pd

from zero_bench.report.formats import PY_FORMATS, number_format

CHAR, BOLD = 1.1, 1.2  # width units per character: regular, bold
PAD = 2  # cell margins
INDENT = 1  # text cells start one character in: a right-aligned number beside them would touch them
MIN_WIDTH, MAX_WIDTH = 6, 50  # text longer than MAX_WIDTH wraps in its cell
LINE_PT, MAX_ROW_PT = 15.0, 409.0  # one line of 11 pt text; Excel's tallest row
EPS = 1e-6  # widths are rounded to 0.1: a text that was sized to fit must not wrap


def display_text(col: str, value) -> str:
    """The cell as a reader sees it: numbers in the column's format, "" for empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    fmt = PY_FORMATS.get(number_format(str(col)) or "")
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value)


def is_text(values: pd.Series) -> bool:
    return any(isinstance(v, str) for v in values)


def indent_of(values: pd.Series) -> int:
    return INDENT if is_text(values) else 0


def column_width(col, values: pd.Series, cap: float = MAX_WIDTH) -> float:
    """Wide enough for the header's longest word (bold) and the longest value, up to `cap`."""
    word = max((len(w) for w in str(col).split()), default=0)
    body = max((len(display_text(col, v)) for v in values), default=0)
    header = word * BOLD + INDENT  # every header starts one character in: it never runs into the next
    width = min(max(header, body * CHAR + indent_of(values), MIN_WIDTH), max(cap, header))
    return round(width + PAD, 1)


def wrapped_lines(text: str, width: float, per_char: float = CHAR, indent: int = 0) -> int:
    """Lines `text` takes in a cell `width` units wide, wrapped at spaces (a longer word breaks)."""
    capacity = max(1, int((width - PAD - indent) / per_char + EPS))
    lines = 0
    for paragraph in str(text).split("\n"):
        used = 0
        lines += 1
        for word in paragraph.split(" "):
            n = len(word)
            if used and used + 1 + n <= capacity:
                used += 1 + n
            elif used:
                lines, used = lines + 1, 0
            if not used:
                lines += (n - 1) // capacity if n else 0
                used = (n - 1) % capacity + 1 if n else 0
    return lines


def row_height(lines: int) -> float:
    return min(MAX_ROW_PT, LINE_PT * lines + 2)


def needs_wrap(col, values: pd.Series, width: float) -> bool:
    room = width - PAD - indent_of(values)
    return any(len(display_text(col, v)) * CHAR > room + EPS for v in values)
