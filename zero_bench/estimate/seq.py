"""The longest sequence the estimate predicts to fit at a micro-batch: `zero_bench estimate` prints
it beside the max batch, and it seeds `zero_bench maxseq` as `seed_micro` seeds maxbatch.

The same estimate at each sequence length: activations grow with s (every layer's inputs, the
MLP's intermediates, the logits) and, with attention=unfused, with s^2 (the a x s x s scores and
probabilities per layer, estimate/activations.py), so the peak is no straight line in s and the
boundary is found on the search's grid by bisection, one estimate per step (~12 at a 1M-token range
on a 256-token grid). The peak only grows with s, so bisection finds the largest fitting size.
"""
from __future__ import annotations

from typing import Optional

from zero_bench.config.schema import BenchConfig, Device, SearchConfig
from zero_bench.estimate import estimate
from zero_bench.models.description import PositionEmbedding
from zero_bench.records import Seed
from zero_bench.search.dimension import with_seq_len


def seq_top(bench: BenchConfig, grid: SearchConfig) -> int:
    """The longest size the grid allows this model: learned positions stop at their table
    (model.seq_len rows; maxseq refuses a range past it: search/dimension.check_positions)."""
    top = grid.max
    if bench.model.position_embedding == PositionEmbedding.learned:
        top = min(top, bench.model.seq_len)
    return grid.min + (top - grid.min) // grid.granularity * grid.granularity if top >= grid.min else top


def peak_at(bench: BenchConfig, seq_len: int, micro: int) -> tuple[int, Optional[int]]:
    """(predicted per-rank peak, capacity) at this sequence length and micro-batch."""
    e = estimate(with_seq_len(bench, seq_len))
    return e.peak_bytes(micro), e.capacity


def host_at(bench: BenchConfig, seq_len: int, micro: int) -> Optional[int]:
    """Host RAM one node needs at this sequence length, where it grows with the sequence: on GPU with
    recompute_offload (every checkpointed layer input of every rank of the node, plus the offloaded
    states). None elsewhere (on CPU the host is the device the capacity is about)."""
    if not bench.recompute_offload or bench.hardware.device == Device.cpu:
        return None
    return estimate(with_seq_len(bench, seq_len)).host_bytes(micro)


def longest_seq(bench: BenchConfig, micro: int, grid: SearchConfig) -> Optional[int]:
    """The largest size on `grid` (grid.min + k x granularity) predicted to fit the capacity at
    `micro`; 0: not even grid.min; None: no capacity known, or no estimate."""
    top = seq_top(bench, grid)
    if top < grid.min:
        return 0
    try:
        peak, cap = peak_at(bench, grid.min, micro)
        if cap is None:
            return None
        if peak > cap:
            return 0
        lo, hi = 0, (top - grid.min) // grid.granularity  # k = lo fits; find the largest k that does
        if peak_at(bench, top, micro)[0] <= cap:
            return top
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if peak_at(bench, grid.min + mid * grid.granularity, micro)[0] <= cap:
                lo = mid
            else:
                hi = mid
    except Exception:  # noqa: BLE001 - a prediction must never stop the estimate's other lines or a search
        return None
    return grid.min + lo * grid.granularity


def seed_seq(bench: BenchConfig, micro: int, grid: SearchConfig) -> Optional[Seed]:
    """maxseq's first guess: the predicted longest sequence, and the bytes one more token adds to the
    predicted peak there (over one granularity step: the slope where the search will look).
    None when the estimate cannot say or predicts nothing fits (the search starts from its minimum)."""
    s = longest_seq(bench, micro, grid)
    if not s:
        return None
    try:
        g = grid.granularity
        slope = (peak_at(bench, s + g, micro)[0] - peak_at(bench, s, micro)[0]) / g
    except Exception:  # noqa: BLE001
        return Seed(s)
    return Seed(s, max(1, int(slope)))
