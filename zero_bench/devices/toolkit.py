"""The CUDA toolkit DeepSpeed JIT-builds its GPU ops with, and what a run uses when it cannot.

A GPU trial's AdamW is DeepSpeed's FusedAdam, JIT-built with nvcc before the first trial
(doctor.prebuild_ops). DeepSpeed cannot tell beforehand whether that will work: FusedAdamBuilder's
is_compatible is OpBuilder's `return True`, and its JIT path (builder.jit_load) never calls
assert_no_cuda_mismatch. So this module asks the same questions itself: is there an nvcc
(builder.installed_cuda_version: CUDA_HOME, `nvcc -V`), and is its major version torch's
(torch's own policy, cpp_extension._check_cuda_version: a different major is an error, a
different minor a warning)? Where FusedAdam is neither prebuilt, JIT-cached nor buildable, runs
use torch's fused AdamW, compiled into torch (DeepSpeed's engine: optimizer.params torch_adam=true
returns torch.optim.AdamW and passes fused=true on to it).
"""
from __future__ import annotations

import functools
import glob
import os
import sys
from dataclasses import dataclass
from typing import Optional

# What ds_config merges where FusedAdam cannot be had (see fused_adam_fallback).
TORCH_FUSED_ADAMW = {"optimizer": {"params": {"torch_adam": True, "fused": True}}}


def extensions_dir() -> str:
    """Where DeepSpeed JIT-builds its ops: one cache per virtualenv unless the user chose one.
    A cache shared by two venvs rebuilds on every switch and can be left locked by a killed build."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")


def jit_cached(op: str) -> Optional[str]:
    """Path of a JIT-built op in the torch extensions cache, if one was built."""
    root = extensions_dir()
    hits = glob.glob(os.path.join(root, "*", op, "*.so")) + glob.glob(os.path.join(root, op, "*.so"))
    return hits[0] if hits else None


@dataclass
class Toolkit:
    """nvcc against torch's CUDA: `problem` is why ops cannot be built (None: they can)."""
    nvcc: Optional[str]  # "12.4", None without one
    torch_cuda: Optional[str]  # torch.version.cuda, None for a CPU build
    problem: Optional[str] = None
    note: str = ""

    def line(self) -> str:
        text = f"nvcc {self.nvcc or 'missing'}, torch built with CUDA {self.torch_cuda or '- (CPU build)'}"
        return "; ".join(x for x in (text, self.problem, self.note) if x)


def cuda_toolkit() -> Toolkit:
    """What DeepSpeed's op builder will find, compared with the CUDA torch was built for."""
    import torch
    from deepspeed.ops.op_builder.builder import installed_cuda_version

    torch_cuda = torch.version.cuda
    try:
        major, minor = installed_cuda_version()
    except Exception as exc:  # noqa: BLE001 - MissingCUDAException (no CUDA_HOME / nvcc), a broken nvcc
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        return Toolkit(None, torch_cuda, f"no usable nvcc ({why})")
    nvcc = f"{major}.{minor}"
    if torch_cuda is None:
        return Toolkit(nvcc, None, "torch is a CPU build: no CUDA op can be built against it")
    t_major, _, t_minor = torch_cuda.partition(".")
    if int(t_major) != major:
        return Toolkit(nvcc, torch_cuda, f"nvcc {nvcc} and torch's CUDA {torch_cuda} differ in the major "
                       "version: ops built with it do not load into torch")
    note = "" if t_minor.split(".")[0] == str(minor) else "minor versions differ (torch accepts that, with a warning)"
    return Toolkit(nvcc, torch_cuda, None, note)


@functools.lru_cache(maxsize=1)
def fused_adam_fallback() -> Optional[str]:
    """None where a GPU run can use DeepSpeed's FusedAdam (prebuilt, JIT-cached, or buildable here);
    otherwise why not, and runs use torch's fused AdamW (TORCH_FUSED_ADAMW) instead."""
    try:
        from deepspeed.git_version_info import installed_ops
    except Exception:  # noqa: BLE001 - no DeepSpeed: nothing would run anyway
        return None
    if installed_ops.get("fused_adam") or jit_cached("fused_adam"):
        return None
    return cuda_toolkit().problem
