"""Number formats by column header: Excel's for the workbook, Python's for Markdown."""
from __future__ import annotations

import re
from typing import Optional

# Excel number formats by header; compare columns ("x [a]", "x Δ") take the format of x.
FORMATS = {"MFU": "0.00%", "HFU": "0.00%", "peak memory used": "0.0%", "scaling efficiency": "0.0%",
           "num params": "#,##0", "active params": "#,##0", "Throughput (samples/sec)": "#,##0.00", "tokens/s": "#,##0",
           "tokens/s per GPU": "#,##0", "model TFLOP/s per GPU": "0.000", "speedup": "0.00", "ideal speedup": "0.00",
           "duration (s)": "0.0", "peak FLOP/s per device": "0.00E+00", "created": "yyyy-mm-dd hh:mm:ss",
           "cost per hour": "#,##0.00", "cost per 1M tokens": "#,##0.000", "time to train (days)": "#,##0.0",
           "cost to train": "#,##0", "other MiB (peak - rest)": "#,##0",
           # the time estimate's (estimate/time/), as their measured columns
           "MFU (predicted)": "0.00%", "Throughput (samples/sec, predicted)": "#,##0.00", "tokens/s (predicted)": "#,##0",
           "tokens/s per GPU (predicted)": "#,##0", "cost per 1M tokens (predicted)": "#,##0.000",
           "time to train (days, predicted)": "#,##0.0", "cost to train (predicted)": "#,##0",
           "predicted time/it (ms)": "#,##0.0", "measured time/it (ms)": "#,##0.0"}
# The same formats for the Markdown table.
PY_FORMATS = {"0.00%": "{:.2%}", "0.0%": "{:.1%}", "#,##0": "{:,.0f}", "#,##0.0": "{:,.1f}", "#,##0.00": "{:,.2f}",
              "#,##0.000": "{:,.3f}", "0.000": "{:.3f}", "0.00": "{:.2f}", "0.0": "{:.1f}", "0.00E+00": "{:.2e}"}


def number_format(col: str) -> Optional[str]:
    m = re.match(r"^(.*) (\[.*\]|Δ|ratio)$", col)
    if m:
        return "0.000" if m.group(2) == "ratio" else number_format(m.group(1))
    if col in FORMATS:
        return FORMATS[col]
    if col.startswith("time/it"):
        return "#,##0.0"
    if col.endswith("MiB"):
        return "#,##0"
    if col.endswith("(MiB/rank)"):
        return "#,##0.00"
    if col.endswith("(%)") or col.endswith("Δ %"):
        return "0.0"
    return None
