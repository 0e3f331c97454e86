"""What an allocation failure looks like: one list of patterns for exceptions (in the rank) and for
logs (in the runner), so "does not fit" is recognised the same way on both sides."""
from __future__ import annotations

import re
from typing import Optional

# Messages of allocation failures: torch's CPU allocator ("can't allocate memory") and glibc
# ("cannot allocate memory"), CUDA's errors raised as plain RuntimeErrors (a kernel launch, an
# extension), cuBLAS/cuDNN/cuSOLVER/cuFFT workspaces, the driver's CUDA_ERROR_OUT_OF_MEMORY, the
# runtime's cudaErrorMemoryAllocation, NCCL's own failures (include/alloc.h: "Failed to CUDA calloc
# %ld bytes"; CUDA's error 2 as NCCL prints it: "Cuda failure 2 ..."), and the exception class
# names as a traceback in a log shows them.
ALLOCATION_FAILURE = re.compile(
    r"out of memory|can't allocate memory|cannot allocate memory|cudaErrorMemoryAllocation|"
    r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUSOLVER_STATUS_ALLOC_FAILED|CUFFT_ALLOC_FAILED|"
    r"ERROR_OUT_OF_MEMORY|Failed to CUDA (?:calloc|malloc|host alloc)|Cuda failure 2 |"
    r"OutOfMemoryError|MemoryError", re.I)
# cublasCreate allocates its handle's memory with cudaMalloc, outside torch's cache; on a full card
# that fails and cuBLAS answers NOT_INITIALIZED (torch: "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED
# when calling `cublasCreate(handle)`"). The same status has other causes (a broken install, a
# context lost earlier), so it counts as an allocation failure only on a device that is near full.
ALLOCATION_FAILURE_IF_FULL = re.compile(r"CUBLAS_STATUS_NOT_INITIALIZED", re.I)
# DeepSpeed's launcher reporting a rank the kernel killed (SIGKILL, as the OOM killer sends).
KILLED = re.compile(r"return code = -9\b")


def is_oom(exc: Optional[BaseException], near_full: bool = False) -> bool:
    """An allocation failure (the batch does not fit), not a bug: the exception, its message, or any
    exception it was raised from (DeepSpeed and NCCL wrap the original in RuntimeErrors).
    `near_full`: the device was close to full as it failed (see ALLOCATION_FAILURE_IF_FULL)."""
    try:
        import torch

        oom_types: tuple = (MemoryError, torch.cuda.OutOfMemoryError)
    except ImportError:
        oom_types = (MemoryError,)
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, oom_types) or ALLOCATION_FAILURE.search(str(exc)):
            return True
        if near_full and ALLOCATION_FAILURE_IF_FULL.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def oom_in_log(text: str) -> Optional[str]:
    """The first sign of an allocation failure or a killed rank in a log tail, if any."""
    m = ALLOCATION_FAILURE.search(text) or KILLED.search(text)
    return m.group(0) if m else None
