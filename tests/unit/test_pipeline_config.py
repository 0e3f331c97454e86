"""Bad input under a pipeline (parallel.pp > 1, issue 53): one line naming the key and what is allowed,
before any launch (exit 2 from the command line); what trials have compared with pp = 1 composes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.schema import BenchConfig, ConfigError

PP2 = ["hardware=cpu", "precision=fp32", "model=llama-tiny", "parallel.pp=2", "parallel.dp=1", "batch.grad_accum=2"]


def bench(*overrides: str) -> BenchConfig:
    return from_cfg(compose([*PP2, *overrides]), here=False)


@pytest.mark.parametrize("overrides,starts", [
    # the schedule's keys and its micro-batches
    (["parallel.vpp=2"], "parallel.vpp=2: virtual stages run with parallel.pp_schedule=interleaved_1f1b"),
    (["parallel.pp_schedule=interleaved_1f1b"], "parallel.pp_schedule=interleaved_1f1b: needs parallel.vpp >= 2"),
    (["batch.grad_accum=1"], "batch.grad_accum=1: the micro-batches of a pipeline step; parallel.pp_schedule=1f1b needs at least parallel.pp=2"),
    (["parallel.pp_schedule=interleaved_1f1b", "parallel.vpp=2", "batch.grad_accum=3"],
     "batch.grad_accum=3: parallel.pp_schedule=interleaved_1f1b needs a multiple of parallel.pp=2"),
    (["parallel.pp=3"], "parallel.pp=3: pp x vpp = 3 must divide model.num_layers=4"),
    # DeepSpeed trains ZeRO 0-1 under a pipeline
    (["zero=2"], "zero=2: under a pipeline (parallel.pp=2) DeepSpeed trains ZeRO 0-1"),
    (["zero=3"], "zero=3: under a pipeline (parallel.pp=2) DeepSpeed trains ZeRO 0-1"),
    # dimensions no trial has compared under a pipeline
    (["model=gpt-tiny"], "model.tie_embeddings=true: megatron keeps the word embedding on the first and the last"),
    (["model=moe-tiny"], "model.num_experts=8: a mixture of experts is not compared under a pipeline"),
    (["model.attention=unfused"], "model.attention=unfused: only sdpa attention is compared"),
    (["parallel.dp=2", "parallel.sp=2"], "parallel.sp=2: Ulysses is not compared under a pipeline"),
    (["engine=fsdp2", "zero=3", "parallel.dp=2", "parallel.dp_shard=1"],
     "parallel.dp_shard=1: hybrid sharding is not compared under a pipeline"),
    (["hardware=h100_80gb", "precision=fp16"], "precision=fp16: fp16's loss scaling is not compared"),
    (["precision=bf16", "states=bf16"], "states=bf16: pure bf16 states are not compared under a pipeline"),
    (["offload=true", "zero=1"], "offload=true: offload is not compared under a pipeline"),
    (["recompute=full"], "recompute=full: recompute is not compared under a pipeline"),
    (["recompute=op", "engine=fsdp2", "zero=3"], "recompute=op: recompute is not compared"),
    (["compile=true"], "compile=true: torch.compile is not compared under a pipeline"),
    (["loss=chunked"], "loss=chunked: only megatron's loss is compared under a pipeline"),
    (["tiled_mlp=4"], "tiled_mlp=4: the tiled MLP is not compared under a pipeline"),
])
def test_refused_in_one_line(overrides, starts):
    with pytest.raises(ConfigError) as e:
        bench(*overrides)
    msg = str(e.value)
    assert msg.startswith(starts) and "\n" not in msg, msg
    assert "allowed" in msg or "must divide" in msg, msg


def test_the_moe_refusal_names_expert_parallelism_first_where_asked():
    with pytest.raises(ConfigError) as e:
        bench("model=moe-tiny", "parallel.dp=2", "parallel.ep=2", "zero=1")
    assert "parallel.ep=2" in str(e.value) or "model.num_experts" in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["zero=0"], ["zero=1"], ["zero=1", "parallel.pp_schedule=gpipe", "batch.grad_accum=1"],
    ["engine=fsdp2", "zero=3"], ["engine=fsdp2", "zero=2", "parallel.dp=2", "batch.grad_accum=4"],
    ["zero=1", "parallel.pp_schedule=interleaved_1f1b", "parallel.vpp=2", "batch.grad_accum=4"],
    ["engine=fsdp2", "zero=3", "parallel.pp=4", "batch.grad_accum=4"],
    ["zero=1", "precision=bf16"], ["engine=fsdp2", "zero=3", "precision=bf16"],
    ["zero=1", "parallel.tp=2"], ["engine=fsdp2", "zero=3", "parallel.tp=2", "parallel.dp=2"],
])
def test_compared_configs_compose(overrides):
    b = bench(*overrides)
    assert b.parallel.world_size == b.parallel.pp * b.parallel.dp * b.parallel.tp


def test_the_command_line_exits_2_before_launching(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zero_bench", "run", "hardware=cpu", "model=llama-tiny", "parallel.pp=2",
                        "precision=fp32", "parallel.dp=1", "batch.grad_accum=2", "zero=2"], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(Path(__file__).parents[2]), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "zero=2: under a pipeline (parallel.pp=2) DeepSpeed trains ZeRO 0-1" in r.stderr
    assert "launch" not in r.stdout.lower()


def test_the_estimate_refuses_recompute_layers_that_do_not_divide_a_stage():
    """megatron's uniform recompute loops over one model chunk's layers k at a time (transformer_block.py
    _checkpointed_forward): 4 layers over pp 2 are 2 per stage, and k 4 would index past them. The
    estimate (which answers for recompute under a pipeline) took it and counted a chunk of 2."""
    with pytest.raises(ConfigError, match=r"^recompute_layers=4: must divide the 2 layers of each pipeline chunk "
                                          r"\(model.num_layers=4 / parallel.pp=2 x parallel.vpp=1"):
        from_cfg(compose([*PP2, "recompute=full", "recompute_layers=4"]), here=False, training=False)
    assert from_cfg(compose([*PP2, "recompute=full", "recompute_layers=2"]), here=False, training=False)
