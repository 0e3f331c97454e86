"""Figures measured on real runs, stored as measured (tests/data/measured/*.json), with where and how
each set was taken: the machine, the date, the command and the versions. Benchmarks and tests compare
the estimate and the trace with these; nothing here is computed from what it checks."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "measured"
LIVE_PEAKS = DATA / "fsdp2_live_peaks.json"


@dataclass(frozen=True)
class LivePeak:
    """One measured configuration: zero_bench's keys beyond hardware=cpu model=... engine=fsdp2
    parallel.dp=2, the micro-batch, rank 0's peak live tensors (MiB) and the set it belongs to."""
    model: str
    overrides: tuple[str, ...]
    micro: int
    mib: float
    source: str


def live_peaks(path: Path = LIVE_PEAKS) -> list[LivePeak]:
    doc = json.loads(path.read_text())
    out = []
    for s in doc["sets"]:
        for r in s["rows"]:
            mib = r["peak_live_mib"] if "peak_live_mib" in r else r["peak_live_bytes"][0] / 2**20
            out.append(LivePeak(r["model"], tuple(r["overrides"]), r["micro"], mib, s["name"]))
    return out


def prototype_peaks() -> dict:
    """issue 29's prototype: (model, precision, zero, micro) -> MiB (tests/unit/test_fsdp2.py's key)."""
    out = {}
    for p in live_peaks():
        if p.source.startswith("issue 29"):
            keys = dict(o.split("=", 1) for o in p.overrides)
            out[(p.model, keys["precision"], int(keys["zero"]), p.micro)] = p.mib
    return out


def llama_tiny_peaks() -> list[LivePeak]:
    """Every stored llama-tiny row (several runs of one configuration are each kept)."""
    return [p for p in live_peaks() if p.model == "llama-tiny"]
