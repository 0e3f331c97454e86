"""Pay for the launcher once per search: ranks started once, a fresh forked child per trial.

A `Pool` is one deepspeed launch of `zero_bench.trial.rank --pool DIR` (zero_bench.trial.pool_rank): every
rank imports torch, deepspeed and megatron-core, then forks a child for each trial the runner
requests. The child is the trial, exactly as a freshly launched rank would run it (its own process
group, master port, records, logs and memory figures), so "fresh" keeps its meaning. A `PoolSlot`
holds at most one pool for a search: started on first use, replaced when a trial needs other ranks
(world size, nodes, environment) or when it died, closed at the end. Whatever a child does (OOM,
crash, hang), the runner ends that child only and the pool serves the next trial; a pool that does
not answer a kill is closed and the next trial starts a new one. A pool that refuses to serve
(its imports initialized CUDA: forked children could not use the GPU) turns the slot off: every
trial from then on is a launch of its own (zero_bench.trial.launch), and one line says why.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import psutil

from zero_bench.config.schema import BenchConfig
from zero_bench.records import PoolRequest
from zero_bench.trial.launcher import free_port, kill_tree, launch_env, launcher_cmd, trial_env
from zero_bench.trial.machine import machine_lock
from zero_bench.trial.pool_rank import exit_path, refused_path, request_path, write_whole
from zero_bench.trial.sampler import is_worker

# How long the ranks may take to report a killed child's exit before the pool counts as broken.
KILL_ANSWER_S = 15.0
# How long, once a child failed, the others may take to report their own exits before the rest are
# killed: a rank the kernel SIGKILLed and the peer that lost it exit within milliseconds of each
# other, and which parent writes its exit file first is a race (each polls up to CHILD_POLL_S).
SETTLE_S = 1.0
# How often the runner looks for a trial's exit files: a few stat calls each time, so often enough
# that a finished trial (a gpt-tiny one takes ~0.9 s in all) does not wait half of 0.1 s for the next
# look on average, as it did.
EXIT_POLL_S = 0.02


def cause(failed: list[int]) -> int:
    """Of the failed children's exit codes (rank order), the one that says why: the first ended by
    a signal, else the first."""
    return next((c for c in failed if c < 0), failed[0])


def pool_key(cfg: BenchConfig) -> str:
    """What the pool's ranks are: trials with the same key can be children of the same pool."""
    hw = cfg.hardware
    return json.dumps([cfg.parallel.world_size, hw.hostfile, hw.num_nodes, hw.launcher, trial_env(cfg)],
                      sort_keys=True)


class Pool:
    """One deepspeed launch whose ranks fork a child per trial request."""

    def __init__(self, cfg: BenchConfig, pool_dir: Path):
        self.cfg, self.dir, self.key = cfg, pool_dir, pool_key(cfg)
        self.multi_node = bool(cfg.hardware.hostfile)
        self.n = 0  # requests written so far
        self.dir.mkdir(parents=True, exist_ok=True)
        cmd = launcher_cmd(cfg, self.dir, free_port(), flag="--pool")
        env, self.cmd_text = launch_env(cfg, self.dir, cmd)
        with open(self.dir / "stdout.log", "w") as out, open(self.dir / "stderr.log", "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def refused(self) -> Optional[str]:
        """Why the pool's ranks refused to serve (pool_rank.serve), None while they serve."""
        try:
            return refused_path(self.dir).read_text()
        except OSError:
            return None

    def submit(self, spec_path: Path, run_dir: Path, port: int) -> tuple["PoolTrial", str]:
        """Ask every rank for a child running the trial spec at `spec_path` with master port `port`;
        the running trial and the command text that re-runs it (also written to run_dir/cmd.txt)."""
        self.n += 1
        cmd_text = f"{self.cmd_text}  # request {self.n}: {spec_path}, MASTER_PORT={port}"
        (run_dir / "cmd.txt").write_text(cmd_text + "\n")
        for name in ("stdout.log", "stderr.log"):  # the children append to them
            (run_dir / name).write_text("")
        # absolute: the ranks' working directory is the pool's, not this job's
        req = PoolRequest(spec=str(spec_path.resolve()), port=port, out_dir=str(run_dir.resolve()))
        write_whole(request_path(self.dir, self.n), req.to_json())
        return PoolTrial(self, self.n, run_dir), cmd_text

    def exits(self, n: int) -> dict[int, int]:
        """Exit codes of request n's children, by rank, as far as reported."""
        out = {}
        for r in range(self.cfg.parallel.world_size):
            with contextlib.suppress(OSError, ValueError):
                out[r] = int(exit_path(self.dir, n, r).read_text())
        return out

    def close(self) -> None:
        """End the pool. Its ranks hold nothing worth a clean exit: the stop file ends the ones on
        other nodes, and the launcher's whole tree here goes at once."""
        with contextlib.suppress(OSError):
            (self.dir / "stop").write_text("")
        kill_tree(self.proc, [], multi_node=self.multi_node)


class PoolTrial:
    """One request to a pool, seen by the runner as the rank processes of one launch."""
    forked = True  # the sampler counts the children, not the pool's parents

    def __init__(self, pool: Pool, n: int, run_dir: Path):
        self.pool, self.n, self.run_dir = pool, n, run_dir
        self.root_pid = pool.proc.pid
        self.marker = str(pool.dir) if pool.multi_node else None
        self.killed = False
        self.first_failure: Optional[int] = None  # exit code of the first child that failed by itself
        self._failed_at: Optional[float] = None  # when a failed child was first seen

    def wait(self, timeout: float) -> bool:
        """True once every rank's child has ended (or the pool itself has). As DeepSpeed's launcher
        does, a child that failed ends its peers, which may wait for it in a collective."""
        end = time.time() + timeout
        while True:
            exits = self.pool.exits(self.n)
            if len(exits) == self.pool.cfg.parallel.world_size or not self.pool.alive():
                return True
            failed = [c for _, c in sorted(exits.items()) if c]
            if failed and not self.killed:
                self._failed_at = self._failed_at or time.time()
                # A child ended by a signal (killed, aborted) is the cause, an exit code what its
                # peers did once they lost it; the peer's exit may be reported first, so the
                # others get SETTLE_S to report theirs before the rest are killed.
                signalled = cause(failed)
                if signalled < 0 or time.time() - self._failed_at >= SETTLE_S:
                    self.first_failure = signalled
                    self.kill()
            if time.time() >= end:
                return False
            time.sleep(EXIT_POLL_S)

    def kill(self) -> None:
        """End this trial's children: at once where they run on this host, through the kill file
        (read by their parents within CHILD_POLL_S) everywhere."""
        self.killed = True
        with contextlib.suppress(OSError):
            request_path(self.pool.dir, self.n, ".kill").write_text("")
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.root_pid).children(recursive=True):
                with contextlib.suppress(psutil.Error, ProcessLookupError):
                    if is_worker(p) and is_worker(p.parent()):
                        os.killpg(p.pid, signal.SIGKILL)  # its own group: what it started goes too

    def end(self, known: list[psutil.Process]) -> None:
        """Leave no child running: ask the parents to kill it; a pool that does not answer goes."""
        if self.wait(0):
            return
        self.kill()
        if not self.wait(KILL_ANSWER_S):
            for p in known:  # the children this host has
                with contextlib.suppress(psutil.Error):
                    p.kill()
            self.pool.close()

    @property
    def rc(self) -> Optional[int]:
        """The first failing child's exit code, as the launcher would report it; 0 if all ended 0."""
        if not self.pool.alive() and len(self.pool.exits(self.n)) < self.pool.cfg.parallel.world_size:
            return self.pool.proc.returncode
        if self.first_failure is not None:
            return self.first_failure
        failed = [c for _, c in sorted(self.pool.exits(self.n).items()) if c]
        return cause(failed) if failed else 0

    def log_tail(self, n: int = 3000) -> str:
        text = ""
        for f in (self.run_dir / "stderr.log", self.run_dir / "stdout.log", self.pool.dir / "stderr.log"):
            with contextlib.suppress(OSError):
                text += f.read_text(errors="replace")[-n:]
        return text


class PoolSlot:
    """At most one pool at a time, held by one search (or by a sweep's searches in one process). It
    keeps the machine lock while a pool lives: its idle ranks are launcher command lines another
    zero_bench's cleanup would kill."""

    def __init__(self, root: Path):
        self.root = root
        self.pool: Optional[Pool] = None
        self.started = 0
        self.disabled: Optional[str] = None  # why trials are launched one by one instead
        self._lock: Optional[contextlib.ExitStack] = None

    def get(self, cfg: BenchConfig) -> Optional[Pool]:
        """The pool for `cfg`'s ranks; None once a pool refused (launch each trial on its own)."""
        if self.disabled is not None:
            return None
        if self.pool is not None and (self.pool.key != pool_key(cfg) or not self.pool.alive()):
            self.close()
        if self.pool is None:
            if self._lock is None:
                self._lock = contextlib.ExitStack()
                self._lock.enter_context(machine_lock())
            self.started += 1
            self.pool = Pool(cfg, self._new_dir())
        return self.pool

    def _new_dir(self) -> Path:
        """A folder no pool used (a resumed search or sweep finds its killed predecessor's)."""
        n = 1
        while (self.root / f"pool{n:02d}").exists():
            n += 1
        return self.root / f"pool{n:02d}"

    def refuse(self, reason: str) -> None:
        """A pool refused: no more pools here, every later trial is a launch of its own."""
        self.close()
        self.disabled = reason
        print(f"zero_bench: pool refused ({reason}); launching each trial fresh", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> "PoolSlot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

