"""NVML through the sampler's seam (`zero_bench.devices.nvml.nvml_module`): a fake pynvml module object
with pynvml's real function names and pynvml's own exception classes (tests/gpu_fakes.py), so that
what the code catches is what a real driver raises. Device mapping follows CUDA_VISIBLE_DEVICES
(index, UUID, UUID prefix, MIG) and local rank, by UUID or PCI bus id where the rank knows them;
memory is nvidia-smi's "used" (NVML v2), v1 where the driver has nothing newer. A rank's record
of its GPU is RankGpu.record (with a fake torch.cuda)."""
from __future__ import annotations

import os
import types

import pynvml
import pytest

from zero_bench.devices import nvml
from zero_bench.devices.gpu import DEVICES_ENV, RankGpu
from zero_bench.devices.nvml import Nvml, torch_identity
from zero_bench.trial.sampler import Sampler

from gpu_fakes import A100, ERRORS, FAKE_NAMES, FakeCuda, fake_pynvml

GiB, MiB = 2**30, 2**20


@pytest.fixture
def use_fake(monkeypatch):
    def install(nv):
        monkeypatch.setattr(nvml, "nvml_module", lambda: nv)
        return nv
    for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", DEVICES_ENV):
        monkeypatch.delenv(k, raising=False)
    return install


def rank_record(local_rank: int, devices=A100, reserved: int = 0) -> dict:
    """What rank `local_rank` records about its GPU, through torch.cuda's fake."""
    cuda = FakeCuda(devices, driver=reserved)
    return RankGpu(types.SimpleNamespace(cuda=cuda), local_rank, None, interval=0).record()


def test_fake_has_real_pynvml_names_and_classes():
    nv = fake_pynvml()
    for name in FAKE_NAMES:
        assert hasattr(pynvml, name), name
        assert callable(getattr(nv, name))
    for name in ERRORS:
        assert getattr(nv, name) is getattr(pynvml, name)
        assert issubclass(getattr(nv, name), pynvml.NVMLError)
    assert pynvml.NVMLError_LibraryNotFound().value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND == 12
    # the v2 struct and version the code asks for, as pynvml spells them
    assert nv.nvmlMemory_v2 == pynvml.nvmlMemory_v2 == 0x02000028
    assert [f[0] for f in pynvml.c_nvmlMemory_v2_t._fields_] == ["version", "total", "reserved", "free", "used"]
    # what pynvml raises where the driver lacks a function: the class the fallback catches
    assert isinstance(pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND), pynvml.NVMLError_FunctionNotFound)


def test_device_calls_before_init_raise_uninitialized():
    nv = fake_pynvml()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()


def test_real_pynvml_without_gpu_is_library_not_found():
    """On this machine (no driver) the real module answers as the field notes say, and Nvml copes."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present here: the no-GPU case cannot be observed")
    n = Nvml()
    assert n.nv is None and "NVMLError_LibraryNotFound" in n.error
    assert n.read() == [] and n.handles == {}
    n.close()
    rec = rank_record(0)
    assert rec["nvml_error"].startswith("memory not sampled by NVML") and "nvml_used_bytes" not in rec
    assert rec["cuda_total_bytes"] == A100[0][3]  # CUDA's own view still answers


@pytest.mark.parametrize("err", ["NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission"])
def test_init_failure_leaves_gpu_path_out(use_fake, err):
    nv = use_fake(fake_pynvml(init_error=err))
    n = Nvml()
    assert n.nv is None and err in n.error and n.read() == []
    assert nv.state["calls"] == ["nvmlInit"]  # nothing else is asked of a library that did not start
    assert "memory not sampled by NVML" in n.status()
    s = Sampler(os.getpid(), gpus="0,1,2,3")
    s.sample_once()
    assert [x for x in s.samples if x.kind == "gpu"] == [] and err in s.error
    s.stop()


def test_import_error_in_seam(monkeypatch):
    def missing():
        raise ImportError("No module named 'pynvml'")
    monkeypatch.setattr(nvml, "nvml_module", missing)
    n = Nvml()
    assert n.nv is None and "ImportError" in n.error


def test_all_gpus_in_pci_order_without_cuda_visible_devices(use_fake):
    use_fake(fake_pynvml())
    n = Nvml()
    assert n.error is None and n.driver == "550.54.15"
    assert [g.uuid for g in n.visible] == [d[1] for d in A100]
    assert n.gpus[1].pci_bus_id == "0000:0f:00.0"
    assert n.read() == [(i, d[4], d[3]) for i, d in enumerate(A100)]
    assert n.status() == "NVML driver 550.54.15: 4 GPU(s) (NVIDIA A100-SXM4-40GB), 4 visible"
    n.close()
    assert n.nv is None


@pytest.mark.parametrize("env,expect", [
    ("2,0", [2, 0]),                                   # indices: CUDA 0 is NVML device 2
    ("GPU-9c0d1e2f-0000-1111-2222-333344445555,1", [2, 1]),  # full UUID, then an index
    ("5e6f7a8b-0000-1111-2222-333344445555", [1]),    # UUID without "GPU-"
    ("GPU-9c0d", [2]),                                 # unique prefix, as CUDA accepts
    ("GPU-1a2b,3", []),                                # ambiguous prefix: CUDA stops there
    ("0,7,1", [0]),                                    # out of range: CUDA stops at the first invalid entry
    ("1,-1,2", [1]),                                   # -1 hides the rest
    ("3,3", [3]),                                      # a repeated device is invalid
    ("", []),                                          # empty: no GPU visible
    (" 1 , 0 ", [1, 0]),
])
def test_cuda_visible_devices_mapping(use_fake, monkeypatch, env, expect):
    use_fake(fake_pynvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    n = Nvml()
    assert [g.nvml_index for g in n.visible] == expect
    assert [(i, used) for i, used, _ in n.read()] == [(i, A100[j][4]) for i, j in enumerate(expect)]
    assert n.names == {i: A100[j][0] for i, j in enumerate(expect)}


def test_mig_uuid_resolved_by_nvml(use_fake, monkeypatch):
    mig = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
    use_fake(fake_pynvml(mig={mig: 3}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig)
    n = Nvml()
    assert [g.uuid for g in n.visible] == [mig]
    assert n.read() == [(0, A100[3][4], A100[3][3])]


def test_rank_device_follows_local_rank_uuid_and_pci(use_fake, monkeypatch):
    """What the launcher gives a rank: CUDA_VISIBLE_DEVICES of its node and LOCAL_RANK; torch knows
    its device's UUID (printed without "GPU-") and PCI ids (CUDA spelling)."""
    use_fake(fake_pynvml())
    n = Nvml(visible="2,3")  # e.g. a node whose launcher was given --include host:2,3
    assert n.for_rank(0).nvml_index == 2 and n.for_rank(1).nvml_index == 3
    assert n.for_rank(2) is None
    assert n.for_rank(0, visible="1,0").nvml_index == 1
    # by identity, whatever the index says
    assert n.for_rank(0, uuid="1a2bffff-0000-1111-2222-333344445555").nvml_index == 3
    assert n.for_rank(0, pci_bus_id="0000:0f:00.0").nvml_index == 1
    assert n.for_rank(0, pci_bus_id="00000000:47:00.0").nvml_index == 2


def test_rank_record_is_its_own_gpu(use_fake, monkeypatch):
    """RankGpu.record, the one GPU record: rank 1 of a node given CUDA_VISIBLE_DEVICES=2,3."""
    use_fake(fake_pynvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    rec = rank_record(1)
    assert {k: rec[k] for k in ("gpu_uuid", "gpu_pci_bus_id", "gpu_name", "nvml_used_bytes", "nvml_total_bytes")} == {
        "gpu_uuid": A100[3][1], "gpu_pci_bus_id": "0000:4e:00.0", "gpu_name": A100[3][0],
        "nvml_used_bytes": A100[3][4], "nvml_total_bytes": A100[3][3]}
    assert "nvml_error" not in rec


def test_torch_identity_formats_like_nvml():
    class Uuid:
        def __str__(self):
            return "9c0d1e2f-0000-1111-2222-333344445555"
    props = types.SimpleNamespace(uuid=Uuid(), pci_domain_id=0, pci_bus_id=0x47, pci_device_id=0)
    uuid, pci = torch_identity(props)
    assert (uuid, pci) == ("9c0d1e2f-0000-1111-2222-333344445555", "0000:47:00.0")
    assert torch_identity(types.SimpleNamespace()) == (None, None)


def test_mixed_models_in_default_order_are_flagged(use_fake, monkeypatch):
    devs = [A100[0], ("NVIDIA H100 80GB HBM3", "GPU-eeee0000-0000-1111-2222-333344445555", (0, 0x10, 0),
                      80 * GiB, 5 * GiB)]
    use_fake(fake_pynvml(devs))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    n = Nvml()
    assert n.visible[0].name.startswith("NVIDIA H100") and "CUDA_DEVICE_ORDER" in n.note
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert Nvml().note is None


def test_gpu_lost_mid_run(use_fake):
    nv = use_fake(fake_pynvml())
    s = Sampler(os.getpid(), gpus="0,1,2,3")
    s.sample_once()
    assert sorted(x.ident for x in s.samples if x.kind == "gpu") == [0, 1, 2, 3]
    nv.state["lost"].add(1)  # "GPU has fallen off the bus"
    s.sample_once()
    s.sample_once()
    gpu = [x for x in s.samples if x.kind == "gpu"]
    assert sorted(x.ident for x in gpu) == [0, 0, 0, 1, 2, 2, 2, 3, 3, 3]  # gpu1 dropped, others go on
    assert "GPU 1 lost" in s.error and "NVMLError_GpuIsLost" in s.error
    assert 1 not in s.nvml.handles
    s.stop()
    assert nv.state["init"] == 0  # shut down


def test_gpu_lost_before_enumeration(use_fake):
    nv = fake_pynvml()
    nv.state["lost"].add(0)
    use_fake(nv)
    n = Nvml()
    assert n.handles == {} and "NVMLError_GpuIsLost" in n.error and n.read() == []


def test_rank_record_when_its_gpu_is_lost(use_fake):
    nv = use_fake(fake_pynvml())
    cuda = FakeCuda(A100)
    gpu = RankGpu(types.SimpleNamespace(cuda=cuda), 2, None, interval=0)
    nv.state["lost"].add(2)
    rec = gpu.record()
    assert rec["gpu_uuid"] == A100[2][1] and "NVMLError_GpuIsLost" in rec["nvml_error"]
    assert "nvml_used_bytes" not in rec


def test_rank_without_an_nvml_device_says_so(use_fake, monkeypatch):
    use_fake(fake_pynvml(A100[:1]))
    cuda = FakeCuda(A100)
    cuda.get_device_properties = lambda i: types.SimpleNamespace(name="not in NVML", total_memory=40 * GiB)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    rec = RankGpu(types.SimpleNamespace(cuda=cuda), 1, None, interval=0).record()
    assert rec["nvml_error"] == "no NVML device for local rank 1" and "gpu_uuid" not in rec


# -- memory as nvidia-smi shows it (NVML v2) --------------------------------------------------------

def test_memory_uses_v2_used(use_fake):
    """v2's used leaves the driver's reserve out (nvml.h: v1 used is "Sum of Reserved and Allocated")."""
    use_fake(fake_pynvml(reserved=870 * MiB))
    n = Nvml()
    mem = n.memory(n.visible[1])
    assert mem.used == A100[1][4] - 870 * MiB and mem.used_v1 == A100[1][4]
    assert mem.reserved == 870 * MiB and mem.total == A100[1][3] and n.v2 is True
    assert n.read()[1] == (1, A100[1][4] - 870 * MiB, A100[1][3])  # the sampler reads the same figure


def test_memory_falls_back_to_v1(use_fake):
    nv = use_fake(fake_pynvml(reserved=870 * MiB, v2=False))
    n = Nvml()
    mem = n.memory(n.visible[1])
    assert (mem.used, mem.used_v1, mem.reserved) == (A100[1][4], A100[1][4], None) and n.v2 is False
    assert n.error is None
    calls = len(nv.state["calls"])
    n.memory(n.visible[1])
    assert nv.state["calls"][calls:] == ["nvmlDeviceGetMemoryInfo"]  # v2 is not asked again


def test_record_says_v2_and_flags_other_processes(use_fake, monkeypatch):
    nv = use_fake(fake_pynvml(reserved=870 * MiB))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    rec = rank_record(0, reserved=870 * MiB)
    assert rec["nvml_v2"] is True and rec["nvml_used_v1_bytes"] == A100[1][4]
    assert rec["nvml_reserved_bytes"] == 870 * MiB and rec["nvml_used_bytes"] == A100[1][4] - 870 * MiB
    assert rec["gpu_shared"] is False and rec["gpu_processes"] == 0
    nv.state["procs"][1] = [(4242, 600 * MiB), (os.getpid(), 900 * MiB)]
    rec = rank_record(0, reserved=870 * MiB)
    assert rec["gpu_processes"] == 2 and rec["gpu_shared"] is True
