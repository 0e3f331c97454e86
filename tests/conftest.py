"""Shared helpers: tiny real configurations, a check that trials leave no process or /dev/shm
buffer behind, and the session's isolation from the machine it runs on:

- The machine lock (zero_bench.trial.machine) is the real one: another zero_bench (a demo) running trials
  makes the suite wait for it, at most ZERO_BENCH_LOCK_WAIT_S seconds in all (default 1200; the
  `python -m zero_bench` the tests start inherit it), then skip what needs the machine, naming the
  holder. It never fails a test.
- The session runs in a temporary working directory (PYTHONPATH leads with this checkout, so
  `python -m zero_bench` runs this code) with its own ZERO_BENCH_CACHE: default paths
  (results/zero_bench.sqlite, runs/, ~/.cache/zero_bench) are never written by a test.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from zero_bench.config.configure import resolve
from zero_bench.config.schema import BenchConfig, HardwareConfig, ModelConfig, ParallelConfig, StepsConfig
from zero_bench.devices.toolkit import extensions_dir
from zero_bench.errors import MachineBusy
from zero_bench.trial.machine import machine_lock

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
# The whole session waits at most this long for another zero_bench's trials, then skips instead.
LOCK_WAIT_S = float(os.environ.get("ZERO_BENCH_LOCK_WAIT_S") or 1200)
# torch.compile's trials (test_compile.py): each rank runs one thread on the suite's 2-core machines,
# and inductor's default compile pool (a worker per core, in every rank) only competes for the same
# cores. One compile thread: the same kernels and losses; the five compiled trials 131 -> 103 s here.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ["ZERO_BENCH_LOCK_WAIT_S"] = str(LOCK_WAIT_S)
# DeepSpeed ops loaded in a test's own process (deepspeed.init_distributed builds the CPU
# shared-memory collective) come from the cache `make test` built them into, with the venv's ninja,
# as the ranks' do (trial/launcher.py trial_env): torch's default cache (~/.cache) is empty on a fresh
# machine, and a unit test compiled the op there first (49 s of the unit tests' 167).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
os.environ["PATH"] = os.pathsep.join([os.path.join(sys.prefix, "bin"), os.environ.get("PATH", "")])
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
BUSY = "another zero_bench is running trials on this machine"  # MachineBusy's message, also on a CLI's stderr
_waited = [0.0]  # seconds this session has waited for the lock


def ours(pid: int) -> bool:
    """This test process, or a live process it started (a `python -m zero_bench` of the test)."""
    if pid == os.getpid():
        return True
    try:
        return any(p.pid == os.getpid() for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def busy_reason(exc: BaseException) -> str | None:
    """The MachineBusy message in an exception, in its text or in a failed command's output, when
    the holder it names is another zero_bench: one the test itself holds the lock with is a bug."""
    texts = [str(exc)] + [v if isinstance(v, str) else (v or b"").decode(errors="replace")
                          for v in (getattr(exc, "stdout", None), getattr(exc, "stderr", None))]
    for text in texts:
        line = next((ln.strip() for ln in text.splitlines() if BUSY in ln), None)
        if line is not None:
            holder = re.search(r"\(pid (\d+):", line)
            return None if holder and ours(int(holder.group(1))) else line
    return None


def _skip_if_busy(exc: BaseException) -> None:
    reason = busy_reason(exc)
    if reason is not None:
        _waited[0] = LOCK_WAIT_S  # the wait is spent: later tests skip at once while the holder runs
        os.environ["ZERO_BENCH_LOCK_WAIT_S"] = "0"
        pytest.skip(f"machine busy, not tested: {reason}")


# Only tests that launch on the machine (marked slow) are skipped for a busy machine: a unit test of
# the lock itself (its own lock file) that ends in MachineBusy has failed.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    try:
        return (yield)
    except Exception as exc:  # noqa: BLE001 - a fixture's launch found the machine taken
        if item.get_closest_marker("slow") is not None:
            _skip_if_busy(exc)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except Exception as exc:  # noqa: BLE001 - a launch, or a zero_bench command it ran, found the machine taken
        if item.get_closest_marker("slow") is not None:
            _skip_if_busy(exc)
        raise


@pytest.fixture(autouse=True)
def machine_free(request):
    """Before each test that launches (marked slow): wait for another zero_bench's lock to be free,
    with what is left of the session's wait, or skip naming the holder. The lock is released at
    once: the test's own launches take it again (in this process or in `python -m zero_bench`)."""
    if request.node.get_closest_marker("slow") is None:
        yield
        return
    os.environ["ZERO_BENCH_LOCK_WAIT_S"] = str(max(0.0, LOCK_WAIT_S - _waited[0]))
    t0 = time.time()
    try:
        with machine_lock():
            pass
    except MachineBusy as exc:
        _skip_if_busy(exc)
    finally:
        _waited[0] += time.time() - t0
        os.environ["ZERO_BENCH_LOCK_WAIT_S"] = str(max(0.0, LOCK_WAIT_S - _waited[0]))
    yield


def _written(root: Path) -> dict:
    out = {}
    for name in ("results", "runs", "reports"):
        for f in (root / name).rglob("*") if (root / name).is_dir() else ():
            out[str(f)] = f.stat().st_mtime if f.exists() else None
    return out


@pytest.fixture(scope="session", autouse=True)
def away_from_the_checkout(tmp_path_factory):
    """The session's working directory and ZERO_BENCH_CACHE are temporary folders; fails at the end
    if a test wrote into the checkout's results/, runs/ or reports/ anyway."""
    before, cwd, cache = _written(ROOT), os.getcwd(), os.environ.get("ZERO_BENCH_CACHE")
    os.environ["ZERO_BENCH_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        yield
    finally:
        os.chdir(cwd)
        if cache is None:
            os.environ.pop("ZERO_BENCH_CACHE", None)
        else:
            os.environ["ZERO_BENCH_CACHE"] = cache
    after = _written(ROOT)
    changed = sorted(f for f in after if before.get(f) != after[f])
    assert not changed, f"tests wrote into the checkout: {changed[:10]}"


def model(name: str) -> ModelConfig:
    return ModelConfig(**yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()))


def cpu_cfg(name: str = "gpt-tiny", **kw) -> BenchConfig:
    """A 2-rank CPU config, resolved as configure.from_cfg leaves it (its keys are the ones the
    search stores trials under); keyword arguments replace BenchConfig fields."""
    base = BenchConfig(model=model(name), hardware=HardwareConfig(device="cpu"), precision="fp32",
                       parallel=ParallelConfig(tp=1, dp=2), steps=StepsConfig(warmup=1, timed=2),
                       timeout_s=300)
    return resolve(dataclasses.replace(base, **kw), here=False)


def compile_case(**kw) -> BenchConfig:
    """gpt-mini at micro 2 for torch.compile's checks (tests/integration/test_compile.py's cases, whose
    ZeRO-2 trial is also the reference setup's compiled one): one timed step; compiled trials run two
    more (their compile and recompile: trial/worker.py), so the eager reference warms up for two to
    give as many losses."""
    b = cpu_cfg("gpt-mini", **kw)
    return dataclasses.replace(b, steps=dataclasses.replace(b.steps, warmup=0 if b.compile else 2, timed=1))


FRESH_MICROS = (6, 7)


@pytest.fixture(scope="session")
def gpt_mini_fresh(tmp_path_factory):
    """gpt-mini ZeRO-2 fp32 on 2 CPU ranks, one fresh launch (no pool, no budget) at each of
    FRESH_MICROS: the pool test's reference for a forked child, and the search test's calibration
    (its budget lies midway between the two measured peaks). (cfg, {micro: TrialResult})."""
    from zero_bench.trial.launch import run_launch
    from zero_bench.records import Entry

    tmp = tmp_path_factory.mktemp("gpt_mini_fresh")
    cfg = cpu_cfg("gpt-mini", zero=2)
    out = {}
    for m in FRESH_MICROS:
        (out[m],) = run_launch(cfg.with_micro(m), [Entry(m)], tmp / f"micro{m}")
        assert out[m].status == "ok", out[m].reason
    return cfg, out


def wait_until(predicate, timeout: float, what: str):
    """Poll `predicate` until it returns something true, at most `timeout` seconds (a loaded machine
    takes longer than a quiet one: poll instead of sleeping a fixed time and asserting)."""
    deadline = time.time() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.time() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.05)


def worker_processes(marker: str = "") -> list[psutil.Process]:
    """Launcher and rank processes (whose command line holds `marker`, e.g. the test's tmp dir)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if ("zero_bench.trial.rank" in cmd or "deepspeed.launcher" in cmd) and marker in cmd:
            out.append(p)
    return out


def launch_ports(root: Path) -> set[int]:
    """Master ports of the launches (and pools) whose run folders are under `root`: each writes its
    command line to cmd.txt (--master_port N, or MASTER_PORT=N for a pool's trial)."""
    ports = set()
    for f in root.rglob("cmd.txt"):
        ports.update(int(p) for p in re.findall(r"(?:--master_port |MASTER_PORT=)(\d+)", f.read_text()))
    return ports


def shm_buffers(ports: set[int]) -> set[Path]:
    """DeepSpeed's /dev/shm buffers of those ports (named deepspeed_*_<port>_<rank>,
    zero_bench.trial.machine.remove_shm_buffers)."""
    return {f for f in Path("/dev/shm").glob("deepspeed_*")
            if any(f"_{port}_" in f.name for port in ports)}


@pytest.fixture
def no_leftovers(tmp_path):
    """Fails the test if any rank or launcher process of its trials (under tmp_path) outlives it,
    or if one of its launches left DeepSpeed's shared-memory buffers in /dev/shm (RAM, 66 MiB per
    rank). Only this test's launches count (their master ports, from their run folders' cmd.txt):
    another DeepSpeed run on the machine has buffers of its own."""
    shm_before = set(Path("/dev/shm").glob("deepspeed_*"))
    yield tmp_path
    ports = launch_ports(tmp_path)
    left = shm_buffers(ports) - shm_before
    assert not left, f"shm buffers left in /dev/shm by this test's launches: {sorted(map(str, left))}"
    left = [p for p in worker_processes(str(tmp_path)) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left behind: {[' '.join(p.cmdline()) for p in left]}"


def profiled_allocations(gpt, step, micro: int, **kw) -> list:
    """The net allocations (bytes, + allocated / - freed, in order) of one profiled `step(micro, **kw)`
    of a megatron model on one CPU rank, after a warm-up step at the same size (the gradients exist,
    zeroed in place; lazily built state too) and with megatron's global memory buffer emptied."""
    from megatron.core import parallel_state
    from torch.profiler import ProfilerActivity, profile

    step(micro)
    gpt.zero_grad(set_to_none=False)
    parallel_state.get_global_memory_buffer().buffer.clear()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(micro, **kw)
    return [n for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                                 if e.name() == "[memory]")]


@contextlib.contextmanager
def megatron_one_rank(store: Path):
    """megatron's parallel state on a real one-rank gloo group (rendezvous file `store`), with the
    CPU shims: module-level tests of megatron's layers."""
    import torch
    from megatron.core import parallel_state

    from zero_bench.models.shims import install_cpu_shims

    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    install_cpu_shims()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


# (config, plan) -> (results, run_dir) of the session's launches through measured_once
_measured: dict = {}


def measured_once(cfg: BenchConfig, plan: list, run_dir: Path, pools) -> tuple[list, Path]:
    """run_launch(cfg, plan) as a child of `pools`, once per session: a module asking for a trial
    another module already ran (the same resolved config and plan: e.g. llama-tiny ZeRO-1 at micro 2,
    the reference of both the model tests and the sequence-parallel ones) gets that trial's results
    and run folder instead of a second launch that would measure the same figures. Each module run
    alone still launches all of its own. (results, the folder they were written to)."""
    from zero_bench.trial.launch import LaunchOptions, run_launch

    key = (json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str),
           tuple((e.micro, str(e.mode)) for e in plan))
    if key not in _measured:
        _measured[key] = (run_launch(cfg, plan, run_dir, LaunchOptions(pools=pools)), run_dir)
    return _measured[key]


_session_slot: list = []  # the session's PoolSlot, once a module asked for `pools`


@pytest.fixture(scope="session")
def session_pools(tmp_path_factory):
    from zero_bench.trial.pool import PoolSlot

    with PoolSlot(tmp_path_factory.mktemp("pool")) as slot:
        _session_slot.append(slot)
        yield slot


@pytest.fixture(scope="module")
def pools(session_pools):
    """One pool for a module's trials: each a fresh child forked from it, as a search runs them, its
    figures a launch of its own's (tests/integration/test_pool_cpu.py), without a launch's ~9 s of
    imports each. A test that runs `python -m zero_bench` closes it first (it holds the machine
    lock); tests about how a launch of its own ends launch without it. The slot is the session's:
    where the next module's first test asks for `pools` too, the pool's ranks serve it on (one
    launch's start-up less, ~10 s here); at every other module boundary it is closed
    (pytest_runtest_teardown), so nothing between modules finds a pool, as with one per module."""
    return session_pools


_four_slot: list = []  # the session's 4-rank PoolSlot, once a module asked for `pools4`


@pytest.fixture(scope="session")
def pools4(tmp_path_factory):
    """One pool of 4 ranks for the modules whose trials run on 4 (tp x dp, pp x dp, dp_shard): its start
    (~12 s here, 4 ranks importing on 2 cores) paid once for all of them, not once per module. Those
    modules run one after another (pytest_collection_modifyitems), and the slot is closed after the
    last test that asks for it (pytest_runtest_teardown), before another pool or command takes the
    machine lock."""
    from zero_bench.trial.pool import PoolSlot

    with PoolSlot(tmp_path_factory.mktemp("pool4")) as slot:
        _four_slot.append(slot)
        yield slot


def _uses(item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items):
    """The modules on the session's pool (a test asks for `pools`) run one after another, after the
    others (each module's tests keep their order): the pool's start (~10 s here) is paid once for
    the run of them instead of once per module that follows one without it. The modules on the
    4-rank pool (`pools4`) run one after another too, where the two groups meet: last of the
    others, first of those on `pools`. A module that closes the session's pool to run a command
    (CLOSES_POOL = True) runs last of those on `pools`, so that no module after it starts it again."""
    first, on_pool, on_four = {}, set(), set()
    for i, item in enumerate(items):
        module = getattr(item, "module", None)
        first.setdefault(module, i)
        if _uses(item, "pools"):
            on_pool.add(module)
        if _uses(item, "pools4"):
            on_four.add(module)

    def order(item):
        module = getattr(item, "module", None)
        pooled = module in on_pool
        group = ((module not in on_four) + getattr(module, "CLOSES_POOL", False)) if pooled else (module in on_four)
        return pooled, group, first[module]

    items.sort(key=order)


def pytest_runtest_teardown(item, nextitem):
    if _four_slot and (nextitem is None or (nextitem.module is not item.module and not _uses(nextitem, "pools4"))):
        _four_slot[0].close()
    if _session_slot and (nextitem is None or (nextitem.module is not item.module
                                               and "pools" not in nextitem.fixturenames)):
        _session_slot[0].close()
