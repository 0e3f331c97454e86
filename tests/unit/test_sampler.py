"""The sampler's summary: the peak of each device and the phase it happened in."""
from __future__ import annotations

from zero_bench.records import DeviceMemStats
from zero_bench.trial.sampler import Sample, phase_at, summarize

def test_summarize_names_the_phase_of_each_peak():
    samples = [Sample(1.0, "rank", 0, 100, 1000), Sample(2.0, "rank", 0, 300, 1000),
               Sample(3.0, "rank", 0, 200, 1000), Sample(2.5, "gpu", 1, 50, 80)]
    marks = {0: [(0.5, "init"), (1.5, "forward"), (2.2, "backward")], 1: [(2.4, "step")]}
    peaks = {d.key: d for d in summarize(samples, marks)}
    assert peaks[("rank", 0)] == DeviceMemStats(kind="rank", id=0, peak_bytes=300, total_bytes=1000,
                                                phase="forward", samples=3)
    assert peaks[("gpu", 1)].phase == "step"
    assert phase_at([], 5.0) == "init"
