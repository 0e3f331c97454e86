"""The store: typed records round-trip, schema version, bad paths, one writer per search."""
from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest

from zero_bench.errors import ConfigError
from zero_bench.records import (DeviceMemStats, ModelStates, RankRecord, SearchResult, SearchStatus, Status,
                                TrialResult)
from zero_bench.store import SCHEMA_VERSION, Store


def trial(**kw) -> TrialResult:
    return TrialResult(search_key="k", trial_key="t", label="l", micro=3, global_batch=6, status=Status.OK,
                       fresh=True, ranks=[RankRecord(rank=0, event="end", peak_rss_bytes=5, marks=[[1.0, "init"]])],
                       devices=[DeviceMemStats(kind="rank", id=0, peak_bytes=5, total_bytes=9)], **kw)


def test_records_round_trip_typed(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    t = trial()
    store.add_trial(t)
    store.put_search(SearchResult(search_key="k", label="l", status=SearchStatus.DONE, measure=t))
    (back,) = store.trials("k")
    assert back == t and isinstance(back.status, Status) and isinstance(back.ranks[0], RankRecord)
    s = store.search("k")
    assert s.status is SearchStatus.DONE and s.measure == t


def test_model_states_keep_their_stored_keys():
    """The typed record is stored as the dict engines wrote before it: the same keys, in order."""
    ds = ModelStates(params=1, master=2, moments=3, grads=4, numel_local=5)
    assert list(ds.to_dict().items()) == [("params", 1), ("master", 2), ("optimizer", 3), ("grads", 4),
                                          ("numel_local", 5)]
    fsdp = ModelStates(params=1, moments=3, grads_at_step=7)
    assert list(fsdp.to_dict())[-1] == "grads_at_step" and fsdp.to_dict()["grads_at_step"] == 7
    for s in (ds, fsdp):
        assert ModelStates.from_dict(s.to_dict()) == s
    old = ModelStates.from_dict({"params": 8, "optimizer": 16})  # stored without the later keys
    assert (old.total, old.numel_local, old.grads_at_step) == (24, 0, None)


def test_model_states_split_device_and_host():
    """The estimate's form of the record: how much of it is offloaded; a trial's count has no split."""
    offloaded = ModelStates(params=2, master=4, moments=8, grads=16, host=12)
    assert (offloaded.total, offloaded.optimizer, offloaded.device) == (30, 12, 18)
    assert ModelStates.from_dict(offloaded.to_dict()) == offloaded and offloaded.to_dict()["host"] == 12
    counted = ModelStates(params=2, master=4, moments=8, grads=16)
    assert counted.device == counted.total and "host" not in counted.to_dict()


def test_schema_1_devices_are_read(tmp_path):
    d = trial().to_dict()
    d["devices"] = {"rank1": {"peak_bytes": 7, "total_bytes": 9, "phase": "step", "samples": 2}}
    t = TrialResult.from_dict(d)
    assert t.devices == [DeviceMemStats(kind="rank", id=1, peak_bytes=7, total_bytes=9, phase="step", samples=2)]


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_text("not sqlite at all " * 100), "not a zero_bench SQLite store"),
    (lambda p: None, "cannot write there"),
])
def test_bad_store_paths_are_one_line(tmp_path, make, message):
    p = tmp_path / "s.sqlite"
    make(p)
    if message == "cannot write there":
        p = tmp_path / "file" / "s.sqlite"
        (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(ConfigError, match=message) as err:
        Store(p)
    assert str(err.value).startswith(f"store={p}:") and "\n" not in str(err.value)


def test_newer_schema_is_refused(tmp_path):
    p = tmp_path / "s.sqlite"
    Store(p)
    with sqlite3.connect(p) as c:
        c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(ConfigError, match="written by a newer zero_bench"):
        Store(p)


def test_a_search_has_one_writer(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        with sqlite3.connect(store.path) as c:
            c.execute("INSERT INTO claims VALUES (?,?,?,?)", ("k", socket.gethostname(), other.pid, "l"))
        with pytest.raises(ConfigError, match=rf"being written by pid {other.pid}"):
            store.claim("k", "l")
    finally:
        other.kill()
        other.wait()
    store.claim("k", "l")  # the writer is gone: its claim is taken over
    store.release("k")
    store.claim("k", "l")
