"""The GPU path, checked without a GPU where it can be (and for real where one is visible):
CUDA OOM classification, the NCCL backend, per-process memory fraction (capacity emulation),
NVML mapping against torch's own device identities.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from zero_bench.config.schema import BenchConfig, HardwareConfig, ModelConfig, ParallelConfig
from zero_bench.records import OOM_EXIT
from zero_bench.trial.oom import is_oom

TINY = ModelConfig(name="GPT-tiny", num_layers=2, hidden_size=64, num_heads=4, seq_len=64, vocab_size=1024)
NO_GPU = "no CUDA device visible: torch.cuda.is_available() is False (torch %s)" % torch.__version__


def gpu_cfg(**hw) -> BenchConfig:
    return BenchConfig(model=TINY, parallel=ParallelConfig(tp=1, dp=2), hardware=HardwareConfig(device="gpu", **hw),
                       precision="bf16")


CUDA_OOM = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
            "1.2 GiB is free. Of the allocated memory 75.3 GiB is allocated by PyTorch")


@pytest.mark.parametrize("exc,expect", [
    (torch.cuda.OutOfMemoryError(CUDA_OOM), True),
    (torch.OutOfMemoryError("x"), True),
    (MemoryError(), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 1152921504606846976 bytes. Error code 12 (Cannot allocate memory)"), True),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for "
                  "details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
                  "Last error:\nCuda failure 'out of memory'"), True),
    (RuntimeError("cudaErrorMemoryAllocation"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (RuntimeError("CUDA error: device-side assert triggered"), False),
    (RuntimeError("NCCL error: remote process exited or there was a network error"), False),
    (ValueError("Type fp16 is not supported on your device."), False),
])
def test_is_oom(exc, expect):
    assert is_oom(exc) is expect


def test_is_oom_follows_the_cause_chain():
    """DeepSpeed/engine code may re-raise an allocation failure as another error."""
    try:
        try:
            raise torch.cuda.OutOfMemoryError(CUDA_OOM)
        except torch.cuda.OutOfMemoryError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert is_oom(outer)
    try:
        try:
            raise MemoryError()
        except MemoryError:
            raise KeyError("during handling")  # implicit context
    except KeyError as outer:
        assert is_oom(outer)
    assert not is_oom(RuntimeError("plain"))


def test_gpu_trial_env_selects_cuda_and_nccl(tmp_path):
    """hardware.device=gpu -> DS_ACCELERATOR=cuda -> DeepSpeed's CUDA accelerator: NCCL backend,
    CUDA_VISIBLE_DEVICES set per node, NCCL_* exported to remote nodes."""
    from zero_bench.trial.launcher import trial_env

    env = trial_env(gpu_cfg())
    assert env["DS_ACCELERATOR"] == "cuda" and "MALLOC_MMAP_THRESHOLD_" not in env
    # torch's default (3): the watchdog ends a failed rank without ncclCommAbort, which can hang
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env
    code = ("from deepspeed.accelerator import get_accelerator as g; a = g(); import json; "
            "print(json.dumps([a.device_name(), a.communication_backend_name(), a.export_envs(), "
            "a.visible_devices_envs()]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    name, backend, exports, visible = json.loads(out.stdout.strip().splitlines()[-1])
    assert (name, backend) == ("cuda", "nccl")
    assert "NCCL" in exports and visible == ["CUDA_VISIBLE_DEVICES"]


class _Stop(Exception):
    pass


@pytest.mark.parametrize("cap_gb,fraction", [(20, 0.25), (100, None), (None, None)])
def test_worker_sets_per_process_memory_fraction(tmp_path, monkeypatch, cap_gb, fraction):
    """Capacity emulation: a rank on an 80 GB card told hardware.memory_gb=20 caps its allocator at 1/4
    of its own device (the local rank's), so a bigger batch raises a real CUDA OOM. The real worker,
    baseline and RankGpu; fakes only at the seams: NVML (gpu_fakes.fake_pynvml), torch.cuda
    (gpu_fakes.FakeCuda), and NCCL's process group (no GPU here to form it)."""
    from zero_bench.devices import gpu
    from zero_bench.devices import nvml
    from zero_bench.trial import worker
    from zero_bench.engines import deepspeed as ds_engine
    from zero_bench.records import TrialSpec

    from gpu_fakes import EIGHT, FakeCuda, fake_pynvml

    nv, cuda = fake_pynvml(EIGHT), FakeCuda(EIGHT)
    monkeypatch.setattr(nvml, "nvml_module", lambda: nv)
    for k in ("CUDA_VISIBLE_DEVICES", gpu.DEVICES_ENV, "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    # this rank's torch: the fake CUDA, and the rank the (absent) NCCL group would give it
    monkeypatch.setattr(worker, "torch", types.SimpleNamespace(
        cuda=cuda, distributed=types.SimpleNamespace(get_rank=lambda *a, **k: 3)))
    at_init = {}
    monkeypatch.setattr(ds_engine.deepspeed, "init_distributed", lambda *a, **k: at_init.update(
        nvml=list(nv.state["calls"]), cuda=dict(cuda.calls)))
    made = []  # the real RankGpu, kept to stop its NVML sampling thread

    class KeptRankGpu(gpu.RankGpu):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)
    monkeypatch.setattr(worker, "RankGpu", KeptRankGpu)

    def stop(*a, **k):
        raise _Stop()
    monkeypatch.setattr(worker, "build_engine", stop)
    cfg = gpu_cfg(memory_gb=cap_gb)
    spec = TrialSpec(config=cfg, ds_config="", out_dir=str(tmp_path), plan=[],
                     capacity_bytes=int(cap_gb * 2**30) if cap_gb else None)
    try:
        with pytest.raises(_Stop):
            worker.start(spec)
    finally:
        for g in made:
            g.close()
    assert len(made) == 1 and not made[0].sampler.is_alive()
    assert cuda.calls["device"] == 1
    # other processes' memory on the rank's own card was read from NVML before this process's first
    # CUDA call (NCCL's communicator, formed by init_distributed, would be counted as theirs)
    assert "nvmlDeviceGetMemoryInfo" in " ".join(at_init["nvml"]) and at_init["cuda"] == {}
    if fraction is None:
        assert "fraction" not in cuda.calls
    else:
        assert cuda.calls["fraction"] == (pytest.approx(fraction), 1)
    start = json.loads((tmp_path / "rank3.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["local_rank"] == 1
    assert start["gpu_uuid"] == EIGHT[1][1] and start["gpu_others_bytes"] == EIGHT[1][4]  # card 1, not 0


def test_gpu_oom_record_classifies_as_oom():
    """A rank's CUDA OOM (record status oom, exit OOM_EXIT) ends the entry as oom, not error."""
    from zero_bench.trial.outcome import Entry, LaunchEnd, classify
    from zero_bench.records import RankRecord

    cfg = gpu_cfg(memory_gb=20)
    logs = {0: [RankRecord(event="begin", micro=8, rank=0),
                RankRecord(event="end", micro=8, rank=0, status="oom", error="OutOfMemoryError: " + CUDA_OOM)],
            1: [RankRecord(event="begin", micro=8, rank=1)]}
    (r,) = classify(cfg, [Entry(8)], logs, LaunchEnd(rc=OOM_EXIT, cap=20 * 2**30))
    assert r.status == "oom" and "CUDA out of memory" in r.reason and r.phase == "step"
    # both ranks past capacity by torch's reserved bytes -> oom with the measured peak
    logs = {i: [RankRecord(event="begin", micro=8, rank=i),
                RankRecord(event="end", micro=8, rank=i, status="over_capacity", peak_rss_bytes=2**30,
                           torch_peak_reserved=21 * 2**30)] for i in (0, 1)}
    (r,) = classify(cfg, [Entry(8)], logs, LaunchEnd(rc=0, cap=20 * 2**30))
    assert r.status == "oom" and "21504 MiB > capacity 20480 MiB" in r.reason


# -- with a real GPU ----------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)


@needs_gpu
def test_real_memory_fraction_raises_classified_oom():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.05, 0)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError) as info:
            torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda:0")
        assert is_oom(info.value)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


@needs_gpu
def test_real_nvml_maps_torch_devices_by_uuid():
    from zero_bench.devices.nvml import Nvml, torch_identity

    n = Nvml()
    assert n.error is None, n.error
    for i in range(torch.cuda.device_count()):
        uuid, pci = torch_identity(torch.cuda.get_device_properties(i))
        by_id = n.for_rank(i, uuid=uuid, pci_bus_id=pci)
        assert by_id is not None and by_id.pci_bus_id == pci
        if not n.note:  # same order unless mixed models in FASTEST_FIRST order
            assert n.for_rank(i).uuid == by_id.uuid
    n.close()


@needs_gpu
def test_real_nccl_available():
    assert torch.distributed.is_nccl_available()


# -- zero_bench doctor ----------------------------------------------------------------------------

def _demo_cfg(**hw):
    from omegaconf import OmegaConf

    from zero_bench.config.schema import CONF_DIR

    import hydra

    with hydra.initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        cfg = hydra.compose("config", overrides=[f"hardware.{k}={v}" for k, v in hw.items()])
    return OmegaConf.to_container(cfg, resolve=False)


def test_doctor_reports_every_area(capsys):
    from zero_bench.commands.subcommands import doctor as doctor_command
    from zero_bench.commands.doctor import FIX, doctor_checks

    assert doctor_command(_demo_cfg()) == 0
    checks = doctor_checks(_demo_cfg())
    names = {c.name for c in checks}
    for n in ("deepspeed", "GPUs", "NVML", "deepspeed ops", "launcher pdsh", "launcher mpirun", "launcher srun",
              "launcher sshd", "config", "can run", "CPU vector units", "torch CPU capability", "bf16 on CPU",
              "precision=auto", "peak FLOP/s"):
        assert n in names, n
    out = capsys.readouterr().out
    assert "can run" in out and all(c.fix for c in checks if c.status == FIX)
    if not torch.cuda.is_available():
        nvml = next(c for c in checks if c.name == "NVML")
        assert nvml.status == "--" and "NVMLError_LibraryNotFound" in nvml.detail


def test_doctor_names_fixes_for_a_multinode_config(tmp_path, monkeypatch):
    from zero_bench.commands.doctor import FIX, check_launchers

    monkeypatch.setattr("shutil.which", lambda tool: None)
    import dataclasses

    from zero_bench.config.schema import BenchConfig

    hf = tmp_path / "hostfile"
    hf.write_text("a slots=1\n")
    bench = BenchConfig(model=TINY, hardware=HardwareConfig(device="cpu", hostfile=str(hf), num_nodes=2,
                                                            launcher="slurm"))
    checks = {c.name: c for c in check_launchers(bench)}
    assert checks["launcher srun"].status == FIX and checks["launcher sinfo"].status == FIX
    assert checks["launcher pdsh"].status == "--"
    assert checks["hostfile"].status == FIX and "lists only 1 hosts" in checks["hostfile"].detail
    bench = dataclasses.replace(bench, hardware=dataclasses.replace(bench.hardware, launcher="pdsh"))
    checks = {c.name: c for c in check_launchers(bench)}
    assert checks["launcher pdsh"].status == FIX and "ci_provision.sh" in checks["launcher pdsh"].fix


# -- nvcc against torch's CUDA, and the optimizer a GPU run then uses ------------------------------

@pytest.fixture
def toolkit(monkeypatch, tmp_path):
    """DeepSpeed's own installed_cuda_version (the builder's nvcc -V) and torch.version.cuda, set
    per test; FusedAdam neither prebuilt nor JIT-cached."""
    import deepspeed.git_version_info as info
    from deepspeed.ops.op_builder import builder

    from zero_bench.devices import toolkit as tk

    def install(nvcc, torch_cuda):
        def version(name=""):
            if isinstance(nvcc, Exception):
                raise nvcc
            return nvcc
        monkeypatch.setattr(builder, "installed_cuda_version", version)
        monkeypatch.setattr(torch.version, "cuda", torch_cuda)
        tk.fused_adam_fallback.cache_clear()
    monkeypatch.setattr(info, "installed_ops", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty JIT cache: FusedAdam never built
    yield install
    tk.fused_adam_fallback.cache_clear()


def _gpu_bench(offload=False):
    import dataclasses

    return dataclasses.replace(gpu_cfg(), zero=2, offload=offload)


def test_doctor_reports_nvcc_torch_mismatch_and_offers_torch_adamw(toolkit):
    from zero_bench.commands import doctor
    from zero_bench.engines import ds_config

    toolkit((12, 4), "13.0")
    checks = {c.name: c for c in doctor.check_gpu_optimizer(_gpu_bench())}
    kit, opt = checks["CUDA toolkit"], checks["optimizer"]
    assert "nvcc 12.4" in kit.detail and "CUDA 13.0" in kit.detail and "major" in kit.detail and kit.fix
    assert "torch's fused AdamW" in opt.detail and opt.status == doctor.OK  # the run can run
    assert doctor.needed_ops(_gpu_bench()) == {}  # nothing left to build before the first trial
    said = []
    assert doctor.prebuild_ops(_gpu_bench(), say=said.append) == [] and "torch's fused AdamW" in said[0]
    params = ds_config.build(_gpu_bench())["optimizer"]["params"]
    assert params["torch_adam"] is True and params["fused"] is True
    # optimizer offload builds cpu_adam with the host compiler: no nvcc needed, no fallback
    assert "torch_adam" not in ds_config.build(_gpu_bench(offload=True))["optimizer"]["params"]
    assert "optimizer" not in {c.name for c in doctor.check_gpu_optimizer(_gpu_bench(offload=True))}


def test_doctor_without_nvcc_offers_torch_adamw(toolkit):
    from deepspeed.ops.op_builder.builder import MissingCUDAException

    from zero_bench.commands import doctor

    toolkit(MissingCUDAException("CUDA_HOME does not exist, unable to compile CUDA op(s)"), "12.8")
    checks = {c.name: c for c in doctor.check_gpu_optimizer(_gpu_bench())}
    assert "nvcc missing" in checks["CUDA toolkit"].detail and "CUDA_HOME does not exist" in checks["CUDA toolkit"].detail
    assert "torch's fused AdamW" in checks["optimizer"].detail


def test_a_minor_cuda_difference_builds_fused_adam(toolkit):
    from zero_bench.commands import doctor
    from zero_bench.engines import ds_config

    toolkit((13, 1), "13.0")
    checks = {c.name: c for c in doctor.check_gpu_optimizer(_gpu_bench())}
    assert checks["CUDA toolkit"].status == doctor.OK and "minor versions differ" in checks["CUDA toolkit"].detail
    assert "optimizer" not in checks and not checks["CUDA toolkit"].fix
    assert "fused_adam" in doctor.needed_ops(_gpu_bench())
    assert "torch_adam" not in ds_config.build(_gpu_bench())["optimizer"]["params"]


def test_a_timeout_whose_killed_rank_took_its_peer_along_is_a_timeout():
    """At timeout_s the runner kills the ranks; a peer that saw its partner go first records 'Connection
    closed by peer'. That is our kill's consequence, not an OOM kill and not a bug of the trial."""
    from zero_bench.trial.outcome import LaunchEnd, classify
    from zero_bench.records import Entry, RankRecord

    cfg = gpu_cfg()
    logs = {0: [RankRecord(event="begin", micro=2, rank=0),
                RankRecord(event="end", micro=2, rank=0, status="error",
                           error="RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")],
            1: [RankRecord(event="begin", micro=2, rank=1)]}
    (res,) = classify(cfg, [Entry(2)], logs, LaunchEnd(rc=-9, timed_out=True))
    assert res.status == "timeout"
    (res,) = classify(cfg, [Entry(2)], logs, LaunchEnd(rc=-9, timed_out=False))
    assert res.status == "oom"  # without our timeout: the kernel killed rank 1
