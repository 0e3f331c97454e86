"""What activation recompute buys on this machine, and what torch.compile costs.

    python benchmarks/recompute_memory.py [micros=2,6] [compile=true] [precision=fp32]

Recompute: one fresh 2-rank launch per mode (none / selective / full) of a model whose layers
dominate its activations (8 layers, h 128, s 256, V 1024, fp32, ZeRO-2), probing two micro-batches;
prints the live tensor bytes and RSS one more sample adds (the slope between the two sizes),
the formula's bytes per sample (zero_bench.estimate.activation_bytes_per_sample) and each mode
relative to none. Compile: gpt-tiny at micro 2, eager and compiled, each a fresh launch: time/it
and compile time (the warm-up beyond steady steps; inductor's cache in /tmp makes a second run
faster, so the first run on a machine is the one to quote). Run it alone on the machine.
The accuracy docs/verified.md states from it (the formula within WITHIN of the live tensors per
sample for none, selective and full, fp32) is checked on every run: exit 1 past it.
The precision is named, never precision=auto: auto became bf16 on CPUs with native bf16 (4bcb62b,
this machine's avx512_bf16), so the trials ran bf16 while the formula was asked for fp32 (22.15 /
10.96 / 4.38 MiB measured against fp32's 26.78 / 20.16 / 6.63). The formula is read at the
precision of the config that was launched, so the two cannot part again.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import yaml

from zero_bench.config.configure import resolve
from zero_bench.config.schema import Precision, Recompute, BenchConfig, HardwareConfig, ModelConfig, StepsConfig
from zero_bench.estimate import activation_bytes_per_sample
from zero_bench.records import Entry
from zero_bench.trial.launch import run_launch

# % of the measured live tensors per sample, per STATED mode. full: its measured slope is not one
# figure: 22 fp32 launches of this tree on 2026-11-28 gave 6.76 MiB (16) or 6.49-6.52 (6; the
# 2026-11-22 commit gave 6.76 too), because the micro-2 probe's peak on one rank is now and then
# 1.1 or 1.8 MiB higher (cause not found; a gc.collect() before the probe's gc walk did not stop
# it); the formula's 6.63 is -1.9 % / +2.2 % of the two, so 2 % held on some launches only.
WITHIN = {"none": 2.0, "selective": 2.0, "full": 2.5}
STATED = tuple(WITHIN)
PRECISIONS = ("fp32", "bf16")  # what the CPU runs; fp32 is the one docs/verified.md states

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
LAYERED = ModelConfig(name="GPT-layers", num_layers=8, hidden_size=128, num_heads=4, seq_len=256, vocab_size=1024,
                      pad_vocab_to=128)


def slope(results, field: str, micros: tuple) -> float:
    lo, hi = (max(getattr(rank, field) for rank in r.ranks) for r in results)
    return (hi - lo) / (micros[1] - micros[0])


def mode_config(mode: Recompute, precision: str = "fp32") -> BenchConfig:
    """The launched config of one mode, resolved: its precision is the one asked, never auto."""
    return resolve(BenchConfig(model=LAYERED, hardware=HardwareConfig(device="cpu"), precision=Precision(precision),
                               recompute=mode, steps=StepsConfig(probe=1)), here=False)


def formula_bytes(cfg: BenchConfig) -> int:
    """The formula's bytes per sample for the config that ran (its model, precision and recompute)."""
    return activation_bytes_per_sample(cfg.model, cfg.parallel.tp, cfg.precision, cfg.recompute,
                                       device=cfg.hardware.device, recompute_layers=cfg.recompute_layers)["total"]


def recompute_table(micros: tuple, tmp: Path, precision: str = "fp32") -> list[str]:
    """The table; what of the stated accuracy it broke."""
    missed = []
    print(f"precision {precision}")
    print(f"{'recompute':10} {'live MiB/sample':>16} {'formula MiB/sample':>19} {'RSS MiB/sample':>15} {'vs none':>8}")
    base = None
    for mode in Recompute:
        cfg = mode_config(mode, precision)
        results = run_launch(cfg, [Entry(m) for m in micros], tmp / mode)
        assert all(r.status == "ok" for r in results), [r.reason for r in results]
        live, rss = slope(results, "peak_live_bytes", micros), slope(results, "peak_rss_bytes", micros)
        formula = formula_bytes(cfg)
        base = base or live
        print(f"{mode:10} {live / MiB:16.2f} {formula / MiB:19.2f} {rss / MiB:15.2f} {live / base:8.2f}")
        e = 100 * (formula - live) / live
        if str(mode) in STATED and abs(e) > WITHIN[mode]:
            missed.append(f"recompute={mode}: formula {e:+.1f} % of the live tensors per sample, "
                          f"stated within {WITHIN[mode]} %")
    return missed


def compile_table(tmp: Path) -> None:
    model = ModelConfig(**yaml.safe_load((ROOT / "conf/model/gpt-tiny.yaml").read_text()))
    for compiled in (False, True):
        cfg = BenchConfig(model=model, hardware=HardwareConfig(device="cpu"), precision=Precision.fp32,
                          compile=compiled, steps=StepsConfig(warmup=2, timed=5)).with_micro(2)
        (r,) = run_launch(cfg, [Entry(2, "measure")], tmp / f"compile{compiled}")
        assert r.status == "ok", r.reason
        extra = f", compile time {r.compile_s:.1f} s" if compiled else ""
        print(f"gpt-tiny micro 2 {'compiled' if compiled else 'eager':8}: time/it {r.time_per_step_s * 1e3:.1f} ms"
              f", launch {r.duration_s:.1f} s{extra}")


def main() -> int:
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    micros = tuple(int(x) for x in args.get("micros", "2,6").split(","))
    precision = args.get("precision", "fp32")
    if precision not in PRECISIONS:
        print(f"precision={precision}: allowed {', '.join(PRECISIONS)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        missed = recompute_table(micros, Path(tmp), precision)
        if args.get("compile", "true") == "true":
            compile_table(Path(tmp))
    for m in missed:
        print("NOT AS STATED:", m)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
