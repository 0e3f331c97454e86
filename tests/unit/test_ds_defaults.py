"""Which DeepSpeed defaults a trial runs with: DeepSpeed 0.19.8's own on a GPU (what its users get),
the serial, unpinned settings the CPU figures were measured with on CPU, and the reference preset as
the reference had it on both."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from zero_bench.config.configure import compose, from_cfg
from zero_bench.engines import ds_config
from zero_bench.estimate.buffers import deepspeed_buffers

GOLDEN = Path(__file__).parents[1] / "data" / "ds_json_golden.json"


def bench(*overrides: str):
    return from_cfg(compose(["model=gpt-mini", *overrides]), here=False)


def zero_section(*overrides: str) -> dict:
    return ds_config.build(bench(*overrides))["zero_optimization"]


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


def test_cpu_and_reference_json_keep_their_bytes(monkeypatch):
    """The CPU figures and the reference preset were measured with these exact files: the same
    values in the same key order as before issue 37 (tests/data/ds_json_golden.json says how the
    hashes were made). Moving overlap_comm / pin_memory out of the templates once reordered them."""
    monkeypatch.setattr(ds_config, "fused_adam_fallback", lambda: None)  # as where FusedAdam builds
    want = json.loads(GOLDEN.read_text())["configs"]
    got = {}
    for key in want:
        text = json.dumps(ds_config.build(bench(*key.split())), indent=2) + "\n"  # as ds_config.write
        got[key] = hashlib.sha256(text.encode()).hexdigest()[:16]
    assert {k for k in want if got[k] != want[k]} == set()


@pytest.mark.parametrize("preset,zero", [("default", 1), ("default", 2), ("default", 3),
                                         ("megatron_deepspeed", 2), ("megatron_deepspeed", 3)])
def test_estimated_reduce_buckets_are_the_ones_deepspeed_allocates_on_gpu(preset, zero):
    """estimate/buffers.py reads overlap_comm from the JSON: on GPU it must count what DeepSpeed
    0.19.8 enacts from that JSON. ZeRO-1/2 allocate a second reduce bucket with overlap_comm
    (stage_1_and_2.py: "Use double buffers ... when overlap_comm is enabled"); ZeRO-3 one bucket
    whatever overlap_comm says (stage3.py: one `bucket.buffer` per dtype)."""
    b = bench("hardware=gpu", "precision=bf16", f"zero={zero}", f"ds_preset={preset}")
    z = ds_config.build(b)["zero_optimization"]
    overlap = DeepSpeedZeroConfig(**z).overlap_comm
    elements = int(float(z.get("reduce_bucket_size", 5e8)))
    buffers = 2 if overlap and zero < 3 else 1
    dtype_bytes = 4 if zero == 1 else 2  # ZeRO-1 stages the fp32 accumulator
    assert {x.name: x.bytes for x in deepspeed_buffers(b)}["reduce_bucket"] == buffers * elements * dtype_bytes
    assert overlap is (zero == 3 or preset == "megatron_deepspeed")
