"""The model built from the description, run for real in this process (one gloo rank, tp 1, no
DeepSpeed): sdpa equals megatron's unfused attention to fp32 rounding, and recompute with dropout
recomputes the forward's dropout masks (the CPU RNG tracker + shims.cpu_checkpoint). The 2-rank
trials of the same model (ZeRO 0-3, tp 2, recompute=full through DeepSpeed's checkpoint):
tests/integration/test_models_trials.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import BenchConfig, HardwareConfig
from zero_bench.models import ModelConfig
from zero_bench.models.megatron import build_gpt, transformer_config
from zero_bench.models.shims import cpu_checkpoint, seed_cpu_rng

from conftest import megatron_one_rank, model

# llama-tiny, shortened so that each build and step takes well under a second
SMALL = dataclasses.replace(model("llama-tiny"), num_layers=2, seq_len=64)
# qwen3-tiny likewise: qk-norm, 8 heads of 64 on a 256-wide stream, tied
SMALL_QWEN3 = dataclasses.replace(model("qwen3-tiny"), num_layers=2, seq_len=64)


@pytest.fixture(scope="module", autouse=True)
def megatron_tp1(tmp_path_factory):
    """megatron's parallel state on a real one-rank gloo group, with the CPU shims."""
    from megatron.core import tensor_parallel

    with megatron_one_rank(tmp_path_factory.mktemp("pg") / "store"):
        before = tensor_parallel.checkpoint
        tensor_parallel.checkpoint = cpu_checkpoint
        yield
        tensor_parallel.checkpoint = before


def loss_and_grads(m: ModelConfig, recompute: str = "none", state: dict = None) -> tuple[float, list]:
    """One forward and backward of `m` (fp32) from seeded weights (or `state`), on seeded tokens."""
    seed_cpu_rng(1234)
    cfg = BenchConfig(model=m, hardware=HardwareConfig(device="cpu"), precision="fp32", recompute=recompute)
    gpt = build_gpt(cfg, transformer_config(cfg, on_cpu=True), on_cpu=True)
    if state is not None:
        gpt.load_state_dict(state)
    tok = torch.randint(0, m.vocab_size, (2, m.seq_len + 1), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(m.seq_len).unsqueeze(0).expand(2, -1)
    loss = gpt(tok[:, :-1], pos, None, labels=tok[:, 1:]).float().mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in gpt.parameters()]


def worst(a: list, b: list) -> float:
    """Largest difference over all gradients, relative to each gradient's largest element."""
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


@pytest.mark.parametrize("small", [SMALL, SMALL_QWEN3], ids=["llama", "qwen3"])
def test_sdpa_equals_unfused_attention(small):
    """Same weights, same tokens: loss and every gradient within fp32 rounding (GQA, RoPE, SwiGLU;
    qwen3: qk-norm and head_dim apart from h / a)."""
    seed_cpu_rng(1234)
    cfg = BenchConfig(model=dataclasses.replace(small, attention="unfused"), hardware=HardwareConfig(device="cpu"),
                      precision="fp32")
    state = build_gpt(cfg, transformer_config(cfg, on_cpu=True), on_cpu=True).state_dict()
    ref_loss, ref = loss_and_grads(cfg.model, state=state)
    loss, grads = loss_and_grads(dataclasses.replace(small, attention="sdpa"), state=state)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert worst(grads, ref) < 1e-5


@pytest.mark.parametrize("attention", ["unfused", "sdpa"])
def test_selective_recompute_with_dropout_recomputes_the_same_masks(attention):
    """With dropout 0.1 (hidden and attention), recompute=selective gives recompute=none's gradients:
    cpu_checkpoint puts megatron's tracker streams back for the recompute (plain torch checkpoint
    gave 30 % wrong gradients)."""
    m = dataclasses.replace(SMALL, attention=attention, dropout=0.1)
    loss0, g0 = loss_and_grads(m)
    loss, g = loss_and_grads(m, "selective")
    assert loss == loss0 and worst(g, g0) < 1e-6


def test_attention_dropout_draws_from_the_tensor_parallel_stream():
    """The CPU tracker keeps a stream of its own for dropout inside tensor-parallel regions (per tp
    rank, as on GPU), apart from torch's default generator."""
    from megatron.core import tensor_parallel

    seed_cpu_rng(1234)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    default_before = torch.get_rng_state()
    with tracker.fork():
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), default_before)  # the default stream did not move
    seed_cpu_rng(1234)
    assert not torch.equal(torch.rand(4), inside)


def test_fsdp2_bf16_layers_get_megatrons_fp32_rope_angles():
    """Issue 43 item 5: FSDP2's MixedPrecisionPolicy cast every floating-point argument of a
    layer to bf16, megatron's fp32 RoPE angles (rotary_pos_emb, a keyword argument) included;
    DeepSpeed keeps them fp32. One rank, llama-tiny at 1024 tokens, bf16 compute over fp32 shards,
    sharded as the engine shards it: each layer sees fp32 angles and bf16 hidden states, and the
    loss is the one of the same weights cast to bf16 whole (as DeepSpeed's bf16 module holds them)."""
    from torch.distributed.fsdp import fully_shard

    from zero_bench.engines.fsdp2 import compute_config, dp_mesh, shard_layer, shard_options

    m = dataclasses.replace(SMALL, seq_len=1024)
    cfg = BenchConfig(model=m, hardware=HardwareConfig(device="cpu"), precision="bf16", engine="fsdp2", zero=3)
    seed_cpu_rng(1234)
    whole = build_gpt(cfg, compute_config(cfg, on_cpu=True), on_cpu=True)
    state = {k: v.clone() for k, v in whole.state_dict().items() if torch.is_tensor(v)}
    kw = shard_options(dp_mesh(True, RankLayout(dp=1)), cfg, on_cpu=True)
    seed_cpu_rng(1234)
    gpt = build_gpt(cfg, compute_config(cfg, on_cpu=True), on_cpu=True, on_layer=lambda layer: shard_layer(layer, kw, None))
    fully_shard(gpt, **kw)
    seen = []

    def record(module, args, kwargs):
        seen.append((kwargs["rotary_pos_emb"].dtype, (args[0] if args else kwargs["hidden_states"]).dtype))

    for layer in gpt.decoder.layers:
        layer.self_attention.register_forward_pre_hook(record, with_kwargs=True)
    tok = torch.randint(0, m.vocab_size, (1, m.seq_len + 1), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(m.seq_len).unsqueeze(0)
    loss = gpt(tok[:, :-1], pos, None, labels=tok[:, 1:]).float().mean().item()
    assert seen == [(torch.float32, torch.bfloat16)] * m.num_layers
    whole.load_state_dict(state, strict=False)
    ref = whole.bfloat16()(tok[:, :-1], pos, None, labels=tok[:, 1:]).float().mean().item()
    assert loss == pytest.approx(ref, rel=1e-6)
