"""How long a trial may go without progress (zero_bench/trial/time_limits.py), and the one line a failed
or hung trial's note carries (outcome.meaningful_line): pure, no launch."""
from __future__ import annotations

import pytest

from zero_bench.records import Entry, RankRecord, Status, TrialResult
from zero_bench.trial.outcome import LaunchEnd, classify, meaningful_line
from zero_bench.trial.time_limits import (FIRST_STEP, INIT_FACTOR, MARGIN, Limits, Pace, estimated_pace,
                                    measured_pace)

from conftest import cpu_cfg


def step(micro: int, secs: float) -> RankRecord:
    return RankRecord(rank=0, event="step", micro=micro, step_seconds=secs)


def test_the_floor_holds_until_a_step_is_expected_to_come_near_it():
    lim = Limits(floor_s=60.0, pace=Pace(0.1, "measured"))
    assert lim.step_s(4) == 60.0  # 0.4 s expected: the floor
    assert lim.step_s(400) == pytest.approx(MARGIN * 40.0)
    assert lim.step_s(400, first=True) == pytest.approx(MARGIN * FIRST_STEP * 40.0)
    assert lim.init_s() == INIT_FACTOR * 60.0
    assert Limits(floor_s=5.0, grad_accum=4, pace=Pace(1.0, "measured")).step_s(3) == pytest.approx(MARGIN * 12)


def test_the_limit_follows_the_slowest_step_seen_but_not_an_entrys_first():
    lim = Limits(floor_s=1.0, pace=Pace(0.001, "estimated"))
    lim = lim.observe(RankRecord(rank=0, event="begin", micro=8))
    assert lim.after(RankRecord(rank=0, event="begin", micro=8)) == pytest.approx(max(1.0, MARGIN * FIRST_STEP * 0.008))
    lim = lim.observe(step(8, 80.0))  # the first step (allocations) says nothing of the pace
    assert lim.pace == Pace(0.001, "estimated")
    lim = lim.observe(step(8, 4.0))  # 0.5 s per sample, measured: replaces the estimate
    assert lim.pace == Pace(0.5, "measured")
    lim = lim.observe(step(8, 2.0))  # faster: the slowest stays
    assert lim.pace == Pace(0.5, "measured")
    assert lim.after(step(8, 2.0)) == pytest.approx(MARGIN * 4.0)
    # an entry's end carries its step times (a probe's: the profiled step)
    lim = lim.observe(RankRecord(rank=0, event="end", micro=8, step_times=[8.0]))
    assert lim.pace == Pace(1.0, "measured")
    assert lim.after(RankRecord(rank=0, event="start")) == lim.init_s()


def test_a_measured_pace_replaces_an_estimate_either_way():
    assert Pace(0.01, "measured").slower(Pace(5.0, "estimated")) == Pace(0.01, "measured")
    assert Pace(5.0, "estimated").slower(Pace(0.01, "measured")) == Pace(0.01, "measured")
    assert Pace(0.2, "measured").slower(Pace(0.3, "measured")) == Pace(0.3, "measured")
    assert Pace(0.2, "measured").slower(None) == Pace(0.2, "measured")


def _trial(micro: int, status: str, tps=None) -> TrialResult:
    return TrialResult(search_key="k", trial_key="t", label="l", micro=micro, global_batch=2 * micro,
                       status=Status(status), time_per_step_s=tps)


def test_measured_pace_is_the_slowest_fitting_trial_per_sample():
    trials = [_trial(1, "ok", 0.5), _trial(8, "ok", 2.0), _trial(16, "oom"), _trial(4, "timeout")]
    assert measured_pace(trials, grad_accum=1) == Pace(0.5, "measured")
    assert measured_pace(trials, grad_accum=2) == Pace(0.25, "measured")
    assert measured_pace([_trial(2, "oom")], 1) is None


def test_before_any_step_the_pace_is_the_models_flops_over_the_matmul_rate():
    from zero_bench.models.flops import hardware_flops_per_seq

    cfg = cpu_cfg("gpt-mini")
    pace = estimated_pace(cfg, flops_per_s=50e9)
    assert pace.source == "estimated"
    assert pace.s_per_sample == pytest.approx(hardware_flops_per_seq(cfg.model, "none") / (50e9 * 0.1))
    assert estimated_pace(cfg, None) is None


LOG = """/venv/megatron/core/fusions/fused_bias_dropout.py:4: UserWarning: Apex is not installed. Falling back to Torch Norm
  warnings.warn("Apex is not installed. Falling back to Torch Norm")
[2026-11-24 21:40:00,123] [INFO] [launch.py:100:main] WORLD INFO DICT: {'localhost': [0, 1]}
Traceback (most recent call last):
  File "/venv/zero_bench/trial/worker.py", line 3, in <module>
    foo()
RuntimeError: the real reason
[2026-11-24 21:40:01,123] [ERROR] [launch.py:321:sigkill_handler] ['python', '-m', 'zero_bench.trial.rank'] exits with return code = 1
"""


def test_a_failed_launchs_note_is_its_reason_never_a_librarys_warning():
    assert meaningful_line(LOG) == "RuntimeError: the real reason"
    no_exc = LOG.replace("RuntimeError: the real reason\n", "")
    assert "[ERROR]" in meaningful_line(no_exc) and "return code = 1" in meaningful_line(no_exc)
    assert meaningful_line(LOG.splitlines()[0] + "\n" + LOG.splitlines()[1]) == ""
    (res,) = classify(cpu_cfg(), [Entry(1)], {}, LaunchEnd(rc=1, log_tail=LOG))
    assert res.status == Status.ERROR and res.reason == "launcher exit 1: RuntimeError: the real reason"


def test_a_hung_launchs_note_says_what_did_not_happen_within_how_long():
    hung = "no step finished within 40 s (micro=8; 1.2 s/sample measured, floor timeout_s=60)"
    (res,) = classify(cpu_cfg(), [Entry(8)], {0: [RankRecord(rank=0, event="begin", micro=8)]},
                      LaunchEnd(rc=-9, timed_out=True, hung=hung, log_tail=LOG))
    assert res.status == Status.TIMEOUT and res.reason == hung


# What the ranks of `python -m zero_bench compile=true` (ZeRO-2, GPT-mini) left before the fix in
# models/compiled.py: rank 0 aborted in gloo's thread, rank 1 lost its peer.
GLOO_ABORT = """/work/x/megatron/core/utils.py:501: DeprecationWarning: Warning: tp_group is None
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 132224 vs 131456. Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?
RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:62187: Connection reset by peer.
"""


def _aborted_rank0() -> dict:
    return {0: [RankRecord(rank=0, event="begin", micro=2)],
            1: [RankRecord(rank=1, event="begin", micro=2),
                RankRecord(rank=1, event="end", micro=2, status="error", time=1.0,
                           error="RuntimeError: [pair.cc:537] Read error: Connection reset by peer.")]}


@pytest.mark.parametrize("rc", [-6, 250, 134])  # waitpid / Popen, DeepSpeed's sys.exit(-6), a shell's 128 + 6
def test_an_aborted_rank_is_an_error_with_its_cause_never_an_oom(rc):
    """Issue 43: a rank that aborted (SIGABRT) while its peer lost the connection was reported as
    `oom` ("killed, e.g. by the OOM killer") and a search took it for a memory boundary."""
    (res,) = classify(cpu_cfg(), [Entry(2)], _aborted_rank0(), LaunchEnd(rc=rc, log_tail=GLOO_ABORT))
    assert res.status == Status.ERROR
    assert res.reason.startswith("rank 0 died of SIGABRT: what():") and "collective mismatch" in res.reason


def test_a_rank_killed_by_sigkill_not_ours_is_an_oom_and_after_our_timeout_a_timeout():
    logs = _aborted_rank0()
    for rc in (-9, 137, 247):
        (res,) = classify(cpu_cfg(), [Entry(2)], logs, LaunchEnd(rc=rc, log_tail="Killed\n"))
        assert res.status == Status.OOM and res.reason.startswith("rank 0 was killed (SIGKILL")
    (res,) = classify(cpu_cfg(), [Entry(2)], logs, LaunchEnd(rc=-9, timed_out=True, log_tail="Killed\n"))
    assert res.status == Status.TIMEOUT


def test_an_abort_with_an_allocation_failure_in_its_log_is_an_oom():
    """A C++ allocation failure ends in std::terminate too: the log, not the signal, says it was memory."""
    log = "terminate called after throwing an instance of 'c10::OutOfMemoryError'\n  what():  CUDA out of memory.\n"
    (res,) = classify(cpu_cfg(), [Entry(2)], _aborted_rank0(), LaunchEnd(rc=-6, log_tail=log))
    assert res.status == Status.OOM


def test_a_silent_rank_whose_exit_is_no_signal_is_an_error_with_the_log_line():
    (res,) = classify(cpu_cfg(), [Entry(2)], _aborted_rank0(), LaunchEnd(rc=1, log_tail=GLOO_ABORT))
    assert res.status == Status.ERROR and res.reason.startswith("rank 0 died without a result (exit 1): what():")


def test_a_compiled_trials_first_step_gets_the_cold_compile_allowance():
    """compile=true: GPT-mini's ZeRO-3 first step compiled for ~60 s on 2 CPU cores, past the 60 s
    floor, and the trial was called hung (issue 43 item 1's run)."""
    from zero_bench.trial.time_limits import COLD_COMPILE_S

    eager = Limits.for_trial(cpu_cfg("gpt-mini", zero=3, timeout_s=60), Pace(0.5, "estimated"))
    compiled = Limits.for_trial(cpu_cfg("gpt-mini", zero=3, timeout_s=60, compile=True), Pace(0.5, "estimated"))
    begin = RankRecord(rank=0, event="begin", micro=2)
    assert eager.after(begin) == 60.0
    assert compiled.after(begin) == 60.0 + COLD_COMPILE_S
    assert compiled.after(step(2, 1.0)) == eager.after(step(2, 1.0))  # a steady step gets no more


def test_a_silent_rank_whose_exit_is_unknown_is_an_oom_unless_the_log_shows_a_crash():
    """DeepSpeed's launcher (and a pool, when a peer's exit is seen first) may report the peer's exit
    code: a rank that vanished without a word is what the kernel's OOM killer leaves; one whose
    C++ terminate or fatal error is in the log crashed."""
    (res,) = classify(cpu_cfg(), [Entry(2)], _aborted_rank0(), LaunchEnd(rc=1, log_tail="[INFO] launching\n"))
    assert res.status == Status.OOM and res.reason.startswith("rank 0 died without a result or a word")
    log = "[ERROR] [launch.py:259:sigkill_handler] ['python', '-m', 'x'] exits with return code = -6\n"
    (res,) = classify(cpu_cfg(), [Entry(2)], _aborted_rank0(), LaunchEnd(rc=1, log_tail=log))
    assert res.status == Status.ERROR and res.reason.startswith("rank 0 died of SIGABRT")


def test_a_pool_trial_reports_the_signalled_child_whichever_exit_came_first(tmp_path):
    from zero_bench.trial.pool import cause

    assert cause([1, -9]) == -9 and cause([-6, 1]) == -6 and cause([1, 2]) == 1
