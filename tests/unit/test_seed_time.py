"""benchmarks/seed_time.py's seams: the reference table's time/it read per row (ms, one optimizer step
over the row's max global batch), the predicted step split into parts that add up to it, and the
summary of the ratios. Pure arithmetic, no launch."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zero_bench.estimate.time import TimePrediction, TimeTerm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import seed_table  # noqa: E402
import seed_time  # noqa: E402

MEM = " | ".join(["30760MiB / 40537MiB"] * 8)
# Two rows as shared/seeds/zero_table_8xA100.md writes them (its GPT-345M dp8 ZeRO-0 row and a
# cannot-initialize row)
TABLE = f"""
| GPT-345M | 24 | 1024 | 16 | 8 | 8 | 1 | 0 | No | 256 | 1658.238935 | 154.3806472 | {MEM} | |
| GPT-2.5B | 48 | 2048 | 16 | 8 | 8 | 1 | 0 | No | Cannot even initialize model | | | {" | ".join([""] * 8)} | |
"""


def test_a_rows_time_per_iteration_is_read_in_ms_with_its_global_batch():
    ran, cannot = seed_table.parse(TABLE)
    assert (ran.batch, ran.dp, ran.time_ms) == (256, 8, pytest.approx(1658.238935))
    assert ran.batch / (ran.time_ms / 1e3) == pytest.approx(154.3806472)  # the table's samples/s
    assert cannot.batch is None and cannot.time_ms is None
    assert "no measured time/it" in seed_time.skipped(cannot, None)


def _prediction(*terms: TimeTerm) -> TimePrediction:
    return TimePrediction(terms, sum(t.seconds for t in terms if t.exposed), 1.0, None, 1, 1)


def test_the_parts_add_up_to_the_step_and_an_overlapped_gather_is_not_compute():
    p = _prediction(TimeTerm("forward matmuls", 1.0, True, ""), TimeTerm("recompute (full)", 0.5, True, ""),
                    TimeTerm("parameter all-gather (forward)", 9.0, False, ""),
                    TimeTerm("tensor-parallel all-reduce", 0.25, True, ""),
                    TimeTerm("optimizer step (host, CPU Adam)", 0.125, True, ""),
                    TimeTerm("step overhead", 0.01, True, ""))
    parts = seed_time.breakdown(p)
    assert parts == {"compute": 1.5, "comm": 0.25, "host": 0.125, "other": 0.01}
    assert sum(parts.values()) == pytest.approx(p.step_s)
    assert seed_time.part_of("parameter all-gather (forward)") == "comm"


def test_every_term_of_an_offloaded_zero3_row_lands_in_a_named_part():
    """A term the estimate gains later must not fall silently into 'other' (which holds the device's
    optimizer step, the gradient norm and the assumed overhead only)."""
    row = seed_table.Row("GPT-345M", 8, 8, 1, 3, True, 512, None, 3497.0)
    p = seed_table.predict(row).time_at(64)
    others = {t.name for t in p.terms if seed_time.part_of(t.name) == "other"}
    assert others <= {"gradient norm", "optimizer step (device)", "step overhead"}
    assert seed_time.breakdown(p)["host"] > 0 and sum(seed_time.breakdown(p).values()) == pytest.approx(p.step_s)


def test_summary_counts_within_15_percent_and_within_2x():
    s = seed_time.summarize([0.4, 0.5, 0.86, 1.0, 2.1])
    assert (s.rows, s.median, s.low, s.high) == (5, 0.86, 0.4, 2.1)
    assert (s.within_15, s.within_2x) == (2, 3)
