"""Composition, validation (one clear line per bad input) and the DeepSpeed JSON a trial gets."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from zero_bench import ds_config
from zero_bench.config import CONF_DIR, ConfigError, from_cfg, validate_machine

ROOT = Path(__file__).resolve().parent.parent


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=["hardware=cpu", *overrides])


def bench(*overrides: str):
    return from_cfg(composed(*overrides))


def test_defaults_are_the_cpu_demo():
    b = bench()
    assert (b.model.name, b.zero, b.parallel.world_size, b.precision) == ("GPT-mini", 2, 2, "fp32")
    assert b.global_batch == b.batch.micro * b.parallel.dp


def test_seed_table_models_have_the_published_shapes():
    for name, shape in {"gpt345m": (24, 1024, 16), "gpt2.5b": (48, 2048, 16), "gpt5.8b": (72, 2560, 32)}.items():
        m = bench(f"model={name}").model
        assert (m.num_layers, m.hidden_size, m.num_heads) == shape
    assert bench("model=gpt345m").model.num_params == pytest.approx(355e6, rel=0.02)


def test_offload_true_moves_params_too_only_with_zero3():
    assert (bench("zero=3", "offload=true").offload_param, bench("zero=2", "offload=true").offload_param) == (True, False)


@pytest.mark.parametrize("overrides, message", [
    (["zero=5"], "zero=5: allowed values are 0, 1, 2, 3"),
    (["zero=0", "offload=true"], "offload=true: needs ZeRO stage 1, 2 or 3"),
    (["parallel.tp=3"], "parallel.tp=3: must divide model.num_heads=4"),
    (["precision=fp16"], "precision=fp16: not supported by DeepSpeed's CPU accelerator"),
    (["precision=int8"], "precision=int8: allowed values are fp32, bf16, fp16"),
    (["batch.micro=0"], "batch.micro=0: must be an integer >= 1"),
    (["zero=2", "offload_param=true"], "offload_param=true: needs zero=3"),
])
def test_bad_input_is_one_line_naming_key_and_allowed(overrides, message):
    with pytest.raises(ConfigError) as err:
        bench(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_world_size_beyond_devices():
    with pytest.raises(ConfigError, match=r"world size tp\*dp=64 exceeds"):
        validate_machine(bench("parallel.dp=64"))


def test_cli_errors_are_one_line_without_traceback():
    for args, key in ((["model=gpt9"], "model=gpt9: unknown option; allowed: gpt-mini"),
                      (["zero=7"], "zero=7: allowed values")):
        p = subprocess.run([sys.executable, "-m", "zero_bench", *args], capture_output=True, text=True, cwd=ROOT)
        assert p.returncode == 2
        assert key in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_ds_config_layers_templates_values_and_user_keys():
    b = bench("zero=3", "offload=true", "batch.micro=3", "batch.grad_accum=2", "precision=bf16")
    ds = ds_config.build(b)
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (3, 2, 12)
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["torch_adam"]  # CPU: no JIT op
    # buckets scaled to the model on CPU, unless the user set them
    assert z["reduce_bucket_size"] == max(500_000, b.model.params_per_shard(1) // 16)
    user = from_cfg(composed("zero=3", "+ds.zero_optimization.reduce_bucket_size=12345"))
    assert ds_config.build(user)["zero_optimization"]["reduce_bucket_size"] == 12345
    assert "_comment" not in ds


def test_zero0_gets_no_zero_buckets():
    z = ds_config.build(bench("zero=0"))["zero_optimization"]
    assert z == {"stage": 0}


def test_keys_separate_configs_but_not_batches():
    a, b = bench("zero=1"), bench("zero=2")
    assert a.search_key() != b.search_key()
    assert a.search_key() == a.with_micro(7).search_key() and a.trial_key() != a.with_micro(7).trial_key()
