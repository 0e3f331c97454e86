"""recompute=op: torchtitan's per-op policy decides as torchtitan's does (odd matmuls and the
attention kernels kept, the router's matmul recomputed and not counted), and the estimate keeps
what that policy keeps on megatron's layer (measured on CPU: docs/verified.md, "Per-op recompute")."""
from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import torch
from torch.utils.checkpoint import CheckpointPolicy

from zero_bench.estimate.activations import activation_bytes_per_sample, op_kept_terms
from zero_bench.models.flops import hardware_flops_per_seq, model_flops_per_seq
from zero_bench.models.op_recompute import gate_shapes, policy

from conftest import model

SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
sdpa_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def decisions(calls, recompute=False, shapes=frozenset({(256, 8)})):
    decide = policy(set(shapes))
    ctx = SimpleNamespace(is_recompute=recompute)
    return [decide(ctx, func, torch.empty(0), torch.empty(shape)) for func, shape in calls]


def test_every_second_matmul_and_the_attention_kernel_are_kept():
    # megatron's dense layer: linear_qkv, (attention), linear_proj, linear_fc1, linear_fc2
    calls = [(mm, (256, 384)), (sdpa_cpu, (1,)), (add, (1,)), (mm, (256, 256)), (mm, (256, 1408)), (mm, (704, 256))]
    assert decisions(calls) == [SAVE, SAVE, RECOMPUTE, RECOMPUTE, SAVE, RECOMPUTE]
    # the recompute counts apart from the forward, so it makes the same choices
    assert decisions(calls, recompute=True) == decisions(calls)


def test_the_router_matmul_is_recomputed_and_not_counted():
    # qkv, proj, router (h x E), expert fc1, expert fc2: the router leaves the parity alone
    calls = [(mm, (256, 384)), (mm, (256, 256)), (mm, (256, 8)), (mm, (256, 512)), (mm, (256, 256))]
    assert decisions(calls) == [SAVE, RECOMPUTE, RECOMPUTE, SAVE, RECOMPUTE]
    assert gate_shapes(model("moe-tiny")) == {(256, 8)} and gate_shapes(model("llama-tiny")) == set()


def test_a_llama_layer_keeps_its_input_qkv_attention_and_fc1_outputs():
    """llama-tiny per token, fp32, CPU flash: 1024 + 1536 + (1024 + 32) + 5632 = 9248 bytes
    (measured 9249); unfused or with dropout the scores are recomputed: 8192."""
    m = model("llama-tiny")
    assert sum(op_kept_terms(m, 1, "fp32", "cpu").values()) == 9248
    assert sum(op_kept_terms(dataclasses.replace(m, attention="unfused"), 1, "fp32", "cpu").values()) == 8192
    per = {r: activation_bytes_per_sample(m, 1, "fp32", r, device="cpu") for r in ("none", "op", "full")}
    assert per["full"]["saved"] < per["op"]["saved"] < per["none"]["saved"]
    assert per["full"]["total"] < per["op"]["total"] < per["none"]["total"]


def test_hfu_counts_the_recomputed_down_projections():
    """op re-runs linear_proj and fc2: more than none, far less than full's whole forward."""
    m = model("llama3-8b")
    ratio = hardware_flops_per_seq(m, "op") / model_flops_per_seq(m)
    assert 1.0 < ratio < hardware_flops_per_seq(m, "full") / model_flops_per_seq(m)
    parts = m.seq_len * (2 * m.num_layers * m.hidden_size * (m.hidden_size + m.ffn))  # proj + fc2 per sequence
    assert hardware_flops_per_seq(m, "op") - model_flops_per_seq(m) == parts


def test_the_hidden_states_reach_torchs_checkpoint_positionally(monkeypatch):
    """megatron calls each layer with keywords only; torch's checkpoint looks for the devices whose
    RNG it saves and restores in its positional arguments alone (_infer_device_type(*args),
    get_device_states(*args)). Given none, on GPU it saves no CUDA state and the recompute's hidden
    dropout draws other masks. The tensors that seam sees must include the hidden states, so a
    layer's input on cuda:N puts cuda:N's generator in the saved device states."""
    from torch.utils import checkpoint as torch_checkpoint
    from torch.utils._pytree import tree_leaves

    from zero_bench.models.op_recompute import checkpointed

    seen, infer = [], torch_checkpoint._infer_device_type
    monkeypatch.setattr(torch_checkpoint, "_infer_device_type", lambda *args: seen.append(args) or infer(*args))

    def layer_forward(*, hidden_states, attention_mask=None):  # megatron's keyword call
        return torch.nn.functional.dropout(hidden_states @ hidden_states.T, p=0.5), attention_mask

    x, mask = torch.randn(4, 4, requires_grad=True), torch.ones(1)
    torch.manual_seed(0)
    out, passed = checkpointed(layer_forward, set())(hidden_states=x, attention_mask=mask)
    assert passed is mask
    assert seen and any(t is x for args in seen for t in tree_leaves(args) if isinstance(t, torch.Tensor))
    # the layer still runs as megatron calls it, and its recompute draws the forward's masks
    out.sum().backward()
    y = x.detach().clone().requires_grad_()
    torch.manual_seed(0)
    layer_forward(hidden_states=y)[0].sum().backward()
    assert torch.equal(x.grad, y.grad)


ATTENTION = [getattr(torch.ops.aten, n).default for n in
             ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")]


def test_an_attention_kernel_with_dropout_is_recomputed_without_it_kept():
    """Issue 51 item 2: a kept kernel is not run in the recompute, so it draws no dropout mask there.
    dropout_p is found by name: 3rd argument of flash, 5th of efficient and cuDNN, or a keyword."""
    decide, ctx = policy(set()), SimpleNamespace(is_recompute=False)
    q = torch.empty(0)
    for op in ATTENTION:
        where = [a.name for a in op._schema.arguments].index("dropout_p")
        before = (q, q, q, None, True)[:where]  # attn_bias, compute_log_sumexp before it
        assert decide(ctx, op, *before, 0.1) == RECOMPUTE, op
        assert decide(ctx, op, *before, dropout_p=0.1) == RECOMPUTE, op
        assert decide(ctx, op, *before, 0.0) == SAVE and decide(ctx, op, q, q, q) == SAVE, op


@torch.library.custom_op("zb_test::dropped_attention", mutates_args=())
def dropped_attention(q: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """CUDA's flash kernel as the generator sees it: with dropout_p > 0 it draws from the default
    generator (here the CPU's; on GPU the philox offset the kernel takes from the CUDA generator)."""
    CALLS.append(dropout_p)
    if dropout_p == 0:
        return q.clone()
    return q * (torch.rand_like(q) >= dropout_p) / (1 - dropout_p)


CALLS: list = []


def test_the_recompute_draws_the_forwards_hidden_dropout_masks(monkeypatch):
    """A layer whose attention kernel draws dropout before the hidden dropout, one generator for both
    (megatron's sequence parallelism on GPU), under torch's checkpoint with the op policy: the
    generator the hidden dropout finds in the recompute is the forward's, so its mask and the
    gradients are the unchecked layer's. With the kernel kept (dropout or not, before issue 51) the
    recompute skipped its draw, the mask moved and the gradients came out wrong. Without dropout the
    kernel is kept: not run again."""
    from zero_bench.models import op_recompute

    kernel = torch.ops.zb_test.dropped_attention.default
    saved = op_recompute._saved_ops
    monkeypatch.setattr(op_recompute, "_saved_ops", lambda: saved() | {kernel})

    def layer(*, hidden_states, p):
        attention = kernel(hidden_states.detach(), p)  # its gradient path left out: the masks are the point
        states.append(torch.get_rng_state())  # the generator as the hidden dropout finds it
        return torch.nn.functional.dropout(hidden_states + attention, p=0.5)

    for p, runs in ((0.3, 2), (0.0, 1)):
        states, x = [], torch.randn(64, 64, requires_grad=True)
        CALLS.clear()
        torch.manual_seed(0)
        op_recompute.checkpointed(functools.partial(layer, p=p), set())(hidden_states=x).sum().backward()
        calls = len(CALLS)
        y = x.detach().clone().requires_grad_()
        torch.manual_seed(0)
        layer(hidden_states=y, p=p).sum().backward()
        assert len(states) == 3 and torch.equal(states[0], states[1]), p  # forward, recompute, unchecked
        assert torch.equal(x.grad, y.grad), p
        assert calls == runs, (p, calls)  # forward (and recompute)


def test_with_dropout_no_kernel_output_is_kept_and_the_scores_are_run_again():
    """What the policy above keeps, in the estimate and HFU: on GPU with dropout the kernel's output
    and log-sum-exp are no longer kept (CPU's math kernel never was), and the s^2 term is re-run."""
    m = dataclasses.replace(model("gpt-mini"), attention="sdpa")
    wet = dataclasses.replace(m, dropout=0.1)
    assert op_kept_terms(m, 2, "bf16", "gpu")["attention_output"] > 0
    assert op_kept_terms(wet, 2, "bf16", "gpu")["attention_output"] == 0
    assert op_kept_terms(wet, 1, "fp32", "cpu")["attention_output"] == 0
    scores = 4 * m.num_layers * m.hidden_size * m.seq_len ** 2
    assert hardware_flops_per_seq(wet, "op") - hardware_flops_per_seq(m, "op") == scores
