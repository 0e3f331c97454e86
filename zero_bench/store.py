"""The durable store every run shares (SQLite): trials and search summaries, each in its own
transaction the moment it is known, so a killed search or sweep loses nothing that finished.

The store carries a schema version (PRAGMA user_version); one written by a newer zero_bench is
refused, and so is a file that is not a SQLite store. A search being written is claimed in the
store (host, pid): a second process writing the same search is refused with who holds it.
"""
from __future__ import annotations

import os
import socket
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Optional

from zero_bench.errors import ConfigError
from zero_bench.records import SearchResult, TrialResult

# 1: the first landing (devices keyed "rank0" / "gpu0", no version); 2: typed records, claims.
SCHEMA_VERSION = 2
SCHEMA = """
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    search_key TEXT NOT NULL, trial_key TEXT NOT NULL, micro INTEGER NOT NULL,
    status TEXT NOT NULL, mode TEXT NOT NULL, created REAL NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS trials_search ON trials(search_key);
CREATE TABLE IF NOT EXISTS searches (
    search_key TEXT PRIMARY KEY, status TEXT NOT NULL, created REAL NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS claims (
    search_key TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL, label TEXT NOT NULL);
"""


class Store:
    def __init__(self, path: str | Path, key: str = "store"):
        """Open (or create) the store; `key` names the config key in error messages."""
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with closing(self._conn()) as c, c:
                version = c.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise ConfigError(f"{key}={path}: written by a newer zero_bench (schema {version}, this one "
                                      f"reads up to {SCHEMA_VERSION}); upgrade, or choose another store")
                c.executescript(SCHEMA)
                c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.OperationalError as exc:  # unable to open / readonly database
            raise ConfigError(f"{key}={path}: cannot write there ({exc})") from None
        except sqlite3.DatabaseError as exc:  # file is not a database
            raise ConfigError(f"{key}={path}: not a zero_bench SQLite store ({exc})") from None
        except OSError as exc:
            raise ConfigError(f"{key}={path}: cannot write there ({exc.strerror})") from None

    def _conn(self) -> sqlite3.Connection:
        c = sqlite3.connect(self.path, timeout=30)
        c.execute("PRAGMA journal_mode=WAL")
        c.execute("PRAGMA synchronous=FULL")  # a committed trial survives a power cut, not just a kill
        return c

    def add_trial(self, t: TrialResult) -> None:
        with closing(self._conn()) as c, c:
            c.execute("INSERT INTO trials(search_key, trial_key, micro, status, mode, created, body) "
                      "VALUES (?,?,?,?,?,?,?)",
                      (t.search_key, t.trial_key, t.micro, str(t.status), t.mode, t.created, t.to_json()))

    def trials(self, search_key: Optional[str] = None) -> list[TrialResult]:
        q, args = "SELECT body FROM trials", ()
        if search_key:
            q, args = q + " WHERE search_key = ?", (search_key,)
        with closing(self._conn()) as c:
            return [TrialResult.from_json(r[0]) for r in c.execute(q + " ORDER BY id", args)]

    def put_search(self, s: SearchResult) -> None:
        with closing(self._conn()) as c, c:
            c.execute("INSERT OR REPLACE INTO searches(search_key, status, created, body) VALUES (?,?,?,?)",
                      (s.search_key, str(s.status), s.created, s.to_json()))

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
            c.execute("DELETE FROM claims WHERE search_key = ?", (search_key,))

    # -- one writer per search ----------------------------------------------------------------------
    def claim(self, search_key: str, label: str) -> None:
        """Mark this process as the writer of a search; ConfigError if a live process has it."""
        me = (socket.gethostname(), os.getpid())
        with closing(self._conn()) as c, c:
            c.execute("BEGIN IMMEDIATE")
            row = c.execute("SELECT host, pid FROM claims WHERE search_key = ?", (search_key,)).fetchone()
            if row and tuple(row) != me and _alive(*row):
                raise ConfigError(f"store={self.path}: search '{label}' is being written by pid {row[1]} on "
                                  f"{row[0]}; wait for it, or use another store")
            c.execute("INSERT OR REPLACE INTO claims(search_key, host, pid, label) VALUES (?,?,?,?)",
                      (search_key, *me, label))

    def release(self, search_key: str) -> None:
        with closing(self._conn()) as c, c:
            c.execute("DELETE FROM claims WHERE search_key = ? AND host = ? AND pid = ?",
                      (search_key, socket.gethostname(), os.getpid()))


def _alive(host: str, pid: int) -> bool:
    """A claim on another host counts as alive (we cannot see it); here, the pid must exist."""
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
