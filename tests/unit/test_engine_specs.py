"""An engine is one plug-in (issue 34): a light EngineSpec per engine in zero_bench/engines/specs.py,
and nothing outside zero_bench/engines/ branching on an engine's name."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from zero_bench.config.schema import DEFAULT_ENGINE, EngineName
from zero_bench.engines.specs import SPECS, load, spec

PACKAGE = Path(__file__).resolve().parents[2] / "zero_bench"
# An engine's name compared (==, !=, in) or named as an enum member: what only the specs may do.
NAME = r"""(EngineName\.(deepspeed|fsdp2)|["'](deepspeed|fsdp2)["'])"""
BRANCH = re.compile(rf"(==|!=|\bin\b)\s*[([{{]?\s*{NAME}|{NAME}\s*(==|!=)|EngineName\.(deepspeed|fsdp2)")
ALLOWED = {  # (file, the line stripped): the enum and the default's one declaration
    ("config/choices.py", 'deepspeed = "deepspeed"  # DeepSpeed ZeRO 0-3 (deepspeed.initialize)'),
    ("config/choices.py", 'fsdp2 = "fsdp2"  # PyTorch FSDP2 (torch.distributed.fsdp.fully_shard), ZeRO 2/3 semantics'),
    ("config/choices.py", "DEFAULT_ENGINE = EngineName.deepspeed"),
}


def test_registry_has_every_engine():
    assert list(SPECS) == [e.value for e in EngineName] == ["deepspeed", "fsdp2"]
    assert spec(EngineName.fsdp2) is SPECS["fsdp2"] and spec(DEFAULT_ENGINE).tag == ""
    for s in SPECS.values():
        assert s.name == spec(s.name).name


@pytest.mark.parametrize("field", ["predict", "stored_states"])
def test_light_paths_resolve(field):
    """What a spec names of the estimate loads without a rank."""
    for s in SPECS.values():
        assert callable(load(getattr(s, field)))


def test_rank_side_resolves():
    """Every registered trainer and process-group function imports (base.py imports them all)."""
    from zero_bench.engines.base import TRAINERS

    assert list(TRAINERS) == list(SPECS)
    assert all(callable(load(s.init_distributed)) for s in SPECS.values())


def test_specs_import_no_torch():
    """The runner imports the specs: no torch, deepspeed or megatron at import time."""
    code = ("import sys, zero_bench.engines.specs, zero_bench.config.schema; "
            "print(sorted(m for m in ('torch', 'deepspeed', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_engine_name_branches_outside_engines():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "engines":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if BRANCH.search(line) and (str(rel), line.strip()) not in ALLOWED:
                found.append(f"zero_bench/{rel}:{n}: {line.strip()}")
    assert not found, "ask zero_bench.engines.specs.spec(engine) instead:\n" + "\n".join(found)


def test_the_check_sees_a_branch():
    assert BRANCH.search('if b.engine == EngineName.fsdp2:') and BRANCH.search('x = "deepspeed" != e')
    assert BRANCH.search("e in ('fsdp2',)") and not BRANCH.search('for pkg in ("torch", "deepspeed"):')
