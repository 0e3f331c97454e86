"""The machine a trial runs on: CPU, memory, GPUs (NVML), library versions.

Recorded with every result (TrialResult.env), so a report written elsewhere still says where the
numbers were measured.
"""
from __future__ import annotations

import functools
import os
import platform

from zero_bench.config.schema import software_versions
from zero_bench.devices.metrics import cpu_model
from zero_bench.devices.nvml import nvml_module
from zero_bench.units import MiB



@functools.lru_cache(maxsize=1)
def machine_environment_cached() -> tuple:
    return tuple(machine_environment().items())


def machine_environment() -> dict:
    """This machine: GPUs (NVML), CPU, memory, library versions (those a search key carries)."""
    import psutil

    env = {"cpu": cpu_model(), "cpu cores": os.cpu_count(), "RAM (MiB)": round(psutil.virtual_memory().total / MiB),
           "python": platform.python_version(), "hostname": platform.node()}
    env.update({pkg: version or "not installed" for pkg, version in software_versions()})
    env.update(_gpu_environment())
    return env


def _gpu_environment() -> dict:
    try:
        nv = nvml_module()
        nv.nvmlInit()
    except Exception:  # no driver / no library: a CPU machine
        return {"gpu": "none visible", "gpu count": 0}
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        names = [_text(nv.nvmlDeviceGetName(h)) for h in handles]
        return {"gpu": names[0] if names else "none visible", "gpu count": len(handles),
                "gpu memory (MiB)": round(nv.nvmlDeviceGetMemoryInfo(handles[0]).total / MiB) if handles else None,
                "driver": _text(nv.nvmlSystemGetDriverVersion())}
    except Exception as exc:
        return {"gpu": f"NVML error: {exc}", "gpu count": 0}
    finally:
        nv.nvmlShutdown()


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
