"""offload_device / nvme_path (NVMe offload, ZeRO-Infinity): the rung resolved from either key, the
keys and labels old configs keep, DeepSpeed's JSON, bad input in one line before any launch, the
estimate's split (disk, pinned buffers) and the swap folders a killed launch leaves."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.engines import ds_config
from zero_bench.errors import ConfigError
from zero_bench.estimate import estimate
from zero_bench.estimate.nvme import sub_groups
from zero_bench.search import preflight
from zero_bench.trial import swap


def bench(*overrides: str):
    return from_cfg(compose(["model=gpt-mini", "hardware.device=cpu", "precision=fp32", *overrides]), here=False)


def test_offload_true_is_the_cpu_rung_and_keeps_its_keys_and_label():
    old, new = bench("zero=3", "offload=true"), bench("zero=3", "offload_device=cpu")
    assert old.offload_device == new.offload_device == "cpu" and new.offload and new.offload_param
    assert old.trial_key() == new.trial_key() and old.label() == new.label()
    assert bench("zero=3").offload_device == "none" and bench("zero=3").trial_key() == bench("zero=3",
                                                                                               "offload_device=none").trial_key()


def test_nvme_is_its_own_rung_key_and_label():
    b = bench("zero=3", "offload_device=nvme")
    assert b.offload and b.offload_param and b.nvme
    assert "zero3+nvme" in b.label() and b.trial_key() != bench("zero=3", "offload=true").trial_key()


def test_ds_json_swaps_both_sections_with_deepspeeds_aio_defaults():
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT

    ds = ds_config.build(bench("zero=3", "offload_device=nvme"), "/scratch/zb-1")
    z = ds["zero_optimization"]
    for section in ("offload_optimizer", "offload_param"):
        assert z[section]["device"] == "nvme" and z[section]["nvme_path"] == "/scratch/zb-1"
    assert ds["aio"] == AIO_DEFAULT_DICT
    over = ds_config.build(bench("zero=3", "offload_device=nvme", "+ds.aio.queue_depth=32"))
    assert over["aio"]["queue_depth"] == 32 and over["aio"]["block_size"] == AIO_DEFAULT_DICT["block_size"]
    assert "aio" not in ds_config.build(bench("zero=3", "offload=true"))


@pytest.mark.parametrize("overrides,key", [
    (["zero=2", "offload_device=nvme"], "offload_device=nvme: DeepSpeed 0.19.8 swaps to NVMe at ZeRO-3 only"),
    (["zero=0", "offload_device=nvme"], "offload_device=nvme: needs ZeRO stage 3"),
    (["zero=3", "engine=fsdp2", "offload_device=nvme"], "offload_device=nvme: engine=fsdp2"),
    (["zero=3", "offload=true", "offload_device=none"], "offload_device=none: offload=true"),
    (["zero=3", "offload_device=disk"], "offload_device=disk: allowed values are none, cpu, nvme"),
    (["zero=3", "nvme_path=/tmp"], "nvme_path=/tmp: read only with offload_device=nvme"),
])
def test_bad_input_is_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        bench(*overrides)
    assert str(e.value).startswith(key) and "\n" not in str(e.value), str(e.value)


@pytest.fixture
def with_async_io(monkeypatch):
    monkeypatch.setattr(preflight.aio, "async_io_problem", lambda: None)


def test_a_missing_swap_folder_is_refused(with_async_io):
    path = "/nonexistent/zb"
    with pytest.raises(ConfigError) as e:
        preflight.check_nvme(bench("zero=3", "offload_device=nvme", f"nvme_path={path}"))
    assert str(e.value).startswith(f"nvme_path={path}: does not exist"), str(e.value)


def test_a_filesystem_without_o_direct_is_refused(with_async_io, tmp_path, monkeypatch):
    """The filesystem's EINVAL for O_DIRECT (tmpfs before Linux 6.6) at the one open that asks."""
    def refuse(path):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(preflight.aio, "open_direct", refuse)
    path, why = tmp_path, "without O_DIRECT"
    with pytest.raises(ConfigError) as e:
        preflight.check_nvme(bench("zero=3", "offload_device=nvme", f"nvme_path={path}"))
    assert str(e.value).startswith(f"nvme_path={path}: ") and why in str(e.value), str(e.value)


def test_an_unwritable_swap_folder_is_refused(with_async_io, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes everywhere")
    tmp_path.chmod(0o500)
    with pytest.raises(ConfigError, match="is not writable"):
        preflight.check_nvme(bench("zero=3", "offload_device=nvme", f"nvme_path={tmp_path}"))


def test_too_little_free_disk_is_refused(with_async_io, tmp_path, monkeypatch):
    b = bench("zero=3", "offload_device=nvme", f"nvme_path={tmp_path}")
    need = estimate(b).disk_bytes()
    monkeypatch.setattr(preflight.aio, "free_bytes", lambda p: need - 1)
    with pytest.raises(ConfigError, match=r"GiB free, the swap files of 2 ranks need"):
        preflight.check_nvme(b)
    monkeypatch.setattr(preflight.aio, "free_bytes", lambda p: need)
    preflight.check_nvme(b)


def test_missing_async_io_is_refused_with_its_fix(monkeypatch):
    monkeypatch.setattr(preflight.aio, "async_io_problem", lambda: "async_io cannot be built; fix: apt-get install -y libaio-dev")
    with pytest.raises(ConfigError, match=r"^offload_device=nvme: .*fix: apt-get install -y libaio-dev$"):
        preflight.check_nvme(bench("zero=3", "offload_device=nvme"))


def test_the_cli_refuses_before_any_launch(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zero_bench", "zero=2", "offload_device=nvme"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("rank0.jsonl"))
    assert [ln for ln in out.stderr.splitlines() if "offload_device=nvme" in ln], out.stderr[-1000:]


def test_sub_groups_close_as_deepspeeds():
    assert sub_groups([3, 3, 3], 100) == [9]
    assert sub_groups([3, 3, 3, 1], 5) == [6, 4]


def test_estimate_moves_the_swappable_states_to_disk_and_adds_the_pinned_buffers():
    cpu, nvme = estimate(bench("zero=3", "offload=true")), estimate(bench("zero=3", "offload_device=nvme"))
    assert nvme.nvme_bytes > 0 and nvme.disk_bytes() == 2 * nvme.nvme_bytes
    buf = nvme.prediction.buffer("swap_buffers").bytes
    # gpt-mini's 5 M parameters stay in DeepSpeed's pinned flat copy (max_in_cpu 1e9): only the
    # optimizer's part leaves memory, though the parameters are on disk too
    assert nvme.nvme_freed < nvme.nvme_bytes
    assert nvme.persistent == cpu.persistent - nvme.nvme_freed
    assert nvme.peak_bytes(1) == cpu.peak_bytes(1) - nvme.nvme_freed + buf
    assert nvme.row()["config"] == "zero3+nvme+param" and "disk_needed" in nvme.row()
    assert "disk_needed" not in cpu.row()


def test_a_killed_launchs_swap_folder_is_removed_by_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_BENCH_LOCK", str(tmp_path / "lock"))
    b = bench("zero=3", "offload_device=nvme")
    folder = swap.make_swap_folder(b, tmp_path / "run", 7)
    (folder / "x.swp").write_bytes(b"1" * 4096)
    assert swap.remove_stale_swap() == []  # its runner (this process) lives
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    marker = next(swap.registry().iterdir())
    marker.rename(marker.with_name(f"{dead.stdout.strip()}-7"))  # as if a runner now gone had made it
    assert swap.remove_stale_swap() == [folder] and not folder.exists() and not any(swap.registry().iterdir())


def test_on_gpu_the_swap_buffers_are_host_memory_not_the_devices():
    """Llama-3-8B, 8 x H100, ZeRO-3: NVMe leaves the device's peak as CPU offload has it and moves
    host memory to the disk. At DeepSpeed's defaults the pinned buffers are large, as its code has
    them: sub_group_size 1e9 makes one ~1e9-element sub-group, so the optimizer swapper pins 4 x it in
    fp32 (16 GB); the parameter swapper 5 x the largest partition (the embedding's eighth) in bf16; and the partition (1.0038e9) passing
    max_in_cpu (1e9) leaves a sub-group without a flat copy, so the swap-out buffer of that sub-group's
    whole parameters (ds_numel: ~8e9 x 2 bytes) is reserved too."""
    gpu = ["model=llama3-8b", "parallel=dp8", "hardware=h100_80gb", "zero=3"]
    cpu = estimate(from_cfg(compose([*gpu, "offload=true"]), here=False))
    nvme = estimate(from_cfg(compose([*gpu, "offload_device=nvme"]), here=False))
    assert nvme.peak_bytes(1) == cpu.peak_bytes(1)
    embedding = -(-128_256 * 4096 // 8)  # the largest partition, the parameter swapper's buffer_size
    assert nvme.prediction.nvme.param_buffers - 2 * 8_030_261_248 == 5 * embedding * 2
    assert 4 * 10**9 * 4 + 5 * embedding * 2 + 2 * 7.9e9 < nvme.swap_buffer_bytes < 1.01 * (
        4 * 1_003_782_656 * 4 + 5 * embedding * 2 + 2 * 8_030_261_248)
    assert nvme.host_bytes() == cpu.host_bytes() - 8 * (nvme.nvme_freed - nvme.swap_buffer_bytes)


def test_without_libaio_doctor_names_the_one_command_and_nvme_is_refused(monkeypatch):
    """Where DeepSpeed's AsyncIOBuilder finds no libaio (its io_submit probe fails), async_io is not
    JIT-cached: doctor's line and the refusal carry the package manager's command."""
    from deepspeed.accelerator import get_accelerator

    from zero_bench.commands import doctor
    from zero_bench.devices import aio

    builder = type(get_accelerator().create_op_builder("AsyncIOBuilder"))
    monkeypatch.setattr(builder, "is_compatible", lambda self, verbose=False: False)
    monkeypatch.setattr(aio, "jit_cached", lambda op: None)
    monkeypatch.setattr(aio.shutil, "which", lambda tool: "/usr/bin/apt-get" if tool == "apt-get" else None)
    aio.async_io_problem.cache_clear()
    try:
        problem = aio.async_io_problem()
        check = doctor.check_async_io()
    finally:
        aio.async_io_problem.cache_clear()
    assert problem.endswith("libaio's headers are missing; fix: apt-get install -y libaio-dev"), problem
    assert check.status == doctor.NA and check.fix == "apt-get install -y libaio-dev", check


def test_the_reports_offload_column_names_the_rung_for_old_and_new_records():
    from zero_bench.config.stored import stored_config
    from zero_bench.report.tables import _offload_text, offload_rung

    cases = [  # stored config (as before offload_device, as resolved, a skipped grid entry as given)
        ("none", {"zero": 3}, "No"),
        ("cpu: optimizer+params", {"zero": 3, "offload": True, "offload_param": True}, "Yes (+params)"),
        ("cpu: params", {"zero": 3, "offload_param": True}, "Yes (+params)"),
        ("nvme: optimizer", {"zero": 3, "offload": True, "offload_param": False, "offload_device": "nvme"}, "NVMe"),
        ("nvme: optimizer", {"zero": 2, "offload_device": "nvme"}, "NVMe"),
    ]
    old = {k: v for k, v in bench().to_dict().items() if k not in ("offload_device", "offload", "offload_param")}
    for want, stored, cell in cases:
        s = stored_config({**old, **stored})
        assert (offload_rung(s), _offload_text(s)) == (want, cell), stored


@pytest.mark.parametrize("dp", [4, 8])
def test_on_gpu_the_parameter_swap_buffer_holds_the_largest_partition(dp):
    """DeepSpeed's parameter swapper asserts every swapped partition fits one buffer at zero.Init
    (partitioned_param_swapper.py get_buffer): Llama-3-8B's embedding (128256 x 4096 = 525 M
    elements) over 4 ranks is 131 M, past DeepSpeed's default 1e8. The JSON sizes it on a GPU as on
    CPU, DeepSpeed's config model takes it, and the estimate's pinned buffers count it."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    b = from_cfg(compose(["model=llama3-8b", f"parallel=dp{dp}", "hardware=h100_80gb", "zero=3",
                          "offload_device=nvme"]), here=False)
    z = ds_config.build(b)["zero_optimization"]
    largest = -(-128_256 * 4096 // dp)
    assert z["offload_param"]["buffer_size"] == largest
    assert DeepSpeedZeroConfig(**z).offload_param.buffer_size == largest
    split = estimate(b).prediction.nvme
    assert split.param_buffers >= 5 * largest * 2  # buffer_count x buffer_size, bf16


def test_a_users_parameter_swap_buffer_wins_on_every_device():
    for device in (["hardware.device=cpu", "precision=fp32"], ["hardware=h100_80gb", "precision=bf16"]):
        b = from_cfg(compose(["model=gpt-mini", "zero=3", "offload_device=nvme", *device,
                              "+ds.zero_optimization.offload_param.buffer_size=300000000"]), here=False)
        assert ds_config.build(b)["zero_optimization"]["offload_param"]["buffer_size"] == 300_000_000
