"""benchmarks/time_vs_cpu_trials.py's schedule: each checked trial runs right after the calibration
trials it is predicted from (its engine and stage's points, and its causes'), so that a slow spell of
the machine slows both alike. Configurations only, no launch."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import time_vs_cpu_trials as bench  # noqa: E402

from zero_bench.estimate.time.engine import engine_key  # noqa: E402

ORIGINAL = bench.bench
COMPOSED: dict = {}  # (model, micro, overrides) -> BenchConfig, for the module's tests

MODELS = bench.ENGINE_MODELS.split(",")


@pytest.fixture(autouse=True)
def composed_once(monkeypatch):
    """Each trial's configuration composed by Hydra once (~0.3 s each; the schedule and the oracle
    below ask for the same ones again)."""
    def cached(model, micro, overrides):
        key = (model, micro, tuple(overrides))
        if key not in COMPOSED:
            COMPOSED[key] = ORIGINAL(model, micro, list(overrides))
        return COMPOSED[key]

    monkeypatch.setattr(bench, "bench", cached)


def test_every_checked_trial_follows_its_own_calibration_trials_and_each_runs_once():
    jobs = bench.schedule(list(bench.CONFIGS), 4, MODELS)
    labels = [label for label, _ in jobs]
    assert len(labels) == len(set(labels))
    assert [label for label in labels if label in bench.CONFIGS] != list(bench.CONFIGS)  # grouped by stage
    stages = {label: engine_key(b) for label, b in jobs if label in bench.CONFIGS}
    for i, name in enumerate(labels):
        if name not in bench.CONFIGS:
            continue
        mine = [f"{key}#{k}" for key, benches in bench.engine_benches([name], 4, MODELS).items()
                for k in range(len(benches))]
        before = labels[:i]
        assert set(mine) <= set(before), name
        # nothing of another stage between the case and its stage's points
        since = labels[max(before.index(m) for m in mine):i]
        assert all(stages.get(lbl, lbl).startswith(stages[name]) for lbl in since), (name, since)


def test_engine_only_schedules_the_same_calibration_trials_without_the_checked_ones():
    every = bench.schedule(list(bench.CONFIGS), 4, MODELS)
    only = bench.schedule(list(bench.CONFIGS), 4, MODELS, checked=False)
    assert [label for label, _ in only] == [label for label, _ in every if label not in bench.CONFIGS]
