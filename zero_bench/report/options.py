"""The `report:` section as a typed object; a bad value fails here, in one line naming the key."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional

from zero_bench.config import number
from zero_bench.errors import ConfigError


@dataclass(frozen=True)
class ReportOptions:
    runs: str
    """Where the results are: a store (.sqlite), a directory searched for stores, or a glob."""
    out: str = "reports/zero_bench.xlsx"
    """The workbook's path; the .csv, the .md and its PNG charts are written beside it, same stem."""
    compare: Optional[str] = None
    """Another store (or directory / glob of stores, or a report .xlsx) to put side by side."""
    price_per_device_hour: Optional[float] = None
    """What one device (GPU, or CPU rank) costs per hour, in any currency; None: no cost columns."""
    train_tokens: Optional[float] = None
    """Tokens of a training run to size (e.g. 1e12): its time and, with a price, its cost; None: not shown."""


def report_options(section: Mapping[str, Any]) -> ReportOptions:
    """The `report:` section (a plain dict; `runs` already resolved to a store) -> ReportOptions."""
    allowed = [f.name for f in fields(ReportOptions)]
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ConfigError(f"report.{unknown[0]}: unknown key; allowed: {', '.join(allowed)}")
    runs, out, compare = section.get("runs"), section.get("out", ReportOptions.out), section.get("compare")
    if not runs or not isinstance(runs, (str, Path)):
        raise ConfigError(f"report.runs={runs}: must be a store path, a directory or a glob")
    if not out or not isinstance(out, (str, Path)):
        raise ConfigError(f"report.out={out}: must be a path (the .csv and .md are written beside it)")
    if compare is not None and not isinstance(compare, (str, Path)):
        raise ConfigError(f"report.compare={compare}: must be a store path, a directory, a glob or a report .xlsx")
    return ReportOptions(runs=str(runs), out=str(out), compare=None if compare in (None, "") else str(compare),
                         price_per_device_hour=_optional_number(section, "price_per_device_hour"),
                         train_tokens=_optional_number(section, "train_tokens"))


def _optional_number(section: Mapping[str, Any], key: str) -> Optional[float]:
    value = section.get(key)
    return None if value is None else number(f"report.{key}", value)
