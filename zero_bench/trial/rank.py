"""A rank process, as the deepspeed launcher starts it: `python -m zero_bench.trial.rank --spec trial.json`
runs one trial (zero_bench.trial.worker) and exits; `--pool DIR` serves a search's pool
(zero_bench.trial.pool_rank), forking a fresh child per trial, each running the same `trial` function."""
from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path
from typing import NoReturn

from zero_bench.devices.gpu import select_devices
from zero_bench.trial.pool_rank import serve


def adopt_launcher_env() -> None:
    """openmpi / slurm start ranks with their own variables; torch.distributed reads RANK & co."""
    if "RANK" in os.environ:
        return
    for prefix, names in (("OMPI_COMM_WORLD_", ("RANK", "SIZE", "LOCAL_RANK", None)),
                          ("SLURM_", ("PROCID", "NTASKS", "LOCALID", "NODEID"))):
        if prefix + names[0] in os.environ:
            for ours, theirs in zip(("RANK", "WORLD_SIZE", "LOCAL_RANK", "CROSS_RANK"), names):
                if theirs and prefix + theirs in os.environ:
                    os.environ.setdefault(ours, os.environ[prefix + theirs])
            return


def watch_parent() -> None:
    """End this rank when the process that ran the trial is gone (e.g. a sweep killed with SIGKILL):
    the launcher runs in its own session, so nothing else would stop an orphaned rank. Threads are
    not inherited by fork(): a pool's child calls this again."""
    pid = int(os.environ.get("ZERO_BENCH_PARENT_PID", 0))
    if not pid:
        return

    def watch():
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="zero_bench-parent-watch").start()


def trial(spec_path: Path) -> NoReturn:
    """One trial in this process (a fresh launch's rank, or a pool's child)."""
    # torch, deepspeed and megatron come in here, after select_devices chose the GPUs (main)
    from zero_bench.records import TrialSpec
    from zero_bench.trial.worker import run_spec

    watch_parent()
    run_spec(TrialSpec.from_json(spec_path.read_text()))


def main(argv=None) -> None:
    select_devices()  # before anything starts CUDA
    adopt_launcher_env()
    ap = argparse.ArgumentParser(description=__doc__)
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--spec", help="run this trial spec, then exit")
    how.add_argument("--pool", help="serve trial requests in this folder, one forked child each")
    args = ap.parse_args(argv)
    if args.pool:
        watch_parent()
        serve(Path(args.pool), trial)
    trial(Path(args.spec))


if __name__ == "__main__":
    main()
