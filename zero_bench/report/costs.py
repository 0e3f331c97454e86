"""Cost and time to train from the measured throughput: what the decision is about.

Every configuration runs on "# gpus" devices (GPUs, or CPU ranks) at its own max batch; a device
costs `price` per hour (any currency). Pure arithmetic over the Details frame, nothing measured here.
"""
from __future__ import annotations

from typing import Optional

import pandas as pd

COST_PER_HOUR = "cost per hour"
COST_PER_MTOK = "cost per 1M tokens"
DAYS_TO_TRAIN = "time to train (days)"
COST_TO_TRAIN = "cost to train"
# the same from the time estimate's tokens/s (tables.PRED_TPS), every one named predicted
PRED_COST_PER_MTOK = "cost per 1M tokens (predicted)"
PRED_DAYS_TO_TRAIN = "time to train (days, predicted)"
PRED_COST_TO_TRAIN = "cost to train (predicted)"
PREDICTED_TPS = "tokens/s (predicted)"  # tables.PRED_TPS
COST_COLUMNS = [COST_PER_HOUR, COST_PER_MTOK, DAYS_TO_TRAIN, COST_TO_TRAIN]
PREDICTED_COST_COLUMNS = [PRED_COST_PER_MTOK, PRED_DAYS_TO_TRAIN, PRED_COST_TO_TRAIN]


def cost_per_hour(devices: float, price: float) -> float:
    return devices * price


def cost_per_million_tokens(devices: float, price: float, tokens_per_s: float) -> float:
    return cost_per_hour(devices, price) / (tokens_per_s * 3600) * 1e6


def days_to_train(tokens: float, tokens_per_s: float) -> float:
    return tokens / tokens_per_s / 86400


def cost_to_train(devices: float, price: float, tokens: float, tokens_per_s: float) -> float:
    return cost_per_hour(devices, price) * tokens / tokens_per_s / 3600


def with_costs(details: pd.DataFrame, price: Optional[float], train_tokens: Optional[float]) -> pd.DataFrame:
    """The Details frame with the cost columns the options allow, placed before Notes: per hour and per
    1M tokens need a price, time to train needs train_tokens, cost to train both. Rows without a
    measured throughput are left empty."""
    cols = _columns(price, train_tokens)
    if not cols or details.empty:
        return details
    devices, tps = details["# gpus"].astype(float), pd.to_numeric(details["tokens/s"], errors="coerce")
    tps = tps.where(tps > 0)
    values = {COST_PER_HOUR: lambda: cost_per_hour(devices, price).where(tps.notna()),
              COST_PER_MTOK: lambda: cost_per_million_tokens(devices, price, tps),
              DAYS_TO_TRAIN: lambda: days_to_train(train_tokens, tps),
              COST_TO_TRAIN: lambda: cost_to_train(devices, price, train_tokens, tps)}
    if PREDICTED_TPS in details.columns:  # the time estimate's: every configuration with a max batch
        ptps = pd.to_numeric(details[PREDICTED_TPS], errors="coerce")
        ptps = ptps.where(ptps > 0)
        values.update({PRED_COST_PER_MTOK: lambda: cost_per_million_tokens(devices, price, ptps),
                       PRED_DAYS_TO_TRAIN: lambda: days_to_train(train_tokens, ptps),
                       PRED_COST_TO_TRAIN: lambda: cost_to_train(devices, price, train_tokens, ptps)})
        cols += [PREDICTED[c] for c in cols if c in PREDICTED]
    out = details.copy()
    at = list(out.columns).index("Notes") if "Notes" in out.columns else len(out.columns)
    for i, col in enumerate(cols):
        out.insert(at + i, col, values[col]())
    return out


PREDICTED = {COST_PER_MTOK: PRED_COST_PER_MTOK, DAYS_TO_TRAIN: PRED_DAYS_TO_TRAIN, COST_TO_TRAIN: PRED_COST_TO_TRAIN}


def _columns(price: Optional[float], train_tokens: Optional[float]) -> list[str]:
    cols = [COST_PER_HOUR, COST_PER_MTOK] if price else []
    cols += [DAYS_TO_TRAIN] if train_tokens else []
    cols += [COST_TO_TRAIN] if price and train_tokens else []
    return cols


def present(columns) -> list[str]:
    """The cost columns among `columns` (a frame's columns, a row's index), in their order."""
    have = set(columns)
    return [c for c in COST_COLUMNS + PREDICTED_COST_COLUMNS if c in have]


def assumptions(price: Optional[float], train_tokens: Optional[float], predicted: bool = False) -> str:
    """One line saying what the cost columns assume ("" when there are none); `predicted`: the
    frame has the time estimate's cost columns too."""
    parts = []
    if price:
        parts.append(f"costs at {price:g} per device-hour (report.price_per_device_hour; devices = # gpus, "
                     "or CPU ranks)")
    if train_tokens:
        parts.append(f"time to train {tokens_text(train_tokens)} tokens (report.train_tokens) at each configuration's "
                     "measured tokens/s at its max batch")
    if predicted and (price or train_tokens):
        parts.append("the columns named predicted from the time estimate's tokens/s at the max batch "
                     "(zero_bench/estimate/time/), not measured")
    text = "; ".join(parts)
    return f"{text[:1].upper()}{text[1:]}." if text else ""


def tokens_text(tokens: float) -> str:
    """1e9 -> "1B", 1.5e12 -> "1.5T", 300000 -> "300,000"."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if tokens >= scale:
            return f"{tokens / scale:.3g}{unit}"
    return f"{tokens:,.0f}"
