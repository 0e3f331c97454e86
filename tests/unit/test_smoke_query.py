"""launch/gpu_smoke.sh's query helper against the current store and records: what the shell reads
with `read -r n uuids tps nonzero` is what it means (a 2-GPU trial's UUIDs are one field), and the
per-rank memory lines carry the figures the first GPU run compares with nvidia-smi."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from zero_bench.records import DeviceMemStats, RankRecord, SearchResult, SearchStatus, Status, TrialResult
from zero_bench.store import Store

ROOT = Path(__file__).resolve().parents[2]
QUERY = ROOT / "launch" / "smoke_query.py"
MiB = 2**20
UUIDS = ["GPU-aaaaaaaa-0000-1111-2222-333344445555", "GPU-bbbbbbbb-0000-1111-2222-333344445555"]


def store_with_a_2gpu_trial(tmp_path) -> Path:
    path = tmp_path / "smoke.sqlite"
    ranks = [RankRecord(rank=r, event="end", gpu_uuid=UUIDS[r], nvml_used_bytes=1200 * MiB,
                        nvml_used_v1_bytes=1700 * MiB, nvml_reserved_bytes=500 * MiB, torch_peak_reserved=900 * MiB,
                        torch_peak_allocated=800 * MiB, outside_bytes=300 * MiB, device_peak_bytes=1200 * MiB,
                        cuda_total_bytes=81000 * MiB, gpu_processes=1) for r in (0, 1)]
    devices = [DeviceMemStats(kind="gpu", id=r, peak_bytes=1200 * MiB, total_bytes=4096 * MiB, uuid=UUIDS[r])
               for r in (0, 1)]
    t = TrialResult(search_key="k", trial_key="t", label="l", micro=2, global_batch=4, status=Status.OK,
                    time_per_step_s=0.1234, ranks=ranks, devices=devices)
    store = Store(path)
    store.add_trial(t)
    store.put_search(SearchResult(search_key="k", label="l", status=SearchStatus.DONE, max_micro=8,
                                  first_fail_micro=9, measure=t))
    return path


def shell(script: str) -> str:
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)  # its scripts
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_last_ok_reads_as_four_fields(tmp_path):
    store = store_with_a_2gpu_trial(tmp_path)
    line = shell(f'{sys.executable} {QUERY} {store} last_ok').strip()
    assert line.split(" ") == ["2", ",".join(UUIDS), "0.1234", "1"]
    # what the smoke test's `read` gets: time/it is the time, not the second UUID
    got = shell(f'read -r n uuids tps nonzero <<<"$({sys.executable} {QUERY} {store} last_ok)"; '
                'echo "$n|$uuids|$tps|$nonzero"').strip()
    assert got == f"2|{','.join(UUIDS)}|0.1234|1"


def test_search_and_gpu_mem(tmp_path):
    store = store_with_a_2gpu_trial(tmp_path)
    # its one trial has no pool's command text: launched fresh, none forked
    assert shell(f"{sys.executable} {QUERY} {store} search").split() == ["done", "8", "9", "0", "4096", "0", "1"]
    lines = shell(f"{sys.executable} {QUERY} {store} gpu_mem").strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"rank1 {UUIDS[1]} ")
    for field in ("v1_used=1700", "v2_used=1200", "nvml_reserved=500", "torch_peak_reserved=900",
                  "torch_peak_allocated=800", "outside=300", "cuda_total=81000"):
        assert field in lines[0], field


def test_gpu_smoke_parses():
    shell("bash -n launch/gpu_smoke.sh")


def test_search_counts_trials_forked_from_a_pool(tmp_path):
    """The smoke test's "one pool" check: a pool that refused leaves its folder, and every trial is
    then launched fresh; only a forked trial's command names the pool's request."""
    path = store_with_a_2gpu_trial(tmp_path)
    store = Store(path)
    for n in (1, 2):
        store.add_trial(TrialResult(search_key="k", trial_key=f"p{n}", label="l", micro=n, global_batch=2 * n,
                                    status=Status.OK, cmd=f"deepspeed ... --pool  # request {n}: /x/trial.json, MASTER_PORT=1"))
    assert shell(f"{sys.executable} {QUERY} {path} search").split()[-2:] == ["2", "1"]


def test_a_pool_trials_command_is_what_the_query_counts_as_forked(tmp_path):
    """The "forked" count reads the command text the runner stores for a pool's child: ask
    pool.Pool.submit itself (no launch: a Pool object without its process), so a change of its
    text breaks this test, not the smoke test on the first GPU machine."""
    import importlib.util
    import types

    from zero_bench.trial.pool import Pool

    spec = importlib.util.spec_from_file_location("smoke_query", QUERY)
    query = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(query)
    pool = object.__new__(Pool)
    pool.dir, pool.n, pool.cmd_text = tmp_path / "pool01", 0, "deepspeed ... --pool /x/pool01"
    pool.proc, pool.multi_node = types.SimpleNamespace(pid=0), False
    pool.dir.mkdir()
    run_dir = tmp_path / "trial"
    run_dir.mkdir()
    _, cmd = pool.submit(run_dir / "trial.json", run_dir, 29500)
    assert query.POOL_REQUEST in cmd and query.POOL_REQUEST not in pool.cmd_text  # a launch's own text
