"""What NVMe offload (offload_device=nvme) needs of this machine: DeepSpeed's async_io op (libaio),
and a swap folder that exists, is writable, takes O_DIRECT (DeepSpeed opens every swap file with
it: csrc/aio/common/deepspeed_aio_common.cpp open_file) and has room for the states. Each problem is
one line; `zero_bench doctor` and the pre-flight ask here, and tests that need the op skip with it.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from zero_bench.devices.toolkit import jit_cached


def libaio_fix() -> str:
    """The one command that installs libaio's headers here (the OS's package manager)."""
    if shutil.which("apt-get"):
        return "apt-get install -y libaio-dev"
    if shutil.which("dnf") or shutil.which("yum"):
        return f"{'dnf' if shutil.which('dnf') else 'yum'} install -y libaio-devel"
    if shutil.which("pacman"):
        return "pacman -S --noconfirm libaio"
    return "install libaio's development package (libaio.h and libaio.so) with the OS's package manager"


@functools.lru_cache(maxsize=1)
def async_io_problem() -> Optional[str]:
    """None where DeepSpeed's async_io op is built or can be built here, else one line with the fix."""
    if jit_cached("async_io"):
        return None
    import io
    import logging
    from contextlib import redirect_stdout

    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    logging.disable(logging.INFO)
    try:
        with redirect_stdout(io.StringIO()):  # the probe compiles a test program and logs each line
            from deepspeed.accelerator import get_accelerator

            ok = get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, a DeepSpeed without the op: one line
        return f"DeepSpeed's async_io op cannot be probed here ({type(exc).__name__}); `zero_bench doctor` says more"
    finally:
        logging.disable(logging.NOTSET)
    if ok:
        return None
    return f"DeepSpeed's async_io op (NVMe offload) cannot be built: libaio's headers are missing; fix: {libaio_fix()}"


def existing_parent(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (a default swap folder is made at launch)."""
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def folder_problem(path: Path, must_exist: bool) -> Optional[str]:
    """Why DeepSpeed could not swap into `path` (None: it can): missing, not a folder, not writable,
    or on a filesystem that refuses O_DIRECT (tmpfs, some overlay and network filesystems)."""
    if must_exist and not path.exists():
        return "does not exist"
    where = path if path.exists() else existing_parent(path)
    if not where.is_dir():
        return "is not a folder"
    if not os.access(where, os.W_OK | os.X_OK):
        return "is not writable"
    try:
        fd, probe = tempfile.mkstemp(dir=where, prefix=".zb-odirect-")
    except OSError as exc:
        return f"cannot hold a file ({exc.strerror})"
    os.close(fd)
    try:
        open_direct(probe)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return "is on a filesystem without O_DIRECT, which DeepSpeed's swapper opens its files with (tmpfs?)"
        return f"refuses O_DIRECT ({exc.strerror})"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return None


def open_direct(path: str) -> None:
    """Open `path` for writing with O_DIRECT, as DeepSpeed's swapper does (tmpfs refused it before
    Linux 6.6; some overlay and network filesystems still do)."""
    os.close(os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0)))


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing_parent(path)).free
