"""precision=auto fits the CPU: which vector units it has, whether torch is held below them, and so
whether bf16 is native (zero_bench.devices.cpu_features); what resolve, doctor and the runner make of it.
The detection is tested at its one seam, `assess` (flags, capability and environment passed in);
the rest fakes `cpu_features.detect` with an assessed record."""
from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys

import pytest
import torch

from zero_bench.commands import doctor, subcommands as commands

from zero_bench.config import configure

from zero_bench.devices import cpu_features

from zero_bench.config.schema import ConfigError, Device, EngineName
from zero_bench.devices.cpu_features import BF16_ISAS, NO_BF16_ISAS, assess, bf16_warning, cpu_flags
from zero_bench.devices.metrics import peak_key

from conftest import cpu_cfg

ZEN4 = frozenset({"sse4_2", "avx", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"})  # this machine's kind
SAPPHIRE = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
SKYLAKE = frozenset({"avx2", "avx512f", "avx512_vnni"})  # AVX-512 without bf16
HASWELL = frozenset({"avx", "avx2", "fma"})
NEOVERSE_V1 = frozenset({"fp", "asimd", "sve", "bf16", "i8mm"})
NEOVERSE_N1 = frozenset({"fp", "asimd", "crc32", "atomics"})
RESTRICTED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


# -- assess: the decision from plain inputs -------------------------------------------------------

@pytest.mark.parametrize("machine, flags, capability, env, native, why", [
    ("x86_64", ZEN4, "AVX512", {}, True, "avx512_bf16, torch AVX512"),
    ("x86_64", SAPPHIRE, "AVX512", {}, True, "avx512_bf16 and amx_bf16, torch AVX512"),
    ("x86_64", frozenset({"avx2", "amx_bf16"}), "AVX512", {}, True, "amx_bf16"),
    ("x86_64", SKYLAKE, "AVX512", {}, False, "no avx512_bf16 or amx_bf16"),
    ("x86_64", HASWELL, "AVX2", {}, False, "no avx512_bf16 or amx_bf16"),
    ("x86_64", ZEN4, "AVX2", {"ATEN_CPU_CAPABILITY": "avx2"}, False, "ATEN_CPU_CAPABILITY=avx2 holds torch at AVX2"),
    ("x86_64", ZEN4, "AVX2", {}, False, "torch's CPU capability is AVX2"),
    ("x86_64", ZEN4, "DEFAULT", {"ATEN_CPU_CAPABILITY": "default"}, False, "holds torch at DEFAULT"),
    ("x86_64", ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False, "ONEDNN_MAX_CPU_ISA=AVX2 holds oneDNN"),
    ("x86_64", ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "avx512_core"}, False, "ONEDNN_MAX_CPU_ISA=AVX512_CORE"),
    ("x86_64", ZEN4, "AVX512", {"DNNL_MAX_CPU_ISA": "AVX2"}, False, "ONEDNN_MAX_CPU_ISA=AVX2"),  # its old name
    ("x86_64", ZEN4, "AVX2", RESTRICTED, False, "holds torch at AVX2, ONEDNN_MAX_CPU_ISA=AVX2 holds oneDNN"),
    ("x86_64", ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True, "oneDNN up to AVX512_CORE_BF16"),
    ("x86_64", ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "NOPE"}, True, "torch AVX512"),  # oneDNN ignores it too
    ("x86_64", ZEN4, "unknown", {}, True, "torch unknown"),  # a torch too old to say holds nothing back
    ("AMD64", ZEN4, "AVX512", {}, True, "avx512_bf16"),  # Windows' name for x86_64
    ("aarch64", NEOVERSE_V1, "SVE256", {}, True, "the CPU lists bf16"),
    ("aarch64", NEOVERSE_N1, "DEFAULT", {}, False, "the CPU does not list bf16"),
    ("aarch64", NEOVERSE_V1, "DEFAULT", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, True, "lists bf16"),  # x86 names: not arm's
    ("arm64", NEOVERSE_V1, "DEFAULT", {}, True, "lists bf16"),  # macOS' name for aarch64
    ("ppc64le", frozenset({"vsx"}), "VSX", {}, False, "no bf16 check for ppc64le"),
])
def test_bf16_is_native_only_with_the_unit_and_nothing_holding_torch_below_it(machine, flags, capability, env,
                                                                              native, why):
    f = assess(machine, flags, capability, env)
    assert (f.bf16_native, f.auto_precision) == (native, "bf16" if native else "fp32")
    assert why in f.why, f.why


@pytest.mark.parametrize("isa", sorted(BF16_ISAS | NO_BF16_ISAS))
def test_every_onednn_isa_name_keeps_or_drops_bf16(isa):
    for spelled in (isa, isa.lower()):  # oneDNN reads the variable case-insensitively
        f = assess("x86_64", ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": spelled})
        assert (f.onednn_isa, f.bf16_native) == (isa, isa in BF16_ISAS)


def test_the_units_and_capability_as_doctor_prints_them():
    assert assess("x86_64", ZEN4, "AVX512", {}).units_line() == "avx2 avx512f avx512_bf16 (no amx_bf16)"
    assert assess("x86_64", SAPPHIRE, "AVX512", {}).units_line() == "avx2 avx512f avx512_bf16 amx_bf16"
    assert assess("aarch64", NEOVERSE_V1, "SVE256", {}).units_line() == "asimd sve bf16 (no sve2)"
    assert assess("x86_64", frozenset(), "DEFAULT", {}).units_line() == "none of avx2, avx512f, avx512_bf16, amx_bf16"
    assert assess("ppc64le", frozenset(), "VSX", {}).units_line() == "not listed for ppc64le"
    assert assess("x86_64", ZEN4, "AVX512", {}).capability_line() == "AVX512"
    assert assess("x86_64", ZEN4, "AVX2", RESTRICTED).capability_line() == (
        "AVX2 (set by ATEN_CPU_CAPABILITY=avx2); oneDNN limited to AVX2 by ONEDNN_MAX_CPU_ISA (no bf16)")
    assert "(keeps bf16)" in assess("x86_64", ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "ALL"}).capability_line()
    assert "no ISA oneDNN knows" in assess("x86_64", ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "x"}).capability_line()


def test_cpu_flags_are_the_first_cpus_flags_or_features(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                   "processor\t: 1\nflags\t\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve bf16\nCPU implementer\t: 0x41\n")
    assert cpu_flags(str(x86)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(arm)) == {"fp", "asimd", "sve", "bf16"}


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="torch's probes are x86 ones")
def test_this_cpus_flags_agree_with_torchs_own_probes():
    f = cpu_features.detect()
    assert ("avx512_bf16" in f.units) == torch.cpu._is_avx512_bf16_supported()
    assert ("avx2" in f.units) == torch.cpu._is_avx2_supported()
    assert f.capability == torch.backends.cpu.get_cpu_capability()


# -- resolve: the one place auto becomes concrete ---------------------------------------------------

@pytest.fixture
def cpu_is(monkeypatch):
    """Make this machine's CPU the one `assess` makes of the arguments."""
    def install(flags, capability="AVX512", env=None, machine="x86_64"):
        f = assess(machine, flags, capability, env or {})
        monkeypatch.setattr(cpu_features, "detect", lambda: f)
        return f
    return install


def auto_cfg(**kw):
    return dataclasses.replace(cpu_cfg(), precision="auto", **kw)


@pytest.mark.parametrize("flags, capability, env, want", [
    (ZEN4, "AVX512", {}, "bf16"), (SAPPHIRE, "AVX512", {}, "bf16"), (SKYLAKE, "AVX512", {}, "fp32"),
    (HASWELL, "AVX2", {}, "fp32"), (ZEN4, "AVX2", RESTRICTED, "fp32")])
def test_auto_on_cpu_is_bf16_only_where_native(cpu_is, flags, capability, env, want):
    cpu_is(flags, capability, env)
    assert configure.resolve(auto_cfg()).precision == want
    assert configure.resolve(auto_cfg(), here=False).precision == want  # an estimate on CPU: this CPU
    assert configure.resolve(dataclasses.replace(auto_cfg(), precision="fp32")).precision == "fp32"
    assert configure.resolve(dataclasses.replace(auto_cfg(), precision="bf16")).precision == "bf16"  # warned, runs


def test_auto_on_arm_cpus(cpu_is):
    cpu_is(NEOVERSE_V1, "SVE256", machine="aarch64")
    assert configure.resolve(auto_cfg()).precision == "bf16"
    cpu_is(NEOVERSE_N1, "DEFAULT", machine="aarch64")
    assert configure.resolve(auto_cfg()).precision == "fp32"


@pytest.fixture
def gpu_is(monkeypatch):
    def install(bf16):
        monkeypatch.setattr(configure, "cuda_available", lambda: True)
        monkeypatch.setattr(configure, "gpu_bf16", lambda: bf16)
    return install


def gpu_auto(**kw):
    return dataclasses.replace(auto_cfg(), hardware=dataclasses.replace(auto_cfg().hardware, device="auto"), **kw)


def test_auto_on_gpu_is_bf16_where_the_card_has_it_else_fp16(gpu_is):
    gpu_is(True)
    b = configure.resolve(gpu_auto())
    assert (b.hardware.device, b.precision) == ("gpu", "bf16")
    gpu_is(False)  # a V100
    assert configure.resolve(gpu_auto()).precision == "fp16"


def test_auto_on_a_gpu_without_bf16_and_fsdp2_is_one_line_naming_the_key(gpu_is):
    gpu_is(False)
    with pytest.raises(ConfigError) as info:
        configure.resolve(gpu_auto(engine="fsdp2", zero=3))
    assert str(info.value).startswith("precision=auto: ") and "\n" not in str(info.value)
    assert "precision=fp32" in str(info.value)
    fp32 = dataclasses.replace(gpu_auto(engine="fsdp2", zero=3), precision="fp32")
    assert configure.resolve(fp32).precision == "fp32"


def test_an_estimate_for_a_gpu_assumes_bf16_without_asking_this_machine(monkeypatch):
    monkeypatch.setattr(configure, "cuda_available", lambda: False)
    monkeypatch.setattr(configure, "gpu_bf16", lambda: pytest.fail("asked a GPU that is not here"))
    gpu = dataclasses.replace(auto_cfg(), hardware=dataclasses.replace(auto_cfg().hardware, device="gpu"))
    assert configure.resolve(gpu, here=False).precision == "bf16"


@pytest.mark.parametrize("capability, hip, native", [((7, 0), None, False), ((7, 5), None, False),
                                                     ((8, 0), None, True), ((9, 0), None, True), ((9, 4), "6.2", True)])
def test_gpu_bf16_is_the_cards_own_not_emulated(monkeypatch, capability, hip, native):
    """torch.cuda.is_bf16_supported() counts a V100's or T4's emulated bf16: those are fp16's cards."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert configure.gpu_bf16() is native


def test_auto_on_this_machine_without_restriction_is_the_detected_answer():
    assert configure.resolve(auto_cfg()).precision == cpu_features.detect().auto_precision


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 variables")
def test_a_real_process_held_to_avx2_resolves_auto_to_fp32():
    """ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 in a real process: torch reports AVX2, auto
    is fp32 whatever this CPU has, and the cached matmul rate is another entry than unrestricted."""
    code = ("from zero_bench.config.configure import compose, from_cfg; from zero_bench.devices import cpu_features, metrics; "
            "f = cpu_features.detect(); print(from_cfg(compose(['hardware=cpu'])).precision, f.capability, "
            "f.bf16_native); print(metrics.peak_key('bf16', 1))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **RESTRICTED})
    assert p.returncode == 0, p.stderr[-2000:]
    first, key = p.stdout.strip().splitlines()[-2:]
    assert first == "fp32 AVX2 False"
    assert key.endswith("|bf16|torch=AVX2|onednn=AVX2")
    # the same machine unrestricted (whatever this test process runs under) keys another entry
    free = {k: v for k, v in os.environ.items() if k not in RESTRICTED}
    p = subprocess.run([sys.executable, "-c", "from zero_bench.devices import metrics; print(metrics.peak_key('bf16', 1))"],
                       capture_output=True, text=True, timeout=120, env=free)
    assert p.returncode == 0 and p.stdout.strip().splitlines()[-1] != key, p.stderr[-2000:]


# -- doctor ----------------------------------------------------------------------------------------

def test_doctor_lines_for_a_cpu_without_native_bf16():
    f = assess("x86_64", ZEN4, "AVX2", RESTRICTED)
    lines = [c.line() for c in doctor.cpu_checks(f, "resolves to fp32 on cpu")]
    assert lines == [
        "[ ok] CPU vector units       avx2 avx512f avx512_bf16 (no amx_bf16)",
        "[ ok] torch CPU capability   AVX2 (set by ATEN_CPU_CAPABILITY=avx2); oneDNN limited to AVX2 by "
        "ONEDNN_MAX_CPU_ISA (no bf16)",
        "[ ok] bf16 on CPU            not native: avx512_bf16 present but unused: ATEN_CPU_CAPABILITY=avx2 holds "
        "torch at AVX2, ONEDNN_MAX_CPU_ISA=AVX2 holds oneDNN below bf16",
        "[ ok] precision=auto         resolves to fp32 on cpu"]


def test_doctor_matmul_rates_per_precision():
    rates = {p: {"flops": f, "threads": 1, "cached": True, "path": "/c/cpu_peak.json"}
             for p, f in (("fp32", 77e9), ("bf16", 15.8e9))}
    assert doctor.matmul_check(rates).line() == (
        "[ ok] peak FLOP/s            CPU matmul, 1 thread(s) as a rank runs: fp32 77, bf16 15.8 GFLOP/s "
        "(bf16 4.9x slower); cached in /c/cpu_peak.json (for MFU)")
    rates["bf16"] = {**rates["bf16"], "flops": 200e9, "cached": False}
    assert "bf16 200 GFLOP/s (bf16 2.6x faster); measured now" in doctor.matmul_check(rates).detail


def test_doctor_says_what_auto_resolves_to(cpu_is, gpu_is):
    cpu_is(SKYLAKE)
    assert doctor.auto_line("cpu", "deepspeed") == "resolves to fp32 on cpu"
    names = [c.name for c in doctor.check_cpu("cpu", EngineName.deepspeed)]
    assert names == ["CPU vector units", "torch CPU capability", "bf16 on CPU", "precision=auto"]
    gpu_is(False)
    assert doctor.auto_line("gpu", "deepspeed") == "resolves to fp16 on gpu"
    assert doctor.auto_line("gpu", "fsdp2").startswith("precision=auto: this GPU has no bf16")


# -- the runner's warning for an explicit bf16 --------------------------------------------------------

def fake_rates(monkeypatch):
    asked = []

    def rate(precision):
        asked.append(precision)
        return {"flops": {"fp32": 77e9, "bf16": 15.8e9}[precision]}
    monkeypatch.setattr(commands, "cpu_peak_flops", rate)
    return asked


def test_the_warning_is_one_line_with_the_measured_slowdown():
    f = assess("x86_64", HASWELL, "AVX2", {})
    line = bf16_warning(f, 77e9, 15.8e9)
    assert line == ("precision=bf16: this CPU has no native bf16 (no avx512_bf16 or amx_bf16); a bf16 matmul runs "
                    "4.9x slower than fp32 here (15.8 vs 77 GFLOP/s, measured); precision=auto picks fp32")


def test_warned_once_per_command_and_only_for_bf16_on_a_cpu_without_it(cpu_is, monkeypatch, tmp_path, capsys):
    asked = fake_rates(monkeypatch)
    inv = commands.Invocation(out=tmp_path)
    cpu_is(ZEN4)  # native: nothing to say, nothing measured
    commands.warn_slow_bf16(cpu_cfg(precision="bf16"), inv)
    cpu_is(HASWELL)
    commands.warn_slow_bf16(cpu_cfg(precision="fp32"), inv)
    assert capsys.readouterr().err == "" and asked == []
    for _ in range(2):  # a sweep's jobs share the invocation's memory
        commands.warn_slow_bf16(cpu_cfg(precision="bf16"), commands.Invocation(out=tmp_path, said=inv.said))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("zero_bench: warning: precision=bf16: this CPU has no native bf16")
    assert "4.9x slower" in err[0]


@pytest.mark.parametrize("args", [
    ["run", "model=gpt2.5b"],
    ["maxbatch", "-m", "model=gpt2.5b", "zero=1,2"],  # a sweep of two jobs in this process: one warning
])
def test_run_and_maxbatch_warn_once_before_anything_else_estimate_never(args, cpu_is, monkeypatch, tmp_path, capsys):
    """Through the command line in this process; gpt2.5b does not fit a CPU rank's budget by the
    estimate, so nothing is launched (guarded too)."""
    from zero_bench import cli

    cpu_is(HASWELL)
    fake_rates(monkeypatch)
    monkeypatch.setattr(commands, "run_launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(commands, "run_search", lambda *a, **k: pytest.fail("searched"))
    monkeypatch.setattr(sys, "argv", ["zero_bench"])
    common = ["hardware=cpu", "precision=bf16", f"store={tmp_path}/s.sqlite", f"hydra.run.dir={tmp_path}/run",
              f"hydra.sweep.dir={tmp_path}/sweep"]
    try:
        cli.main(args + common)
    except SystemExit as exc:
        assert exc.code == 3  # run: did not fit by the estimate
    captured = capsys.readouterr()
    warnings = [ln for ln in captured.err.splitlines() if "warning: precision=bf16" in ln]
    assert len(warnings) == 1, captured.err
    if args[0] == "maxbatch":  # each job's first progress line names the precision it runs at
        assert captured.out.count("precision=bf16 | ") == 2, captured.out
    cli.main(["estimate", "model=gpt-tiny", "zero=2", *common])
    assert "warning" not in capsys.readouterr().err


def test_auto_in_a_sweeps_progress_line_is_the_resolved_precision(cpu_is):
    cpu_is(SKYLAKE)
    cfg = configure.compose(["hardware=cpu", "model=gpt-tiny"])
    assert cfg.precision == "auto" and commands.shown_precision(cfg) == "fp32"
    cpu_is(ZEN4)
    assert commands.shown_precision(cfg) == "bf16"
    bad = configure.compose(["hardware=cpu", "model=gpt-tiny", "zero=0", "offload=true"])  # recorded as skipped
    assert commands.shown_precision(bad) == "auto"


def test_the_resolved_precision_is_in_the_label_and_the_stored_config(cpu_is):
    cpu_is(ZEN4)
    b = configure.from_cfg(configure.compose(["hardware=cpu", "model=gpt-tiny"]))
    assert b.label().endswith(" bf16") and b.to_dict()["precision"] == "bf16"
    assert b.search_key() != dataclasses.replace(b, precision="fp32").search_key()
    assert Device(b.hardware.device) == Device.cpu


def test_compiled_kernels_are_cached_apart_per_cpu_kernel_choice(tmp_path):
    """A compile=true trial reusing kernels inductor built under the other CPU restriction aborted
    (glibc heap corruption): each restriction gets its own cache (launcher.inductor_cache_dir)."""
    code = "from zero_bench.trial.launcher import inductor_cache_dir; print(inductor_cache_dir())"
    base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                             "TORCHINDUCTOR_CACHE_DIR")}
    base["ZERO_BENCH_CACHE"] = str(tmp_path)
    plain = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, check=True)
    avx2 = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**base, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert plain.stdout.strip() != avx2.stdout.strip()
    assert avx2.stdout.strip() == str(tmp_path / "inductor" / "zero_bench-avx2-avx2")
    # inductor sets TORCHINDUCTOR_CACHE_DIR in a process that compiled: the kinds stay apart under it
    inherited = {**base, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
    again = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
             .stdout.strip() for env in (inherited, {**inherited, "ATEN_CPU_CAPABILITY": "avx2"})]
    assert again[0] != again[1] and all(x.startswith(str(tmp_path / "ind")) for x in again)
