"""hardware.memory_gb is GiB: typed as a card's marketed size it emulates a card that does not exist,
and the user is told which preset has the real total."""
from __future__ import annotations

import subprocess
import sys

from zero_bench.devices.capacity import marketed_gb_warning, preset_totals


def test_presets_carry_the_cards_real_totals():
    assert preset_totals() == {"a100_40gb": 40537, "a100_80gb": 81920, "h100_80gb": 81559, "h200_141gb": 143771}


def test_a_marketed_size_names_the_presets_and_their_totals():
    line = marketed_gb_warning("gpu", 40)
    assert line == ("hardware.memory_gb=40 is 40960 MiB (GiB), not what a 40GB card shows in nvidia-smi: "
                    "hardware=a100_40gb (40537 MiB), or hardware.memory_mib=<its total>, emulates the card")
    eighty = marketed_gb_warning("gpu", 80)  # A100 80GB shows exactly 80 GiB, the H100 less: still said
    assert "hardware=a100_80gb (81920 MiB) or hardware=h100_80gb (81559 MiB)" in eighty


def test_no_line_for_other_sizes_or_on_cpu():
    assert marketed_gb_warning("gpu", 24) is None  # no preset of that size
    assert marketed_gb_warning("cpu", 40) is None  # on CPU memory_gb is a budget, meant in GiB
    assert marketed_gb_warning("gpu", None) is None


def test_estimate_says_it_once_on_stderr(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zero_bench", "estimate", "model=gpt-tiny", "hardware=gpu",
                        "hardware.memory_gb=40", f"hydra.run.dir={tmp_path}"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "memory_gb=40" in x]
    assert len(lines) == 1 and lines[0].startswith("zero_bench: warning: hardware.memory_gb=40 is 40960 MiB")
