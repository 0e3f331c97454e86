"""`zero_bench calibrate` without a launch: the cache's key and entries (zero_bench.devices.calibration),
which estimate uses which entry, the estimate's fixed terms with and without one, the figures a
launch's rank records give (zero_bench.commands.calibrate), and a GPU rank's probe at the fake-CUDA seam
(tests/gpu_fakes.py). The real CPU run: tests/integration/test_calibrate_cpu.py."""
from __future__ import annotations

import json
import types

import pytest

from zero_bench.devices import calibration, nvml

from zero_bench.commands.calibrate import CalibrationFailed, from_result, lines
from zero_bench.devices.calibration import (BUILT_IN_CPU, PUBLISHED, Calibration, FixedTermsProbe, card_matches, cpu_key,
                                    gpu_key, load, save)
from zero_bench.cli import COMMAND_NAMES, help_text, parse
from zero_bench.commands.subcommands import COMMANDS
from zero_bench.config.configure import compose, from_cfg
from zero_bench.devices.gpu import RankGpu, baseline
from zero_bench.devices.metrics import cpu_model
from zero_bench.estimate import CPU_RANK_OVERHEAD, estimate
from zero_bench.estimate.gpu import (CUBLAS_HANDLES, CUBLAS_WORKSPACE, NCCL_COMMUNICATOR, fragmentation,
                                     outside_allocator)
from zero_bench.estimate.table import estimate_report
from zero_bench.records import Event, RankRecord, Status, TrialResult

from gpu_fakes import A100, FakeCuda, GiB, MiB, fake_pynvml

A100_NAME = A100[0][0]  # "NVIDIA A100-SXM4-40GB"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A cache of the test's own; NVML's answer is not remembered from another test."""
    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    calibration._gpu_identity.cache_clear()
    yield tmp_path
    calibration._gpu_identity.cache_clear()


@pytest.fixture
def gpus(monkeypatch):
    def install(devices=A100, **kw):
        nv = fake_pynvml(devices, **kw)
        monkeypatch.setattr(nvml, "nvml_module", lambda: nv)
        calibration._gpu_identity.cache_clear()
        return nv
    return install


def bench(*overrides):
    return from_cfg(compose(["model=gpt-tiny", *overrides]), here=False)


def cpu_cal(overhead=500 * MiB, key=None) -> Calibration:
    return Calibration(key=key or cpu_key(), kind="cpu", device=cpu_model(), date="2026-11-25 10:00",
                       label="GPT-tiny tp1 dp2 zero2 fp32 micro=2", model="GPT-tiny", engine="deepspeed", zero=2,
                       tp=1, dp=2, runtime_bytes=300 * MiB, overhead_bytes=overhead, matmul_flops={"fp32": 1e11},
                       threads=1)


def gpu_cal(key, **kw) -> Calibration:
    figures = dict(key=key, kind="gpu", device=A100_NAME, date="2026-11-25 10:00", label="GPT-tiny tp1 dp2 zero2",
                   model="GPT-tiny", engine="deepspeed", zero=2, tp=1, dp=2, module_loading="lazy",
                   context_at_init_bytes=300 * MiB, nccl_bytes={"2": 200 * MiB}, cublas_workspace_bytes=64 * MiB,
                   outside_bytes=800 * MiB, context_bytes=400 * MiB, fragmentation=1.2)
    return Calibration(**{**figures, **kw})


# -- keys and the cache ----------------------------------------------------------------------------

def test_cpu_key_names_the_cpu_its_kernel_limits_and_the_software(monkeypatch):
    for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(k, raising=False)
    key = cpu_key()
    assert cpu_model() in key and "onednn=unset" in key and "capability=" in key
    assert all(f"{pkg}=" in key for pkg in ("torch", "deepspeed", "megatron-core"))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")  # other kernels: another machine for the rates
    assert cpu_key() != key and "onednn=AVX2" in cpu_key()


def test_gpu_key_names_the_gpu_the_driver_and_the_module_loading(gpus):
    gpus()
    key = gpu_key("lazy")
    assert key.startswith(f"gpu|{A100_NAME}|driver=550.54.15|") and key.endswith("|loading=lazy")
    assert "nccl=" in key and "deepspeed=" in key and gpu_key("eager") != key
    gpus(init_error="NVMLError_LibraryNotFound")
    assert gpu_key("lazy") is None  # no GPU here: nothing to key by


def test_save_keeps_other_entries_and_the_nccl_sizes_measured_before(cache, gpus):
    gpus()
    save(cpu_cal())
    save(gpu_cal(gpu_key("lazy")))
    save(gpu_cal(gpu_key("lazy"), nccl_bytes={"8": 300 * MiB}, context_bytes=410 * MiB))
    entries = load()
    assert set(entries) == {cpu_key(), gpu_key("lazy")}
    g = entries[gpu_key("lazy")]
    assert g.nccl_bytes == {"2": 200 * MiB, "8": 300 * MiB} and g.context_bytes == 410 * MiB
    assert json.loads((cache / "calibration.json").read_text())[cpu_key()]["overhead_bytes"] == 500 * MiB
    assert not list(cache.glob(".calibration.json.*"))  # written atomically: no temporary left


@pytest.mark.parametrize("card, name, match", [
    (None, A100_NAME, True), ("A100 40GB", A100_NAME, True), ("A100 40GB", "NVIDIA A100-PCIE-40GB", True),
    ("A100 80GB", A100_NAME, False), ("H100 80GB HBM3", "NVIDIA H100 80GB HBM3", True),
    ("H100 80GB HBM3", "NVIDIA H100 PCIe", False), ("H200", "NVIDIA H200", True)])
def test_a_presets_card_names_a_gpu_by_the_words_of_its_nvml_name(card, name, match):
    assert card_matches(card, name) is match


def test_the_card_is_no_part_of_a_trials_key():
    a, b = bench("hardware=a100_40gb"), bench("hardware=a100_40gb", "hardware.card=null")
    assert a.hardware.card == "A100 40GB" and a.trial_key() == b.trial_key() and a.search_key() == b.search_key()


# -- the estimate with and without a calibration ---------------------------------------------------

def test_cpu_estimate_uses_this_cpus_calibration_and_only_it():
    b = bench("hardware=cpu")
    e = estimate(b)
    assert e.overhead == CPU_RANK_OVERHEAD and e.calibration == BUILT_IN_CPU
    save(cpu_cal(key="cpu|another machine"))
    assert estimate(b).overhead == CPU_RANK_OVERHEAD
    save(cpu_cal())
    e = estimate(b)
    assert e.overhead == 500 * MiB and e.terms == {"runtime (calibrated)": 500 * MiB}
    assert e.calibration == f"calibrated on {cpu_model()}, 2026-11-25"
    assert e.peak_bytes(2) == 500 * MiB + e.allocated_bytes(2)


def test_gpu_estimate_uses_the_calibration_of_this_gpu(gpus):
    gpus()
    save(gpu_cal(gpu_key("lazy")))
    for hw in ("hardware=gpu", "hardware=a100_40gb"):  # this machine's GPU, or a preset naming it
        e = estimate(bench(hw, "zero=2"))
        want = 400 * MiB + 2 * 200 * MiB + 64 * MiB  # context + world and data-parallel groups + cuBLAS
        assert e.overhead == e.overhead_low == want and e.calibration == f"calibrated on {A100_NAME}, 2026-11-25"
        assert e.terms == {"CUDA context and kernels (calibrated)": 400 * MiB, "NCCL buffers (calibrated)": 400 * MiB,
                           "cuBLAS workspace (calibrated)": 64 * MiB}
        assert e.fragmentation == 1.2 and e.fragmentation_calibrated  # the model and stage it was measured on
        assert e.peak_bytes(3) == want + int(1.2 * e.allocated_bytes(3))
    other_stage = estimate(bench("hardware=gpu", "zero=3"))
    assert other_stage.fragmentation == fragmentation(3) and not other_stage.fragmentation_calibrated
    assert other_stage.overhead == 864 * MiB


@pytest.mark.parametrize("hw", ["hardware=h100_80gb", "hardware.cuda_module_loading=eager"])
def test_another_card_or_module_loading_gets_the_published_ranges(gpus, hw):
    gpus()
    save(gpu_cal(gpu_key("lazy")))
    b = bench("hardware=gpu", hw)
    e = estimate(b)
    assert e.calibration == PUBLISHED and e.overhead_low < e.overhead and not e.fragmentation_calibrated
    assert e.overhead == calibration_free(b)


def calibration_free(b) -> int:
    return outside_allocator(b.hardware.cuda_module_loading, b.layout, 1).total + CUBLAS_HANDLES * CUBLAS_WORKSPACE


def test_a_group_size_not_calibrated_keeps_its_published_figure(gpus):
    gpus()
    save(gpu_cal(gpu_key("lazy")))
    e = estimate(bench("hardware=gpu", "parallel.tp=2", "parallel.dp=2"))  # groups of 4 (world), 2 (dp), 2 (tp)
    assert e.terms["NCCL buffers (calibrated)"] == 2 * 200 * MiB
    assert e.terms["NCCL buffers (published)"] == NCCL_COMMUNICATOR["more"]


def test_without_a_gpu_calibration_nvml_is_not_asked(monkeypatch):
    save(cpu_cal())

    def no(*_):
        raise AssertionError("NVML asked")
    monkeypatch.setattr(nvml, "nvml_module", no)
    assert estimate(bench("hardware=gpu")).calibration == PUBLISHED


def test_the_estimate_command_says_where_its_fixed_terms_come_from():
    cfg = compose(["model=gpt-tiny", "hardware=cpu", "zero=2"])
    assert "fixed terms: built-in CPU figure" in estimate_report(cfg, frozenset({"zero"})).splitlines()[0]
    save(cpu_cal())
    head = estimate_report(cfg, frozenset({"zero"})).splitlines()[0]
    assert head.endswith(f"fixed terms: calibrated on {cpu_model()}, 2026-11-25")
    doc = json.loads(estimate_report(compose(["model=gpt-tiny", "hardware=cpu", "zero=2", "json=true"]),
                                     frozenset({"zero"})))
    assert doc["calibration"].startswith("calibrated on") and doc["overhead_bytes"] == 500 * MiB


# -- from a launch's rank records ------------------------------------------------------------------

def result(ranks) -> TrialResult:
    return TrialResult(search_key="k", trial_key="t", label="GPT-tiny", micro=2, global_batch=4, status=Status.OK,
                       ranks=ranks)


def test_gpu_figures_from_the_rank_records():
    b = bench("hardware=gpu", "zero=2")
    ranks = [RankRecord(rank=r, event=Event.END, runtime_bytes=700 * MiB, context_bytes=(300 + r) * MiB,
                        nccl_world_bytes=(200 + r) * MiB, cublas_workspace_bytes=64 * MiB,
                        outside_bytes=(900 + r) * MiB, torch_peak_allocated=100 * MiB,
                        torch_peak_reserved=(110 + 10 * r) * MiB) for r in range(2)]
    cal = from_result(b, result(ranks), "gpu|x", A100_NAME, {}, {})
    assert cal.nccl_bytes == {"2": 201 * MiB} and cal.context_at_init_bytes == 301 * MiB
    assert cal.context_bytes == 901 * MiB - 2 * 201 * MiB  # the world and the data-parallel communicator
    assert cal.fragmentation == pytest.approx(1.2) and cal.cublas_workspace_bytes == 64 * MiB
    text = lines(cal, calibration.cache_path())
    assert any(t.startswith("NCCL per communicator (2 ranks)") and "201.0 MiB" in t for t in text)
    assert any(t.startswith("allocator reserved / allocated") and "x1.200" in t for t in text)
    with pytest.raises(CalibrationFailed):
        from_result(b, result([RankRecord(rank=0, event=Event.END)]), "gpu|x", A100_NAME, {}, {})


def test_cpu_figures_from_the_rank_records():
    b = bench("hardware=cpu")
    ranks = [RankRecord(rank=r, event=Event.END, runtime_bytes=(300 + r) * MiB, peak_rss_bytes=(480 + r) * MiB,
                        peak_live_bytes=50 * MiB) for r in range(2)]
    cal = from_result(b, result(ranks), cpu_key(), cpu_model(), {}, {"fp32": 1e11, "bf16": 2e11})
    assert cal.runtime_bytes == 301 * MiB and cal.overhead_bytes == 431 * MiB and cal.kind == "cpu"
    text = lines(cal, calibration.cache_path())
    assert len(text) == 5 and "100.0 GFLOP/s" in text[2] and text[-1].startswith("wrote ")


def test_cpu_calibration_keeps_the_ranks_rates_and_the_estimate_reads_them():
    """calibrate's rank probes (rate_probes.rank_rates) stored with the entry, printed, and read back by
    the time estimate's cpu_rates for a configuration of this CPU in their precision."""
    from zero_bench.devices.rate_probes import RankRates
    from zero_bench.devices.rates import cpu_rates

    b = bench("hardware=cpu", "precision=bf16")
    ranks = [RankRecord(rank=r, event=Event.END, runtime_bytes=300 * MiB, peak_rss_bytes=480 * MiB,
                        peak_live_bytes=50 * MiB) for r in range(2)]
    rr = RankRates(2, 1, "bf16", 9e10, 6e9, 7e9, 2e9, 1e9, 6e8, 4e-4, 2e8, 2.5e-5, 1e-6).to_dict()
    cal = from_result(b, result(ranks), cpu_key(), cpu_model(), {}, {"fp32": 1e11, "bf16": 2e11},
                      {"memory_bytes_per_s": 2e10, "cpu_adam_params_per_s": None, "rank_rates": rr})
    calibration.save(cal)
    text = "\n".join(lines(cal, calibration.cache_path()))
    assert "gloo all-reduce" in text and "1.00 GB/s" in text and "torch AdamW" in text
    r = cpu_rates(b)
    assert r.matmul_flops.value == 9e10 and r.loss_bytes_per_s.value == 2e9 and r.collective_latency_s.value == 4e-4
    assert "calibrated on" in r.matmul_flops.source


# -- a GPU rank's probe at the fake-CUDA seam ------------------------------------------------------

class ProbeCuda(FakeCuda):
    def synchronize(self, i=None):
        self.log.append(("synchronize", (i,)))


def fake_torch(cuda, workspace):
    """torch as the probe uses it: a linear layer's forward adds this thread's cuBLAS workspace to
    torch's allocated bytes, its backward autograd's thread's."""
    class Out:
        def sum(self):
            return self

        def backward(self):
            cuda.allocated += workspace

    def linear(x, w, b):
        cuda.allocated += workspace
        return Out()
    return types.SimpleNamespace(cuda=cuda, device=lambda kind, i: (kind, i), empty=lambda *a, **k: object(),
                                 ones=lambda *a, **k: object(), nn=types.SimpleNamespace(
                                     functional=types.SimpleNamespace(linear=linear)))


def test_probe_measures_the_context_the_world_communicator_and_cublas(gpus):
    devices = list(A100)
    gpus(devices)
    base = baseline(0)  # 1 GiB held by another process before this rank started
    cuda = ProbeCuda(devices)
    torch = fake_torch(cuda, 32 * MiB)

    def grow(by):  # device 0's used bytes (what CUDA and NVML both read) grow outside torch's allocator
        devices[0] = (*devices[0][:4], devices[0][4] + by)
    grow(300 * MiB)  # the CUDA context: the probe starts CUDA
    probe = FixedTermsProbe(torch, 0)
    gpu = RankGpu(torch, 0, None, base=base, interval=0)
    assert gpu.others == 1 * GiB
    groups = []
    dist = types.SimpleNamespace(get_world_size=lambda: 2, all_reduce=lambda t: grow(250 * MiB),
                                 new_group=lambda ranks: groups.append(ranks) or grow(20 * MiB) or "a2a",
                                 all_to_all_single=lambda out, inp, group: grow(90 * MiB if group == "a2a" else 0))
    got = probe.measure(gpu, dist, "bf16")
    assert got == {"context_bytes": 300 * MiB, "nccl_world_bytes": 250 * MiB, "nccl_all_to_all_bytes": 110 * MiB,
                   "cublas_workspace_bytes": 64 * MiB}
    assert groups == [[0, 1]]  # a group of its own over the world's ranks: its creation and first all-to-all
    alone = types.SimpleNamespace(get_world_size=lambda: 1, all_reduce=lambda t: grow(250 * MiB))
    assert probe.first_collective(gpu, alone, 300 * MiB) is None  # one rank: no communicator the estimate counts
    assert probe.all_to_all_group(gpu, alone) is None


def test_the_all_to_all_group_leaves_the_context_term_and_prices_the_ulysses_group():
    """calibrate's all-to-all group: its bytes come out of the context term (no trial has that
    group), and the estimate prices an all-to-all group of that size (Ulysses' sp group) with them,
    the other groups with the world's all-reduce figure."""
    b = bench("hardware=gpu", "zero=2", "model=llama-tiny", "parallel.dp=2", "parallel.sp=2")
    ranks = [RankRecord(rank=r, event=Event.END, runtime_bytes=700 * MiB, context_bytes=300 * MiB,
                        nccl_world_bytes=200 * MiB, nccl_all_to_all_bytes=120 * MiB, cublas_workspace_bytes=64 * MiB,
                        outside_bytes=1200 * MiB, torch_peak_allocated=100 * MiB, torch_peak_reserved=110 * MiB)
             for r in range(2)]
    cal = from_result(b, result(ranks), "gpu|x", A100_NAME, {}, {})
    assert (cal.nccl_all_to_all_bytes, cal.sp) == ({"2": 120 * MiB}, 2)
    assert cal.context_bytes == 1200 * MiB - 3 * 200 * MiB - 120 * MiB  # world, dp, sp; and the probe's group
    text = lines(cal, calibration.cache_path())
    assert any(t.startswith("NCCL all-to-all group (2 ranks)") and "120.0 MiB" in t for t in text)
    assert any("3 communicator(s) x NCCL's - the all-to-all group" in t for t in text)
    from zero_bench.estimate import calibrated_gpu_terms

    assert calibrated_gpu_terms(b, cal)["terms"]["NCCL buffers (calibrated)"] == 2 * 200 * MiB + 120 * MiB


def test_calibrate_is_a_sub_command_with_a_small_default_model():
    assert "calibrate" in COMMAND_NAMES and "calibrate" in COMMANDS and "calibrate" in help_text()
    assert parse(["calibrate"]) == ("calibrate", ["model=gpt-tiny"])
    assert parse(["calibrate", "model=gpt-mini", "--json"]) == ("calibrate", ["model=gpt-mini", "json=true"])
