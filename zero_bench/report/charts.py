"""The Markdown report's charts as PNG files beside it (matplotlib, no display): max global batch,
throughput, the memory per device by kind at a common batch, and the trade-off: each configuration
a labelled point, throughput (and, with a price, cost per 1M tokens) against max global batch.
Every axis starts at zero, so heights and distances compare as the numbers do."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

from zero_bench.report.costs import COST_PER_MTOK
from zero_bench.report.files import replacing
from zero_bench.report.tables import batch_rows
from zero_bench.report.views import PARTS

COLOURS = ("#4472C4", "#ED7D31", "#A5A5A5", "#FFC000")


def short_labels(labels: list[str]) -> tuple[str, list[str]]:
    """Words every label shares (the title says them once) and what is left of each label."""
    words = [str(x).split() for x in labels]
    common = [w for w in words[0] if all(w in ws for ws in words)] if words else []
    rest = [" ".join(w for w in ws if w not in common) or "(all)" for ws in words]
    return " ".join(common), rest


def write_charts(md_path: Path, summary: pd.DataFrame, breakdown: Optional[pd.DataFrame]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    measured = batch_rows(summary)
    measured = measured[measured["Max Global BSZ"].notna()]
    if measured.empty:
        return []
    base = Path(md_path).with_suffix("")
    out = [_bars(Path(f"{base}_max_batch.png"), measured, "Max Global BSZ", "max global batch"),
           _bars(Path(f"{base}_throughput.png"), measured, "Throughput (samples/sec)", "samples/s")]
    if breakdown is not None and len(breakdown):
        out.append(_stacked(Path(f"{base}_memory.png"), breakdown))
    out.append(_tradeoff(Path(f"{base}_tradeoff.png"), measured, "Throughput (samples/sec)", "throughput",
                         "samples/s"))
    if COST_PER_MTOK in measured.columns and measured[COST_PER_MTOK].notna().any():
        out.append(_tradeoff(Path(f"{base}_cost.png"), measured, COST_PER_MTOK, "cost per 1M tokens",
                             "cost per 1M tokens"))
    return out


def _bars(path: Path, df: pd.DataFrame, col: str, y_label: str) -> Path:
    import matplotlib.pyplot as plt

    common, labels = short_labels(list(df["config"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(df)), 4))
    bars = ax.bar(labels, df[col].fillna(0), color=COLOURS[0])
    ax.bar_label(bars, fmt="{:,.0f}" if col == "Max Global BSZ" else "{:,.1f}")
    _finish(ax, f"{y_label} - {common}", y_label)
    return _save(fig, path)


def _stacked(path: Path, df: pd.DataFrame) -> Path:
    import matplotlib.pyplot as plt

    common, labels = short_labels(list(df["config"]))
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(df) + 3), 4.5))
    bottom = pd.Series(0.0, index=df.index)
    for part, colour in zip(PARTS[:-1], COLOURS):  # the explained kinds; "other" is the gap to the total
        ax.bar(labels, df[part].fillna(0), bottom=bottom, label=part.replace(" MiB", ""), color=colour)
        bottom += df[part].fillna(0)
    ax.scatter(labels, df["total MiB"], marker="_", s=900, linewidths=2.5, color="black", zorder=3,
               label="total (from the measured peak); gap = other")
    micro = int(df["micro batch"].iloc[0])
    _finish(ax, f"memory per device at micro-batch {micro}", "MiB")
    ax.set_xlabel(common)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, markerscale=0.3)
    return _save(fig, path)


def _tradeoff(path: Path, df: pd.DataFrame, col: str, what: str, y_label: str) -> Path:
    """Each configuration a point at (max global batch, `col`), its short label beside it."""
    import matplotlib.pyplot as plt

    common, labels = short_labels(list(df["config"]))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    x, y = df["Max Global BSZ"].astype(float), df[col].astype(float)
    ax.scatter(x, y, s=45, color=COLOURS[0], zorder=3)
    for xi, yi, label in zip(x, y, labels):
        if pd.notna(xi) and pd.notna(yi):
            ax.annotate(label, (xi, yi), xytext=(6, 4), textcoords="offset points", fontsize=8)
    ax.set_xlim(left=0, right=max(x.max(), 1) * 1.25)
    ax.set_ylim(top=max(y.max(), 0) * 1.2 or None)
    _finish(ax, f"{what} against max global batch", y_label)
    ax.set_xlabel(f"max global batch (samples) - {common}" if common else "max global batch (samples)")
    ax.tick_params(axis="x", labelrotation=0)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _finish(ax, title: str, y_label: str) -> None:
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(y_label)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path
