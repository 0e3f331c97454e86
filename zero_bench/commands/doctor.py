"""`zero_bench doctor`: can this machine run what the config asks? One line per check, each "ok" or
a fix to apply (or "--" for what this config does not need).

Checks: accelerator and devices (count, memory), the CPU (vector units, torch's CPU capability,
whether bf16 is native, what precision=auto picks; for CPU runs the measured matmul rates), NVML,
DeepSpeed's op compatibility (through its Python API: the builders `ds_report` walks,
`installed_ops`, and the JIT cache), for a GPU run with megatron's fusions a tiny torch.compile on
CUDA (what is missing when it fails), launchers and ssh (pdsh / mpirun / srun / sshd), the hostfile
when one is set, and whether the configured run (by default the demo: gpt-tiny, dp=2) passes
validation, the memory estimate and its op needs.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

from zero_bench.devices import cpu_features, metrics

from zero_bench.config.configure import auto_precision, from_cfg
from zero_bench.config.hosts import check_hostfile, master_addr
from zero_bench.config.schema import DEFAULT_ENGINE, Device, EngineName
from zero_bench.devices.aio import async_io_problem, libaio_fix
from zero_bench.devices.cpu_features import CpuFeatures
from zero_bench.devices.nvml import Nvml
from zero_bench.devices.toolkit import cuda_toolkit, extensions_dir, fused_adam_fallback, jit_cached
from zero_bench.engines.specs import spec
from zero_bench.errors import ConfigError
from zero_bench.search.preflight import preflight, validate_machine

OK, FIX, NA = "ok", "FIX", "--"


@dataclass
class Check:
    status: str  # OK, FIX or NA
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"[{self.status:>3}] {self.name:<22} {self.detail}"
        return text + (f"\n      {'':<22} fix: {self.fix}" if self.fix else "")


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


# -- accelerator -------------------------------------------------------------------------------

def check_accelerator(device: Device) -> list[Check]:
    import psutil
    import torch

    out = [Check(OK, "python / torch", f"Python {platform.python_version()}, torch {torch.__version__}"
                 + (f", CUDA {torch.version.cuda}" if torch.version.cuda else " (CPU build)"))]
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        out.append(Check(OK, "deepspeed", f"{deepspeed.__version__}, accelerator {acc.device_name()} "
                         f"({acc.communication_backend_name()})"))
    except Exception as exc:  # noqa: BLE001
        out.append(Check(FIX, "deepspeed", f"import failed: {type(exc).__name__}: {exc}",
                         "pip install deepspeed (see requirements-cpu.txt for the pinned CPU set)"))
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_cuda:
        devs = []
        for i in range(n_cuda):
            p = torch.cuda.get_device_properties(i)
            devs.append(f"cuda:{i} {p.name} {_gib(p.total_memory)}")
        out.append(Check(OK, "GPUs", f"{n_cuda}: " + "; ".join(devs)))
    else:
        why = "torch is a CPU build" if torch.version.cuda is None else "CUDA sees no device"
        st = FIX if device == Device.gpu else NA
        out.append(Check(st, "GPUs", f"none ({why})",
                         "install a CUDA build of torch and the NVIDIA driver, or use hardware=cpu"
                         if st == FIX else ""))
    vm = psutil.virtual_memory()
    cores = os.cpu_count() or 1
    out.append(Check(OK, "CPU", f"{cores} cores, RAM {_gib(vm.total)} ({_gib(vm.available)} available); "
                     f"CPU ranks run on DeepSpeed's CPU accelerator (gloo)"))
    return out


def check_nvml(device: Device) -> Check:
    n = Nvml()
    try:
        if n.nv is None:
            if device == Device.gpu:
                return Check(FIX, "NVML", n.error or "unavailable",
                             "install the NVIDIA driver (libnvidia-ml.so.1) and nvidia-ml-py; without it "
                             "per-GPU memory is not sampled (torch's own peaks still are)")
            return Check(NA, "NVML", f"not available ({(n.error or '').split(': ', 1)[-1]}): "
                         "expected without an NVIDIA driver; CPU runs sample RSS instead")
        detail = n.status() + (f"; note: {n.note}" if n.note else "")
        if n.error:
            return Check(FIX, "NVML", f"{detail}; {n.error}", "check the GPUs with nvidia-smi (a lost GPU needs a reset)")
        return Check(OK, "NVML", detail)
    finally:
        n.close()


def check_peak_flops(device: Device, precision: str) -> Check:
    import torch

    if device == Device.cpu:
        return matmul_check({p: metrics.cpu_peak_flops(p) for p in ("fp32", "bf16")})
    if not torch.cuda.is_available():
        return Check(NA, "peak FLOP/s", "no GPU visible")
    name = torch.cuda.get_device_properties(0).name
    peak = metrics.gpu_peak_flops(name, precision)
    if peak is None:
        return Check(FIX, "peak FLOP/s", f"{name} is not in the table (A100/H100/H200/L40S/V100)",
                     "add it to zero_bench/devices/metrics.py PEAK_FLOPS to get MFU")
    return Check(OK, "peak FLOP/s", f"{name} {precision}: {peak / 1e12:.0f} TFLOP/s (for MFU)")


def matmul_check(rates: dict) -> Check:
    """The measured matmul rate per precision (metrics.cpu_peak_flops' entries), as one rank computes."""
    fp32, bf16 = rates["fp32"], rates["bf16"]
    how = "cached in" if fp32["cached"] and bf16["cached"] else "measured now, cached in"
    return Check(OK, "peak FLOP/s", f"CPU matmul, {fp32['threads']} thread(s) as a rank runs: fp32 "
                 f"{fp32['flops'] / 1e9:.3g}, bf16 {bf16['flops'] / 1e9:.3g} GFLOP/s (bf16 "
                 f"{cpu_features.bf16_speed(fp32['flops'], bf16['flops'])}); {how} {fp32['path']} (for MFU)")


# -- CPU: what it computes natively, and so what precision=auto picks ---------------------------------

def check_cpu(device: Device, engine: str) -> list[Check]:
    return cpu_checks(cpu_features.detect(), auto_line(device, engine))


def auto_line(device: str, engine: str) -> str:
    try:
        return f"resolves to {auto_precision(Device(device), EngineName(engine))} on {device}"
    except ConfigError as exc:
        return str(exc)


def cpu_checks(f: CpuFeatures, auto: str) -> list[Check]:
    """The CPU's vector units, torch's capability (and the variables that restrict it), whether bf16
    is native, and what precision=auto resolves to (`auto`)."""
    return [Check(OK, "CPU vector units", f.units_line()),
            Check(OK, "torch CPU capability", f.capability_line()),
            Check(OK, "bf16 on CPU", f"{'native' if f.bf16_native else 'not native'}: {f.why}"),
            Check(OK, "precision=auto", auto)]


# -- DeepSpeed ops -------------------------------------------------------------------------------

def op_status() -> dict[str, dict]:
    """What `ds_report` shows, from DeepSpeed's Python API: per op, installed / compatible / cached."""
    import io
    from contextlib import redirect_stdout

    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    from deepspeed.ops.op_builder.builder import probe_is_compatible

    import logging

    out = {}
    for name, builder in ALL_OPS.items():
        buf = io.StringIO()
        logging.disable(logging.INFO)  # probes compile test programs and log each gcc line
        try:
            with redirect_stdout(buf):  # probe warnings go to stdout
                compatible = bool(probe_is_compatible(builder, False))
        finally:
            logging.disable(logging.NOTSET)
        out[name] = {"installed": bool(installed_ops.get(name, False)) and accelerator_name == get_accelerator()._name,
                     "compatible": compatible, "cached": jit_cached(name),
                     "note": buf.getvalue().strip()[-200:]}
    return out


# op name -> the accelerator's builder class (deepspeed/ops/op_builder)
BUILDERS = {"deepspeed_shm_comm": "ShareMemCommBuilder", "fused_adam": "FusedAdamBuilder", "cpu_adam": "CPUAdamBuilder",
            "quantizer": "QuantizerBuilder", "async_io": "AsyncIOBuilder"}
NVME_OP = {"async_io": "NVMe offload's swapper (libaio; JIT-built once, ~2 minutes on 2 cores)"}


def needed_ops(bench) -> dict[str, str]:
    """Ops a run of this config builds on first use, with why.

    ds_configs/base.json asks for "AdamW": on GPU DeepSpeed's engine makes that FusedAdam, or
    DeepSpeedCPUAdam with optimizer offload (engine._configure_basic_optimizer); on CPU
    ds_configs/cpu.json sets torch_adam, so only the shared-memory collective is built. Where
    FusedAdam cannot be built, GPU runs use torch's fused AdamW (ds_config), which needs no build.
    engine=fsdp2 builds none: torch's own AdamW and process group.
    """
    if not spec(bench.engine).builds_deepspeed_ops:
        return {}
    nvme = NVME_OP if bench.nvme else {}
    if bench.hardware.device == Device.cpu:
        return {"deepspeed_shm_comm": "init_distributed on CPU (~34 s to JIT-build once)", **nvme}
    # ZeRO++'s qwZ / qgZ load DeepSpeed's quantizer in every rank (zero.Init, the gradients' all-to-all)
    quant = ({"quantizer": "ZeRO++ qwZ / qgZ: int8 / int4 quantized collectives (JIT-built with nvcc)"}
             if bench.zeropp.qwz or bench.zeropp.qgz else {})
    if bench.offload:
        return {"cpu_adam": "DeepSpeedCPUAdam for optimizer offload (JIT-built with the host compiler)", **quant,
                **nvme}
    if fused_adam_fallback():
        return quant
    return {"fused_adam": "FusedAdam for AdamW (JIT-built with nvcc)", **quant}


def torch_adamw_line(reason: str) -> str:
    return (f"FusedAdam cannot be built here ({reason}); GPU trials use torch's fused AdamW instead "
            "(ds optimizer.params torch_adam=true, fused=true: compiled into torch, no build)")


def prebuild_ops(bench, say=print) -> list[str]:
    """Build the ops a GPU trial of `bench` needs, once, here: outside every trial's timeout, and a
    machine that cannot build them gets one line before any launch instead of failed trials."""
    if bench.hardware.device != Device.gpu and not bench.nvme:
        return []  # CPU: make builds the shared-memory op at install time (async_io: `make test`, or below)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())  # where the ranks will look
    fallback = None if bench.offload else fused_adam_fallback()
    if fallback:
        say(f"zero_bench: {torch_adamw_line(fallback)}")
    built = []
    needed = needed_ops(bench) if bench.hardware.device == Device.gpu else NVME_OP
    for name, why in needed.items():
        if installed_ops.get(name) or jit_cached(name):
            continue
        say(f"zero_bench: building DeepSpeed op {name} once, before the first trial ({why})")
        try:
            get_accelerator().create_op_builder(BUILDERS[name]).load()
        except Exception as exc:  # noqa: BLE001 - no nvcc, no compiler, wrong CUDA: one line
            raise ConfigError(f"DeepSpeed op {name} cannot be built here ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:300]}); `zero_bench doctor` says what is missing") from None
        built.append(name)
    return built


def check_ops(bench=None) -> list[Check]:
    from torch.utils.cpp_extension import is_ninja_available

    out = []
    ninja = is_ninja_available()
    cc = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    jit_ok = ninja and cc
    out.append(Check(OK if jit_ok else FIX, "JIT toolchain", f"ninja {'found' if ninja else 'missing'}, "
                     f"C++ compiler {cc or 'missing'}",
                     "" if jit_ok else "pip install ninja; apt-get install g++ (DeepSpeed JIT-compiles its ops)"))
    try:
        ops = op_status()
    except Exception as exc:  # noqa: BLE001
        return out + [Check(FIX, "deepspeed ops", f"cannot query op builders: {type(exc).__name__}: {exc}",
                            "run ds_report and fix what it reports")]
    need = needed_ops(bench) if bench is not None else {}
    if bench is not None and bench.hardware.device == Device.gpu:
        out += check_gpu_optimizer(bench)
    if bench is None or bench.hardware.device == Device.cpu:
        import torch

        cuda = torch.version.cuda
        out.append(Check(NA, "GPU ops", "a GPU trial needs fused_adam (AdamW) or cpu_adam (offload), built with "
                         f"nvcc once before its first trial; {'CUDA ' + cuda if cuda else 'this torch has no CUDA'}"))
    compat = [n for n, o in ops.items() if o["compatible"]]
    ready = [n for n, o in ops.items() if o["installed"] or o["cached"]]
    out.append(Check(OK, "deepspeed ops", f"{len(compat)}/{len(ops)} compatible ({', '.join(compat)}); "
                     f"prebuilt or JIT-cached: {', '.join(ready) or 'none'}"))
    for name, why in need.items():
        o = ops.get(name)
        if o is None:
            out.append(Check(FIX, f"op {name}", f"unknown to this DeepSpeed, needed for {why}", "upgrade deepspeed"))
        elif o["installed"] or o["cached"]:
            out.append(Check(OK, f"op {name}", "prebuilt" if o["installed"] else f"JIT-cached ({o['cached']})"))
        elif o["compatible"] and jit_ok:
            out.append(Check(OK, f"op {name}", f"compatible; run and maxbatch build it once before the first trial: {why}"))
        else:
            out.append(Check(FIX, f"op {name}", f"not compatible here ({o['note'] or 'see ds_report'}); needed for {why}",
                             "install what ds_report lists for this op, or DS_BUILD_OPS=1 pip install deepspeed"))
    return out


def check_async_io() -> Check:
    """NVMe offload (offload_device=nvme) needs DeepSpeed's async_io op: whether it builds here, and
    the one command that makes it build where it does not. Not blocking: only nvme runs need it."""
    problem = async_io_problem()
    if problem:
        return Check(NA, "op async_io", problem.split("; fix:")[0] + "; offload_device=nvme is refused here",
                     libaio_fix())
    return Check(OK, "op async_io", f"NVMe offload can run ({'JIT-cached' if jit_cached('async_io') else 'libaio found, built at first use'})")


def check_gpu_optimizer(bench) -> list[Check]:
    """nvcc against torch's CUDA (DeepSpeed's JIT build checks neither), and the optimizer a GPU run
    therefore uses."""
    kit = cuda_toolkit()
    fix = (f"for DeepSpeed's FusedAdam: a CUDA toolkit whose nvcc is CUDA {kit.torch_cuda or 'of torch'}'s major "
           "version, with CUDA_HOME pointing at it" if kit.problem else "")
    checks = [Check(OK, "CUDA toolkit", kit.line(), fix)]
    fallback = None if bench.offload else fused_adam_fallback()
    if fallback:
        checks.append(Check(OK, "optimizer", torch_adamw_line(fallback), fix))
    return checks


# -- megatron's jit fusions: torch.compile on CUDA ----------------------------------------------------

JIT_FUSIONS = "torch.compile (GPU)"
# A tiny function under torch.compile on cuda:0, forward and backward (AOTAutograd's two graphs, as
# megatron's bias_dropout_add_fused_train), in a process of its own with empty inductor and Triton
# caches, so that kernels cached by an earlier run cannot hide a missing compiler. Exit 3: no GPU.
COMPILE_PROBE = """
import sys, time
import torch
if not torch.cuda.is_available():
    sys.exit(3)
t0 = time.time()
x = torch.randn(64, 64, device="cuda", requires_grad=True)
torch.compile(lambda y: torch.nn.functional.silu(y) * y)(x).sum().backward()
torch.cuda.synchronize()
print(f"{time.time() - t0:.1f}")
"""
COMPILE_PROBE_TIMEOUT_S = 600  # a cold inductor start, subprocess compile workers, two Triton builds


@dataclass
class CompileProbe:
    """What the tiny compile did: ran (False: no GPU visible), seconds, the error text (None: it built)."""
    ran: bool
    seconds: float = 0.0
    error: Optional[str] = None


def tiny_cuda_compile() -> CompileProbe:
    """Run COMPILE_PROBE in a fresh interpreter (the seam tests replace)."""
    with tempfile.TemporaryDirectory(prefix="zero_bench-compile-") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        try:
            p = subprocess.run([sys.executable, "-c", COMPILE_PROBE], env=env, capture_output=True, text=True,
                               timeout=COMPILE_PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return CompileProbe(True, COMPILE_PROBE_TIMEOUT_S, f"no result within {COMPILE_PROBE_TIMEOUT_S} s")
    if p.returncode == 3:
        return CompileProbe(False)
    if p.returncode != 0:
        return CompileProbe(True, error=p.stderr or p.stdout or f"exit {p.returncode}")
    return CompileProbe(True, float(p.stdout.split()[-1]))


# What a failed compile's output says is missing (triton/runtime/build.py, the NVIDIA backend's
# driver.py libcuda_dirs, torch/_inductor/exc.py), and the fix.
COMPILE_NEEDS = (
    (("Failed to find C compiler",), "a C compiler",
     "apt-get install gcc (or set CC): Triton builds each kernel's CUDA launcher with it"),
    (("Python.h",), "Python's headers",
     f"apt-get install python{sys.version_info.major}.{sys.version_info.minor}-dev (Triton's launcher includes Python.h)"),
    (("libcuda.so cannot found",), "libcuda.so.1 where Triton looks",
     "run /sbin/ldconfig (as root) so that `ldconfig -p` lists libcuda.so.1, or set TRITON_LIBCUDA_PATH to its folder"),
    (("Cannot find a working triton", "No module named 'triton'"), "Triton",
     "pip install the triton your torch names (pip show torch: Requires)"),
)


def missing_from(error: str) -> list[tuple[str, str]]:
    """(what, fix) for each need COMPILE_NEEDS recognises in a failed compile's output."""
    return [(what, fix) for marks, what, fix in COMPILE_NEEDS if any(m in error for m in marks)]


def compile_prerequisites() -> list[tuple[str, str]]:
    """(what, fix) for each prerequisite of Triton's build that this machine visibly lacks, found as
    Triton looks for them: CC else gcc or clang; Python.h in sysconfig's include folder; libcuda.so.1
    in TRITON_LIBCUDA_PATH, `ldconfig -p` or LD_LIBRARY_PATH; the triton package."""
    import importlib.util

    found = {"a C compiler": bool(os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")),
             "Python's headers": os.path.exists(os.path.join(_python_include(), "Python.h")),
             "libcuda.so.1 where Triton looks": _libcuda_found(),
             "Triton": importlib.util.find_spec("triton") is not None}
    return [(what, fix) for _, what, fix in COMPILE_NEEDS if not found[what]]


def _python_include() -> str:
    """Where Triton's build looks for Python.h (triton/runtime/build.py: Debian's posix_local read as
    posix_prefix)."""
    scheme = sysconfig.get_default_scheme()
    return sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]


def _libcuda_found() -> bool:
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        return True
    try:
        if "libcuda.so.1" in subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout:
            return True
    except OSError:
        pass
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    return any(os.path.exists(os.path.join(d, "libcuda.so.1")) for d in dirs)


def check_jit_fusions(bench, probe=tiny_cuda_compile, prerequisites=compile_prerequisites) -> Check:
    """A GPU run with megatron's fusions (BenchConfig.fusions) compiles bias-dropout-add and the
    bias-activation with torch.compile in every rank's first step (megatron/core/jit.py: jit_fuser
    is torch.compile): a machine without a C compiler, Python's headers or libcuda where Triton
    looks fails every trial. Tried here once, on cuda:0; when it fails, what is missing."""
    if bench is None:
        return Check(NA, JIT_FUSIONS, "not tried: the config above does not resolve")
    if bench.hardware.device == Device.cpu:
        return Check(NA, JIT_FUSIONS, "CPU runs take megatron's eager ops: nothing compiled")
    if not bench.fusions:
        return Check(NA, JIT_FUSIONS, "fusions=false: megatron's eager ops, nothing compiled")
    result = probe()
    if not result.ran:
        return Check(NA, JIT_FUSIONS, "not tried: CUDA sees no device")
    if result.error is None:
        return Check(OK, JIT_FUSIONS, f"a tiny function compiled on cuda:0 cold in {result.seconds:.1f} s "
                     "(inductor + Triton): megatron's fusions compile in each rank's first step")
    needs = dict(missing_from(result.error))
    needs.update({what: fix for what, fix in prerequisites() if what not in needs})
    last = next((x for x in reversed(result.error.strip().splitlines()) if x.strip()), "")[-300:]
    detail = (f"a tiny torch.compile on cuda:0 failed ({last}); missing: {', '.join(needs) or 'see the error'}; "
              "megatron's fusions compile so in every GPU rank's first step")
    return Check(FIX, JIT_FUSIONS, detail, "; ".join(list(needs.values()) + [
        "or fusions=false (megatron's eager ops: nothing compiled)"]))


# -- launchers -------------------------------------------------------------------------------------

LAUNCHER_BINARIES = {"pdsh": ["pdsh", "ssh"], "openmpi": ["mpirun"], "mpich": ["mpirun"], "impi": ["mpirun"],
                     "mvapich": ["mpirun_rsh", "mpiname"], "slurm": ["srun", "sinfo"]}
HOW = {"pdsh": "apt-get install pdsh openssh-client (or bash launch/ci_provision.sh)",
       "ssh": "apt-get install openssh-client", "sshd": "apt-get install openssh-server (each node runs sshd)",
       "mpirun": "apt-get install openmpi-bin (or load your cluster's MPI module)",
       "srun": "run inside a Slurm allocation (sbatch launch/slurm_maxbatch.sbatch)", "sinfo": "install Slurm clients",
       "mpirun_rsh": "load MVAPICH2", "mpiname": "load MVAPICH2"}


def _which(tool: str) -> Optional[str]:
    return shutil.which(tool) or next((p for p in (f"/usr/sbin/{tool}", f"/usr/local/sbin/{tool}")
                                       if os.access(p, os.X_OK)), None)


def check_launchers(bench=None) -> list[Check]:
    multi = bench is not None and bench.hardware.hostfile
    chosen = bench.hardware.launcher if multi else None
    needed = set(LAUNCHER_BINARIES.get(chosen, [])) if chosen else set()
    out = []
    for tool in ("pdsh", "ssh", "sshd", "mpirun", "srun", "sinfo"):
        path = _which(tool)
        if path:
            out.append(Check(OK, f"launcher {tool}", path))
        elif tool in needed:
            out.append(Check(FIX, f"launcher {tool}", f"missing; hardware.launcher={chosen} needs it", HOW[tool]))
        else:
            out.append(Check(NA, f"launcher {tool}", "missing (only multi-node runs need it)"
                             + (f"; to add it: {HOW[tool]}" if tool in HOW else "")))
    if multi:
        try:
            hosts = check_hostfile(bench)
            addr = master_addr(hosts) or f"found by DeepSpeed via `ssh {next(iter(hosts))} hostname -I`"
            out.append(Check(OK, "hostfile", f"{bench.hardware.hostfile}: {len(hosts)} nodes x "
                             f"{bench.parallel.world_size // bench.hardware.num_nodes} ranks; master {addr}"))
        except ConfigError as exc:
            out.append(Check(FIX, "hostfile", str(exc), "see launch/hostfile.example"))
        if chosen == "pdsh" and not os.environ.get("PDSH_SSH_ARGS_APPEND") and not _which("sshd"):
            out.append(Check(FIX, "ssh", "pdsh reaches nodes over ssh; no sshd here",
                             "passwordless ssh to every host in the hostfile (keys in ~/.ssh)"))
    return out


# -- the configured run (the demo by default) --------------------------------------------------------

def check_run(cfg: Any) -> tuple[list[Check], Optional[object]]:
    try:
        bench = from_cfg(cfg)
        validate_machine(bench)
    except ConfigError as exc:
        return [Check(FIX, "config", str(exc), "change the override named above")], None
    out = [Check(OK, "config", f"{bench.label()}, {bench.hardware.device}, world size {bench.parallel.world_size}"
                 + (f" over {bench.hardware.num_nodes} nodes" if bench.hardware.hostfile else ""))]
    try:
        refused = preflight(bench)
    except Exception as exc:  # noqa: BLE001 - the estimate is advice, not a gate
        out.append(Check(NA, "memory estimate", f"not available: {type(exc).__name__}: {exc}"))
    else:
        if refused is not None:
            out.append(Check(FIX, "memory estimate", refused.reason,
                             "a smaller model or batch, more ZeRO/offload, or force=true to try anyway"))
        else:
            out.append(Check(OK, "memory estimate", f"micro={bench.batch.micro} fits this host by the estimate"))
    return out, bench


def doctor_checks(cfg: Any) -> list[Check]:
    run_checks, bench = check_run(cfg)
    device = bench.hardware.device if bench is not None else Device.cpu
    precision = bench.precision if bench is not None else "bf16"
    engine = bench.engine if bench is not None else DEFAULT_ENGINE
    checks = check_accelerator(device) + check_cpu(device, engine)
    checks += [check_nvml(device), check_peak_flops(device, precision)]
    checks += check_ops(bench) + [check_async_io()] + [check_jit_fusions(bench)] + check_launchers(bench) + run_checks
    blocking = [c for c in checks if c.status == FIX]
    demo = "the configured run" if bench is None or bench.model.name != "GPT-tiny" else "the default demo"
    checks.append(Check(OK if not blocking else FIX, "can run",
                        f"{demo} can run here" if not blocking else
                        f"{demo} needs {len(blocking)} fix(es) first: {', '.join(c.name for c in blocking)}"))
    return checks
