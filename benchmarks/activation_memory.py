"""Activation memory per sample of llama-tiny on this CPU: measured against the estimate's formula
(zero_bench.estimate.activations) for recompute none / selective / full, sdpa vs unfused attention,
dropout 0 and 0.1.

    python benchmarks/activation_memory.py [micros=2,6] [dropout=0,0.1] [parts=process,trials] [model=llama-tiny]

Two instruments, each reporting the bytes one more sample adds (the slope between the two
micro-batches), fp32 (named: precision=auto is bf16 on a CPU with native bf16):
  process  one process (gloo, world 1, tp 1; no DeepSpeed), the instrument the formula is checked
           with: per micro-batch a warm-up step, then one step under torch.profiler's memory events
           with every allocation of the step in view (attention scratch buffer cleared, gradients kept
           allocated and zeroed so backward accumulates in place, as the estimate counts gradients
           apart). A sentinel allocation marks the end of the forward: "saved" = net bytes the
           forward left for backward, "peak" = the largest net allocation over forward + backward.
           Recompute goes through shims.cpu_checkpoint (selective and full).
  trials   real 2-rank trials (ZeRO-2, DP=2, children of one pool), as a search sees them: each
           rank's peak live tensor bytes of the profiled step and its peak RSS; full recompute goes
           through DeepSpeed's checkpoint. Beside them the formula's peak and the estimate's figure
           for RSS (the peak x CPU_ACTIVATION_FACTOR).
Run it alone on the machine (through /work/tools/serial where trials share it): ~4 minutes here.
The accuracy estimate/activations.py states from this benchmark is checked on every run (exit 1
past it): the process instrument's saved bytes within SAVED_WITHIN and its peak within PEAK_WITHIN,
the trials' live tensors within PEAK_WITHIN (their RSS is printed, no accuracy is stated for it).
"""
from __future__ import annotations

import dataclasses
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from zero_bench.config.schema import BenchConfig, HardwareConfig, Recompute, StepsConfig
from zero_bench.estimate import CPU_ACTIVATION_FACTOR, activation_bytes_per_sample
from zero_bench.models import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
SENTINEL = 7_777_777  # bytes; no tensor of the model has this size
SAVED_WITHIN = 0.1  # % (estimate/activations.py: "the saved bytes to 0.1 %")
PEAK_WITHIN = 5.1  # % ("the step's peak within 5.1 %")
MISSES: list[str] = []  # what of the stated accuracy a run broke


def check(what: str, formula: float, measured: float, within: float) -> None:
    e = 100 * (formula - measured) / measured
    if abs(e) > within:
        MISSES.append(f"{what}: {e:+.2f} %, stated within {within} %")


def preset(name: str = "llama-tiny") -> ModelConfig:
    """A conf/model preset (qwen3-tiny: qk-norm and head_dim apart from h / a)."""
    return ModelConfig(**yaml.safe_load((ROOT / f"conf/model/{name}.yaml").read_text()))


def variants(dropouts: list[float]):
    """(attention, dropout, recompute) in the table's order."""
    for dropout in dropouts:
        for attention in ("sdpa", "unfused"):
            for recompute in Recompute:
                yield attention, dropout, str(recompute)


def err(formula: float, measured: float) -> str:
    return f"{100 * (formula - measured) / measured:+6.1f}"


# -- one process ---------------------------------------------------------------------------------

def session() -> None:
    """megatron on a one-rank gloo group (a file store: trials may use ports), CPU shims, recompute
    through cpu_checkpoint."""
    from megatron.core import parallel_state, tensor_parallel

    from zero_bench.models.shims import cpu_checkpoint, install_cpu_shims

    store = Path(tempfile.mkdtemp(prefix="zb-act-")) / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    install_cpu_shims()
    tensor_parallel.checkpoint = cpu_checkpoint


def build(m: ModelConfig, recompute: str):
    from zero_bench.models.megatron import build_gpt, transformer_config
    from zero_bench.models.shims import seed_cpu_rng

    seed_cpu_rng(1234)  # every configuration starts from the same weights and streams
    cfg = BenchConfig(model=m, hardware=HardwareConfig(device="cpu"), precision="fp32", recompute=recompute)
    return build_gpt(cfg, transformer_config(cfg, on_cpu=True), on_cpu=True)


def step(gpt, m: ModelConfig, micro: int, n: int, sentinel: bool = False) -> float:
    g = torch.Generator().manual_seed(1000 + n)
    tok = torch.randint(0, m.vocab_size, (micro, m.seq_len + 1), generator=g)
    pos = torch.arange(m.seq_len).unsqueeze(0).expand(micro, -1)
    loss = gpt(tok[:, :-1].contiguous(), pos, None, labels=tok[:, 1:].contiguous()).float().mean()
    if sentinel:
        torch.empty(SENTINEL, dtype=torch.uint8)  # allocated and freed at once: marks the forward's end
    loss.backward()
    return loss.item()


def measure(gpt, m: ModelConfig, micro: int) -> dict:
    """{"saved", "peak", "loss"}: net bytes after the forward, and at the step's peak."""
    from megatron.core import parallel_state
    from torch.profiler import ProfilerActivity, profile

    step(gpt, m, micro, 0)  # warm-up: lazily built state (RoPE cache, masks) exists afterwards
    gpt.zero_grad(set_to_none=False)
    parallel_state.get_global_memory_buffer().buffer.clear()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = step(gpt, m, micro, 1, sentinel=True)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    saved = None
    for _, n in events:
        if abs(n) == SENTINEL:
            saved = cur if saved is None and n > 0 else saved
            continue
        cur += n
        peak = max(peak, cur)
    gpt.zero_grad(set_to_none=True)
    return {"saved": saved, "peak": peak, "loss": loss}


def process_table(base: ModelConfig, micros: tuple, dropouts: list[float]) -> None:
    session()
    print(f"\none process, fp32, micro {micros[0]} -> {micros[1]}; MiB per sample")
    print(f"{'attention':9} {'dropout':7} {'recompute':9} | {'saved':>7} {'formula':>7} {'err %':>6} | "
          f"{'peak':>7} {'formula':>7} {'err %':>6} | loss")
    for attention, dropout, recompute in variants(dropouts):
        m = dataclasses.replace(base, attention=attention, dropout=dropout)
        gpt = build(m, recompute)
        lo, hi = (measure(gpt, m, b) for b in micros)
        per = {k: (hi[k] - lo[k]) / (micros[1] - micros[0]) for k in ("saved", "peak")}
        f = activation_bytes_per_sample(m, 1, "fp32", recompute, device="cpu")
        print(f"{attention:9} {dropout:<7} {recompute:9} | {per['saved'] / MiB:7.2f} {f['saved'] / MiB:7.2f} "
              f"{err(f['saved'], per['saved'])} | {per['peak'] / MiB:7.2f} {f['total'] / MiB:7.2f} "
              f"{err(f['total'], per['peak'])} | {lo['loss']:.6f}", flush=True)
        label = f"process {m.name} {attention} dropout {dropout} {recompute}"
        check(f"{label} saved", f["saved"], per["saved"], SAVED_WITHIN)
        check(f"{label} peak", f["total"], per["peak"], PEAK_WITHIN)
        del gpt
        gc.collect()


# -- real 2-rank trials --------------------------------------------------------------------------

def slope(results, field: str, micros: tuple) -> float:
    lo, hi = (max(getattr(rank, field) for rank in r.ranks) for r in results)
    return (hi - lo) / (micros[1] - micros[0])


def trials_table(base: ModelConfig, micros: tuple, dropouts: list[float], tmp: Path) -> None:
    from zero_bench.trial.launch import LaunchOptions, run_launch
    from zero_bench.trial.pool import PoolSlot
    from zero_bench.records import Entry

    print(f"\n2-rank trials, ZeRO-2, DP=2, fp32, micro {micros[0]} -> {micros[1]}; MiB per sample")
    print(f"{'attention':9} {'dropout':7} {'recompute':9} | {'live':>7} {'formula':>7} {'err %':>6} | "
          f"{'RSS':>7} {'estimate':>8} {'err %':>6}")
    with PoolSlot(tmp / "pool") as pools:
        for attention, dropout, recompute in variants(dropouts):
            m = dataclasses.replace(base, attention=attention, dropout=dropout)
            cfg = BenchConfig(model=m, hardware=HardwareConfig(device="cpu"), precision="fp32", recompute=recompute,
                              steps=StepsConfig(probe=1))
            results = run_launch(cfg, [Entry(b) for b in micros], tmp / f"{attention}{dropout}{recompute}",
                                 LaunchOptions(pools=pools))
            assert all(r.status == "ok" for r in results), [r.reason for r in results]
            live, rss = slope(results, "peak_live_bytes", micros), slope(results, "peak_rss_bytes", micros)
            f = activation_bytes_per_sample(m, 1, "fp32", recompute, device="cpu")["total"]
            est = f * CPU_ACTIVATION_FACTOR
            print(f"{attention:9} {dropout:<7} {recompute:9} | {live / MiB:7.2f} {f / MiB:7.2f} {err(f, live)} | "
                  f"{rss / MiB:7.2f} {est / MiB:8.2f} {err(est, rss)}", flush=True)
            check(f"trials {m.name} {attention} dropout {dropout} {recompute} live", f, live, PEAK_WITHIN)


def main() -> int:
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    micros = tuple(int(x) for x in args.get("micros", "2,6").split(","))
    dropouts = [float(x) for x in args.get("dropout", "0,0.1").split(",")]
    parts = args.get("parts", "process,trials").split(",")
    base = preset(args.get("model", "llama-tiny"))
    print(f"{base.name}: L={base.num_layers} h={base.hidden_size} a={base.num_heads} g={base.query_groups} "
          f"f={base.ffn} s={base.seq_len} V={base.padded_vocab(1)} {base.activation} {base.normalization} "
          f"{base.position_embedding}, {'tied' if base.tie_embeddings else 'untied'}"
          f"{', head_dim %d' % base.head_dim if base.head_dim else ''}{', qk-norm' if base.qk_norm else ''}; "
          f"CPU_ACTIVATION_FACTOR {CPU_ACTIVATION_FACTOR}")
    t0 = time.time()
    if "trials" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            trials_table(base, micros, dropouts, Path(tmp))
    if "process" in parts:
        process_table(base, micros, dropouts)
    print(f"\n{time.time() - t0:.0f} s")
    for miss in MISSES:
        print("NOT AS STATED:", miss)
    return len(MISSES)


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
