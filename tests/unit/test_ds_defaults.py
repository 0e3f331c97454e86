"""Which DeepSpeed defaults a trial runs with: DeepSpeed 0.19.8's own on a GPU (what its users get),
the serial, unpinned settings the CPU figures were measured with on CPU, and the reference preset as
the reference had it on both."""
from __future__ import annotations

import pytest
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from zero_bench import ds_config
from zero_bench.configure import compose, from_cfg


def zero_section(*overrides: str) -> dict:
    return ds_config.build(from_cfg(compose(["model=gpt-mini", *overrides]), here=False))["zero_optimization"]


@pytest.mark.parametrize("zero", [2, 3])
def test_gpu_default_preset_leaves_overlap_and_pinning_to_deepspeed(zero):
    z = zero_section("hardware=gpu", "precision=bf16", f"zero={zero}", "offload=true")
    assert "overlap_comm" not in z and "pin_memory" not in z["offload_optimizer"]
    # what DeepSpeed then runs with: overlap for stage 3 only, pinned host memory
    enacted = DeepSpeedZeroConfig(**z)
    assert enacted.overlap_comm is (zero == 3) and enacted.offload_optimizer.pin_memory is True
    if zero == 3:
        assert enacted.offload_param.pin_memory is True


@pytest.mark.parametrize("zero", [2, 3])
def test_cpu_keeps_the_serial_unpinned_settings_its_figures_were_measured_with(zero):
    z = zero_section("hardware=cpu", "precision=fp32", f"zero={zero}", "offload=true")
    assert z["overlap_comm"] is False and z["offload_optimizer"]["pin_memory"] is False
    if zero == 3:
        assert z["offload_param"]["pin_memory"] is False


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_reference_preset_is_unchanged_by_the_device(device):
    """megatron_deepspeed: its own overlap_comm true wins over the serial default; offload unpinned."""
    z2 = zero_section(f"hardware={device}", "precision=fp16" if device == "gpu" else "precision=fp32",
                      "ds_preset=megatron_deepspeed", "zero=2", "offload=true")
    assert z2["overlap_comm"] is True and z2["offload_optimizer"]["pin_memory"] is False
    z3 = zero_section(f"hardware={device}", "precision=fp16" if device == "gpu" else "precision=fp32",
                      "ds_preset=megatron_deepspeed", "zero=3")
    assert z3["overlap_comm"] is True
