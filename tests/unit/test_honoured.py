"""Keys the chosen engine, stage or device would not read (zero_bench/config/honoured.py and
engines/refusals.py ds_keys_read): refused in one line naming the key and what honours it, or named
in one warning line where ignoring them is harmless. Issue 43 item 3."""
from __future__ import annotations

import dataclasses

import pytest

from zero_bench.config import honoured
from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.schema import BenchConfig, ConfigError


def bench(*overrides: str) -> BenchConfig:
    return from_cfg(compose(["hardware=cpu", "precision=fp32", *overrides]), here=False)


def test_every_key_of_the_schema_is_classified_once():
    """A key the schema gains must say where it is read: everywhere, or under a condition."""
    keys = {k for k, _ in honoured.leaf_keys()}
    conditional = [c.key for c in honoured.CONDITIONS]
    assert len(set(conditional)) == len(conditional)
    assert not set(conditional) & honoured.EVERYWHERE
    assert keys == set(conditional) | honoured.EVERYWHERE, (keys ^ (set(conditional) | honoured.EVERYWHERE))


# Per condition: overrides that give the key a value, and overrides under which it is read.
EXAMPLES = {
    "recompute_layers": (["recompute_layers=2"], ["recompute=full"]),
    "recompute_offload": (["recompute_offload=true"], ["recompute=block"]),
    "model.rope_base": (["model.rope_base=500000"], ["model.position_embedding=rope"]),
    "model.moe_router_topk": (["model=llama-tiny", "model.moe_router_topk=1"], ["model=moe-tiny"]),
    "model.norm_topk_prob": (["model=llama-tiny", "model.norm_topk_prob=false"], ["model=moe-tiny"]),
    "model.moe_aux_loss_coeff": (["model=llama-tiny", "model.moe_aux_loss_coeff=0.01"], ["model=moe-tiny"]),
    "hardware.devices": (["hardware.devices='0,1'"], ["hardware.device=gpu", "precision=bf16"]),
    "hardware.launcher": (["hardware.launcher=openmpi"], ["hardware.hostfile=/dev/null"]),
    "hardware.cuda_module_loading": (["hardware.cuda_module_loading=eager"], ["hardware.device=gpu", "precision=bf16"]),
    "hardware.card": (["hardware.card=H100"], ["hardware.device=gpu", "precision=bf16"]),
    "fusions": (["fusions=false"], ["hardware.device=gpu", "precision=bf16"]),
    "offload": (["offload=true"], ["hardware.device=gpu", "precision=bf16"]),
    "zeropp.qgz": (["zero=3", "zeropp.qgz=true"], ["hardware.num_nodes=2"]),
    "nvme_path": (["nvme_path=/tmp"], ["zero=3", "offload_device=nvme"]),
    "parallel.sequence_parallel": (["parallel.sequence_parallel=false"], ["parallel=tp2"]),
    "parallel.pp_schedule": (["parallel.pp_schedule=gpipe"],
                             ["model=llama-tiny", "parallel.pp=2", "parallel.dp=1", "zero=1", "batch.grad_accum=2"]),
}


def test_every_condition_has_an_example():
    assert set(EXAMPLES) == {c.key for c in honoured.CONDITIONS}


@pytest.mark.parametrize("cond", honoured.CONDITIONS, ids=lambda c: c.key)
def test_a_key_nothing_reads_is_refused_or_warned_and_read_where_its_condition_holds(cond):
    given, holds = EXAMPLES[cond.key]
    if cond.harmless:
        lines = honoured.check(bench(*given))
        assert len(lines) == 1 and lines[0].startswith(f"{cond.key}=") and cond.by in lines[0], lines
    else:
        with pytest.raises(ConfigError) as e:
            bench(*given)
        msg = str(e.value)
        assert msg.startswith(f"{cond.key}=") and cond.by in msg and "\n" not in msg, msg
    assert honoured.check(bench(*given, *holds)) == []


def test_the_defaults_and_the_presets_ask_for_nothing_unread():
    for model in ("gpt-mini", "llama-tiny", "qwen3-0.6b", "moe-tiny", "llama3-8b"):
        assert honoured.check(bench(f"model={model}")) == [], model
    for hw in ("a100_40gb", "h100_80gb", "h200_141gb"):
        assert honoured.check(bench(f"hardware={hw}", "precision=bf16")) == [], hw


@pytest.mark.parametrize("override", ["+ds.zero_optimization.stage3_max_live_parameters=1000",
                                      "+ds.zero_optimization.max_live_parameters=1000",
                                      "+ds.zero_optimization.stage3_prefetch_bucket_size=1000",
                                      "+ds.zero_optimization.offload_param.device=cpu"])
def test_deepspeed_zero3_keys_below_stage_3_are_refused(override):
    key = override.split("=")[0].removeprefix("+")
    with pytest.raises(ConfigError, match=r"^ds\.zero_optimization\.\w+: DeepSpeed reads it at ZeRO stage 3 only \(got zero=2\)"):
        bench("zero=2", override)
    assert key.split(".")[2] in bench("zero=3", override).ds["zero_optimization"]


def test_deepspeed_keys_read_only_by_other_settings_are_refused():
    with pytest.raises(ConfigError, match=r"^ds\.zero_optimization\.offload_optimizer: .*zero=0"):
        bench("zero=0", "+ds.zero_optimization.offload_optimizer.device=cpu")
    with pytest.raises(ConfigError, match=r"^ds\.activation_checkpointing: read only with recompute=full"):
        bench("+ds.activation_checkpointing.partition_activations=true")
    bench("recompute=full", "+ds.activation_checkpointing.partition_activations=true")
    # FSDP2 reads no DeepSpeed key at all: refused as before, by its own refusal
    with pytest.raises(ConfigError, match=r"^ds: DeepSpeed settings; engine=fsdp2"):
        bench("engine=fsdp2", "zero=3", "+ds.zero_optimization.reduce_bucket_size=1000")


def test_a_refusal_is_one_line_from_the_cli_before_any_launch(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "zero_bench", "recompute_layers=2"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [x for x in out.stderr.splitlines() if "recompute_layers" in x]
    assert len(lines) == 1 and "read only with recompute=full" in lines[0], out.stderr[-2000:]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("rank0.jsonl"))
