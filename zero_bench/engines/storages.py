"""Bytes of tensors as memory holds them: per storage, each storage once. The one way the engines
count their model states and the worker counts the live tensors: a view or a tied weight is counted
once, and a shard's padding is counted (it is allocated)."""
from __future__ import annotations

from typing import Iterable, Optional

import torch


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> dict[int, int]:
    """{storage address: bytes} of the tensors (None and empty ones skipped). Tensors without a
    real storage (meta, fake) are left out."""
    out = {}
    for t in tensors:
        try:
            if t is None or not t.numel():
                continue
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # meta / fake tensors: no storage to count
            continue
    out.pop(0, None)  # no allocation behind it
    return out
