"""Multi-node through DeepSpeed's launcher, for real, on this one machine.

Two "hosts" are two loopback addresses (127.0.0.1, 127.0.0.2) served by an sshd of this test's own
(port 2222, or a free port if 2222 is taken), reached by pdsh over ssh exactly as on a cluster:
hostfile -> deepspeed runner -> `pdsh -w 127.0.0.1,127.0.0.2` -> ssh -> `deepspeed.launcher.launch
--node_rank=N` on each "node" -> one rank per node. Provisioned by launch/ci_provision.sh (Debian
openssh-server + pdsh); where a piece is missing the test skips and names it.

Everything the test starts (sshd) is stopped by PID; no rank may outlive it.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from zero_bench.config.schema import BenchConfig, HardwareConfig, ParallelConfig, StepsConfig

from conftest import model

pytestmark = pytest.mark.slow

HOSTS = ("127.0.0.1", "127.0.0.2")
SSHD = "/usr/sbin/sshd"


def tiny_cfg(**hw) -> BenchConfig:
    # precision=fp32: auto would run bf16 on a CPU with native bf16; the ranks' placement is tested here
    return BenchConfig(model=model("gpt-tiny"), parallel=ParallelConfig(tp=1, dp=2),
                       hardware=HardwareConfig(device="cpu", **hw), zero=2, precision="fp32",
                       steps=StepsConfig(warmup=1, timed=1), timeout_s=180)


def _missing_tools() -> list[str]:
    why = []
    if not os.path.exists(SSHD):
        why.append(f"{SSHD} not installed (Debian package openssh-server; run launch/ci_provision.sh)")
    for tool, pkg in (("pdsh", "pdsh"), ("ssh", "openssh-client"), ("ssh-keygen", "openssh-client")):
        if not shutil.which(tool):
            why.append(f"`{tool}` not on PATH (Debian package {pkg}; run launch/ci_provision.sh)")
    if not os.path.isdir("/run/sshd") and os.geteuid() != 0:
        why.append("/run/sshd (sshd's privilege-separation dir) is missing and this user cannot create it")
    return why


def _pick_port() -> int:
    """A port the OS just handed out (not a fixed one another job may hold); the fixture retries
    with a new one if something takes it before sshd binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(host: str, port: int, proc: subprocess.Popen, timeout: float = 15) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"sshd not listening on {host}:{port} after {timeout}s")


def _start_sshd(d: Path, port: int, user: str) -> subprocess.Popen:
    """Write sshd's and the client's config for `port` and start sshd (skips if sshd rejects it)."""
    (d / "sshd_config").write_text(
        f"Port {port}\n" + "".join(f"ListenAddress {h}\n" for h in HOSTS) +
        f"HostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PubkeyAuthentication yes\nStrictModes no\nUsePAM no\nAllowTcpForwarding no\nX11Forwarding no\n"
        f"AllowUsers {user}\nLogLevel ERROR\n")
    (d / "ssh_config").write_text(
        f"Host {' '.join(HOSTS)}\n  Port {port}\n  IdentityFile {d / 'client_key'}\n  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  BatchMode yes\n  LogLevel ERROR\n"
        "  ConnectTimeout 10\n")
    test = subprocess.run([SSHD, "-t", "-f", str(d / "sshd_config")], capture_output=True, text=True)
    if test.returncode:
        pytest.skip(f"two-host test cannot run here: `sshd -t` rejects the test config: {test.stderr.strip()}")
    with open(d / "sshd.log", "w") as log:  # sshd keeps its own descriptor
        return subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=log, stderr=log)


@pytest.fixture
def two_hosts(tmp_path, monkeypatch):
    """An sshd of our own on 127.0.0.1 and 127.0.0.2, a key to reach it, pdsh pointed at it."""
    why = _missing_tools()
    if why:
        pytest.skip("two-host test cannot run here: " + "; ".join(why))
    if sys.platform != "linux":
        pytest.skip("two-host test needs Linux: 127.0.0.2 is a loopback address only there")
    d = tmp_path / "ssh"
    d.mkdir()
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    os.makedirs("/run/sshd", exist_ok=True) if os.geteuid() == 0 else None
    user = psutil.Process().username()
    for attempt in range(3):
        port = _pick_port()
        sshd = _start_sshd(d, port, user)
        try:
            for h in HOSTS:
                _wait_port(h, port, sshd)
            break
        except RuntimeError as exc:
            sshd.kill()
            sshd.wait()
            if "Address already in use" not in (d / "sshd.log").read_text() or attempt == 2:
                pytest.skip(f"two-host test cannot run here: {exc}: {(d / 'sshd.log').read_text()[-500:]}")
    try:
        for h in HOSTS:
            r = subprocess.run(["ssh", "-F", str(d / "ssh_config"), h, "echo", "ok"],
                               capture_output=True, text=True, timeout=30)
            assert r.stdout.strip() == "ok", f"ssh to {h}:{port} failed: {r.stderr}"
        r = subprocess.run(["pdsh", "-S", "-w", ",".join(HOSTS), "echo", "up"], capture_output=True, text=True,
                           timeout=30, env={**os.environ, "PDSH_RCMD_TYPE": "ssh",
                                            "PDSH_SSH_ARGS_APPEND": f"-F {d / 'ssh_config'}"})
        assert r.returncode == 0 and r.stdout.count("up") == 2, f"pdsh: {r.stdout} {r.stderr}"
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
        monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", f"-F {d / 'ssh_config'}")
        monkeypatch.delenv("MASTER_ADDR", raising=False)
        yield {"hostfile": hostfile, "port": port, "sshd": sshd, "dir": d}
    finally:
        sshd.terminate()  # by PID: only the daemon this test started
        try:
            sshd.wait(timeout=10)
        except subprocess.TimeoutExpired:
            sshd.kill()
            sshd.wait()
        # per-connection sshd children of our daemon (config path in their command line), if any
        for p in psutil.process_iter(["cmdline"]):
            try:
                if str(d / "sshd_config") in " ".join(p.info["cmdline"] or []):
                    p.kill()
            except psutil.Error:
                pass


class RankWatcher(threading.Thread):
    """Polls this host for the trial's rank processes (children of sshd, not of the launcher)."""

    def __init__(self, marker: str):
        super().__init__(daemon=True)
        self.marker, self.seen, self.stop_evt = marker, {}, threading.Event()

    def run(self):
        from zero_bench.trial.sampler import env_of, find_workers

        while not self.stop_evt.is_set():
            for p in find_workers(self.marker):
                if p.pid in self.seen:
                    continue
                env = env_of(p, "RANK", "CROSS_RANK", "LOCAL_RANK", "PATH", "OMP_NUM_THREADS", "DS_ACCELERATOR",
                             "MALLOC_MMAP_THRESHOLD_", "PYTHONPATH")
                if "RANK" not in env:
                    continue
                try:
                    chain = [a.name() for a in p.parents()]
                    cwd, rss = p.cwd(), p.memory_info().rss
                except psutil.Error:
                    continue
                self.seen[p.pid] = {"env": env, "parents": chain, "cwd": cwd, "rss": rss}
            self.stop_evt.wait(0.2)


@pytest.mark.slow
def test_maxbatch_search_over_two_hosts(two_hosts, tmp_path):
    """A maxbatch search with a hostfile: ranks 0 and 1 run on "nodes" 0 and 1, reached over ssh."""
    from zero_bench.store import Store
    from zero_bench.config.schema import SearchConfig
    from zero_bench.search.maxbatch import SearchOptions, run_search
    from zero_bench.trial.sampler import find_workers

    cfg = tiny_cfg(hostfile=str(two_hosts["hostfile"]), num_nodes=2, launcher="pdsh", memory_gb=1.5)
    run_dir = tmp_path / "search"
    watcher = RankWatcher(str(run_dir))
    watcher.start()
    lines = []
    try:
        res = run_search(cfg, SearchConfig(max=4), Store(tmp_path / "store.sqlite"), run_dir,
                         SearchOptions(progress=lines.append))
    finally:
        watcher.stop_evt.set()
        watcher.join(5)
        leftovers = find_workers(str(run_dir))
        for p in leftovers:
            p.kill()
    assert not leftovers, f"ranks left running: {[p.pid for p in leftovers]}"
    # the ranks were launched once (a pool over both hosts); each trial is a child forked on its node
    launches = sorted(run_dir.glob("launch*"))
    pools = sorted((run_dir / "pool").glob("pool*"))
    logs = "\n".join(f"--- {p.name}\n" + (p / "stderr.log").read_text()[-2000:] + (p / "stdout.log").read_text()[-2000:]
                     for p in launches + pools)
    assert res.status == "done", f"{res.status}: {res.note}\n" + "\n".join(lines) + logs
    assert res.max_micro == 4 and res.max_global_batch == 8
    assert res.measure and res.measure.status == "ok" and res.measure.time_per_step_s > 0

    assert len(pools) == 1 and len(launches) >= 2, (pools, launches)
    for pool in pools:
        # 1. the launcher took the multi-node path: pdsh to both hosts, a node rank per host
        out = (pool / "stdout.log").read_text() + (pool / "stderr.log").read_text()
        cmd = re.search(r"cmd = (pdsh .*)", out)
        assert cmd, f"no pdsh command in {pool}: {out[-1500:]}"
        assert "-w 127.0.0.1,127.0.0.2" in cmd.group(1) and "--node_rank=%n" in cmd.group(1)
        assert f"cd {os.getcwd()};" in cmd.group(1)  # the runner's cd: remote ranks start in our cwd
        for var in ("OMP_NUM_THREADS=1", "DS_ACCELERATOR=cpu", "MALLOC_MMAP_THRESHOLD_=65536", "PATH="):
            assert f"export {var}" in cmd.group(1), var
    for launch in launches:
        # 2. every rank wrote its start record; world = 2 ranks
        starts = {}
        for f in launch.glob("rank*.jsonl"):
            import json

            recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            s = next(r for r in recs if r["event"] == "start")
            starts[s["rank"]] = s
        assert sorted(starts) == [0, 1]
        if all("node_rank" in s for s in starts.values()):  # once the worker records CROSS_RANK
            assert {r: s["node_rank"] for r, s in starts.items()} == {0: 0, 1: 1}

    # 3. the processes themselves: one rank per node rank, each a descendant of sshd (pdsh -> ssh),
    #    started in our working directory with the environment from the env file
    ranks = {(v["env"]["RANK"], v["env"]["CROSS_RANK"]) for v in watcher.seen.values()}
    assert ("0", "0") in ranks and ("1", "1") in ranks, watcher.seen
    for v in watcher.seen.values():
        assert "sshd" in v["parents"], v["parents"]
        assert v["cwd"] == os.getcwd()
        assert v["env"]["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
        assert v["env"]["OMP_NUM_THREADS"] == "1" and v["env"]["DS_ACCELERATOR"] == "cpu"
        assert v["env"]["MALLOC_MMAP_THRESHOLD_"] == "65536"
    # 4. each node's ranks reported their own memory (the runner cannot see remote processes)
    assert {r.rank for r in res.measure.ranks} == {0, 1}
    assert all(r.peak_rss_bytes > 0 for r in res.measure.ranks)
