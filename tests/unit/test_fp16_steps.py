"""fp16's dynamic loss scale through the worker's real plan logic (Rank.run_entry, Rank.step, the
profiled step, the records). DeepSpeed's CPU accelerator refuses fp16, so the one stand-in is the
engine (zero_bench.engines.base.Engine): it overflows (skips the update, halves the scale) the way
DeepSpeed's fp16 optimizers do, and an applied step takes measurably longer than a skipped one."""
from __future__ import annotations

import time

import pytest
import torch

from zero_bench.config.schema import BenchConfig, HardwareConfig, StepsConfig
from zero_bench.records import Mode, ModelStates, TrialSpec
from zero_bench.trial import worker

from conftest import model

APPLIED_S = 0.05  # an applied step sleeps this long; a skipped one returns at once


class OverflowingEngine:
    """The first `overflows` optimizer steps overflow: skipped, loss scale halved."""
    zero_init = False
    hpz_secondary: dict = {}

    def __init__(self, overflows: int, fp16: bool = True):
        self.overflows, self.steps, self.fp16 = overflows, 0, fp16
        self.scale = 2.0 ** 16
        self.applied = False

    def step(self, batches, mask, marks):
        marks("forward")
        self.steps += 1
        self.applied = self.steps > self.overflows
        if self.applied:
            time.sleep(APPLIED_S)
        else:
            self.scale /= 2
        return [5.0] * len(batches)

    def was_step_applied(self):
        return self.applied

    def loss_scale(self):
        return self.scale if self.fp16 else None

    def grad_norm(self):
        return None  # what an fp16 step that overflowed reports: nothing clipped

    def model_states(self):
        return ModelStates(params=self.steps)  # the steps taken when the states were counted

    def offloaded(self):
        return {"optimizer": False, "params": False}

    def compile(self):
        pass


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    """Rank.step synchronises its peers: a real one-rank gloo group."""
    store = tmp_path_factory.mktemp("pg") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def rank(engine, steps: StepsConfig, tmp_path) -> worker.Rank:
    cfg = BenchConfig(model=model("gpt-tiny"), hardware=HardwareConfig(device="cpu"), precision="fp16", steps=steps)
    spec = TrialSpec(config=cfg, ds_config="", out_dir=str(tmp_path), plan=[])
    return worker.Rank(spec, engine, 0, worker.Marks())


def test_probe_runs_until_an_update_was_applied(tmp_path):
    r = rank(OverflowingEngine(overflows=3), StepsConfig(warmup=2, timed=3, probe=1), tmp_path)
    rec = r.run_entry(4, Mode.PROBE)
    # 1 probe step + 3 more until the 4th step applied; optimizer state exists only then
    assert ModelStates.from_dict(rec.model_states).params == 4
    assert rec.skipped_steps == 3 and rec.loss_scale == 2.0 ** 13


def test_timed_steps_exclude_skipped_ones(tmp_path):
    r = rank(OverflowingEngine(overflows=2), StepsConfig(warmup=1, timed=3, probe=1), tmp_path)
    rec = r.run_entry(4, Mode.MEASURE)
    # warm-up skipped, first timed skipped, then stepping on until three timed steps were applied
    assert len(rec.step_times) == 3 and min(rec.step_times) >= APPLIED_S
    assert rec.skipped_steps == 2 and rec.loss_scale == 2.0 ** 14 and rec.time_note == ""


def test_timed_steps_continue_until_applied(tmp_path):
    """The megatron preset's scale (2**16, hysteresis 2) can overflow through warm-up 2 + timed 5."""
    r = rank(OverflowingEngine(overflows=7), StepsConfig(warmup=2, timed=5, probe=1), tmp_path)
    rec = r.run_entry(4, Mode.MEASURE)
    assert len(rec.step_times) == 5 and min(rec.step_times) >= APPLIED_S
    assert rec.time_per_step >= APPLIED_S and rec.skipped_steps == 7


class AlwaysOverflowing(OverflowingEngine):
    """Overflows every step except `applied_at` (1-based step numbers)."""

    def __init__(self, applied_at=()):
        super().__init__(overflows=0)
        self.applied_at = set(applied_at)

    def step(self, batches, mask, marks):
        marks("forward")
        self.steps += 1
        self.applied = self.steps in self.applied_at
        if not self.applied:
            self.scale /= 2
        return [5.0] * len(batches)


def test_no_time_from_a_skipped_step(tmp_path, monkeypatch):
    """Every timed step overflowed (bounded by MAX_SKIPPED_STEPS): no time/it, and the record says
    why, rather than the time of a step that did no update."""
    monkeypatch.setattr(worker, "MAX_SKIPPED_STEPS", 4)
    r = rank(AlwaysOverflowing(applied_at={1}), StepsConfig(warmup=1, timed=2, probe=1), tmp_path)
    rec = r.run_entry(4, Mode.MEASURE)
    assert rec.step_times == [] and rec.time_per_step is None
    # warm-up applied (step 1); 2 timed + 4 more skipped; the profiled step retried 4 times, skipped each time
    assert "every timed step overflowed" in rec.time_note and rec.skipped_steps == 2 + 4 + 5
    assert "memory from a skipped step" in rec.time_note
    # a probe whose profiled step overflowed: no time either
    rec = r.run_entry(8, Mode.PROBE)
    assert rec.time_per_step is None and "profiled step overflowed" in rec.time_note


class PeakPerStep(OverflowingEngine):
    """An applied step allocates its optimizer's temporaries (a 4 MiB tensor alive during the
    step); a skipped one does not."""

    def step(self, batches, mask, marks):
        losses = super().step(batches, mask, marks)
        if self.applied:
            temp = torch.ones(1 << 20)  # noqa: F841 - alive while the profiler watches
            del temp
        return losses


def test_the_profiled_step_is_an_applied_one(tmp_path):
    """The profiled step overflows once: it is profiled again, so its peak holds the update's
    temporaries, and no note says the memory came from a skipped step."""
    eng = PeakPerStep(overflows=0)
    r = rank(eng, StepsConfig(warmup=1, timed=1, probe=1), tmp_path)
    r.run_entry(2, Mode.MEASURE)  # optimizer state exists; the next steps apply unless told otherwise
    eng.overflows = eng.steps + 2  # the next probe step and its first profiled step overflow
    rec = r.run_entry(2, Mode.PROBE)
    assert rec.skipped_steps == 2 and rec.peak_live_bytes >= 4 * 2**20
    assert "skipped step (no optimizer" not in rec.time_note and rec.time_per_step is not None


def test_an_entry_without_time_is_ok_without_throughput():
    """outcome: the entry fits (memory says so) but has no time/it, and the reason says why."""
    from zero_bench.trial.outcome import LaunchEnd, classify
    from zero_bench.records import Entry, RankRecord

    cfg = BenchConfig(model=model("gpt-tiny"), hardware=HardwareConfig(device="cpu"), precision="fp16")
    note = "fp16: every timed step overflowed, no time/it from a skipped step"
    logs = {r: [RankRecord(rank=r, event="end", micro=4, status="ok", time_per_step=None if r else 0.5,
                           time_note="" if r == 0 else note)] for r in (0, 1)}
    (t,) = classify(cfg, [Entry(4, Mode.MEASURE)], logs, LaunchEnd(rc=0))
    assert t.status == "ok" and t.time_per_step_s is None and t.samples_per_s is None
    assert t.reason == f"rank 1: {note}"


def test_no_loss_scale_without_fp16(tmp_path):
    r = rank(OverflowingEngine(overflows=0, fp16=False), StepsConfig(warmup=1, timed=2, probe=1), tmp_path)
    rec = r.run_entry(2, Mode.MEASURE)
    assert rec.loss_scale is None and rec.skipped_steps == 0 and len(rec.step_times) == 2


class TransientInTheStep(OverflowingEngine):
    """Each step's RSS peak is a freed 64 MiB tensor (mmap'd: back to the OS as it is freed)."""

    def step(self, batches, mask, marks):
        x = torch.ones(16 << 20)
        del x
        return super().step(batches, mask, marks)


def test_the_peak_rss_holds_the_profiled_steps_transient_and_the_mark_is_set_back_after_it(tmp_path):
    """CPU peak RSS: VmHWM read at the end of the profiled step (the profiler's bookkeeping after it
    is not the training's), then set back, so later entries start from their own steps."""
    if not worker.reset_rss_high_water():
        pytest.skip("this kernel refuses /proc/self/clear_refs")
    r = rank(TransientInTheStep(overflows=0, fp16=False), StepsConfig(warmup=0, timed=1, probe=1), tmp_path)
    rec = r.run_entry(2, Mode.MEASURE)
    now = worker.rss_now()
    assert rec.peak_rss_bytes >= now + 60 * 2**20
    assert worker.rss_high_water() < now + 16 * 2**20
