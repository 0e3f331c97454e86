"""Run one deepspeed launch (one or more batch sizes) and turn what its ranks wrote into results.

The launch: DeepSpeed's own launcher (`python -m deepspeed.launcher.runner`, so hostfiles and
multi-node launchers work unchanged) in its own process group, with a free master port, a timeout,
a memory sampler beside it, and the whole tree killed afterwards whatever happened.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil

from zero_bench import ds_config as dsc
from zero_bench.config import BenchConfig
from zero_bench.environment import machine_environment_cached
from zero_bench.results import TrialResult
from zero_bench.sampler import Sampler, summarize
from zero_bench.worker import OOM_EXIT

# What ranks print when an allocation fails, or what the launcher says when the kernel killed one.
OOM_PATTERNS = re.compile(r"out of memory|OutOfMemoryError|can't allocate memory|MemoryError|"
                          r"return code = -9\b", re.I)


@dataclass
class Entry:
    micro: int
    mode: str = "probe"  # "probe" (memory) or "measure" (full timed steps)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def capacity_bytes(cfg: BenchConfig) -> Optional[int]:
    """Per-rank capacity: the user's figure, else (CPU) this host's RAM shared by its ranks."""
    if cfg.hardware.memory_gb:
        return int(cfg.hardware.memory_gb * 2**30)
    if cfg.hardware.device == "gpu":
        return None  # the card itself; NVML reports its total
    local = max(1, cfg.parallel.world_size // cfg.hardware.num_nodes)
    return psutil.virtual_memory().total // local


# Variables a remote rank needs from this process. Over pdsh/ssh only PYTHON*/UCX*/MV2*/MLFLOW*
# (and NCCL* on CUDA) pass by themselves; the rest must travel in the env file (DS_ENV_FILE).
REMOTE_PASS = ("LD_LIBRARY_PATH", "CUDA_DEVICE_ORDER", "HF_HOME")


def extensions_dir() -> str:
    """Where DeepSpeed JIT-builds its ops: one cache per virtualenv unless the user chose one.
    A cache shared by two venvs rebuilds on every switch and can be left locked by a killed build."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")


def trial_env(cfg: BenchConfig) -> dict:
    """Environment of the rank processes (also written to the env file for remote nodes).

    Multi-node (a hostfile): remote commands start from a login shell of sshd/srun with its own
    PATH, so PATH leads with this interpreter's bin directory (the venv: ninja for DeepSpeed's
    JIT ops, the `deepspeed` scripts) and library/cache paths set here are passed on. The working
    directory needs nothing: DeepSpeed's pdsh runner itself runs `cd <launch cwd>` on every node.
    """
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    if cfg.hardware.device == "cpu":
        # glibc keeps freed blocks otherwise and RSS hides what ZeRO frees (field notes).
        env.update(DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    else:
        env["DS_ACCELERATOR"] = "cuda"
    env["TORCH_EXTENSIONS_DIR"] = extensions_dir()
    if cfg.hardware.hostfile:
        for k in REMOTE_PASS:
            if os.environ.get(k):
                env[k] = os.environ[k]
        bin_dir = os.path.dirname(sys.executable)
        path = [p for p in os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep) if p]
        env["PATH"] = os.pathsep.join([bin_dir] + [p for p in path if p != bin_dir])
    return env


def read_hostfile(path: str) -> dict[str, int]:
    """host -> slots, in file order, parsed as DeepSpeed parses it (`host slots=N`, # comments)."""
    from zero_bench.config import ConfigError

    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        # DeepSpeed itself would warn and silently run on this host only.
        raise ConfigError(f"hardware.hostfile={path}: cannot read it ({exc.strerror})") from None
    hosts: dict[str, int] = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+)\s+slots=(\d+)", line)
        if not m:
            raise ConfigError(f"hardware.hostfile={path}: bad line {line!r}; expected 'HOST slots=N'")
        if m.group(1) in hosts:
            raise ConfigError(f"hardware.hostfile={path}: host {m.group(1)} listed twice")
        hosts[m.group(1)] = int(m.group(2))
    if not hosts:
        raise ConfigError(f"hardware.hostfile={path}: no 'HOST slots=N' line")
    return hosts


def check_hostfile(cfg: BenchConfig) -> dict[str, int]:
    """The hosts a multi-node launch will use; every mismatch with the config is one-line ConfigError."""
    from zero_bench.config import ConfigError

    hw, world = cfg.hardware, cfg.parallel.world_size
    hosts = read_hostfile(hw.hostfile)
    if hw.num_nodes > len(hosts):
        raise ConfigError(f"hardware.num_nodes={hw.num_nodes}: the hostfile {hw.hostfile} lists only "
                          f"{len(hosts)} hosts")
    if world % hw.num_nodes:
        raise ConfigError(f"hardware.num_nodes={hw.num_nodes}: must divide the world size tp*dp={world}")
    per_node = world // hw.num_nodes
    used = dict(list(hosts.items())[:hw.num_nodes])
    short = {h: s for h, s in used.items() if s < per_node}
    if short:
        raise ConfigError(f"hardware.hostfile={hw.hostfile}: {per_node} ranks per node but "
                          + ", ".join(f"{h} has slots={s}" for h, s in short.items()))
    return used


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def master_addr(cfg: BenchConfig, hosts: dict[str, int]) -> Optional[str]:
    """--master_addr for a multi-node launch, or None to let DeepSpeed find it.

    MASTER_ADDR from the environment wins (Slurm scripts set it); a first host written as an IP
    address is used as is. Otherwise DeepSpeed runs a plain `ssh <first host> hostname -I`, which
    ignores PDSH_SSH_ARGS_APPEND (ports, config files) - so prefer one of the two above.
    """
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    first = next(iter(hosts))
    return first if _is_ip(first) else None


def launcher_cmd(cfg: BenchConfig, spec_path: Path, port: int) -> list[str]:
    """DeepSpeed's own launcher; a hostfile makes it a multi-node launch through hw.launcher.

    --no_ssh_check: DeepSpeed's pre-check runs a plain `ssh host hostname` that ignores the pdsh
    ssh options (port, -F config); a host that cannot be reached fails the launch anyway, with
    pdsh's message in stderr.log. Extra launcher flags (e.g. openmpi's --mca ...) come from
    ZERO_BENCH_LAUNCHER_ARGS.
    """
    hw = cfg.hardware
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(port)]
    if hw.hostfile:
        hosts = check_hostfile(cfg)
        ranks_per_node = cfg.parallel.world_size // hw.num_nodes
        cmd += ["--hostfile", hw.hostfile, "--num_nodes", str(hw.num_nodes), "--num_gpus",
                str(ranks_per_node), "--launcher", hw.launcher, "--no_ssh_check"]
        addr = master_addr(cfg, hosts)
        if addr:
            cmd += ["--master_addr", addr]
        if os.environ.get("ZERO_BENCH_LAUNCHER_ARGS"):
            cmd += ["--launcher_args", os.environ["ZERO_BENCH_LAUNCHER_ARGS"]]
    else:
        cmd += ["--num_gpus", str(cfg.parallel.world_size)]
    return cmd + ["--no_local_rank", "--module", "zero_bench.worker", "--spec", str(spec_path)]


def kill_tree(proc: subprocess.Popen, known: list[psutil.Process], multi_node: bool = False) -> None:
    """SIGKILL the launch's process group and every worker the sampler saw (even if re-parented).

    Multi-node: SIGTERM the runner first, so DeepSpeed's own cleanup (pdsh pkill on every node)
    reaches the remote ranks before the local tree goes.
    """
    if multi_node and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in known:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def remove_shm_buffers(port: int) -> None:
    """Unlink this launch's /dev/shm buffers of DeepSpeed's CPU collective (66 MiB per rank).

    Ranks that end by os._exit or SIGKILL never unlink them, and /dev/shm is RAM: left alone, a
    test suite's worth of launches fills the machine's memory.
    """
    for f in Path("/dev/shm").glob(f"deepspeed_*_{port}_*"):
        try:
            f.unlink()
        except OSError:
            pass


_launch_ids = itertools.count(int(time.time() * 1000))


def read_rank_logs(out_dir: Path) -> dict[int, list[dict]]:
    logs = {}
    for f in sorted(out_dir.glob("rank*.jsonl")):
        recs = []
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
        if recs:
            logs[recs[0]["rank"]] = recs
    return logs


def run_launch(cfg: BenchConfig, plan: list[Entry], run_dir: Path, fault: Optional[dict] = None,
               on_result: Optional[Callable[[TrialResult], None]] = None,
               on_event: Optional[Callable[[dict], None]] = None,
               sample_interval: float = 0.05) -> list[TrialResult]:
    """Launch once, run `plan` (ascending micro sizes), return one TrialResult per entry."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.jsonl"):
        old.unlink()
    ds = dsc.write(cfg, run_dir / "ds_config.json")
    cap = capacity_bytes(cfg)
    spec = {"config": cfg.to_dict(), "ds_config": str(run_dir / "ds_config.json"),
            "out_dir": str(run_dir), "plan": [e.__dict__ for e in plan], "capacity_bytes": cap,
            "fault": fault}
    spec_path = run_dir / "trial.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    env = {**os.environ, **trial_env(cfg)}
    env_file = run_dir / ".deepspeed_env"  # what remote ranks get (only PYTHON* passes otherwise)
    env_file.write_text("".join(f"{k}={v}\n" for k, v in trial_env(cfg).items()))
    env["DS_ENV_FILE"] = str(env_file)
    if not cfg.hardware.hostfile:
        env["ZERO_BENCH_PARENT_PID"] = str(os.getpid())  # ranks end themselves if we are killed
    port = free_port()
    cmd = launcher_cmd(cfg, spec_path, port)
    cmd_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in trial_env(cfg).items()) + " " + shlex.join(cmd)
    (run_dir / "cmd.txt").write_text(cmd_text + "\n")

    t0 = time.time()
    launch_id = next(_launch_ids)
    emitted: list[TrialResult] = []

    def emit(results: list[TrialResult], sampler: Sampler, logs: dict) -> None:
        """Hand each entry's result on the moment it is final (the store writes it at once)."""
        marks = {rank: [m for r in recs for m in r.get("marks", [])] for rank, recs in logs.items()}
        for r in results[len(emitted):]:
            r.launch, r.run_dir, r.cmd, r.ds_config, r.capacity_bytes = launch_id, str(run_dir), cmd_text, ds, cap
            r.env = dict(machine_environment_cached())
            r.duration_s = round(time.time() - t0, 2)
            if r.status in ("ok", "oom", "timeout"):
                r.devices = _window(sampler, r, marks) or summarize(sampler.samples, marks)
            if sampler.error:
                r.reason = (r.reason + "; " if r.reason else "") + sampler.error
            emitted.append(r)
            if on_result:
                on_result(r)

    with open(run_dir / "stdout.log", "w") as out, open(run_dir / "stderr.log", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=os.getcwd(),
                                start_new_session=True)
        stopped = []

        def over_budget(msg: str) -> None:  # stop early: past the budget the batch cannot fit
            stopped.append(msg)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        sampler = Sampler(proc.pid, sample_interval, use_gpu=cfg.hardware.device == "gpu",
                          budget=cap if cfg.hardware.device == "cpu" else None, on_over=over_budget,
                          marker=str(spec_path) if cfg.hardware.hostfile else None)
        sampler.start()

        def poll(logs: dict) -> None:
            done = finished_prefix(plan, logs, cfg.parallel.world_size)
            if done > len(emitted):
                emit(classify(cfg, plan[:done], logs, None, False, None, "", cap), sampler, logs)

        timed_out = False
        try:
            _wait(proc, run_dir, cfg.timeout_s, on_event, poll)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            sampler.stop()
            kill_tree(proc, list(sampler.procs.values()), multi_node=bool(cfg.hardware.hostfile))
            remove_shm_buffers(port)
    sampler.write_csv(run_dir / "memory_timeline.csv")
    log_tail = _tail(run_dir / "stderr.log") + _tail(run_dir / "stdout.log")
    logs = read_rank_logs(run_dir)
    results = classify(cfg, plan, logs, rc=proc.returncode, timed_out=timed_out,
                       stopped=stopped[0] if stopped else None, log_tail=log_tail, cap=cap)
    emit(results, sampler, logs)
    return emitted


def finished_prefix(plan: list[Entry], logs: dict[int, list[dict]], world: int) -> int:
    """How many leading entries every rank has ended "ok" (final whatever happens next)."""
    n = 0
    for entry in plan:
        ok = [x for recs in logs.values() for x in recs
              if x.get("event") == "end" and x.get("micro") == entry.micro and x.get("status") == "ok"]
        if len(ok) < world:
            break
        n += 1
    return n


def _wait(proc: subprocess.Popen, run_dir: Path, timeout: float, on_event, poll) -> None:
    """Wait for the launch; meanwhile pass rank 0's new records to `on_event` (live progress)
    and all ranks' records to `poll` (results final before the launch ends)."""
    deadline = time.time() + timeout
    seen = 0
    while True:
        try:
            proc.wait(timeout=0.5)
            return
        except subprocess.TimeoutExpired:
            if time.time() > deadline:
                raise
        logs = read_rank_logs(run_dir)
        if on_event:
            recs = logs.get(0, [])
            for rec in recs[seen:]:
                on_event(rec)
            seen = len(recs)
        poll(logs)


def _window(sampler: Sampler, r: TrialResult, marks: dict) -> dict:
    """Device peaks over the time this entry ran (entries of one launch run one after another)."""
    lo, hi = r.ranks[0].get("t_begin") if r.ranks else None, r.ranks[0].get("t_end") if r.ranks else None
    if lo is None:
        return {}
    return summarize([s for s in sampler.samples if lo <= s.t <= (hi or 1e18)], marks)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _base(cfg: BenchConfig, micro: int, mode: str, status: str, **kw) -> TrialResult:
    c = cfg.with_micro(micro)
    return TrialResult(search_key=cfg.search_key(), trial_key=c.trial_key(), label=cfg.label(), micro=micro,
                       global_batch=c.global_batch, status=status, mode=mode, config=c.to_dict(), **kw)


def classify(cfg: BenchConfig, plan: list[Entry], logs: dict[int, list[dict]], rc: Optional[int],
             timed_out: bool, stopped: Optional[str], log_tail: str, cap: Optional[int]) -> list[TrialResult]:
    """Per entry: ok / oom / error / timeout / not_run, from every rank's records and the exit.

    An entry every rank ended "ok" fits. Any rank "over_capacity" or "oom" -> oom. An entry that
    began but did not end on some rank failed with the launch: oom if the sampler stopped it over
    budget, a rank exited with OOM_EXIT or was SIGKILLed, or the logs show an allocation failure;
    timeout if the clock ran out (a rank that died while peers wait in a collective is also caught
    by the timeout, and its log decides oom); otherwise error with the log tail.
    """
    world = cfg.parallel.world_size
    results = []
    failed = False
    for entry in plan:
        if failed:
            results.append(_base(cfg, entry.micro, entry.mode, "not_run", reason="launch ended earlier"))
            continue
        ends = {r: next((x for x in recs if x.get("event") == "end" and x.get("micro") == entry.micro), None)
                for r, recs in logs.items()}
        begun = any(x.get("event") == "begin" and x.get("micro") == entry.micro
                    for recs in logs.values() for x in recs)
        done = [e for e in ends.values() if e]
        statuses = {e["status"] for e in done}
        if len(done) == world and statuses == {"ok"}:
            results.append(_ok(cfg, entry, logs, done))
            continue
        failed = True
        if done and statuses <= {"ok", "over_capacity"} and len(done) == world:
            peak = max(e["peak_rss_bytes"] if cfg.hardware.device == "cpu" else e.get("torch_peak_reserved", 0)
                       for e in done)
            r = _base(cfg, entry.micro, entry.mode, "oom",
                      reason=f"peak {peak / 2**20:.0f} MiB > capacity {cap / 2**20:.0f} MiB per rank",
                      phase="step")
            r.ranks = [_rank_view(e) for e in sorted(done, key=lambda e: e["rank"])]
            results.append(r)
            continue
        inits = [x for recs in logs.values() for x in recs if x.get("event") == "init_failed"]
        # Earliest first: a rank's crash makes its peers fail next ("Connection closed by peer").
        errs = sorted([e for e in done if e["status"] in ("oom", "error")] + inits, key=lambda e: e.get("time", 0))
        phase = "init" if (inits or not begun) else "step"
        silent = [r for r in range(world) if not ends.get(r)
                  and not any(x.get("event") == "init_failed" for x in logs.get(r, []))]
        status, reason = _failure(errs, rc, timed_out, stopped, log_tail, silent)
        results.append(_base(cfg, entry.micro, entry.mode, status, reason=reason, phase=phase))
    return results


# What peers of a dead rank raise: consequences, not causes.
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote worker|NCCL communicator was aborted",
                       re.I)


def _failure(errs: list[dict], rc, timed_out: bool, stopped: Optional[str], log_tail: str,
             silent: list[int]) -> tuple[str, str]:
    if stopped:
        return "oom", f"stopped early: {stopped}"
    oom = [e for e in errs if e["status"] == "oom"]
    if oom:
        return "oom", f"rank {oom[0]['rank']}: {oom[0]['error']}"
    if silent and errs and all(PEER_LOST.search(e["error"]) for e in errs):
        # A rank vanished without a word (every exception is recorded, so: SIGKILL, as the kernel's
        # OOM killer sends) and its peers only lost the connection to it.
        return "oom", f"rank {silent[0]} died without a result (killed, e.g. by the OOM killer); peers: {errs[0]['error'][:200]}"
    if not timed_out and rc in (OOM_EXIT, -9, 137, 247, 256 - OOM_EXIT):  # after a timeout, -9 is ours
        return "oom", f"a rank was killed or ran out of memory (launcher exit {rc})"
    if OOM_PATTERNS.search(log_tail):
        return "oom", "allocation failure in the logs: " + OOM_PATTERNS.search(log_tail).group(0)
    if errs:
        return "error", f"rank {errs[0]['rank']}: {errs[0]['error']}"
    if timed_out:
        return "timeout", "no result before timeout_s; logs: " + log_tail[-300:].strip()
    return "error", f"launcher exit {rc}: " + log_tail[-1500:].strip()


def _rank_view(e: dict) -> dict:
    keep = ("rank", "peak_rss_bytes", "peak_live_bytes", "peak_phase", "model_states",
            "torch_peak_allocated", "torch_peak_reserved", "time_per_step", "loss")
    out = {k: e[k] for k in keep if k in e}
    marks = e.get("marks") or []
    if marks:
        out["t_begin"], out["t_end"] = marks[0][0], marks[-1][0]
    return out


def _ok(cfg: BenchConfig, entry: Entry, logs: dict, done: list[dict]) -> TrialResult:
    c = cfg.with_micro(entry.micro)
    # The slowest rank sets the pace of a synchronous step.
    tps = max(e["time_per_step"] for e in done)
    samples = c.global_batch / tps
    r = _base(cfg, entry.micro, entry.mode, "ok", time_per_step_s=tps, samples_per_s=samples,
              tokens_per_s=samples * cfg.model.seq_len, loss=done[0]["loss"])
    r.ranks = [_rank_view(e) for e in sorted(done, key=lambda e: e["rank"])]
    return r
