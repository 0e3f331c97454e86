"""benchmarks/recompute_memory.py launches the precision its formula is read at. It once left
precision at auto, which became bf16 on CPUs with native bf16 (4bcb62b), while it asked the formula
for fp32: on this machine (avx512_bf16) the trials ran bf16 and the fp32 formula missed them by 21-84 %
(docs/verified.md states fp32). No trial runs here: run_launch is stopped at its call."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zero_bench.config import configure
from zero_bench.config.schema import Precision, Recompute
from zero_bench.devices import cpu_features
from zero_bench.estimate import activation_bytes_per_sample

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import recompute_memory  # noqa: E402

ZEN4 = frozenset({"sse4_2", "avx", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"})  # this machine's kind
MiB = 2**20


class Launched(Exception):
    """run_launch was reached: the config it was given rides on the exception."""


@pytest.fixture
def launches(monkeypatch, tmp_path):
    """A CPU with native bf16 (where auto means bf16); recompute_table stopped at its first launch.
    Returns the call that gives the config it launched, resolved as run_launch resolves it."""
    native = cpu_features.assess("x86_64", ZEN4, "AVX512", {})
    monkeypatch.setattr(cpu_features, "detect", lambda: native)

    def stop(cfg, plan, run_dir, opts=None):
        raise Launched(cfg)

    monkeypatch.setattr(recompute_memory, "run_launch", stop)

    def launched(*args):
        with pytest.raises(Launched) as e:
            recompute_memory.recompute_table((2, 6), tmp_path, *args)
        return configure.resolve(e.value.args[0], here=False)
    return launched


def test_the_trials_run_fp32_as_stated_on_a_cpu_where_auto_is_bf16(launches):
    assert launches().precision == Precision.fp32
    assert launches("bf16").precision == Precision.bf16


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", list(Recompute))
def test_the_formula_is_read_at_the_launched_configs_precision(mode, precision):
    cfg = recompute_memory.mode_config(mode, precision)
    assert cfg.precision == precision and cfg.recompute == mode
    want = activation_bytes_per_sample(recompute_memory.LAYERED, 1, precision, mode, device="cpu")["total"]
    assert recompute_memory.formula_bytes(cfg) == want


def test_the_fp32_and_bf16_formulas_differ_by_what_the_old_run_missed():
    """The figures in the report of 2026-11-28: fp32 26.78 / 20.16 / 6.63 MiB, bf16 22.16 / 11.09 /
    4.32 (the trials that ran bf16 measured 22.15 / 10.96 / 4.38)."""
    got = {(p, m): recompute_memory.formula_bytes(recompute_memory.mode_config(m, p)) / MiB
           for p in ("fp32", "bf16") for m in ("none", "selective", "full")}
    assert [round(got["fp32", m], 2) for m in ("none", "selective", "full")] == [26.78, 20.16, 6.63]
    assert [round(got["bf16", m], 2) for m in ("none", "selective", "full")] == [22.16, 11.09, 4.32]


def test_an_unknown_precision_is_refused_before_any_launch(monkeypatch, capsys):
    monkeypatch.setattr(recompute_memory, "run_launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(sys, "argv", ["recompute_memory.py", "precision=fp16"])
    assert recompute_memory.main() == 2
    assert capsys.readouterr().err.strip() == "precision=fp16: allowed fp32, bf16"
