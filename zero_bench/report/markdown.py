"""DataFrames -> .csv and .md (the seed table's layout: "used / total MiB" per device)."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from zero_bench.report.formats import PY_FORMATS, number_format
from zero_bench.report.xlsx import replacing

def write_csv(path: Path, summary: pd.DataFrame) -> None:
    with replacing(path) as tmp:
        summary.to_csv(tmp, index=False)


def write_markdown(path: Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)


def markdown_report(summary: pd.DataFrame, scaling: pd.DataFrame, env: dict) -> str:
    hw = env.get("gpu") if env.get("gpu count") else f"CPU: {env.get('cpu')} ({env.get('cpu cores')} cores)"
    parts = ["# zero_bench report", "",
             f"{hw} | torch {env.get('torch')} | deepspeed {env.get('deepspeed')} | "
             f"megatron-core {env.get('megatron-core')}", "", markdown_table(_markdown_summary(summary))]
    if len(scaling):
        parts += ["", "## Scaling", "", markdown_table(scaling.drop(columns=["config"]))]
    return "\n".join(parts) + "\n"


def _markdown_summary(summary: pd.DataFrame) -> pd.DataFrame:
    """The seed's layout: one "used / total MiB" cell per device; no empty or bookkeeping columns."""
    df = summary.drop(columns=["search key", "source", "config"])
    for c in [c for c in df.columns if c.startswith("Dev") and c.endswith("used MiB")]:
        total = c.replace("used", "total")
        cell = df[c].map(_mib) + " / " + df[total].map(_mib)
        df.insert(df.columns.get_loc(c), c.replace(" used MiB", " MiB"), cell.where(df[c].notna(), ""))
        df = df.drop(columns=[c, total])
    return df.dropna(axis=1, how="all")


def _mib(v) -> str:
    return "" if pd.isna(v) else f"{v:,.0f}"


def markdown_table(df: pd.DataFrame) -> str:
    def cell(col: str, v) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
            return ""
        fmt = PY_FORMATS.get(number_format(col) or "")
        if fmt and isinstance(v, (int, float)) and not isinstance(v, bool):
            return fmt.format(v)
        if isinstance(v, float) and v.is_integer():
            return str(int(v))
        return str(v).replace("|", "\\|").replace("\n", " ")

    head = "| " + " | ".join(str(c) for c in df.columns) + " |"
    rule = "| " + " | ".join("---" for _ in df.columns) + " |"
    body = ["| " + " | ".join(cell(c, v) for c, v in zip(df.columns, rec)) + " |"
            for rec in df.itertuples(index=False)]
    return "\n".join([head, rule, *body])
