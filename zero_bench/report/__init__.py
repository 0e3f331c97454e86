"""`zero_bench report`: store(s) -> DataFrames -> .xlsx (for the stakeholder), .csv, .md (for the PR).

One Summary row per configuration: a SearchResult, or a trial no search owns (`zero_bench run`).
Failed configurations keep their row, with the reason in Notes. Above the Summary (sheet and .md):
the recommendation per model and device (recommend.py); with a price and/or a token count, cost
and time to train (costs.py). Every file is written to a temporary name beside the target and moved
over it, so a crash mid-export leaves the previous report intact.

rows.py: stores -> one Row per configuration, each read as a BenchConfig by one reader (bench_of:
config.stored.stored_config); tables.py: Rows -> DataFrames; views.py: the stakeholder's views of
them; recommend.py, costs.py, predicted.py: recommendation, cost, predicted vs measured; xlsx.py, layout.py, formats.py,
sheet_charts.py: the workbook; markdown.py, charts.py, files.py: .md / .csv, PNG charts, atomic writes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

from zero_bench.config.schema import ConfigError, ReportConfig
from zero_bench.devices.environment import machine_environment
from zero_bench.report.charts import write_charts
from zero_bench.report.costs import assumptions, with_costs
from zero_bench.report.markdown import markdown_report, write_csv, write_markdown
from zero_bench.report.predicted import predicted_frame
from zero_bench.report.recommend import Advice, advice_lines, recommend
from zero_bench.report.rows import find_stores, load, rows_of
from zero_bench.report.tables import (ESTIMATE_COLUMNS, PRED_TPS, SEED_COLUMNS, Peaks, compare_frame, environment_frames,
                                      recorded_environment, scaling_frame, summary_frame, trials_frame)
from zero_bench.report.views import breakdown_frame, buys_frame, summary_view
from zero_bench.report.xlsx import BREAKDOWN, BUYS, PREDICTED, write_xlsx

__all__ = ["Report", "ReportConfig", "build", "write_reports", "ESTIMATE_COLUMNS", "SEED_COLUMNS",
           "Peaks", "find_stores", "load", "rows_of", "summary_frame"]

@dataclass
class Report:
    summary: pd.DataFrame  # every column (the Details sheet, the CSV); the Summary sheet is a view of it
    trials: pd.DataFrame
    scaling: pd.DataFrame
    environment: list[tuple[str, pd.DataFrame]]
    env: dict
    breakdown: pd.DataFrame = None  # memory by kind at a common batch
    buys: pd.DataFrame = None  # what each optimization buys
    advice: list[Advice] = field(default_factory=list)  # the recommendation, per model and device
    predicted: pd.DataFrame = None  # the estimate's terms beside the measured ones
    assumptions: str = ""  # what the cost columns assume ("" without a price or token count)

    def preface(self) -> list[tuple[str, str]]:
        """The recommendation as (style, text) lines: what the Summary sheet and the .md open with."""
        if not self.advice:
            return []
        lines = [("title", "Recommendation")] + advice_lines(self.advice)
        return lines + ([("note", self.assumptions)] if self.assumptions else [])

    def sheets(self) -> dict[str, pd.DataFrame]:
        out = {"Summary": summary_view(self.summary), "Details": self.summary}
        for name, df in ((BUYS, self.buys), (BREAKDOWN, self.breakdown), (PREDICTED, self.predicted)):
            if df is not None and len(df):
                out[name] = df
        out["Trials"] = self.trials
        if len(self.scaling):
            out["Scaling"] = self.scaling
        return out


def build(runs: str | Path, key: str = "report.runs", options: Optional[ReportConfig] = None,
          traced: bool = False) -> Report:
    """Store(s) -> every table of the report (nothing written); `key` names the input in errors;
    `options` add the cost columns (price, tokens to train); `traced` the traced prediction beside
    the formula's on the Predicted vs measured sheet (`traced=true`: seconds per configuration)."""
    sources = find_stores(runs)
    if not sources:
        raise ConfigError(f"{key}={runs}: no store (*.sqlite) found there")
    loaded = load(sources, key)
    if not loaded.searches and not loaded.trials:
        raise ConfigError(f"{key}={runs}: the store(s) hold no results yet")
    rows = rows_of(loaded)
    recorded = recorded_environment(loaded)
    env = recorded or machine_environment()
    env_source = ("recorded with the results" if recorded else
                  "the machine that wrote this report (the store does not record one)")
    peaks = Peaks(env)
    price, tokens = (options.price_per_device_hour, options.train_tokens) if options else (None, None)
    summary = with_costs(summary_frame(rows, peaks), price, tokens)
    return Report(summary=summary, trials=trials_frame(loaded), scaling=scaling_frame(summary),
                  environment=environment_frames(env, env_source, peaks, rows, loaded, sources), env=env,
                  breakdown=breakdown_frame(rows), buys=buys_frame(summary), advice=recommend(summary, tokens),
                  predicted=predicted_frame(rows, traced),
                  assumptions=assumptions(price, tokens, PRED_TPS in summary.columns))


# Older reports' spellings of the seed table's columns (shared/seeds/zero_table_8xA100.md spells them now).
_LEGACY = {"ZeRO stage": "ZeRO Stage", "CPU offload": "CPU Offload", "throughput (samples/s)": "Throughput (samples/sec)"}


def compare_summary(compare: str | Path) -> pd.DataFrame:
    """The other side of a comparison: a store (or dir / glob of stores), or a report .xlsx already written."""
    if str(compare).endswith(".xlsx") and Path(compare).is_file():
        # a workbook written before the columns took the seed table's spellings reads the same
        return pd.read_excel(compare, sheet_name="Details").rename(columns=lambda c: _LEGACY.get(c, c))
    return build(compare, key="report.compare").summary


def side_names(runs, compare) -> tuple[str, str]:
    def name(p, fallback: str) -> str:
        return Path(p).stem if Path(p).exists() else fallback

    a, b = name(runs, "runs"), name(compare, "compare")
    return (a, b) if a != b else ("runs", "compare")


def output_paths(out: str | Path) -> tuple[Path, Path, Path]:
    out = Path(out)
    base = out.with_suffix("") if out.suffix in (".xlsx", ".csv", ".md") else out
    return Path(f"{base}.xlsx"), Path(f"{base}.csv"), Path(f"{base}.md")


def write_reports(opts: ReportConfig, traced: bool = False) -> list[Path]:
    """`zero_bench report`: the .xlsx, .csv and .md beside each other; returns their paths."""
    rep = build(opts.runs, options=opts, traced=traced)
    sheets = rep.sheets()
    if opts.compare:
        sheets["Compare"] = compare_frame(rep.summary, compare_summary(opts.compare),
                                          side_names(opts.runs, opts.compare))
    xlsx, csv, md = output_paths(opts.out)
    write_xlsx(xlsx, sheets, rep.environment, rep.preface())
    write_csv(csv, rep.summary)
    pngs = write_charts(md, sheets["Summary"], rep.breakdown)
    write_markdown(md, markdown_report(rep, pngs))
    return [xlsx, csv, md, *pngs]
