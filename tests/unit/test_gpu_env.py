"""What a GPU rank runs with besides its config: one GPU numbering for CUDA, NVML and the user; one
hardware queue under tensor parallelism; megatron's torch-only fusions on GPU, none on CPU."""
from __future__ import annotations

import dataclasses

import pytest

from zero_bench.config.schema import BenchConfig, HardwareConfig, ParallelConfig
from zero_bench.models.megatron import fusion_args, transformer_config
from zero_bench.trial.launcher import trial_env

from conftest import model


def cfg(device="gpu", tp=1, name="gpt-tiny") -> BenchConfig:
    return BenchConfig(model=model(name), parallel=ParallelConfig(tp=tp, dp=2), hardware=HardwareConfig(device=device),
                       precision="bf16" if device == "gpu" else "fp32")


def test_gpu_ranks_number_gpus_as_nvidia_smi_does(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert trial_env(cfg())["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")  # NVML resolves indices in PCI order: so do the ranks
    assert trial_env(cfg())["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "CUDA_DEVICE_ORDER" not in trial_env(cfg("cpu"))


def test_one_hardware_queue_under_tensor_parallelism(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert trial_env(cfg(tp=2))["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in trial_env(cfg(tp=1))
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in trial_env(cfg("cpu", tp=2))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # the user's choice is kept
    assert trial_env(cfg(tp=2))["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "qwen3-tiny"])
def test_gpu_turns_on_megatrons_torch_only_fusions_and_megatron_accepts_them(name):
    c = cfg(name=name)
    tc = transformer_config(c, on_cpu=False, initialize=False)  # TransformerConfig's own checks run
    assert tc.bias_dropout_fusion and tc.bias_activation_fusion
    assert not (tc.masked_softmax_fusion or tc.apply_rope_fusion or tc.persist_layer_norm
                or tc.gradient_accumulation_fusion)  # these need Apex / TE / megatron's kernels
    on_cpu = transformer_config(c, on_cpu=True, initialize=False)
    assert not (on_cpu.bias_dropout_fusion or on_cpu.bias_activation_fusion)


def test_ungated_gelu_without_bias_keeps_the_activation_unfused():
    """TransformerConfig refuses bias_activation_fusion for gelu without GLU and without a bias."""
    m = dataclasses.replace(model("gpt-tiny"), add_bias=False)
    assert fusion_args(m, on_cpu=False)["bias_activation_fusion"] is False
    transformer_config(dataclasses.replace(cfg(), model=m), on_cpu=False, initialize=False)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_moe_experts_fuse_swiglu_only(name):
    """SequentialMLP passes each expert its routing weights as per_token_scale; megatron's MLP then
    fuses SwiGLU (weighted_bias_swiglu_impl) and raises ValueError for gelu (mlp.py)."""
    m = dataclasses.replace(model(name), num_experts=4, moe_router_topk=2)
    assert fusion_args(m, on_cpu=False)["bias_activation_fusion"] is m.gated
    tc = transformer_config(dataclasses.replace(cfg(name=name), model=m), on_cpu=False, initialize=False)
    assert tc.num_moe_experts == 4 and tc.bias_activation_fusion is m.gated
