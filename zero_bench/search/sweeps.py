"""Sweeps whose jobs run elsewhere (Hydra's submitit launcher: Slurm, or local processes).

Each job of such a sweep writes its own store in its job directory (`<sweep dir>/<job num>/
zero_bench.sqlite`): SQLite is not safe on the network filesystems clusters share, and one file
for many jobs would contend. A re-run of the sweep (same `hydra.sweep.dir`) skips configurations
finished in any store under the sweep directory and resumes the others from their own stores.
`zero_bench report report.runs=<sweep dir>` merges every store found; `zero_bench status <sweep
dir>` says per job what it is doing. Any sweep (`-m`), wherever its jobs run, is a `Sweep` to the
job: which of how many it is, for the progress line and its ETA, and whether a bad combination of
keys is recorded as skipped rather than ending the command.
"""
from __future__ import annotations

import math
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import yaml

from zero_bench.config.schema import CONF_DIR
from zero_bench.records import Dimension, SearchResult
from zero_bench.store import Store

if TYPE_CHECKING:
    from zero_bench.trial.pool import PoolSlot

JOB_STORE = "zero_bench.sqlite"


@dataclass
class Sweep:
    """The multirun a job belongs to, as the job sees it."""
    dir: Path  # hydra.sweep.dir
    num: int  # this job's number, from 0
    total: int  # jobs the sweep launches
    t0: float  # when the sweep started (Hydra wrote multirun.yaml)
    pools: Optional["PoolSlot"] = None  # one pool shared by the jobs this process runs; None: own pools

    def progress(self, label: str, finished: bool) -> str:
        """Which config of how many, elapsed, and an estimate of the time left."""
        elapsed = time.time() - self.t0
        done = self.num + 1 if finished else self.num
        left = f" | ~{elapsed / done * (self.total - done) / 60:.1f} min left" if done else ""
        state = "done" if finished else "starting"
        return (f"[sweep] config {self.num + 1}/{self.total} {state}: {label} | {done}/{self.total} done | "
                f"elapsed {elapsed / 60:.1f} min{left}")


def current_sweep(pools: Optional["PoolSlot"] = None) -> Optional[Sweep]:
    """This Hydra job's sweep, or None for a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    sweep_dir = Path(hc.sweep.dir)
    started = sweep_dir / "multirun.yaml"
    t0 = started.stat().st_mtime if started.exists() else time.time()
    return Sweep(dir=sweep_dir, num=int(hc.job.num), total=planned_jobs(sweep_dir) or 1, t0=t0,
                 pools=None if under_submitit() else pools)


def sweep_size(args: list[str]) -> int:
    """Jobs a multirun will launch: the product of swept values (command line over preset)."""
    return math.prod(len(v) for v in swept_values(args).values()) if swept_values(args) else 1


def swept_values(args: list[str]) -> dict[str, list[str]]:
    """Each swept key's values (a +sweep= preset's, then the command line's), as override text."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params: dict[str, list[str]] = {}
    for a in args:
        if a.startswith("+sweep="):
            preset = yaml.safe_load((CONF_DIR / "sweep" / f"{a.split('=', 1)[1]}.yaml").read_text())
            for k, v in ((preset.get("hydra") or {}).get("sweeper") or {}).get("params", {}).items():
                params[k] = [x.strip() for x in str(v).split(",")]
    for o in OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")]):
        if o.is_sweep_override():
            params[o.key_or_group] = [str(v) for v in o.sweep_string_iterator()]
    return params


def under_submitit() -> bool:
    """True inside a job started by Hydra's submitit launcher (Slurm or local)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return "submitit" in str(HydraConfig.get().launcher.get("_target_", ""))
    except Exception:  # noqa: BLE001 - outside Hydra
        return False


def stores_under(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in Path(sweep_dir).rglob("*.sqlite") if ".submitit" not in p.parts)


def finished_elsewhere(key: str, sweep_dir: Path, mine: Path) -> Optional[SearchResult]:
    """A finished search of this configuration in another store of the sweep, if any."""
    for path in stores_under(sweep_dir):
        if path.resolve() == Path(mine).resolve():
            continue
        res = Store(path).search(key)
        if res and res.status.finished:
            return res
    return None


@dataclass
class JobStatus:
    num: int
    overrides: str
    state: str  # done / running / failed / not started
    job_id: str
    detail: str  # the search's answer, or the last progress line


def _job_id(job_dir: Path) -> str:
    try:
        return str(yaml.safe_load((job_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]["job"]["id"])
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return ""


def _last_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1][-200:] if lines else ""


def _failed(folder: Path, job_id: str) -> Optional[str]:
    """submitit's result pickle: ("error", traceback) when the job raised; None otherwise."""
    try:
        outcome, value = pickle.loads((folder / f"{job_id}_0_result.pkl").read_bytes())
    except (OSError, ValueError, pickle.UnpicklingError, EOFError):
        return None
    return str(value).strip().splitlines()[-1][:200] if outcome == "error" else None


def job_status(sweep_dir: Path, num: int) -> JobStatus:
    job_dir = Path(sweep_dir) / str(num)
    try:
        overrides = " ".join(o for o in yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
                             if not o.startswith("command="))
    except OSError:
        overrides = ""
    job_id = _job_id(job_dir)
    folder = Path(sweep_dir) / ".submitit" / job_id
    log = _last_line(folder / f"{job_id}_0_log.out") if job_id else ""
    searches = Store(job_dir / JOB_STORE).searches() if (job_dir / JOB_STORE).exists() else []
    if searches and searches[-1].status.finished:
        s = searches[-1]
        found = f"max seq len {s.max_seq_len}" if s.dimension == Dimension.SEQ else f"max global batch {s.max_global_batch}"
        return JobStatus(num, overrides, "done", job_id, f"{s.status}: {found}")
    error = _failed(folder, job_id) if job_id else None
    if error:
        return JobStatus(num, overrides, "failed", job_id, error)
    if searches or log or (job_dir / JOB_STORE).exists():
        return JobStatus(num, overrides, "running", job_id, log)
    return JobStatus(num, overrides, "not started", job_id, "")


def planned_jobs(sweep_dir: Path) -> int:
    """How many jobs the sweep has, from the multirun.yaml Hydra writes when it starts (0 if none)."""
    try:
        hydra = yaml.safe_load((Path(sweep_dir) / "multirun.yaml").read_text())["hydra"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return 0
    params = (hydra.get("sweeper") or {}).get("params") or {}
    args = [o for o in hydra["overrides"]["task"] if not o.startswith("+sweep=")]
    return sweep_size(args + [f"{k}={v}" for k, v in params.items()])


def sweep_status(sweep_dir: Path) -> list[JobStatus]:
    nums = {int(p.name) for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()}
    nums |= set(range(planned_jobs(sweep_dir)))
    return [job_status(sweep_dir, n) for n in sorted(nums)]


def format_status(rows: list[JobStatus]) -> str:
    counts = {s: sum(r.state == s for r in rows) for s in ("done", "running", "failed", "not started")}
    lines = [f"{r.num:>4}  {r.state:<11}  {r.job_id or '-':<14}  {r.overrides}  | {r.detail}" for r in rows]
    return "\n".join(lines + [", ".join(f"{n} {s}" for s, n in counts.items())])
