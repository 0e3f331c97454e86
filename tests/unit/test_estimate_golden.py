"""`zero_bench estimate`'s output for GPU configurations, held to a golden file
(tests/data/estimate_golden.json): a change to the estimate that moves a figure shows here, named
by configuration, and is regenerated on purpose (`python tests/unit/test_estimate_golden.py`), with
the commit saying which figures moved and why. GPU presets only: a CPU estimate reads this
machine's CPU and RAM. Issue 44 asks for the estimate to be reshaped with its output byte-identical."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "estimate_golden.json"

CASES = [
    ("model=gpt2.5b", "zero=3", "offload=true", "parallel=dp8", "hardware=a100_40gb"),
    ("model=gpt345m", "parallel=mp8", "hardware=a100_40gb", "precision=fp16", "recompute=full"),
    ("model=llama3-8b", "parallel=dp8", "hardware=h100_80gb", "recompute=full"),
    ("model=llama3-8b", "parallel=dp8", "hardware=h100_80gb"),
    ("model=llama3-8b", "parallel=dp8", "hardware=h100_80gb", "fusions=false", "model.attention=sdpa"),
    ("model=llama3-8b", "parallel=dp8", "hardware=h100_80gb", "engine=fsdp2", "zero=3", "recompute=op"),
    ("model=qwen3-0.6b", "parallel=dp4", "hardware=h100_80gb", "states=bf16", "loss=chunked"),
    ("model=mixtral-8x7b", "parallel=dp8", "hardware=h200_141gb", "zero=2", "parallel.ep=8", "recompute=full"),
    ("model=llama3.1-70b", "parallel=dp8", "hardware=h200_141gb", "zero=3", "offload=true", "json=true"),
]


def report(case: tuple) -> str:
    from zero_bench.config.configure import compose
    from zero_bench.estimate.table import estimate_report

    return estimate_report(compose(list(case)), frozenset(x.split("=")[0] for x in case))


@pytest.mark.parametrize("case", CASES, ids=lambda c: " ".join(c))
def test_estimate_output_is_the_golden_one(case):
    want = json.loads(GOLDEN.read_text())[" ".join(case)]
    assert report(case) == want


if __name__ == "__main__":  # regenerate, on purpose
    GOLDEN.write_text(json.dumps({" ".join(c): report(c) for c in CASES}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
