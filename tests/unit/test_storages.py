"""Bytes per storage, each once: how both engines count their model states and the worker its live
tensors (engines/storages.py)."""
import torch

from zero_bench.engines.storages import storage_bytes


def test_each_storage_counts_once_whole():
    w = torch.zeros(4, 8)  # 128 bytes
    tied = torch.nn.Parameter(w)  # the same storage (tied embeddings)
    view = w[1:3]  # a view counts its whole storage, once
    other = torch.zeros(3, dtype=torch.bfloat16)  # 6 bytes
    got = storage_bytes([w, tied, view, None, torch.empty(0), other])
    assert sorted(got.values()) == [6, 128]


def test_tensors_without_storage_are_left_out():
    got = storage_bytes([torch.empty(5, device="meta"), torch.zeros(2)])
    assert list(got.values()) == [8]
