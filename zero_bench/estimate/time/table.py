"""`zero_bench estimate`'s time sheet: per configuration, the predicted step at its max micro and at
batch.micro (time/it, tokens/s per device, MFU, with a price the cost per 1M tokens, with
report.train_tokens the days and cost of the run), the dominant term, and every term's seconds."""
from __future__ import annotations

from typing import Optional

from zero_bench.config.schema import BenchConfig
from zero_bench.devices.rates import HardwareRates, Rate
from zero_bench.estimate.time.record import TimePrediction

# What each kind of prediction was checked against, in one phrase (the figures: docs/estimate.md).
FIRST_MODEL = "a first model, faster than measured steps so far: a lower bound"
CPU_CHECKED = ("with the engine term calibrated here: within 15 % of 13 of 15 two-rank CPU trials in one quiet run, "
               "tp and Ulysses sp not calibrated")

MIN_SHOWN_S = 1e-3  # terms below a millisecond are left out of the terms lines (the JSON has them all)


def predictions(est, max_micro: Optional[int], micro: int) -> list[tuple[str, Optional[TimePrediction]]]:
    """(label, prediction) at the max micro (where one is predicted and differs) and at batch.micro."""
    out = []
    if max_micro and max_micro != micro:
        out.append((f"{max_micro} (max)", est.time_at(max_micro)))
    out.append((f"{micro}" + (" (max)" if max_micro == micro else ""), est.time_at(micro)))
    return out


def fits(max_micro: Optional[int], micro: int) -> str:
    """Whether the memory estimate has `micro` fit: '?' without a capacity."""
    return "?" if max_micro is None else ("yes" if micro <= max_micro else "no")


def sheet_rows(rows: list[dict], ests: list, micro: int, price: Optional[float],
               train_tokens: Optional[float]) -> list[dict]:
    """One line per configuration and micro-batch."""
    lines = []
    for r, e in zip(rows, ests):
        for label, p in predictions(e, r.get("max_micro"), micro):
            if p is None:
                continue
            line = {"config": r["config"], "micro": label, "fits": fits(r.get("max_micro"), p.micro),
                    "time/it s": f"{p.step_s:,.3f}",
                    "tokens/s/device": f"{p.tokens_per_s_per_device:,.0f}",
                    "MFU %": "-" if p.mfu is None else f"{100 * p.mfu:.1f}"}
            if price:
                line["cost per 1M tokens"] = f"{p.cost_per_million_tokens(price):,.3f}"
            if train_tokens:
                days = train_tokens / (p.tokens_per_s_per_device * e.dp * e.tp * e.pp) / 86400
                line["days to train"] = f"{days:,.1f}"
                if price:
                    line["cost to train"] = f"{train_tokens / 1e6 * p.cost_per_million_tokens(price):,.0f}"
            line["dominant term"] = f"{p.dominant.name} ({100 * p.dominant.seconds / p.step_s:.0f} %)"
            lines.append(line)
    return lines


def terms_line(config: str, p: TimePrediction) -> str:
    """`config @ micro: term s, ...` largest first; ~ marks a term overlapped with compute."""
    shown = sorted((t for t in p.terms if t.seconds >= MIN_SHOWN_S), key=lambda t: -t.seconds)
    return f"  {config} @ {p.micro}: " + ", ".join(f"{'' if t.exposed else '~'}{t.name} {t.seconds:,.3f}" for t in shown)


def assumed_line(rates: HardwareRates, shown: list[TimePrediction]) -> str:
    """The rates the shown terms used that nobody measured (to be calibrated), so no figure reads as checked."""
    used = {t.source for p in shown for t in p.terms if t.seconds > 0}
    assumed = sorted({r.source for r in vars(rates).values()
                      if isinstance(r, Rate) and r.assumed and any(r.source in s for s in used)})
    return "rates nobody measured yet (to be calibrated): " + "; ".join(assumed) if assumed else ""


def time_sheet(bench: BenchConfig, rows: list[dict], ests: list, price: Optional[float] = None,
               train_tokens: Optional[float] = None) -> str:
    """The time sheet below the memory tables."""
    micro = bench.batch.micro
    if not ests or ests[0].time is None or ests[0].time.rates is None:
        return (f"time per step: no rates for hardware.card={bench.hardware.card} (zero_bench/devices/rates.py "
                "lists A100 40GB, A100 80GB, H100, H200; the CPU's are measured)")
    import pandas as pd

    rates = ests[0].time.rates
    lines = sheet_rows(rows, ests, micro, price, train_tokens)
    # What it was checked against so far, and how far off, is stated once: docs/estimate.md.
    title = (f"predicted time per optimizer step (grad_accum {bench.batch.grad_accum}; {rates.name} rates: "
             "zero_bench/devices/rates.py; " + (CPU_CHECKED if rates.engine_points else FIRST_MODEL)
             + ", docs/estimate.md#time-per-step-predicted):")
    terms, shown = ["terms of each step, seconds (largest first; ~: overlapped with compute; source of each: --json):"], []
    for r, e in zip(rows, ests):
        p = e.time_at(r.get("max_micro") or micro)
        if p is not None:
            terms.append(terms_line(r["config"], p))
            shown.append(p)
    out = [title, pd.DataFrame(lines).to_string(index=False) if lines else "(nothing fits)", *terms]
    assumed = assumed_line(rates, shown)
    return "\n".join(out + ([assumed] if assumed else []))


def time_json(est, max_micro: Optional[int], micro: int) -> dict:
    """The JSON's `time` of one configuration: every term at its max micro and at batch.micro."""
    at_max = est.time_at(max_micro) if max_micro else None
    at = est.time_at(micro)
    return {"at_max_micro": at_max.to_dict() if at_max else None, "at_micro": at.to_dict() if at else None}

