"""Bad input for tiled_mlp and recompute_offload (issue 45): one line naming the key and what is
allowed, before any launch; good input composes, keeps the trial keys of configs without them, and
is labelled."""
from __future__ import annotations

import subprocess
import sys

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.schema import BenchConfig, ConfigError


def bench(*overrides: str) -> BenchConfig:
    return from_cfg(compose(["hardware=cpu", "precision=fp32", "model=llama-tiny", *overrides]), here=False)


@pytest.mark.parametrize("overrides,starts", [
    (["tiled_mlp=0"], "tiled_mlp=0: must be an integer >= 1"),
    (["tiled_mlp=-2"], "tiled_mlp=-2: must be an integer >= 1"),
    (["tiled_mlp=many"], "tiled_mlp=many: must be an integer >= 1"),
    (["tiled_mlp=4", "model=moe-tiny"], "tiled_mlp=4: tiles megatron's dense MLP"),
    (["tiled_mlp=auto", "recompute=op"], "tiled_mlp=auto: recompute=op keeps fc1's output"),
    (["recompute_offload=true"], "recompute_offload=true: read only with recompute=full or recompute=block"),
    (["recompute_offload=true", "recompute=selective"], "recompute_offload=true: read only with recompute=full"),
    (["recompute_offload=true", "recompute=full", "+ds.activation_checkpointing.cpu_checkpointing=true"],
     "recompute_offload=true: ds.activation_checkpointing.cpu_checkpointing=true already"),
])
def test_refused_in_one_line(overrides, starts):
    with pytest.raises(ConfigError) as e:
        bench(*overrides)
    assert str(e.value).startswith(starts) and "\n" not in str(e.value), str(e.value)


def test_accepted_values_and_keys():
    plain = bench()
    for tiles in ("1", "16", "auto"):
        b = bench(f"tiled_mlp={tiles}")
        assert b.tiled_mlp == tiles and f"tiled_mlp={tiles}" in b.label()
        assert b.trial_key() != plain.trial_key()
    b = bench("recompute=block", "recompute_layers=2", "recompute_offload=true", "engine=fsdp2", "zero=3")
    assert "recompute_offload" in b.label()
    # off: the keys configs had before these keys existed
    assert "tiled_mlp" not in plain._key_dict() and "recompute_offload" not in plain._key_dict()
    assert BenchConfig(tiled_mlp=8).tiled_mlp == "8"  # from Python or YAML as from the command line


def test_the_command_line_exits_2_before_launching(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zero_bench", "run", "hardware=cpu", "model=llama-tiny",
                        "tiled_mlp=0"], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[2]), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr
    assert "tiled_mlp=0: must be an integer >= 1" in r.stderr and "launch" not in r.stdout.lower()


def test_the_estimate_moves_the_offloaded_inputs_to_the_host_per_node():
    """GPU: the checkpointed inputs leave the device's activations and join the host RAM a node needs
    (its ranks x max micro-batch); CPU: the host is the memory measured, the per-sample figure stays."""
    from zero_bench.estimate import estimate

    def est(device: str, *extra: str):
        hw = ["hardware=h100_80gb", "precision=bf16"] if device == "gpu" else []
        b = from_cfg(compose(["model=llama3-8b", "model.seq_len=32768", "parallel.dp=8", "zero=3", "engine=fsdp2",
                              "batch.micro=1", "loss=chunked", "recompute=full", *hw, *extra]), here=False)
        return estimate(b)

    full, off = est("gpu"), est("gpu", "recompute_offload=true")
    host = off.activations["host"]
    assert host == full.activations["layers"] > 0 and off.activations["layers"] == 0
    assert off.peak_bytes(1) < full.peak_bytes(1)
    m = off.row()["max_micro"]
    assert off.row()["host_needed"] == off.local_ranks * host * m and full.row()["host_needed"] == 0
    cpu_full, cpu_off = est("cpu"), est("cpu", "recompute_offload=true")
    assert cpu_off.act_per_sample == cpu_full.act_per_sample


def test_traced_refuses_what_it_cannot_trace_in_one_line():
    from zero_bench.estimate.traced import refusal

    why = refusal(bench("tiled_mlp=4", "engine=fsdp2", "zero=3"))
    assert why.startswith("tiled_mlp=4: traced=true cannot trace it") and "\n" not in why
    gpu = from_cfg(compose(["hardware=h100_80gb", "precision=bf16", "model=llama-tiny", "engine=fsdp2", "zero=3",
                            "recompute=full", "recompute_offload=true"]), here=False)
    assert refusal(gpu).startswith("recompute_offload=true: traced=true traces CPU tensors")
    assert refusal(bench("engine=fsdp2", "zero=3", "recompute=full", "recompute_offload=true")) is None
