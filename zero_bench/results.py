"""One record type from worker to report, and the durable store every run shares (SQLite).

A TrialResult is one batch size tried for one configuration. A search's summary is a SearchResult.
Both are written in their own transaction the moment they are known; a killed search or sweep
loses nothing that finished and resumes from what is here.
"""
from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

# fits / oom / error / timeout, plus the outcomes no launch produced
STATUSES = ("ok", "oom", "error", "timeout", "not_run", "skipped", "estimated_oom")


@dataclass
class TrialResult:
    search_key: str
    trial_key: str
    label: str
    micro: int
    global_batch: int
    status: str
    mode: str = "probe"  # probe: memory only; measure: full timed steps
    reason: str = ""
    phase: str = ""  # where a failure happened: "init" = before the first step
    time_per_step_s: Optional[float] = None
    samples_per_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    loss: Optional[float] = None
    capacity_bytes: Optional[int] = None
    ranks: list = field(default_factory=list)  # per rank: peak RSS, live tensors, model states, phase
    devices: dict = field(default_factory=dict)  # per device: sampled peak, total, phase
    duration_s: float = 0.0
    launch: int = 0  # trials sharing a launch id ran in one deepspeed launch
    run_dir: str = ""
    cmd: str = ""
    config: dict = field(default_factory=dict)
    ds_config: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)  # the machine: CPU/GPU, memory, library versions
    created: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str)

    @classmethod
    def from_json(cls, text: str) -> "TrialResult":
        return cls(**json.loads(text))


@dataclass
class SearchResult:
    search_key: str
    label: str
    status: str  # "done" / "error" / "cannot_initialize" / "skipped" / "estimated_oom"
    max_micro: Optional[int] = None
    max_global_batch: Optional[int] = None
    first_fail_micro: Optional[int] = None
    note: str = ""
    trials: int = 0
    launches: int = 0
    wall_s: float = 0.0
    strategy: str = ""
    config: dict = field(default_factory=dict)
    measure: Optional[dict] = None  # the TrialResult (as dict) measured at max_micro with full steps
    repeats: list = field(default_factory=list)  # time/step of each repeat at max_micro
    created: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str)

    @classmethod
    def from_json(cls, text: str) -> "SearchResult":
        return cls(**json.loads(text))


SCHEMA = """
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    search_key TEXT NOT NULL, trial_key TEXT NOT NULL, micro INTEGER NOT NULL,
    status TEXT NOT NULL, mode TEXT NOT NULL, created REAL NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS trials_search ON trials(search_key);
CREATE TABLE IF NOT EXISTS searches (
    search_key TEXT PRIMARY KEY, status TEXT NOT NULL, created REAL NOT NULL, body TEXT NOT NULL);
"""


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._conn() as c:
            c.executescript(SCHEMA)

    def _conn(self) -> sqlite3.Connection:
        c = sqlite3.connect(self.path, timeout=30)
        c.execute("PRAGMA journal_mode=WAL")
        c.execute("PRAGMA synchronous=FULL")  # a committed trial survives a power cut, not just a kill
        return c

    def add_trial(self, t: TrialResult) -> None:
        with closing(self._conn()) as c, c:
            c.execute("INSERT INTO trials(search_key, trial_key, micro, status, mode, created, body) "
                      "VALUES (?,?,?,?,?,?,?)",
                      (t.search_key, t.trial_key, t.micro, t.status, t.mode, t.created, t.to_json()))

    def trials(self, search_key: Optional[str] = None) -> list[TrialResult]:
        q, args = "SELECT body FROM trials", ()
        if search_key:
            q, args = q + " WHERE search_key = ?", (search_key,)
        with closing(self._conn()) as c:
            return [TrialResult.from_json(r[0]) for r in c.execute(q + " ORDER BY id", args)]

    def put_search(self, s: SearchResult) -> None:
        with closing(self._conn()) as c, c:
            c.execute("INSERT OR REPLACE INTO searches(search_key, status, created, body) VALUES (?,?,?,?)",
                      (s.search_key, s.status, s.created, s.to_json()))

    def search(self, search_key: str) -> Optional[SearchResult]:
        with closing(self._conn()) as c:
            row = c.execute("SELECT body FROM searches WHERE search_key = ?", (search_key,)).fetchone()
        return SearchResult.from_json(row[0]) if row else None

    def searches(self) -> list[SearchResult]:
        with closing(self._conn()) as c:
            return [SearchResult.from_json(r[0]) for r in c.execute("SELECT body FROM searches ORDER BY created")]

    def forget(self, search_key: str) -> None:
        """force=true: measure again from scratch."""
        with closing(self._conn()) as c, c:
            c.execute("DELETE FROM trials WHERE search_key = ?", (search_key,))
            c.execute("DELETE FROM searches WHERE search_key = ?", (search_key,))
