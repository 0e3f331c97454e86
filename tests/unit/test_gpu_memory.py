"""A rank's GPU memory at the CUDA/NVML seam (fake pynvml and fake torch.cuda, tests/gpu_fakes.py):
the emulated card is as large as asked by CUDA's own total, other processes are not the rank's
overhead, memory that grows outside the allocator after the cap was set counts against the
capacity, and a cuBLAS handle that cannot be created is an OOM only on a full device."""
from __future__ import annotations

import types

import pytest
import torch

from zero_bench.devices import nvml

from zero_bench.config.schema import StepsConfig
from zero_bench.devices.capacity import compared_peak, over_capacity
from zero_bench.devices.gpu import DEVICES_ENV, REFRESH_GROWTH, RankGpu, baseline, near_full
from zero_bench.records import Event, Mode, ModelStates, RankRecord, RankStatus, TrialSpec
from zero_bench.trial import worker
from zero_bench.trial.oom import is_oom

from conftest import cpu_cfg
from gpu_fakes import EIGHT, FakeCuda, GiB, MiB, fake_pynvml

CAP = 40537 * MiB  # hardware=a100_40gb on an 80 GB card
DRIVER = 870 * MiB  # the driver's reserve: in NVML's total and v1 used, not in CUDA's total


@pytest.fixture
def devices(monkeypatch):
    """A mutable copy of EIGHT behind fake NVML (driver reserve DRIVER); the rank uses GPU 0."""
    devs = list(EIGHT)
    for k in (DEVICES_ENV, "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    return devs


def install(monkeypatch, devs, **kw):
    nv = fake_pynvml(devs, reserved=DRIVER, **kw)
    monkeypatch.setattr(nvml, "nvml_module", lambda: nv)
    return nv


def used(devs, i, v1_used):
    devs[i] = devs[i][:4] + (v1_used,)


def rank_gpu(devs, reserved=0, base=None, cap=CAP):
    cuda = FakeCuda(devs, reserved, driver=DRIVER)
    return RankGpu(types.SimpleNamespace(cuda=cuda), 0, cap, base=base, interval=0), cuda


def test_emulated_fraction_uses_mem_get_info(monkeypatch, devices):
    """torch multiplies the fraction by cudaMemGetInfo's total, which leaves the driver's reserve out;
    NVML's total and v1 used both count it (the old arithmetic lost ~1 GiB of the emulated card)."""
    install(monkeypatch, devices)
    r = 2 * GiB
    gpu, cuda = rank_gpu(devices, reserved=r)
    gpu.emulate()
    f = cuda.calls["fraction"][0]
    free, total = cuda.mem_get_info(0)
    outside = (total - free) - r
    assert total == 80 * GiB - DRIVER and outside == 1 * GiB - DRIVER  # context: v2 used, not v1
    assert f == (CAP - outside) / total
    assert f * total + outside == pytest.approx(CAP, abs=1)  # allocator + outside = the card asked for, to the byte
    rec = gpu.record()
    assert rec["cuda_total_bytes"] == total and rec["gpu_card_bytes"] == 80 * GiB and rec["memory_fraction"] == f
    assert rec["outside_bytes"] == outside


def test_other_process_is_not_outside(monkeypatch, devices):
    """Another process holds 5 GiB of the GPU before the rank starts: the emulated card stays the
    same size and the rank's NVML peak leaves those 5 GiB out."""
    install(monkeypatch, devices)
    ctx = 512 * MiB  # the rank's own context, NCCL, cuBLAS

    def start(other: int) -> RankGpu:
        used(devices, 0, DRIVER + other)
        base = baseline(0)  # read before the rank's first CUDA call
        assert base.used == other
        used(devices, 0, DRIVER + other + ctx)
        gpu, _ = rank_gpu(devices, reserved=2 * GiB, base=base)
        gpu.emulate()
        return gpu

    idle, busy = start(0), start(5 * GiB)
    assert busy.fraction == idle.fraction == (CAP - ctx) / busy.cuda_total
    rec = busy.record()
    assert rec["gpu_others_bytes"] == 5 * GiB and rec["nvml_peak_bytes"] == ctx and rec["outside_bytes"] == ctx
    assert rec["gpu_shared"] is True and rec["nvml_used_bytes"] == 5 * GiB + ctx  # device-wide, as nvidia-smi
    assert idle.record()["gpu_shared"] is False


def test_others_from_v1_leave_the_reserve_out(monkeypatch, devices):
    """A driver without NVML v2: v1's used includes the reserve, which is NVML's total minus CUDA's."""
    install(monkeypatch, devices, v2=False)
    used(devices, 0, DRIVER + 5 * GiB)
    base = baseline(0)
    assert base.reserved is None and base.used == DRIVER + 5 * GiB
    used(devices, 0, DRIVER + 6 * GiB)
    gpu, _ = rank_gpu(devices, base=base)
    assert gpu.others == 5 * GiB and gpu.outside_now() == 1 * GiB
    rec = gpu.record(peak_reserved=0)
    assert rec["nvml_v2"] is False and rec["nvml_peak_bytes"] == 1 * GiB  # neither the reserve nor the others'
    assert rec["device_peak_bytes"] == 1 * GiB


def test_outside_growth_after_emulate_is_over_capacity(monkeypatch, devices):
    """The fraction keeps torch's reserved bytes below cap - outside by construction; NCCL buffers
    connected at the first collective come on top. The device peak sees them, reserved alone not."""
    install(monkeypatch, devices)
    gpu, cuda = rank_gpu(devices)
    gpu.emulate()
    limit = int(gpu.fraction * gpu.cuda_total)
    cuda.reserved = cuda.allocated = limit  # the allocator at its cap
    used(devices, 0, devices[0][4] + 300 * MiB)  # NCCL connects its buffers in the first step
    rec = RankRecord(rank=0, event=Event.END, torch_peak_reserved=limit, **gpu.record(peak_reserved=limit))
    assert not over_capacity(rec.torch_peak_reserved, CAP)  # what the check compared before: never over
    assert compared_peak(rec, "gpu") == rec.device_peak_bytes == pytest.approx(CAP + 300 * MiB, abs=1)
    assert over_capacity(compared_peak(rec, "gpu"), CAP)


def test_refresh_lowers_the_fraction_by_the_growth(monkeypatch, devices):
    install(monkeypatch, devices)
    gpu, cuda = rank_gpu(devices, reserved=4 * GiB)
    gpu.emulate()
    before = gpu.fraction
    used(devices, 0, devices[0][4] + REFRESH_GROWTH // 2)
    assert gpu.refresh() is False  # noise: left alone
    used(devices, 0, devices[0][4] + 300 * MiB)
    cuda.log.clear()
    assert gpu.refresh() is True
    assert gpu.fraction == pytest.approx(before - (300 * MiB + REFRESH_GROWTH // 2) / gpu.cuda_total)
    # blocks cached above the new limit would stay usable: the cache goes first
    assert [c for c, _ in cuda.log] == ["empty_cache", "fraction"]


def test_no_refresh_without_emulation(monkeypatch, devices):
    install(monkeypatch, devices)
    gpu, cuda = rank_gpu(devices, cap=None)
    gpu.emulate()
    used(devices, 0, devices[0][4] + 1 * GiB)
    assert gpu.refresh() is False and "fraction" not in cuda.calls


class _Engine:
    """Counts steps; every step applied (the worker's GPU bookkeeping is what is under test)."""
    zero_init = False
    hpz_secondary: dict = {}

    def __init__(self, log):
        self.log = log

    def step(self, batches, mask, marks):
        self.log.append("step")
        return [1.0] * len(batches)

    def was_step_applied(self):
        return True

    def grad_norm(self):
        return 1.0

    def loss_scale(self):
        return None

    def model_states(self):
        return ModelStates()

    def offloaded(self):
        return {"optimizer": False, "params": False}


def test_rank_refreshes_the_cap_after_each_entrys_first_step(tmp_path):
    """Rank.run_entry (the real plan logic) asks the GPU to follow outside growth after the first
    step of every entry, before the steps that are measured."""
    log: list = []
    gpu = types.SimpleNamespace(refresh=lambda: log.append("refresh"))
    cfg = cpu_cfg(steps=StepsConfig(warmup=2, timed=2, probe=1))
    rank = worker.Rank(TrialSpec(config=cfg, ds_config="", out_dir=str(tmp_path), plan=[]), _Engine(log), 0,
                       worker.Marks(), gpu)
    store = tmp_path / "pg"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        rank.run_entry(1, Mode.MEASURE)
        assert log == ["step", "refresh", "step", "step", "step", "step"]  # warm-up 2, timed 2, profiled
        log.clear()
        rank.run_entry(2, Mode.PROBE)
        assert log == ["step", "refresh", "step"]
    finally:
        torch.distributed.destroy_process_group()


# -- CUBLAS_STATUS_NOT_INITIALIZED: out of memory only on a full device ------------------------------

CUBLAS = RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`")


@pytest.mark.parametrize("full, expect", [(True, True), (False, False)])
def test_cublas_not_initialized_is_oom_only_when_full(full, expect):
    assert is_oom(CUBLAS, near_full=full) is expect
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = CUBLAS
    assert is_oom(wrapped, near_full=full) is expect


def test_near_full_reads_cuda(monkeypatch, devices):
    install(monkeypatch, devices)
    gpu, cuda = rank_gpu(devices, reserved=2 * GiB, cap=None)
    assert not gpu.near_full()
    cuda.reserved = gpu.cuda_total - (1 * GiB - DRIVER) - 100 * MiB  # 100 MiB free on the card
    assert gpu.near_full()
    rec = worker.failure_record(0, CUBLAS, Event.END, worker.device_near_full(gpu))
    assert rec.status == RankStatus.OOM
    # under emulation the emulated card is what is full, not the 80 GB one
    emu, cuda = rank_gpu(devices, reserved=2 * GiB)
    emu.emulate()
    assert not emu.near_full()
    cuda.reserved = int(emu.fraction * emu.cuda_total)
    assert emu.near_full() and near_full(cuda, 0, CAP, emu.others)
    assert worker.failure_record(0, CUBLAS, Event.END, worker.device_near_full(None)).status == RankStatus.ERROR
