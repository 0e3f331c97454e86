"""Sweeps beyond one machine, without launching: merged stores, status of a sweep directory, the
Slurm allocation's hostfile, and the sbatch script Hydra's submitit_slurm launcher would submit."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from zero_bench import report
from zero_bench.config.hosts import with_slurm_hostfile
from zero_bench.config.schema import ConfigError
from zero_bench.records import SearchResult, SearchStatus, Status, TrialResult
from zero_bench.search.sweeps import JOB_STORE, finished_elsewhere, format_status, sweep_status
from zero_bench.store import Store

from conftest import cpu_cfg



def search(cfg, status=SearchStatus.DONE, micro=4, created=None) -> SearchResult:
    return SearchResult(search_key=cfg.search_key(), label=cfg.label(), status=status, max_micro=micro,
                        max_global_batch=micro * 2, config=cfg.to_dict(), created=created or time.time())


def job(sweep: Path, num: int, overrides: list[str], job_id: str = "") -> Path:
    d = sweep / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (d / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {"id": job_id}}}))
    return d


def test_merged_stores_one_row_per_configuration_newest_finished_wins(tmp_path):
    a, b = cpu_cfg(zero=1), cpu_cfg(zero=2)
    Store(tmp_path / "0" / JOB_STORE).put_search(search(a, micro=3, created=100.0))
    Store(tmp_path / "1" / JOB_STORE).put_search(search(a, micro=5, created=200.0))
    Store(tmp_path / "2" / JOB_STORE).put_search(search(a, SearchStatus.INCOMPLETE, micro=9, created=300.0))
    Store(tmp_path / "3" / JOB_STORE).put_search(search(b))
    (tmp_path / ".submitit").mkdir()
    rows = report.rows_of(report.load(report.find_stores(tmp_path)))
    assert sorted(r.key for r in rows) == sorted([a.search_key(), b.search_key()])
    (row,) = [r for r in rows if r.key == a.search_key()]
    assert row.max_micro == 5 and row.source == f"1/{JOB_STORE}"
    assert "duplicate: also in 2 other store(s) (0/zero_bench.sqlite, 2/zero_bench.sqlite)" in row.note
    assert finished_elsewhere(a.search_key(), tmp_path, tmp_path / "2" / JOB_STORE).max_micro in (3, 5)
    assert finished_elsewhere(b.search_key(), tmp_path, tmp_path / "3" / JOB_STORE) is None


def test_status_of_a_sweep_directory(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / ".submitit").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "overrides": {"task": ["model=gpt-tiny", "zero=0,1", "offload=false,true"]}, "sweeper": {"params": {}}}}))
    done = job(sweep, 0, ["zero=0", "offload=false"], "41_0")
    Store(done / JOB_STORE).put_search(search(cpu_cfg(zero=0)))
    running = job(sweep, 1, ["zero=0", "offload=true"], "41_1")
    Store(running / JOB_STORE).add_trial(TrialResult(search_key="k", trial_key="t", label="l", micro=1,
                                                     global_batch=2, status=Status.OK))
    (sweep / ".submitit" / "41_1").mkdir()
    (sweep / ".submitit" / "41_1" / "41_1_0_log.out").write_text("[x] trial 1: micro=1 -> ok\n[x] launch 2\n")
    job(sweep, 2, ["zero=1", "offload=false"], "41_2")
    (sweep / ".submitit" / "41_2").mkdir()
    (sweep / ".submitit" / "41_2" / "41_2_0_result.pkl").write_bytes(
        pickle.dumps(("error", "Traceback ...\nRuntimeError: node lost")))
    rows = sweep_status(sweep)
    assert [(r.num, r.state, r.job_id) for r in rows] == [(0, "done", "41_0"), (1, "running", "41_1"),
                                                          (2, "failed", "41_2"), (3, "not started", "")]
    assert rows[1].detail == "[x] launch 2" and rows[2].detail == "RuntimeError: node lost"
    assert "max global batch 8" in rows[0].detail
    assert format_status(rows).splitlines()[-1] == "1 done, 1 running, 1 failed, 1 not started"
    p = subprocess.run([sys.executable, "-m", "zero_bench", "status", str(sweep), f"hydra.run.dir={tmp_path}/r"],
                       capture_output=True, text=True)
    assert p.returncode == 4 and "1 failed" in p.stdout, p.stderr  # a failed job: exit code 4


def test_slurm_allocation_becomes_a_hostfile(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'gpu-a\\ngpu-b\\n'\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    import dataclasses

    cfg = cpu_cfg()
    cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, hostfile="slurm", num_nodes=2))
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    with pytest.raises(ConfigError, match="hardware.hostfile=slurm: not inside a Slurm allocation"):
        with_slurm_hostfile(cfg, tmp_path)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-[a-b]")
    got = with_slurm_hostfile(cfg, tmp_path / "run")
    assert Path(got.hardware.hostfile).read_text() == "gpu-a slots=1\ngpu-b slots=1\n"
    assert os.environ["MASTER_ADDR"] == "gpu-a"


def test_submitit_slurm_command_writes_the_sbatch_a_user_would_submit(tmp_path):
    """The documented command, up to the sbatch script submitit writes: a fake sbatch keeps it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ncp \"$1\" {tmp_path}/submitted.sh\necho 'Submitted batch job 4242'\n")
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")  # submitit checks that Slurm is there
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    args = ["maxbatch", "-m", "model=gpt-tiny", "zero=1,2", "hydra/launcher=submitit_slurm",
            "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=8", "hydra.launcher.nodes=2",
            "hydra.launcher.timeout_min=240", "hardware.hostfile=slurm", "hardware.num_nodes=2",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.Popen([sys.executable, "-m", "zero_bench", *args], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    submitted = tmp_path / "submitted.sh"
    try:
        deadline = time.time() + 120  # until the fake sbatch has copied the whole script (its last line)
        while time.time() < deadline and proc.poll() is None and not (
                submitted.exists() and "srun" in submitted.read_text()):
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # it would now wait for Slurm to run the jobs
        out = proc.communicate()[0]
    script = (tmp_path / "submitted.sh").read_text() if (tmp_path / "submitted.sh").exists() else ""
    assert script, out[-2000:]
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=8", "#SBATCH --nodes=2",
                 "#SBATCH --time=240", "#SBATCH --array=0-1"):
        assert line in script, (line, script)
    assert "submitit" in script and str(tmp_path / "sweep") in script
