"""Multi-node without launching: the hostfile, the launcher command line, what remote ranks get.
The real two-host launch: tests/integration/test_multinode.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from zero_bench.config.schema import BenchConfig, ConfigError, HardwareConfig, ModelConfig, ParallelConfig, StepsConfig

HOSTS = ("127.0.0.1", "127.0.0.2")
TINY = ModelConfig(name="GPT-tiny", num_layers=2, hidden_size=64, num_heads=4, seq_len=64, vocab_size=1024)
SSHD = "/usr/sbin/sshd"


def tiny_cfg(**hw) -> BenchConfig:
    return BenchConfig(model=TINY, parallel=ParallelConfig(tp=1, dp=2),
                       hardware=HardwareConfig(device="cpu", **hw), zero=2,
                       steps=StepsConfig(warmup=1, timed=1), timeout_s=180)


# -- pure checks of the multi-node command line and environment (no launch) ----------------------

def test_launcher_cmd_passes_hostfile_nodes_launcher(tmp_path, monkeypatch):
    from zero_bench.trial.launcher import launcher_cmd

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("ZERO_BENCH_LAUNCHER_ARGS", raising=False)
    hf = tmp_path / "hostfile"
    hf.write_text("# two nodes\n10.0.0.5 slots=4\n10.0.0.6 slots=4\n")
    cfg = tiny_cfg(hostfile=str(hf), num_nodes=2, launcher="openmpi")
    cmd = launcher_cmd(cfg, tmp_path / "trial.json", 29999)
    joined = " ".join(cmd)
    assert cmd[1:3] == ["-m", "deepspeed.launcher.runner"]
    for frag in (f"--hostfile {hf}", "--num_nodes 2", "--num_gpus 1", "--launcher openmpi", "--no_ssh_check",
                 "--master_addr 10.0.0.5", "--master_port 29999", "--module zero_bench.trial.rank"):
        assert frag in joined
    monkeypatch.setenv("MASTER_ADDR", "node-a")
    monkeypatch.setenv("ZERO_BENCH_LAUNCHER_ARGS", "--mca btl_tcp_if_include lo")
    cmd = launcher_cmd(cfg, tmp_path / "trial.json", 29999)
    assert cmd[cmd.index("--master_addr") + 1] == "node-a"
    assert cmd[cmd.index("--launcher_args") + 1] == "--mca btl_tcp_if_include lo"
    # host names: DeepSpeed finds the address itself (ssh host hostname -I)
    monkeypatch.delenv("MASTER_ADDR")
    hf.write_text("node-a slots=1\nnode-b slots=1\n")
    assert "--master_addr" not in launcher_cmd(cfg, tmp_path / "trial.json", 1)


@pytest.mark.parametrize("text,hw,msg", [
    (None, dict(num_nodes=2), "cannot read it"),
    ("a slots=1\n", dict(num_nodes=2), "lists only 1 hosts"),
    ("a slots=1\nb slots=1\n", dict(num_nodes=2), None),
    ("a slots=1\nb\n", dict(num_nodes=2), "bad line"),
    ("a slots=1\na slots=1\n", dict(num_nodes=1), "listed twice"),
    ("a slots=1\nb slots=1\n", dict(num_nodes=1), "2 ranks per node but a has slots=1"),
])
def test_hostfile_checked_before_launch(tmp_path, text, hw, msg):
    """DeepSpeed would warn and run on this host alone when the hostfile is missing: refuse instead."""
    from zero_bench.trial.launcher import launcher_cmd

    hf = tmp_path / "hostfile"
    if text is not None:
        hf.write_text(text)
    cfg = tiny_cfg(hostfile=str(hf), **hw)
    if msg is None:
        launcher_cmd(cfg, tmp_path / "t.json", 1)
        return
    with pytest.raises(ConfigError, match=msg):
        launcher_cmd(cfg, tmp_path / "t.json", 1)


def test_nodes_must_divide_world(tmp_path):
    from zero_bench.trial.launcher import launcher_cmd

    hf = tmp_path / "hostfile"
    hf.write_text("a slots=2\nb slots=2\n")
    cfg = dataclass_replace_dp(tiny_cfg(hostfile=str(hf), num_nodes=2), 3)
    with pytest.raises(ConfigError, match="must divide the world size"):
        launcher_cmd(cfg, tmp_path / "t.json", 1)


def dataclass_replace_dp(cfg: BenchConfig, dp: int) -> BenchConfig:
    import dataclasses

    return dataclasses.replace(cfg, parallel=ParallelConfig(tp=1, dp=dp))


def test_trial_env_carries_what_remote_ranks_need(tmp_path, monkeypatch):
    from zero_bench.trial.launcher import trial_env

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/cache/ext")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/lib")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    local = trial_env(tiny_cfg())
    # every rank builds DeepSpeed's JIT ops with the venv's ninja (the system's would not read its log)
    assert local["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    env = trial_env(tiny_cfg(hostfile=str(tmp_path / "hf"), num_nodes=2))
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert env["OMP_NUM_THREADS"] == "1" and env["DS_ACCELERATOR"] == "cpu"
    assert env["MALLOC_MMAP_THRESHOLD_"] == "65536" and env["MALLOC_TRIM_THRESHOLD_"] == "0"
    assert env["TORCH_EXTENSIONS_DIR"] == "/cache/ext" and env["LD_LIBRARY_PATH"] == "/opt/lib"
    assert trial_env(dataclass_replace_hw(tiny_cfg(), device="gpu"))["DS_ACCELERATOR"] == "cuda"


def dataclass_replace_hw(cfg: BenchConfig, **kw) -> BenchConfig:
    import dataclasses

    return dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, **kw))


def test_find_workers_matches_rank_processes_only(tmp_path):
    """The sampler's helper finds a trial's ranks by spec path, whoever their parent is."""
    from zero_bench.trial.sampler import env_of, find_workers

    marker = str(tmp_path / "trial.json")
    code = "import time; time.sleep(30)"
    rank = subprocess.Popen([sys.executable, "-c", code, "-m", "zero_bench.trial.rank", "--spec", marker],
                            env={**os.environ, "RANK": "1", "CROSS_RANK": "1"})
    other = subprocess.Popen([sys.executable, "-c", code, "-m", "zero_bench.trial.rank", "--spec", marker + "x"])
    try:
        deadline = time.time() + 10
        while time.time() < deadline and not find_workers(marker):
            time.sleep(0.05)
        found = [p.pid for p in find_workers(marker)]
        assert rank.pid in found
        assert env_of(psutil.Process(rank.pid), "RANK", "CROSS_RANK", "NOPE") == {"RANK": "1", "CROSS_RANK": "1"}
    finally:
        for p in (rank, other):
            p.kill()
            p.wait()
