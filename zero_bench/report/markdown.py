"""DataFrames -> .csv and .md (the seed table's layout: "used / total MiB" per device)."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from zero_bench.report.files import replacing
from zero_bench.report.formats import PY_FORMATS, number_format
from zero_bench.report.views import summary_view

BREAKDOWN_NOTE = ("Model states: the worker's exact counts. Activations: the estimate's bytes per sample x the "
                  "micro-batch (the same for every ZeRO stage). Buffers: the estimate's, from the ds_config "
                  "(FSDP2: its gathered parameters and unsharded gradients). "
                  "Runtime: the process before the model is built (recorded, or the estimate's fixed cost). "
                  "Other: the measured peak at the configuration's own max micro-batch minus all of these "
                  "(negative: they overcount). Total: the sum at this micro-batch.")

def write_csv(path: Path, summary: pd.DataFrame) -> None:
    with replacing(path) as tmp:
        summary.to_csv(tmp, index=False)


def write_markdown(path: Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)


def markdown_report(rep, pngs: list[Path]) -> str:
    """The recommendation, the Summary in the reference table's layout, what each optimization buys,
    the memory breakdown, the charts (PNG files beside the .md) and scaling; the rest is in the
    .xlsx / .csv."""
    env = rep.env
    hw = env.get("gpu") if env.get("gpu count") else f"CPU: {env.get('cpu')} ({env.get('cpu cores')} cores)"
    parts = ["# zero_bench report", "",
             f"{hw} | torch {env.get('torch')} | deepspeed {env.get('deepspeed')} | "
             f"megatron-core {env.get('megatron-core')}", ""] + _recommendation(rep.preface())
    parts += ["## Summary", "", markdown_table(_markdown_summary(summary_view(rep.summary)))]
    if rep.buys is not None and len(rep.buys):
        parts += ["", "## What each optimization buys", "", markdown_table(rep.buys)]
    if rep.breakdown is not None and len(rep.breakdown):
        parts += ["", f"## Memory per device at micro-batch {int(rep.breakdown['micro batch'].iloc[0])}", "",
                  BREAKDOWN_NOTE, "", markdown_table(rep.breakdown.drop(columns=["micro batch"]))]
    if rep.predicted is not None and len(rep.predicted):
        parts += ["", "## Predicted vs measured (per rank, at each configuration's max batch)", "",
                  markdown_table(rep.predicted)]
    if pngs:
        parts += ["", "## Charts", ""] + [f"![{p.stem}]({p.name})" for p in pngs]
    if len(rep.scaling):
        parts += ["", "## Scaling", "", markdown_table(rep.scaling.drop(columns=["config"]))]
    return "\n".join(parts) + "\n"


def _recommendation(lines: list[tuple[str, str]]) -> list[str]:
    """The Summary sheet's preface as Markdown: a heading, a bold line per group, a bullet per sentence."""
    out = []
    for style, text in lines:
        if style == "title":
            out += [f"## {text}", ""]
        elif style == "group":
            out += ([""] if out[-1:] != [""] else []) + [f"**{text}**", ""]
        elif style == "note":
            out += ["", f"_{text}_"]
        else:
            out.append(f"- {text}")
    return out + ([""] if out else [])


def _markdown_summary(view: pd.DataFrame) -> pd.DataFrame:
    """The table's layout: the "used / total" text per device, not the numbers beside it."""
    df = view.drop(columns=[c for c in view.columns if c.endswith(" used MiB")] + ["config"])
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
