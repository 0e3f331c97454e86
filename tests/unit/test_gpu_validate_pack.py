"""launch/gpu_validate.sh's own logic, with a stand-in interpreter that launches nothing: the steps
run in the order of their value with the report written right after the searches, each under its
time budget (killed past it), none started that would not fit before the pack's deadline, and the
budgets project a pack that ends within a GPU session's 8 minutes on one H100 (issue 43 item 9)."""
from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACK = ROOT / "launch" / "gpu_validate.sh"

# Stands in for `python`: records each call, answers what the pack reads, launches nothing.
FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$*" in
  *"zero_bench calibrate"*) sleep "${FAKE_CALIBRATE_S:-0}"; echo "wrote calibration.json (calibrated on FakeCPU)";;
  *"zero_bench estimate"*) echo "fixed terms: calibrated on FakeCPU, 2026-11-26";;
  *"zero_bench report"*)
    for a in "$@"; do case $a in report.out=*) f=${a#report.out=}; mkdir -p "$(dirname "$f")"; echo x > "$f";; esac; done;;
  *validate_query.py*)
    echo "PASS search Llama-tiny tp1 dp2 zero3 fp32: max micro 4"
    echo "PASS pool Llama-tiny tp1 dp2 zero1 fp32: 3 trial(s) forked from its pool, 0 launched on their own";;
esac
exit 0
"""


def run_pack(tmp_path: Path, *args: str, answers: str = "", **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The pack under the stand-in interpreter (answering `answers` too); its output and the calls."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.replace("exit 0\n", answers + "exit 0\n"))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.txt"
    log.touch()
    full = {**os.environ, "PYTHON": str(fake), "FAKE_LOG": str(log), "TMPDIR": str(tmp_path), **env}
    out = subprocess.run(["bash", str(PACK), *args], capture_output=True, text=True, env=full, timeout=120)
    return out, log.read_text().splitlines()


def verdicts(out: subprocess.CompletedProcess) -> dict[str, str]:
    """step name -> the last verdict the pack printed for it (its padding to columns squeezed)."""
    found = {}
    for line in out.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0] in ("PASS", "FAIL", "SKIP", "INFO"):
            found[parts[1]] = " ".join(line.split())
    return found


def index(calls: list[str], *words: str) -> int:
    return next(i for i, c in enumerate(calls) if all(w in c.split() for w in words))


def test_the_steps_run_most_valuable_first_and_the_report_is_written_after_the_searches(tmp_path):
    out, calls = run_pack(tmp_path, "--cpu")
    assert out.returncode == 0, out.stdout + out.stderr
    order = [index(calls, "calibrate"), index(calls, "maxbatch", "zero=3"),
             index(calls, "maxbatch", "engine=fsdp2", "zero=3"), index(calls, "launch/validate_query.py"),
             index(calls, "report"), index(calls, "maxbatch", "zero=1"), index(calls, "maxbatch", "zero=0")]
    assert order == sorted(order)  # calibrate, ZeRO-3, FSDP2, verdicts, the report, then the other stages
    assert sum(c.split()[2:3] == ["report"] for c in calls) == 2  # written early and again at the end
    searches = [c for c in calls if "maxbatch" in c.split()]
    assert len(searches) == 5 and all("model.attention=sdpa" in c.split() for c in searches)
    v = verdicts(out)
    assert v["report"].startswith("PASS") and v["final-report"].startswith("PASS")
    assert v["calibrated"].startswith("PASS calibrated calibrated on FakeCPU")
    assert v["pool"].startswith("PASS pool")  # the verdict lines relayed from validate_query.py
    work = Path(re.search(r"work in (\S+)", out.stdout).group(1))
    timings = (work / "timings.txt").read_text().splitlines()
    assert [t.split()[0] for t in timings][:3] == ["calibrate", "calibrated", "zero3"]
    assert all(t.split()[2].isdigit() for t in timings)  # each step's time beside its budget
    assert (work / "report" / "pack.txt").read_text().splitlines()[-1].startswith("passed ")


def test_a_step_over_its_budget_is_killed_and_the_pack_goes_on(tmp_path):
    # calibrate's budget: 90 s x 0.02 = 2 s; it takes 30
    out, calls = run_pack(tmp_path, "--cpu", PACK_SCALE="0.02", FAKE_CALIBRATE_S="30")
    assert out.returncode == 1
    v = verdicts(out)
    assert v["calibrate"].startswith("FAIL calibrate over its budget of 2 s: killed")
    assert "calibrated" not in v  # nothing asked of a calibration that did not finish
    assert v["final-report"].startswith("PASS")  # the rest still ran
    assert any("maxbatch" in c.split() and "zero=3" in c.split() for c in calls)


def test_no_step_starts_that_would_not_fit_before_the_deadline(tmp_path):
    # 60 s in all, 20 kept for the final report: the 90 s calibrate and the 80 s searches cannot start
    out, calls = run_pack(tmp_path, "--cpu", PACK_SCALE="1", PACK_BUDGET_S="60")
    v = verdicts(out)
    for name in ("calibrate", "zero3", "fsdp2", "zero1", "zero2", "zero0"):
        assert v[name].startswith(f"SKIP {name} no time left"), v.get(name)
    assert not any("maxbatch" in c.split() or "calibrate" in c.split() for c in calls)
    assert v["report"].startswith("PASS") and v["final-report"].startswith("PASS")


def test_the_budgets_project_a_pack_within_eight_minutes_on_one_h100():
    out = subprocess.run(["bash", str(PACK), "--plan"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    m = re.search(r"the first report by (\d+) s, the pack ends by (\d+) s \(deadline (\d+) s\)", out.stdout)
    first, end, deadline = map(int, m.groups())
    assert deadline == 480 and end <= deadline and first <= 400
    runs = re.search(r"runs: (.*)", out.stdout).group(1).split()
    assert runs[:8] == ["gpu", "calibrate", "calibrated", "zero3", "fsdp2-check", "fsdp2", "verdicts", "report"]
    assert "op-zero1" in runs and runs[-1] == "final-report"
    assert runs.index("report") < runs.index("maxseq-tiled") < runs.index("op-zero1")  # issue 45's search, budgeted


def test_every_step_the_pack_runs_has_a_budget():
    text = PACK.read_text()
    plan = text[text.index("<<'STEPS'"):text.index("\nSTEPS\n")].splitlines()[1:]
    budgeted = {line.split()[0] for line in plan}
    body = text[text.index("\nSTEPS\n"):]
    used = set(re.findall(r"^\s*(?:step|search|trial|verdicts|write_report|CUDA_VISIBLE_DEVICES=\S+ search) "
                          r"([a-z][a-z0-9-]*)", body, flags=re.M))
    recipes = body[body.index("<<'RECIPES'"):body.index("\nRECIPES\n")].splitlines()[1:]
    used |= {line.split()[0] for line in recipes} | {"zero1", "zero2", "zero0"}
    assert used <= budgeted, used - budgeted


# Stands in for nvidia-smi on a machine of $FAKE_NGPU H100s.
FAKE_SMI = r"""#!/usr/bin/env bash
case "$*" in
  *query-compute-apps*) ;;
  *query-gpu=index*) seq 0 $(( FAKE_NGPU - 1 ));;
  *query-gpu=name*) echo "NVIDIA H100 80GB HBM3";;
  *query-gpu=uuid*) a="$*"; echo "GPU-fake-${a##*-i }";;
esac
"""

GPU_ANSWERS = r"""
case "$*" in
  *"smoke_query.py - device"*) echo "gpu$4 smi(used,total)=1600,81559 v1_used=1600 (MiB)";;
  *"last_ok"*) echo "1 GPU-fake-$(( FAKE_NGPU - 1 )) 0.1234 1";;
  *"gpu_mem"*) echo "rank0 GPU-fake-$(( FAKE_NGPU - 1 )) v1_used=1 v2_used=1 (MiB)";;
  *"validate_query.py"*" ulysses "*) echo "PASS ulysses Llama-tiny tp1 dp2 zero3 bf16 sp=2 seq 16384 vs sp=1: 3 steps";;
  *"validate_query.py"*" 3072 "*)
    echo "PASS search Llama-tiny tp1 dp1 zero1 bf16 recompute=full tiled_mlp=auto recompute_offload: max seq len 61440";;
esac
"""


def run_gpu_pack(tmp_path: Path, ngpu: int, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return run_pack(tmp_path, answers=GPU_ANSWERS, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_NGPU=str(ngpu),
                    PACK_REPORT_DIR=str(tmp_path / "reports"), **env)


def test_on_one_gpu_the_zero3_search_answers_the_smoke_tests_trial_checks_then_the_recipes_run(tmp_path):
    out, calls = run_gpu_pack(tmp_path, 1)
    assert out.returncode == 0, out.stdout + out.stderr
    v = verdicts(out)
    assert v["1-gpu"].startswith("PASS 1-gpu CUDA_VISIBLE_DEVICES=0: time/it 0.1234s on GPU-fake-0")
    assert v["mem-gpu0"].startswith("INFO") and v["mem-rank"].startswith("INFO mem-rank rank0 GPU-fake-0")
    assert v["2-gpu"] == "SKIP 2-gpu one GPU only"
    names = [line.split()[1] for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert names.index("report") < names.index("op-zero1") < names.index("moe-fsdp2-op") < names.index("moe-zero2")
    assert names.index("moe-zero2") < names.index("zeropp-qwz") and "zeropp2" not in names  # qwZ built on one GPU
    assert index(calls, "report") < index(calls, "recompute=op")  # the report before the recipes
    searches = [c for c in calls if "maxbatch" in c.split()]
    assert all("model.attention=sdpa" in c.split() and "hardware.memory_mib=24576" in c.split() for c in searches)
    assert (tmp_path / "reports" / "pack.txt").exists() and (tmp_path / "reports" / "timings.txt").exists()
    # issue 45: the longest sequence with the tiled MLP and checkpoint offload, after the report, before the recipes
    seq = calls[index(calls, "maxseq")].split()
    assert {"tiled_mlp=auto", "recompute=full", "recompute_offload=true", "hardware.memory_mib=3072"} <= set(seq)
    assert index(calls, "report") < index(calls, "maxseq") < index(calls, "recompute=op")
    assert index(calls, "launch/validate_query.py", "3072") > index(calls, "maxseq")  # its verdicts at its card
    assert v["maxseq-tiled"].startswith("INFO maxseq-tiled search exit 0")
    assert v["search"].startswith("PASS search Llama-tiny tp1 dp1 zero1 bf16 recompute=full tiled_mlp=auto")  # relayed


def test_on_two_gpus_the_nccl_checks_come_before_the_recipes(tmp_path):
    out, calls = run_gpu_pack(tmp_path, 2)
    assert out.returncode == 0, out.stdout + out.stderr
    v = verdicts(out)
    assert v["1-gpu"].startswith("PASS 1-gpu CUDA_VISIBLE_DEVICES=1: time/it 0.1234s on GPU-fake-1")
    assert v["tp2"].startswith("PASS") and v["ep2-fsdp2"].startswith("PASS")
    assert index(calls, "parallel=tp2") < index(calls, "parallel=dp2", "maxbatch") < index(calls, "states=bf16")
    # ZeRO++'s quantized all-gathers (refused on CPU) over 2 GPUs, hpZ beside them
    assert v["zeropp2"].startswith("PASS") and index(calls, "zeropp.qwz=true", "zeropp.hpz=2") < index(calls, "states=bf16")
    # issue 45: Ulysses over the two GPUs, then the same run at sp=1, their losses compared, before the 2-rank search
    pair = [i for i, c in enumerate(calls) if "model.seq_len=16384" in c.split()]
    assert len(pair) == 2 and "parallel.sp=2" in calls[pair[0]].split() and "parallel.sp" not in calls[pair[1]]
    sp2, sp1 = pair
    same = [w for w in calls[sp2].split() if w != "parallel.sp=2" and not w.startswith("hydra.run.dir=")]
    assert same == [w for w in calls[sp1].split() if not w.startswith("hydra.run.dir=")]  # the same run but for sp
    assert index(calls, "parallel=tp2") < sp2 < index(calls, "parallel=dp2", "maxbatch")
    assert sp1 < index(calls, "launch/validate_query.py", "ulysses") < index(calls, "parallel=dp2", "maxbatch")
    assert v["ulysses"].startswith("PASS ulysses Llama-tiny tp1 dp2 zero3 bf16 sp=2")
