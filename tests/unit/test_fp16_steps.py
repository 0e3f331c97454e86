"""fp16's dynamic loss scale at the worker's seam: DeepSpeed's CPU accelerator refuses fp16, so
the engine here is a stand-in that overflows (skips the update, halves the scale) as DeepSpeed's
fp16 optimizers do. The plan logic under test is the worker's own run_entry."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from zero_bench import worker
from zero_bench.config import BenchConfig, HardwareConfig, StepsConfig

from conftest import model


class OverflowingEngine:
    """The first `overflows` optimizer steps overflow: skipped, loss scale halved."""

    def __init__(self, overflows: int, fp16: bool = True):
        self.overflows, self.steps, self.fp16 = overflows, 0, fp16
        self.optimizer = SimpleNamespace(loss_scale=2.0 ** 16)
        self.applied = False

    def fp16_enabled(self):
        return self.fp16

    def step(self):
        self.steps += 1
        self.applied = self.steps > self.overflows
        if not self.applied:
            self.optimizer.loss_scale /= 2

    def was_step_applied(self):
        return self.applied


class SeamRank(worker.Rank):
    """Rank.run_entry over the stand-in engine: a step is the engine's step, 1 s when applied."""

    def __init__(self, engine, steps: StepsConfig):
        self.cfg = BenchConfig(model=model("gpt-tiny"), hardware=HardwareConfig(device="cpu"), precision="fp16",
                               steps=steps)
        self.engine, self.on_cpu, self.rank, self.marks = engine, True, 0, worker.Marks()
        self.states, self.applied, self.applied_any, self.compile_s, self.zero_init = None, False, False, None, False

    def step(self, micro):
        self.engine.step()
        self._note_applied()
        return (1.0 if self.applied else 0.2), 5.0

    def profiled_step(self, micro):
        secs, loss = self.step(micro)
        return secs, loss, 123, "forward"

    def memory_now(self):
        return {}


@pytest.fixture(autouse=True)
def counted_states(monkeypatch):
    """Model states are counted once, after the steps before the profiled one: say which that was."""
    monkeypatch.setattr(worker, "model_state_bytes", lambda engine: {"counted_after_step": engine.steps})


def test_probe_runs_until_an_update_was_applied():
    r = SeamRank(OverflowingEngine(overflows=3), StepsConfig(warmup=2, timed=3, probe=1))
    rec = r.run_entry(4, "probe")
    # 1 probe step + 3 more until the 4th step applied; optimizer state exists only then
    assert rec.model_states == {"counted_after_step": 4}
    assert rec.skipped_steps == 3 and rec.loss_scale == 2.0 ** 13


def test_timed_steps_exclude_skipped_ones():
    r = SeamRank(OverflowingEngine(overflows=2), StepsConfig(warmup=1, timed=3, probe=1))
    rec = r.run_entry(4, "measure")
    # warm-up skipped, first timed skipped (0.2 s), two timed applied (1 s each)
    assert rec.step_times == [1.0, 1.0] and rec.time_per_step == 1.0
    assert rec.skipped_steps == 2 and rec.loss_scale == 2.0 ** 14


def test_no_loss_scale_without_fp16():
    r = SeamRank(OverflowingEngine(overflows=0, fp16=False), StepsConfig(warmup=1, timed=2, probe=1))
    rec = r.run_entry(2, "measure")
    assert rec.loss_scale is None and rec.skipped_steps == 0 and len(rec.step_times) == 2
