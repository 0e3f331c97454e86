"""What this CPU computes natively: its vector units, torch's CPU capability, oneDNN's ISA limit, and
from them whether bf16 is native here, which is what precision=auto picks on CPU (configure.resolve).

bf16 is native on x86 when the CPU has avx512_bf16 or amx_bf16 AND nothing holds torch below it:
torch's CPU capability (ATEN_CPU_CAPABILITY=avx2 lowers it) must be AVX512, and ONEDNN_MAX_CPU_ISA
(oneDNN computes torch's bf16 matmuls), if set, must name an ISA with bf16. Measured here (AMD
EPYC with avx512_bf16, one thread, a 1024 x 1024 linear layer, x @ W.T): fp32 74, bf16 212 GFLOP/s;
with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 fp32 75, bf16 21.6 (and 0.9 for a plain
x @ W, which ATen's fallback computes). The capability condition is the cautious one:
ATEN_CPU_CAPABILITY=avx2 alone left the bf16 matmul at 214 GFLOP/s (oneDNN does not read it) and
ATen's bf16 layer_norm / gelu / softmax no slower than fp32, but bf16 then runs on kernels chosen
below what the CPU has, so auto does not pick it. On
aarch64 bf16 is native when the CPU lists bf16 in its Features.

`assess` decides from plain inputs (flags, capability, environment), so every case is testable
without such a CPU; `detect` gathers them on this machine. torch is imported only when asked.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Mapping, Optional

X86, ARM = ("x86_64", "amd64", "i386", "i686"), ("aarch64", "arm64")
UNITS = {"x86": ("avx2", "avx512f", "avx512_bf16", "amx_bf16"), "arm": ("asimd", "sve", "sve2", "bf16")}
UNKNOWN = "unknown"
# ONEDNN_MAX_CPU_ISA values (oneDNN's dispatcher control, case-insensitive) that keep or drop bf16.
# oneDNN ignores a name it does not know, so does this check (measured: =NOPE runs bf16 at full speed).
BF16_ISAS = frozenset({"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX",
                       "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
                       "AVX10_2_512_AMX_2", "ALL", "DEFAULT"})
NO_BF16_ISAS = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})


@dataclass(frozen=True)
class CpuFeatures:
    """This CPU as precision=auto sees it."""
    arch: str  # "x86", "arm" or platform.machine() for others
    units: tuple[str, ...]  # vector units present, of UNITS[arch]
    lacks: tuple[str, ...]  # vector units absent, of UNITS[arch]
    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...
    aten_env: Optional[str]  # ATEN_CPU_CAPABILITY as set, None when unset
    onednn_isa: Optional[str]  # ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) as set, upper case
    bf16_native: bool
    why: str  # why bf16 is or is not native, one phrase

    @property
    def auto_precision(self) -> str:
        return "bf16" if self.bf16_native else "fp32"

    def units_line(self) -> str:
        if self.arch not in UNITS:
            return f"not listed for {self.arch}"
        if not self.units:
            return f"none of {', '.join(self.lacks)}"
        return " ".join(self.units) + (f" (no {', '.join(self.lacks)})" if self.lacks else "")

    def capability_line(self) -> str:
        line = self.capability + (f" (set by ATEN_CPU_CAPABILITY={self.aten_env})" if self.aten_env else "")
        if self.onednn_isa:
            if self.onednn_isa in BF16_ISAS | NO_BF16_ISAS:
                keeps = "keeps bf16" if self.onednn_isa in BF16_ISAS else "no bf16"
                line += f"; oneDNN limited to {self.onednn_isa} by ONEDNN_MAX_CPU_ISA ({keeps})"
            else:
                line += f"; ONEDNN_MAX_CPU_ISA={self.onednn_isa} is no ISA oneDNN knows (it ignores it)"
        return line


def assess(machine: str, flags: frozenset, capability: str, env: Mapping[str, str]) -> CpuFeatures:
    """The record for a CPU of architecture `machine` (platform.machine()) with these cpuinfo
    `flags`, torch's `capability` and environment `env`."""
    arch = "x86" if machine.lower() in X86 else "arm" if machine.lower() in ARM else machine
    shown = UNITS.get(arch, ())
    aten, isa = env.get("ATEN_CPU_CAPABILITY") or None, onednn_limit(env)
    native, why = _bf16(arch, flags, capability, aten, isa)
    return CpuFeatures(arch, tuple(u for u in shown if u in flags), tuple(u for u in shown if u not in flags),
                       capability, aten, isa, native, why)


def _bf16(arch: str, flags: frozenset, capability: str, aten: Optional[str], isa: Optional[str]) -> tuple[bool, str]:
    if arch == "arm":
        return ("bf16" in flags, "the CPU lists bf16" if "bf16" in flags else "the CPU does not list bf16")
    if arch != "x86":
        return False, f"no bf16 check for {arch}"
    units = [u for u in ("avx512_bf16", "amx_bf16") if u in flags]
    if not units:
        return False, "no avx512_bf16 or amx_bf16"
    held = []
    if capability != UNKNOWN and not capability.upper().startswith("AVX512"):
        held.append(f"ATEN_CPU_CAPABILITY={aten} holds torch at {capability}" if aten else
                    f"torch's CPU capability is {capability}")
    if isa in NO_BF16_ISAS:
        held.append(f"ONEDNN_MAX_CPU_ISA={isa} holds oneDNN below bf16")
    if held:
        return False, f"{' and '.join(units)} present but unused: " + ", ".join(held)
    return True, f"{' and '.join(units)}, torch {capability}" + (f", oneDNN up to {isa}" if isa else "")


def onednn_limit(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """ONEDNN_MAX_CPU_ISA as oneDNN reads it (DNNL_MAX_CPU_ISA is its older name), upper case."""
    value = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return value or None


def torch_capability() -> str:
    """torch's CPU capability: the vector kernels ATen dispatches to (ATEN_CPU_CAPABILITY lowers it)."""
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except (ImportError, AttributeError):  # a torch older than 2.1 does not say
        return UNKNOWN


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset:
    """The first CPU's flags (x86) or Features (arm); torch's own probes where there is no cpuinfo."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return _torch_flags()


def _torch_flags() -> frozenset:
    try:
        import torch

        probes = {"avx2": "_is_avx2_supported", "avx512f": "_is_avx512_supported",
                  "avx512_bf16": "_is_avx512_bf16_supported", "amx_bf16": "_is_amx_tile_supported"}
        return frozenset(k for k, fn in probes.items() if getattr(torch.cpu, fn, lambda: False)())
    except ImportError:
        return frozenset()


def detect() -> CpuFeatures:
    """This machine's record (not cached: the environment may change between calls)."""
    return assess(platform.machine(), cpu_flags(), torch_capability(), os.environ)


def bf16_warning(f: CpuFeatures, fp32_flops: float, bf16_flops: float) -> str:
    """The one line for precision=bf16 where bf16 is not native, with the measured matmul rates."""
    return (f"precision=bf16: this CPU has no native bf16 ({f.why}); a bf16 matmul runs "
            f"{bf16_speed(fp32_flops, bf16_flops)} than fp32 "
            f"here ({bf16_flops / 1e9:.3g} vs {fp32_flops / 1e9:.3g} GFLOP/s, measured); precision=auto picks fp32")


def bf16_speed(fp32_flops: float, bf16_flops: float) -> str:
    """"4.9x slower" or "3.1x faster": bf16's measured rate against fp32's."""
    ratio = fp32_flops / bf16_flops
    return f"{ratio:.2g}x slower" if ratio >= 1 else f"{1 / ratio:.2g}x faster"
