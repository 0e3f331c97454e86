"""The GPU path at its seams, with the fake NVML of test_nvml and a fake torch.cuda: the right GPUs
are launched on, sampled and reported; a MIG slice reports its own memory; an emulated card caps
the allocator below itself and is reported against its own capacity."""
from __future__ import annotations

import os
import types

import pytest

from zero_bench.config.schema import BenchConfig, ConfigError, HardwareConfig, ParallelConfig
from zero_bench.devices import nvml
from zero_bench.devices.capacity import memory_fraction
from zero_bench.devices.gpu import DEVICES_ENV, RankGpu, select_devices
from zero_bench.records import Entry, RankRecord, Status, TrialResult
from zero_bench.report.tables import _memory, emulation_note
from zero_bench.trial.launch import LaunchOptions, _Launch
from zero_bench.trial.launcher import trial_env
from zero_bench.trial.outcome import gpu_devices
from zero_bench.trial.sampler import Sampler

from conftest import model
from gpu_fakes import A100, EIGHT, FakeCuda, GiB, MiB, fake_pynvml


def gpu_cfg(dp=2, **hw) -> BenchConfig:
    return BenchConfig(model=model("gpt-tiny"), parallel=ParallelConfig(tp=1, dp=dp), precision="bf16",
                       hardware=HardwareConfig(device="gpu", **hw))


@pytest.fixture
def fake(monkeypatch):
    def install(devices=EIGHT, mig=None, **kw):
        nv = fake_pynvml(devices, mig=mig, **kw)
        monkeypatch.setattr(nvml, "nvml_module", lambda: nv)
        return nv
    for k in ("CUDA_VISIBLE_DEVICES", DEVICES_ENV, "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(k, raising=False)
    return install


def rank_gpu(monkeypatch, devices, local_rank, cap=None, reserved=0, driver=0, base=None, mig=None):
    cuda = FakeCuda(devices, reserved, driver=driver, mig=mig)
    return RankGpu(types.SimpleNamespace(cuda=cuda), local_rank, cap, base=base, interval=0), cuda


def test_cuda_visible_devices_4_5_is_what_runs_is_sampled_and_is_reported(fake, monkeypatch, tmp_path):
    fake()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    cfg = gpu_cfg()
    assert trial_env(cfg)[DEVICES_ENV] == "4,5"
    cmd, env = _Launch(cfg, [Entry(1)], tmp_path, LaunchOptions()).prepare(29500)
    # DeepSpeed's runner would drop CUDA_VISIBLE_DEVICES next to --num_gpus: the list travels apart
    assert "CUDA_VISIBLE_DEVICES" not in env and env[DEVICES_ENV] == "4,5" and "--num_gpus" in cmd
    assert "ZERO_BENCH_DEVICES=4,5" in (tmp_path / "cmd.txt").read_text()

    # each rank makes the list its CUDA_VISIBLE_DEVICES and finds its own GPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    rank_env = {DEVICES_ENV: env[DEVICES_ENV], "CUDA_VISIBLE_DEVICES": "0,1"}  # what DeepSpeed's launch sets
    select_devices(rank_env)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", rank_env["CUDA_VISIBLE_DEVICES"])
    monkeypatch.setenv(DEVICES_ENV, rank_env[DEVICES_ENV])
    records = []
    for local_rank in (0, 1):
        gpu, cuda = rank_gpu(monkeypatch, EIGHT, local_rank)
        assert cuda.calls["device"] == local_rank
        records.append(RankRecord(rank=local_rank, event="end", host="node-a", **gpu.record()))
    assert [r.gpu_uuid for r in records] == [EIGHT[4][1], EIGHT[5][1]]

    # the runner samples exactly those two
    s = Sampler(os.getpid(), gpus=env[DEVICES_ENV])
    s.sample_once()
    assert sorted((x.ident, x.used) for x in s.samples if x.kind == "gpu") == [(0, 5 * GiB), (1, 6 * GiB)]
    s.stop()

    # and the report shows exactly those two, with their identity
    t = TrialResult(search_key="k", trial_key="t", label="l", micro=1, global_batch=2, status=Status.OK,
                    ranks=records, devices=gpu_devices(records, [], None))
    mem = _memory(t)
    assert [d.uuid for d in t.devices_of("gpu")] == [EIGHT[4][1], EIGHT[5][1]]
    assert mem["Dev0 used MiB"] == 5 * 1024 and mem["Dev1 used MiB"] == 6 * 1024 and "Dev2 used MiB" not in mem


def test_too_few_gpus_for_the_ranks_is_one_line(monkeypatch):
    from zero_bench.search.preflight import validate_machine

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES=3: lists 1 GPUs but 2 ranks per node"):
        validate_machine(gpu_cfg())
    with pytest.raises(ConfigError, match=r"hardware.devices=GPU-aa: lists 1 GPUs"):
        validate_machine(gpu_cfg(devices="GPU-aa"))


def test_mig_slice_reports_its_own_memory(fake, monkeypatch):
    mig = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
    slice_ = ("NVIDIA A100-SXM4-40GB MIG 2g.10gb", mig, (0, 0x07, 0), 10 * GiB, 3 * GiB)
    fake(A100 + [slice_], mig={mig: len(A100)})
    monkeypatch.setenv(DEVICES_ENV, mig)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig)
    gpu, _ = rank_gpu(monkeypatch, A100, 0, mig={mig: slice_})
    rec = gpu.record()
    assert rec["gpu_uuid"] == mig and rec["nvml_total_bytes"] == 10 * GiB and rec["gpu_card_bytes"] == 10 * GiB
    assert rec["nvml_used_bytes"] == 3 * GiB  # not the parent's 1 GiB of 40


def test_emulated_a100_40gb_caps_the_allocator_and_reports_against_40537_mib(fake, monkeypatch):
    fake()
    cap = 40537 * MiB
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    gpu, cuda = rank_gpu(monkeypatch, EIGHT, 0, cap=cap, reserved=0)  # 1 GiB used outside torch (context)
    gpu.emulate()
    f, dev = cuda.calls["fraction"]
    assert dev == 0 and f == pytest.approx((cap - 1 * GiB) / (80 * GiB))  # allocator + context <= 40537 MiB
    assert type(f) is float
    rec = RankRecord(rank=0, event="end", **{**gpu.record(), "nvml_peak_bytes": 30000 * MiB})
    t = TrialResult(search_key="k", trial_key="t", label="l", micro=1, global_batch=1, status=Status.OK,
                    ranks=[rec], devices=gpu_devices([rec], [], cap))
    mem = _memory(t)
    assert mem["Dev0 total MiB"] == 40537 and mem["peak memory used"] == pytest.approx(30000 / 40537)
    assert emulation_note(t) == "capacity emulated: 40,537 MiB per GPU on 81,920 MiB cards"


def test_memory_fraction():
    assert memory_fraction(None, 80 * GiB, 0) is None
    assert memory_fraction(90 * GiB, 80 * GiB, 0) is None  # not smaller than the card: no emulation
    assert memory_fraction(40 * GiB, 80 * GiB, 2 * GiB) == pytest.approx(38 / 80)
    assert type(memory_fraction(40 * GiB, 80 * GiB, 0)) is float  # torch refuses an int
    assert 0 < memory_fraction(40 * GiB, 80 * GiB, 50 * GiB) < 1e-9  # outside alone passes the cap


def test_memory_mib_and_the_a100_preset():
    from zero_bench.devices.capacity import capacity_bytes
    from zero_bench.config.configure import compose

    c = compose(["hardware=a100_40gb"])
    assert (c.hardware.device, c.hardware.memory_mib) == ("gpu", 40537)
    assert capacity_bytes(gpu_cfg(memory_mib=40537)) == 40537 * MiB
    c = compose(["+sweep=seed_grid"])
    # the reference's setup: fp16, full recompute, the Megatron-DeepSpeed ds_config, A100-40GB
    assert (c.hardware.memory_mib, c.precision, c.recompute, c.ds_preset) == (
        40537, "fp16", "full", "megatron_deepspeed")


# -- GPUs named by UUID reach DeepSpeed as integers (its CUDA accelerator int()s them) --------------

def test_uuid_devices_reach_deepspeed_as_indices(fake, monkeypatch):
    """DeepSpeed's CUDA_Accelerator.available_memory (ZeRO-1/2 call it in DeepSpeedZeroOptimizer's
    __init__) maps torch's index through int() of each CUDA_VISIBLE_DEVICES entry."""
    from deepspeed.accelerator import cuda_accelerator

    nv = fake()
    env = {DEVICES_ENV: f"{EIGHT[4][1]},{EIGHT[5][1]}", "CUDA_VISIBLE_DEVICES": "0,1"}  # launcher's "0,1"
    assert select_devices(env) == f"{EIGHT[4][1]},{EIGHT[5][1]}"  # the user's spelling is kept for the rank
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert nv.state["init"] == 0  # select_devices released NVML again

    # DeepSpeed's own accelerator (its nvmlInit fails here, which leaves its module global None)
    acc = cuda_accelerator.CUDA_Accelerator()
    nv.nvmlInit()  # as the accelerator's own _init_pynvml does on a machine with a driver
    monkeypatch.setattr(cuda_accelerator, "pynvml", nv)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"])
    assert acc.available_memory(1) == EIGHT[5][3] - EIGHT[5][4]  # NVML device 5's free
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", EIGHT[4][1])  # what the user's spelling would have done
    with pytest.raises(ValueError, match="invalid literal for int"):
        acc.available_memory(0)


@pytest.mark.parametrize("devices, expect", [("4,5", "4,5"), ("GPU-00000004,5", "4,5"),
                                             ("MIG-aaaa,MIG-bbbb", "MIG-aaaa,MIG-bbbb"),
                                             ("GPU-ffffffff", "GPU-ffffffff")])  # unknown: CUDA decides
def test_select_devices_rewrites_only_what_needs_it(fake, devices, expect):
    fake()
    env = {DEVICES_ENV: devices, "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}  # the user's shell
    select_devices(env)
    assert env["CUDA_VISIBLE_DEVICES"] == expect
    # every index is nvidia-smi's (PCI order), as the runner's NVML sampler reads it; MIG: no order
    assert env["CUDA_DEVICE_ORDER"] == ("FASTEST_FIRST" if devices.startswith("MIG-") else "PCI_BUS_ID")


def test_without_nvml_uuids_stay(monkeypatch):
    def missing():
        raise ImportError("No module named 'pynvml'")
    monkeypatch.setattr(nvml, "nvml_module", missing)
    env = {DEVICES_ENV: EIGHT[4][1]}
    select_devices(env)
    assert env["CUDA_VISIBLE_DEVICES"] == EIGHT[4][1] and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_mig_available_memory_answers_from_cuda(fake, monkeypatch):
    """A MIG slice keeps its UUID in CUDA_VISIBLE_DEVICES: DeepSpeed's int() would fail there, so
    the rank answers available_memory itself, from CUDA's view of its slice (and the emulated cap)."""
    from deepspeed.accelerator import cuda_accelerator

    mig = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
    slice_ = ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", mig, (0, 0x10, 0), 40 * GiB, 1 * GiB)
    nv = fake(EIGHT + [slice_], mig={mig: len(EIGHT)})
    monkeypatch.setenv(DEVICES_ENV, mig)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig)
    gpu, cuda = rank_gpu(monkeypatch, EIGHT, 0, cap=20 * GiB, reserved=6 * GiB, mig={mig: slice_})
    cuda.allocated = 4 * GiB  # 2 GiB of torch's 6 are cached, free for reuse
    acc = cuda_accelerator.CUDA_Accelerator()
    nv.nvmlInit()
    monkeypatch.setattr(cuda_accelerator, "pynvml", nv)
    with pytest.raises(ValueError):
        acc.available_memory(0)  # DeepSpeed's own: int("MIG-...")
    gpu.serve_deepspeed(acc)
    free = 40 * GiB - 1 * GiB - 6 * GiB
    assert acc.available_memory() == free + 2 * GiB  # no emulation yet: the slice's free + the cache
    gpu.emulate()
    f = cuda.calls["fraction"][0]
    assert f == pytest.approx((20 * GiB - 1 * GiB) / (40 * GiB))
    assert acc.available_memory() == min(free + 2 * GiB, int(f * 40 * GiB) - 4 * GiB)  # the emulated card's
    assert gpu.record()["gpu_card_bytes"] == 40 * GiB


def test_deepspeed_cpu_accelerator_is_left_alone(fake, monkeypatch):
    fake()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    gpu, _ = rank_gpu(monkeypatch, EIGHT, 0)
    acc = types.SimpleNamespace(_name="cpu", available_memory=lambda device_index=None: 7)
    gpu.serve_deepspeed(acc)
    assert acc.available_memory() == 7


@pytest.mark.parametrize("text", ["NCCL WARN Failed to CUDA calloc 6291456 bytes",
                                  "ncclUnhandledCudaError: Call to CUDA function failed. Cuda failure 2 'x'",
                                  "CUDA error: CUDA_ERROR_OUT_OF_MEMORY"])
def test_nccl_allocation_failures_are_oom(text):
    from zero_bench.trial.oom import is_oom

    assert is_oom(RuntimeError(text))


@pytest.mark.parametrize("offload, op", [(False, "fused_adam"), (True, "cpu_adam")])
def test_gpu_ops_are_built_once_before_any_trial(monkeypatch, offload, op):
    import deepspeed.accelerator
    import deepspeed.git_version_info as info

    from zero_bench.commands import doctor

    built = []
    fake_acc = types.SimpleNamespace(create_op_builder=lambda cls: types.SimpleNamespace(
        load=lambda: built.append(cls)))
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake_acc)
    monkeypatch.setattr(info, "installed_ops", {})
    monkeypatch.setattr(doctor, "jit_cached", lambda name: None)
    monkeypatch.setattr(doctor, "fused_adam_fallback", lambda: None)  # an nvcc of torch's CUDA is here
    cfg = gpu_cfg()
    cfg = BenchConfig(**{**cfg.__dict__, "zero": 2, "offload": offload})
    assert doctor.prebuild_ops(cfg, say=lambda s: None) == [op] and built == [doctor.BUILDERS[op]]
    monkeypatch.setattr(doctor, "jit_cached", lambda name: "/cache/x.so")
    assert doctor.prebuild_ops(cfg, say=lambda s: None) == []

    def broken():
        raise RuntimeError("nvcc not found")
    fake_acc.create_op_builder = lambda cls: types.SimpleNamespace(load=broken)
    monkeypatch.setattr(doctor, "jit_cached", lambda name: None)
    with pytest.raises(ConfigError, match=rf"DeepSpeed op {op} cannot be built here .*nvcc not found"):
        doctor.prebuild_ops(cfg, say=lambda s: None)


def test_several_ranks_on_mig_slices_is_one_line_one_rank_is_fine(monkeypatch):
    """A CUDA process sees one MIG instance: rank 1 would ask for an ordinal that does not exist."""
    from zero_bench.search.preflight import check_devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    two = gpu_cfg(dp=2, devices="MIG-aaaa,MIG-bbbb")
    with pytest.raises(ConfigError) as e:
        check_devices(two)
    assert str(e.value).startswith("hardware.devices: 2 ranks per node on MIG slices") and "\n" not in str(e.value)
    check_devices(gpu_cfg(dp=1, devices="MIG-aaaa"))  # one rank on one slice runs
    check_devices(gpu_cfg(dp=2, devices="0,1"))  # whole GPUs
