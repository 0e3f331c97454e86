"""The last layer's attention backward, measured on CPU against the estimate's moment for it
(estimate/activations.py `attention_backward`), with full recompute: what a layer's backward holds
when almost nothing else is kept (the ALST rows of docs/long-context.md whose peak it is).

    python benchmarks/attention_backward.py [seq=2048] [layers=2]    # exit 1 when not within WITHIN

One process, no engine: megatron's GPTModel (llama-tiny's layer: GQA 8/2 heads, SwiGLU, RMSNorm,
RoPE, sdpa; fp32, micro 1) on a one-rank gloo group, recompute=full through torch's checkpoint
(shims.cpu_checkpoint, as CPU trials run it). A dispatch mode notes every storage an op creates and
frees it when the storage is collected (weak references), so it counts the tensors alive at each op,
not the allocator: the moment read is right after the first flash-attention backward op of the step
(the last layer's), the parameters and their gradients left out (the estimate counts them apart).
A second figure: the same step with torch's reentrant checkpoint (DeepSpeed's and megatron's own
CheckpointFunction are reentrant), whose backward holds the recomputed layer's output while it runs
the layer's backward: the step's peak against the non-reentrant one.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from activation_memory import build, preset, session  # noqa: E402

from zero_bench.estimate import activation_bytes_per_sample  # noqa: E402

MiB = 2**20
WITHIN = 0.5
"""% of the measured moment less RoPE's tables: the estimate's attention_backward may be at most this
far off. RoPE's cos and sin are not counted (megatron's apply_rotary_pos_emb makes them for Q and for
K in every call and the products keep them: 4 x head_dim fp32 per token, `rope_tables`); everything
else the moment holds is."""


def rope_tables(m) -> int:
    """Bytes per token of the cos and sin tables the rotations of Q and K keep (fp32 here)."""
    return 4 * m.kv_channels * 4 if m.position_embedding == "rope" else 0


class Live(TorchDispatchMode):
    """Bytes of the storages ops created that are still alive; a snapshot after the first op whose
    name holds `mark`, and at the peak."""

    def __init__(self, known: set, mark: str = "flash_attention_for_cpu_backward"):
        super().__init__()
        self.live, self.known, self.mark = {}, known, mark
        self.cur = self.peak = 0
        self.at_mark = None

    def _free(self, key: int, n: int) -> None:
        self.live.pop(key, None)
        self.cur -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, n = st.data_ptr(), st.nbytes()
            if n == 0 or key in self.live or key in self.known:
                continue
            self.live[key] = (func.__name__, n, tuple(t.shape))
            self.cur += n
            weakref.finalize(st, self._free, key, n)
            self.peak = max(self.peak, self.cur)
        if self.at_mark is None and self.mark in func.__name__:
            self.at_mark = (self.cur, dict(self.live))
        return out


def step(gpt, m, track=None) -> None:
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, m.vocab_size, (1, m.seq_len + 1), generator=g)
    pos = torch.arange(m.seq_len).unsqueeze(0)
    with track if track is not None else contextlib.nullcontext():
        loss = gpt(tok[:, :-1].contiguous(), pos, None, labels=tok[:, 1:].contiguous()).float().mean()
        loss.backward()


def measure(m, reentrant: bool = False) -> Live:
    """One warm-up step, then the tracked one (gradients kept allocated: accumulated in place)."""
    from megatron.core import parallel_state, tensor_parallel
    from torch.utils.checkpoint import checkpoint

    from zero_bench.models.shims import cpu_checkpoint

    tensor_parallel.checkpoint = ((lambda fn, distribute, *a: checkpoint(fn, *a, use_reentrant=True))
                                  if reentrant else cpu_checkpoint)
    gpt = build(m, "full")
    step(gpt, m)
    gpt.zero_grad(set_to_none=False)
    parallel_state.get_global_memory_buffer().buffer.clear()
    gc.collect()
    known = {x.untyped_storage().data_ptr() for p in gpt.parameters() for x in (p, p.grad) if x is not None}
    track = Live(known)
    step(gpt, m, track)
    return track


def main(argv: list[str]) -> int:
    args = dict(a.split("=", 1) for a in argv)
    m = dataclasses.replace(preset("llama-tiny"), seq_len=int(args.get("seq", 2048)),
                            num_layers=int(args.get("layers", 2)))
    session()
    t = measure(m)
    f = activation_bytes_per_sample(m, 1, "fp32", "full", device="cpu")
    measured, formula = t.at_mark[0], f["attention_backward"]
    counted = measured - rope_tables(m) * m.seq_len
    err = 100 * (formula - counted) / counted
    print(f"llama-tiny layer, {m.num_layers} layers, seq {m.seq_len}, fp32, recompute=full, CPU: the last layer's "
          f"attention backward holds {measured / MiB:.2f} MiB ({measured / m.seq_len:.0f} B/token); the estimate's "
          f"attention_backward {formula / MiB:.2f} MiB, {err:+.2f} % of the {counted / MiB:.2f} MiB besides RoPE's "
          f"tables (stated within {WITHIN} %)")
    by_op = collections.Counter()
    for op, n, shape in t.at_mark[1].values():
        by_op[(op, shape)] += n
    for (op, shape), n in by_op.most_common():
        print(f"  {n / m.seq_len:8.0f} B/token  {op} {list(shape)}")
    peak_plain = t.peak
    del t
    gc.collect()
    peak_reentrant = measure(m, reentrant=True).peak
    h_bytes = 4 * m.hidden_size
    print(f"step peak (activations): non-reentrant checkpoint {peak_plain / MiB:.2f} MiB, reentrant "
          f"{peak_reentrant / MiB:.2f} MiB: +{(peak_reentrant - peak_plain) / m.seq_len / h_bytes:.2f} x B*h per token")
    return 0 if abs(err) <= WITHIN else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
