"""The GPU path at its seams, with the fake NVML of test_nvml and a fake torch.cuda: the right GPUs
are launched on, sampled and reported; a MIG slice reports its own memory; an emulated card caps
the allocator below itself and is reported against its own capacity."""
from __future__ import annotations

import os
import types

import pytest

from zero_bench import nvml
from zero_bench.capacity import memory_fraction
from zero_bench.config import BenchConfig, ConfigError, HardwareConfig, ParallelConfig
from zero_bench.gpu import DEVICES_ENV, RankGpu, select_devices
from zero_bench.launch import LaunchOptions, _Launch, trial_env
from zero_bench.records import Entry
from zero_bench.outcome import gpu_devices
from zero_bench.records import RankRecord, Status, TrialResult
from zero_bench.report.tables import _memory, emulation_note
from zero_bench.sampler import Sampler

from conftest import model
from test_nvml import A100, fake_pynvml

GiB, MiB = 2**30, 2**20
EIGHT = [("NVIDIA A100-SXM4-80GB", f"GPU-{i:08x}-0000-1111-2222-333344445555", (0, 0x10 + i, 0), 80 * GiB,
          (i + 1) * GiB) for i in range(8)]


def gpu_cfg(dp=2, **hw) -> BenchConfig:
    return BenchConfig(model=model("gpt-tiny"), parallel=ParallelConfig(tp=1, dp=dp), precision="bf16",
                       hardware=HardwareConfig(device="gpu", **hw))


@pytest.fixture
def fake(monkeypatch):
    def install(devices=EIGHT, mig=None):
        nv = fake_pynvml(devices, mig=mig)
        monkeypatch.setattr(nvml, "nvml_module", lambda: nv)
        return nv
    for k in ("CUDA_VISIBLE_DEVICES", DEVICES_ENV, "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(k, raising=False)
    return install


class FakeCuda:
    """torch.cuda as a rank sees it: its devices are CUDA_VISIBLE_DEVICES' entries, in order."""

    def __init__(self, devices, reserved=0):
        self.devices, self.reserved, self.calls = devices, reserved, {}

    def _visible(self):
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        return [int(x) for x in env.split(",")] if env else list(range(len(self.devices)))

    def set_device(self, i):
        self.calls["device"] = i

    def get_device_properties(self, i):
        d = self.devices[self._visible()[i]]
        return types.SimpleNamespace(uuid=d[1][4:], pci_domain_id=d[2][0], pci_bus_id=d[2][1], pci_device_id=d[2][2],
                                     total_memory=d[3], name=d[0])

    def memory_reserved(self, i=None):
        return self.reserved

    def set_per_process_memory_fraction(self, f, i=None):
        self.calls["fraction"] = (f, i)


def rank_gpu(monkeypatch, devices, local_rank, cap=None, reserved=0):
    cuda = FakeCuda(devices, reserved)
    return RankGpu(types.SimpleNamespace(cuda=cuda), local_rank, cap, interval=0), cuda


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
    from zero_bench.preflight import validate_machine

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
    cuda = FakeCuda(A100)
    cuda.get_device_properties = lambda i: types.SimpleNamespace(total_memory=10 * GiB, name="MIG")
    gpu = RankGpu(types.SimpleNamespace(cuda=cuda), 0, None, interval=0)
    rec = gpu.record()
    assert rec["gpu_uuid"] == mig and rec["nvml_total_bytes"] == 10 * GiB and rec["gpu_card_bytes"] == 10 * GiB
    assert rec["nvml_used_bytes"] == 3 * GiB  # not the parent's 1 GiB of 40


def test_emulated_a100_40gb_caps_the_allocator_and_reports_against_40537_mib(fake, monkeypatch):
    fake()
    cap = 40537 * MiB
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    gpu, cuda = rank_gpu(monkeypatch, EIGHT, 0, cap=cap, reserved=0)  # NVML: 1 GiB used (context)
    gpu.emulate()
    f, dev = cuda.calls["fraction"]
    assert dev == 0 and f == pytest.approx((cap - 1 * GiB) / (80 * GiB))  # allocator + context <= 40537 MiB
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


def test_memory_mib_and_the_a100_preset():
    from zero_bench.capacity import capacity_bytes
    from zero_bench.configure import compose

    c = compose(["hardware=a100_40gb"])
    assert (c.hardware.device, c.hardware.memory_mib) == ("gpu", 40537)
    assert capacity_bytes(gpu_cfg(memory_mib=40537)) == 40537 * MiB
    c = compose(["+sweep=seed_grid"])
    # the reference's setup: fp16, full recompute, the Megatron-DeepSpeed ds_config, A100-40GB
    assert (c.hardware.memory_mib, c.precision, c.recompute, c.ds_preset) == (
        40537, "fp16", "full", "megatron_deepspeed")


@pytest.mark.parametrize("text", ["NCCL WARN Failed to CUDA calloc 6291456 bytes",
                                  "ncclUnhandledCudaError: Call to CUDA function failed. Cuda failure 2 'x'",
                                  "CUDA error: CUDA_ERROR_OUT_OF_MEMORY"])
def test_nccl_allocation_failures_are_oom(text):
    from zero_bench.oom import is_oom

    assert is_oom(RuntimeError(text))


@pytest.mark.parametrize("offload, op", [(False, "fused_adam"), (True, "cpu_adam")])
def test_gpu_ops_are_built_once_before_any_trial(monkeypatch, offload, op):
    import deepspeed.accelerator
    import deepspeed.git_version_info as info

    from zero_bench import doctor

    built = []
    fake_acc = types.SimpleNamespace(create_op_builder=lambda cls: types.SimpleNamespace(
        load=lambda: built.append(cls)))
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake_acc)
    monkeypatch.setattr(info, "installed_ops", {})
    monkeypatch.setattr(doctor, "_jit_cached", lambda name: None)
    cfg = gpu_cfg()
    cfg = BenchConfig(**{**cfg.__dict__, "zero": 2, "offload": offload})
    assert doctor.prebuild_ops(cfg, say=lambda s: None) == [op] and built == [doctor.BUILDERS[op]]
    monkeypatch.setattr(doctor, "_jit_cached", lambda name: "/cache/x.so")
    assert doctor.prebuild_ops(cfg, say=lambda s: None) == []

    def broken():
        raise RuntimeError("nvcc not found")
    fake_acc.create_op_builder = lambda cls: types.SimpleNamespace(load=broken)
    monkeypatch.setattr(doctor, "_jit_cached", lambda name: None)
    with pytest.raises(ConfigError, match=rf"DeepSpeed op {op} cannot be built here .*nvcc not found"):
        doctor.prebuild_ops(cfg, say=lambda s: None)
