"""The Markdown report's charts as PNG files beside it (matplotlib, no display): max global batch,
throughput, and the memory per device by kind at a common batch. Every value axis starts at zero,
so bar heights compare as the numbers do."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

from zero_bench.report.xlsx import PARTS, replacing

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
    measured = summary[summary["Max Global BSZ"].notna()]
    if measured.empty:
        return []
    base = Path(md_path).with_suffix("")
    out = [_bars(Path(f"{base}_max_batch.png"), measured, "Max Global BSZ", "max global batch"),
           _bars(Path(f"{base}_throughput.png"), measured, "Throughput (samples/sec)", "samples/s")]
    if breakdown is not None and len(breakdown):
        out.append(_stacked(Path(f"{base}_memory.png"), breakdown))
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
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(df)), 4.5))
    bottom = pd.Series(0.0, index=df.index)
    for part, colour in zip(PARTS, COLOURS):
        ax.bar(labels, df[part], bottom=bottom, label=part.replace(" MiB", ""), color=colour)
        bottom += df[part]
    micro = int(df["micro batch"].iloc[0])
    _finish(ax, f"memory per device at micro-batch {micro} - {common}", "MiB")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
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
