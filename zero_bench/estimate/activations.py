"""Activation bytes one sample adds to a rank: what megatron's local-spec GPTModel keeps for
backward, tensor by tensor, for recompute none / selective / full, tensor parallel t with or without
megatron's sequence parallelism, dropout on or off, unfused or sdpa attention, on CPU or GPU, from
the one description.

It generalises Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", eq. 2: s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit with dropout) by counting the
storages megatron-core 0.16.1 + torch 2.13 actually keep, so the terms follow the code. Per layer,
per token, B bytes per element (fp32 4, bf16 2), q = a*d/t, kv = g*d/t, f = ffn/t, A = a*s/t
(attention-score elements per token), m = dropout-mask bytes per element:
  input norm      its input B*h + statistics (RMSNorm on CPU: torch's composite keeps an fp32 copy 4h
                  and the normalised fp32 x 4h, whatever the dtype)
  QKV projection  its input B*h
  Q, K, V         unfused: GQA (a > g): Q + K, V repeated to a/t heads = 3q*B; MHA: the QKV output
                  (q + 2kv)*B, plus with RoPE the rotated Q and K (V's view pins the QKV output);
                  sdpa: q + 2kv (K/V expanded to q where the kernel takes no GQA)
  core attention  unfused: the softmax output, which the next matmul keeps too. CPU (and GPU with
                  fusions=false) in 16-bit: attention_softmax_in_fp32 upcasts the scores, so the
                  fp32 output 4A and its 16-bit copy B*A (6 bytes per score); GPU with fusions
                  (models/megatron.py softmax_in_fp32): the 16-bit softmax, B*A, what megatron's
                  fused scale-mask-softmax kernel keeps (Korthikanti's 2); fp32: 4A either way.
                  Dropout: mask m*A + output B*A (the 16-bit copy, then unused, is freed).
                  sdpa flash kernels: the log-sum-exp, 4*a/t, nothing s x s; CPU with dropout:
                  torch's math fallback: softmax, dropout mask, dropped probabilities, 3*4A
  context         q*B (unfused: the permuted copy; sdpa: the kernel's output, the same tensor)
  dropout         m*h after attention and after the MLP
  pre-MLP norm    as the input norm; fc1 input B*h
  MLP             GeLU: 2f*B (GeLU input, fc2 input; fused or not); SwiGLU, eager (megatron's glu,
                  transformer/mlp.py MLP.forward): fc1 output 2f, SiLU output f,
                  `x_linear + glu_linear_offset` f (a copy even at offset 0), fc2 input f = 5f*B;
                  fused (GPU with fusions=true: fusions/fused_bias_swiglu.py bias_swiglu_impl, whose
                  SwiGLUFunction / BiasSwiGLUFunction save only their input): fc1 output 2f, fc2
                  input f = 3f*B. swiglu_fused says which one megatron runs.
m is 1 byte on GPU (native_dropout's bool mask) and B on CPU (torch's CPU dropout keeps a scaled
noise tensor of the input's dtype). selective (megatron's core_attn): the core attention's inputs
stay alive in the checkpoint (with RoPE: the rotated Q, K and the whole QKV output V is a view of),
its internals are recomputed in backward. full (megatron-core's uniform method,
transformer_block.py _checkpointed_forward): recompute_layers (k) layers per checkpoint, each
checkpoint keeps its input B*h (L/k of them), and its backward rebuilds all k layers before the top
one's backward runs (DeepSpeed's checkpoint, which the engine installs in megatron's place, is
called per chunk the same way: partition_activations and cpu_checkpointing act on L/k inputs).
Outside the layers: token ids, embedding dropout mask, the final norm, the output layer's input
B*h, the logits' fp32 softmax 4V/t (the vocab-parallel cross entropy works on an fp32 copy; in
fp32 on the logits themselves) and 13 bytes of loss bookkeeping; unfused attention also keeps one
B*A scratch buffer (GlobalMemoryBuffer "mpu"), sized by the largest micro-batch seen.
Mixture of experts (megatron-core 0.16.1's MoELayer, local spec, allgather dispatcher, ep 1, tp 1,
dropless): an MoE layer keeps, in place of fc1's input and the MLP, per token (E experts, top-k,
f_e = moe_ffn):
  router          the gating linear's input B*h (router.py router_gating_linear); top-k indices
                  8k (int64, topk and the scatter into the dense probs); the softmax over the top-k
                  in fp32 4k (moe_utils.topk_routing_with_score_function; norm_topk_prob=false:
                  the softmax over all E, 4E, instead); with the aux loss the fp32 softmax over
                  all E scores 4E (router.py, aux_loss_load_balancing)
  dispatch        the local routing map (bool E, the dispatcher's self.local_map) and its
                  transposed copy masked_select keeps (E); the permutation indices 8k
                  (moe_utils.permute, kept as reversed_local_input_permutation_mapping)
  experts         per routed row (k per token): its input B*h (index_select's output, fc1's input),
                  the MLP as dense (SwiGLU 5f_e, GeLU 2f_e) plus the activation scaled by its
                  routing weight (mlp.py per_token_scale: the product's input and output, f_e more),
                  and the weight B; fused (weighted_bias_swiglu_impl: WeightedSwiGLUFunction saves
                  its input 2f_e and the weight, and returns the scaled product, fc2's input f_e):
                  3f_e and the weight B
  unpermute       scatter_add_ keeps only the indices above; the shared expert keeps its MLP (its
                  input is the router's)
Sequence parallelism (parallel.sequence_parallel at t > 1; Korthikanti et al. 2022, section 4.2.2:
per layer sbh(10 + 24/t + 5as/(ht)) becomes sbh(34/t + 5as/(ht)) in 16-bit with dropout): the
terms outside the tp-split regions hold s/t tokens per rank: both norms (input and statistics),
the QKV and fc1 inputs (megatron's column-parallel linear saves its sequence shard and all-gathers
it again in backward), the dropout masks, the embedding's dropout mask, the final norm and the
output layer's input; full recompute keeps each layer's input shard. What stays whole: the
attention (all s tokens of a/t heads), the context, the MLP (f/t), the logits. Each
column-parallel linear all-gathers its input into GlobalMemoryBuffer's "mpu" tensor, the same
buffer unfused attention's scores use (one s x h tensor per sample, or the scores where larger).

Long sequences (models/sequence.py): tiled_mlp (DeepSpeed's TiledMLP) keeps no MLP intermediates,
only fc1's input; its backward holds one tile's intermediates and gradients (1/tiles of the
sequence's) and the input's whole gradient B*h. recompute_offload: the checkpointed inputs B*h per
checkpoint are counted in `host`, not on the device (on CPU, where the host is the device, the estimate
adds them back). Measured on CPU: tests/unit/test_sequence.py (the saved storages, to the byte) and
tests/integration/test_long_sequence.py (the peak drop of tiling at 8192 tokens).
Measured against live tensors on CPU (benchmarks/activation_memory.py, docs/verified.md,
"Activations of llama-tiny" and "of moe-tiny"): the saved bytes to 0.1 %, the step's peak within
5.1 %. The GPU-only terms (fused RMSNorm, 1-byte dropout masks, flash kernels) are read from the
code, not measured here; the GPU's 16-bit softmax runs on CPU too and is measured
(tests/unit/test_attention_terms.py), and against Megatron-LM's own GPU runs in
benchmarks/heldout_gpu.py. The attention's terms (norms, Q/K/V, core attention, context) are
counted in estimate/attention.py, Ulysses' replacements for them at sp > 1 in estimate/ulysses.py.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from zero_bench.config.schema import Device, Recompute
from zero_bench.models import ModelConfig
from zero_bench.models.description import native_gqa
from zero_bench.units import BYTES

# the attention's terms (estimate/attention.py), re-exported: callers read every term from here
from zero_bench.estimate.attention import (attention_inputs_bytes, core_attention_terms, dims, mask_bytes,  # noqa: F401
                                           norm_bytes, qk_norm_terms, qkv_output_kept, sdpa_kernel,
                                           softmax_upcast)
from zero_bench.estimate.ulysses import attention_terms, exchange_bytes


def swiglu_fused(m: ModelConfig, device: str, fusions: bool) -> bool:
    """Whether megatron runs its fused SwiGLU for this model here: models/megatron.py
    bias_activation_fused (GPU with the fusions key; not a gated MoE model with biases), the one
    place the model's TransformerConfig takes it from."""
    if device == Device.cpu or not fusions or not m.gated:
        return False  # never fused: answered without importing torch (models/megatron.py does)
    from zero_bench.models.megatron import bias_activation_fused

    return bias_activation_fused(m, on_cpu=False, fusions=True)


def mlp_bytes(m: ModelConfig, f: int, B: int, fused: bool = False) -> int:
    """Bytes per token an MLP of width f (this rank's share) keeps besides its input: GeLU 2f,
    SwiGLU 5f eager and 3f fused (the module docstring's MLP line)."""
    return (2 if not m.gated else 3 if fused else 5) * f * B


def moe_terms(m: ModelConfig, tp: int = 1, precision: str = "bf16", fused: bool = False) -> dict:
    """Bytes per token an MoE layer keeps in place of fc1's input and the dense MLP (see the module
    docstring): router, dispatch, the k experts' rows, the shared expert. fused: megatron's fused
    SwiGLU (swiglu_fused), whose routed rows keep no separate product input."""
    B, h, E, k, f_e = BYTES[precision], m.hidden_size, m.num_experts, m.moe_router_topk, m.moe_ffn // tp
    scaled = 0 if fused else f_e * B  # eager: the activation before its routing weight scales it
    topk_softmax = 4 * k if m.norm_topk_prob else 4 * E  # fp32 softmax over the top-k, or over all E
    shared = m.moe_shared_expert_intermediate_size
    return {
        "router_input": B * h,
        "router": 8 * k + topk_softmax + (4 * E if m.moe_aux_loss_coeff > 0 else 0),
        "dispatch": 2 * E + 8 * k,
        "expert_inputs": k * B * h,
        "experts": k * (mlp_bytes(m, f_e, B, fused) + scaled + B),
        "shared_expert": mlp_bytes(m, shared // tp, B, fused) if shared else 0,  # bias_swiglu_impl when fused
    }


def seq_shard(tp: int, sequence_parallel: bool) -> int:
    """The ranks the sequence-parallel terms are split over: t with sequence parallelism, else 1."""
    return tp if sequence_parallel and tp > 1 else 1


def layer_terms(m: ModelConfig, tp: int = 1, precision: str = "bf16", device: str = "gpu",
                moe: bool = False, fusions: bool = False, tiles: int = 0, sequence_parallel: bool = False,
                ulysses_sp: int = 1) -> dict:
    """Bytes per token one layer keeps for backward without recompute, by term (moe: an MoE layer;
    fusions: megatron's jit fusions asked for, the BenchConfig key; False counts the eager ops;
    tiles: tiled_mlp's tiles, 0 untiled: the tiled MLP keeps only its input, fc1_input;
    sequence_parallel: the norms', dropouts' and linears' inputs' terms hold 1/t of the tokens;
    ulysses_sp > 1: per local token, with the all-to-all's attention_qkv and ulysses_context,
    estimate/ulysses.py)."""
    B, x = BYTES[precision], dims(m, tp)
    h, f, n = x["h"], x["f"], seq_shard(tp, sequence_parallel)
    mb = mask_bytes(B, device) if m.dropout > 0 else 0
    core = core_attention_terms(m, tp, precision, device, fusions)
    fused = swiglu_fused(m, device, fusions)
    mlp = (moe_terms(m, tp, precision, fused) if moe else
           {"fc1_input": B * h / n, "mlp": 0 if tiles else mlp_bytes(m, f, B, fused)})
    exchanged = attention_terms(m, tp, precision, device, ulysses_sp) if ulysses_sp > 1 else {}
    return {
        "input_norm": norm_bytes(m, precision, device) / n,
        "qkv_input": B * h / n,
        **qk_norm_terms(m, tp, precision, device, ulysses_sp),
        "attention_qkv": exchanged.pop("attention_qkv", core["qkv"]),
        "attention_internal": core["internal"],
        "attention_context": core["context"],
        **exchanged,
        "attention_dropout_mask": mb * h / n,
        "pre_mlp_norm": norm_bytes(m, precision, device) / n,
        **mlp,
        "mlp_dropout_mask": mb * h / n,
    }


ATTENTION_KEYS = ("input_norm", "qkv_input", "qk_norm", "qk_norm_qkv_output", "attention_qkv", "attention_internal",
                  "attention_context", "ulysses_context", "attention_dropout_mask")


def mlp_part(terms: dict) -> float:
    """The MLP half of a layer's terms (pre-MLP norm to the MLP's dropout mask), dense or MoE."""
    return sum(v for k, v in terms.items() if k not in ATTENTION_KEYS)


def head_terms(m: ModelConfig, tp: int = 1, precision: str = "bf16", device: str = "gpu",
               loss: str = "megatron", sequence_parallel: bool = False) -> dict:
    """Bytes per token outside the layers (embedding, final norm, output layer, loss). The loss's
    softmax kept for backward (models/loss.py): megatron's fp32 softmax 4V/t; loss=bf16 torch's
    log-softmax in the logits' dtype; fp32 its fp32 log-softmax; chunked none. With sequence
    parallelism the embedding's dropout, the final norm and the output layer's input hold 1/t of
    the tokens (the output layer all-gathers its input's shard)."""
    B, h, V = BYTES[precision], m.hidden_size, m.padded_vocab(tp)
    n = seq_shard(tp, sequence_parallel)
    softmax = {"megatron": 4 * V // tp, "bf16": B * V, "fp32": 4 * V, "chunked": 0}[loss]
    return {
        "token_ids": 8 + (1 if tp > 1 else 0),
        "embedding_dropout_mask": (mask_bytes(B, device) * h / n) if m.dropout > 0 else 0,
        "final_norm": norm_bytes(m, precision, device) / n,
        "output_layer_input": B * h / n,
        "logits_softmax_fp32": softmax,
        "loss_bookkeeping": 13,  # target mask (bool), masked target (int64), per-token loss (fp32)
    }


def logits_transient(m: ModelConfig, tp: int, B: int, loss: str) -> float:
    """Bytes per token alive at the end of the forward beyond what it keeps: megatron's 16-bit
    logits before its fp32 copy (none in fp32, where the copy is the logits); torch's losses the
    logits while their log-softmax is made, and with loss=fp32 the fp32 copy too (none in fp32:
    .float() returns the tensor itself); chunked one chunk only (a constant, not per sample)."""
    V = m.padded_vocab(tp) // tp
    if loss == "megatron":
        return B * V if B != 4 else 0
    if loss == "chunked":
        return 0
    return B * V + (4 * V if loss == "fp32" and B != 4 else 0)


def output_layer_backward(m: ModelConfig, tp: int = 1, precision: str = "bf16", loss: str = "megatron",
                          ulysses_sp: int = 1) -> dict:
    """Bytes per sample (seq_len / ulysses_sp tokens) of the output layer's backward, where its weight
    gradient is made (FSDP2 holds it unsharded to the end: estimate/fsdp2.py): "softmax", what the
    loss kept (head_terms), freed once the loss is differentiated; "logits_grad", the logits'
    gradient in their dtype, B*V/t, beside it (megatron's fp32 gradient, its softmax written over,
    is cast back to the 16-bit logits' dtype; in fp32 it is that softmax; torch's losses end with
    the logits' gradient too; chunked: one chunk's, in loss_chunk_bytes); "input_grad", the output
    layer's input gradient B*h, made before the weight's."""
    B, V, h = BYTES[precision], m.padded_vocab(tp) // tp, m.hidden_size
    softmax = {"megatron": 4 * V, "bf16": B * V, "fp32": 4 * V, "chunked": 0}[loss]
    per_token = {"softmax": softmax, "logits_grad": 0 if loss == "chunked" else B * V, "input_grad": B * h}
    return {k: int(round(v * m.seq_len / ulysses_sp)) for k, v in per_token.items()}


def loss_chunk_bytes(m: ModelConfig, precision: str) -> int:
    """loss=chunked: one chunk in flight (models/loss.py CHUNK_TOKENS tokens, not per sample): its
    logits, their fp32 copy and log-softmax in forward; in backward the recomputed chunk's and two
    fp32 gradients. The larger: CHUNK_TOKENS x V x (B + 4 + 4 + 4)."""
    from zero_bench.models.loss import CHUNK_TOKENS

    return CHUNK_TOKENS * m.padded_vocab(1) * (BYTES[precision] + 12)


def backward_transients(m: ModelConfig, tp: int, precision: str, device: str, tiles: int = 0,
                        fusions: bool = False) -> dict:
    """Bytes per token a layer's backward allocates beyond what it had saved, at its worst moment.

    mlp: SwiGLU's backward holds the gradients of both halves (2f; fc2's gradient replaces fc2's
    freed input), GeLU's one (f). attention, s x s kernels: in fp32 (unfused, and torch's math
    kernel) four fp32 A-sized tensors when the masked softmax is differentiated (the incoming
    gradient and three temporaries of autograd's CopySlices: megatron's masked_fill_ works in place
    on a view of the baddbmm output), by which time the layer's softmax / dropout tensors are freed.
    In 16-bit with the upcast softmax the mask is applied to an fp32 copy: the probabilities' 16-bit
    gradient and its fp32 cast; with the 16-bit softmax (GPU, fusions) the fp32 path's four tensors
    in 16 bits. flash kernels (flash_backward): the kernel's incoming gradient beside dq, dk, dv, and
    on GPU its fp32 dq accumulator and, taking GQA, dk and dv at every query head.
    tiles (tiled_mlp, DeepSpeed's TiledMLP backward): one tile rebuilt at a time, its intermediates
    and gradients 1/tiles of the sequence's, beside the whole input's gradient TiledMLP fills tile by
    tile (zeros_like(x), B*h)."""
    B, x = BYTES[precision], dims(m, tp)
    core = core_attention_terms(m, tp, precision, device, fusions)
    mlp = (2 if m.gated else 1) * x["f"] * B
    if tiles:
        mlp = (mlp + mlp_bytes(m, x["f"], B, swiglu_fused(m, device, fusions))) / tiles + B * x["h"]
    if m.is_moe and m.moe_layers[-1]:
        # the gradient of the k permuted rows, and one expert's two halves at a time (SequentialMLP
        # runs its experts one by one; balanced routing: k/E of the rows each)
        f_e = m.moe_ffn // tp
        mlp = m.moe_router_topk * B * x["h"] + (2 if m.gated else 1) * f_e * B * m.moe_router_topk / m.num_experts
    if m.attention == "sdpa" and sdpa_kernel(m, device) == "math":
        attention = 4 * 4 * x["A"] - core["internal"]  # float intermediates whatever the dtype
    elif m.attention == "unfused":
        upcast = softmax_upcast(precision, device, fusions)
        attention = (4 + B) * x["A"] if upcast else 4 * B * x["A"] - core["internal"]
    else:
        attention = flash_backward(m, tp, precision, device)
    return {"mlp": mlp, "attention": attention}


def flash_backward(m: ModelConfig, tp: int, precision: str, device: str) -> float:
    """Bytes per token a flash kernel's backward holds at once beyond the layer's saved tensors: dout
    (linear_proj's input gradient, which the kernel reads whole: measured on CPU, the last layer's
    attention backward held q*B more than dq, dk, dv; benchmarks/attention_backward.py), dq, dk, dv,
    and on GPU what FlashAttention-2's mha_bwd / mha_varlen_bwd allocate for the kernel (flash_api.cpp,
    torch's in-tree port alike): dq_accum in fp32 (4q) and, where K/V come with fewer heads than Q,
    dk_expanded and dv_expanded at every query head (2q*B), summed into dk, dv after the kernel."""
    B, x = BYTES[precision], dims(m, tp)
    grads = core_attention_terms(m, tp, precision, device)["qkv"] + x["q"] * B
    if device == Device.cpu:
        return grads  # torch's CPU flash backward accumulates per thread (a few tiles, not per token)
    expanded = 2 * x["q"] * B if native_gqa(device, precision) and x["rep"] > 1 else 0
    return grads + 4 * x["q"] + expanded


def op_kept_terms(m: ModelConfig, tp: int = 1, precision: str = "bf16", device: str = "gpu",
                  moe: bool = False, sequence_parallel: bool = False) -> dict:
    """Bytes per token one layer keeps under recompute=op (models/op_recompute.py: torchtitan's
    per-op policy): the checkpoint's input, and the outputs of the ops the policy saves. In
    megatron's layer the odd matmuls are linear_qkv's and each up projection (fc1: SwiGLU's gate
    and up, 2f; an MoE layer's k routed rows through their expert's fc1 and the shared expert's fc1;
    the router's matmul is not counted) and the attention kernel's output with its fp32
    log-sum-exp (flash kernels without dropout only: unfused attention, torch's math kernel and a
    kernel that draws dropout masks are recomputed)."""
    B, x = BYTES[precision], dims(m, tp)
    up = 2 if m.gated else 1
    if moe:
        shared = m.moe_shared_expert_intermediate_size or 0
        fc1 = m.moe_router_topk * up * (m.moe_ffn // tp) * B + up * (shared // tp) * B
    else:
        fc1 = up * x["f"] * B
    flash = m.attention == "sdpa" and sdpa_kernel(m, device) == "flash" and m.dropout == 0
    return {"layer_input": B * x["h"] / seq_shard(tp, sequence_parallel), "qkv_output": (x["q"] + 2 * x["kv"]) * B,
            "attention_output": x["q"] * B + 4 * x["heads"] if flash else 0, "fc1_output": fc1}


def layers_per_checkpoint(recompute: str, recompute_layers: int, L: int) -> int:
    """Layers per checkpoint of L: recompute=full's recompute_layers (megatron's uniform method), else 1."""
    return min(recompute_layers, L) if recompute == Recompute.full else 1


def _layers(m: ModelConfig, tp: int, precision: str, recompute: str, ck: Mapping, kinds: list,
            device: str = "gpu", offload: bool = False, sequence_parallel: bool = False,
            chunk: Optional[Sequence[bool]] = None) -> tuple:
    """(bytes the L layers keep, bytes the last checkpoint rebuilds in backward, bytes on the host)
    per token. kinds: (number of layers, their terms, MoE or not) per kind of layer (dense, MoE);
    the last layer's kind is last. sequence_parallel: a layer's input is its shard. chunk: with
    recompute=full, the MoE flags of the layers of the last checkpoint (megatron's uniform method
    checkpoints recompute_layers layers at a time: one input kept per chunk, and the chunk's
    backward rebuilds all of its layers before the top one's backward runs); None: the last layer."""
    B, h, L = BYTES[precision], m.hidden_size / seq_shard(tp, sequence_parallel), sum(n for n, _, _ in kinds)
    chunk = [kinds[-1][2]] if chunk is None else list(chunk)
    by_kind = {moe: sum(t.values()) for _, t, moe in kinds}
    last = sum(by_kind[moe] for moe in chunk)  # the layers the last checkpoint rebuilds
    checkpoints = -(-L // len(chunk))
    if recompute == Recompute.op:
        # the last layer's backward rebuilds what the policy did not keep
        kept = [sum(op_kept_terms(m, tp, precision, device, moe, sequence_parallel).values()) for _, _, moe in kinds]
        return sum(n * k for (n, _, _), k in zip(kinds, kept)), last - kept[-1], 0.0
    if recompute == Recompute.full:
        kept = B * h / (tp if ck.get("partition_activations") else 1)
        if ck.get("partition_activations") and ck.get("cpu_checkpointing"):
            return 0.0, last - kept, checkpoints * kept
        if offload:  # recompute_offload (models/sequence.py): every input on the host, the last one's back
            return 0.0, last, checkpoints * kept
        return checkpoints * kept, last - kept, 0.0
    if recompute == Recompute.selective:
        # the checkpoint's inputs (attention_inputs_bytes) hold the QKV output the key norm pins
        terms = kinds[-1][1]  # Ulysses: the checkpoint wraps the exchanges, its context copy is rebuilt too
        recomputed = terms["attention_qkv"] + terms["attention_internal"] + terms.get("ulysses_context", 0)
        dropped = recomputed + terms["qk_norm_qkv_output"] - attention_inputs_bytes(m, tp, precision)
        return sum(n * (sum(t.values()) - dropped) for n, t, _ in kinds), recomputed, 0.0
    return sum(n * sum(t.values()) for n, t, _ in kinds), 0.0, 0.0


def layer_kinds(m: ModelConfig, tp: int, precision: str, device: str, fusions: bool = False, tiles: int = 0,
                sequence_parallel: bool = False, ulysses_sp: int = 1, layers: Optional[Sequence[int]] = None) -> list:
    """[(layers, terms, MoE)] per kind of layer, the last layer's kind last (dense models: one kind).
    layers: the (global) indices of the layers a pipeline stage holds; None: every layer."""
    flags = m.moe_layers if layers is None else [m.moe_layers[i] for i in layers]
    order = [not flags[-1], flags[-1]]
    return [(flags.count(moe), layer_terms(m, tp, precision, device, moe, fusions, tiles, sequence_parallel,
                                           ulysses_sp), moe)
            for moe in order if moe in flags]


def sequence_args(bench) -> dict:
    """activation_bytes_per_sample's tiles, offload and sequence_parallel for a BenchConfig's
    tiled_mlp, recompute_offload (models/sequence.py reads the same keys in trials) and layout."""
    from zero_bench.models.sequence import mlp_tiles

    m = bench.model
    tokens = m.seq_len // getattr(bench.parallel, "sp", 1)  # what one rank's MLP sees of a sequence
    layout = bench.layout
    out = {"tiles": mlp_tiles(bench.tiled_mlp, tokens, m.hidden_size), "offload": bench.recompute_offload,
           "sequence_parallel": layout.sequence_parallel, "ulysses_sp": layout.sp}
    if layout.pp > 1 and layout.stage is not None:  # a pipeline stage's layers, embedding and head (estimate/pipeline.py)
        out.update(layers=layout.stage_layers(), first=layout.first_stage, last=layout.last_stage)
    return out


def bench_activations(bench) -> dict:
    """activation_bytes_per_sample of a BenchConfig at its own keys: what its engine's memory prediction
    holds (estimate/deepspeed.py, estimate/fsdp2.py) and what the time prediction's checkpoint copies
    move (estimate/time/offload.py), one call for both. An engine that reads DeepSpeed's JSON takes the
    composed JSON's activation_checkpointing (partition_activations, cpu_checkpointing); FSDP2 has none."""
    from zero_bench.engines.specs import spec
    from zero_bench.estimate.buffers import ds_full

    checkpointing = ds_full(bench).get("activation_checkpointing") if spec(bench.engine).reads_ds_config else None
    return activation_bytes_per_sample(bench.model, bench.parallel.tp, bench.precision, bench.recompute, checkpointing,
                                       bench.hardware.device, bench.recompute_layers, bench.loss, bench.fusions,
                                       **sequence_args(bench))


def activation_bytes_per_sample(model: ModelConfig, tp: int = 1, precision: str = "bf16", recompute: str = "none",
                                checkpointing: Optional[Mapping] = None, device: str = "gpu",
                                recompute_layers: int = 1, loss: str = "megatron", fusions: bool = False,
                                tiles: int = 0, offload: bool = False, sequence_parallel: bool = False,
                                ulysses_sp: int = 1, layers: Optional[Sequence[int]] = None, first: bool = True,
                                last: bool = True) -> dict:
    """Activation bytes one sample (sequence) adds to a rank.

    saved: what the forward leaves for backward (layers + embedding + logits + scratch); measured
    on CPU as the net bytes the forward allocates, it matches this to 0.1 %.
    total: the step's peak, the largest of three moments:
      end_of_forward      saved + the 16-bit logits before their fp32 copy (or the incoming gradient)
      mlp_backward        the last layer's MLP backward: the output layer, final norm and logits are
                          freed by then; full recompute has rebuilt the last checkpoint's k layers
                          (the ones below are freed only by their own backward); + the incoming
                          gradient B*h and the MLP's gradients
      attention_backward  the last layer's attention backward: its MLP part is freed too (the rest
                          of a rebuilt chunk is not); selective recompute has rebuilt the core
                          attention; + the attention's gradients
      loss_backward       loss=bf16 / fp32: the start of backward, torch's cross entropy holding
                          the gradients of its log-probabilities and of the logits beside them
      block_rebuild       recompute=block: the backward of the last recomputed layer (the first
                          recompute_layers are; the later ones keep everything, so the moments
                          above are those of recompute=none): the recomputed layers' inputs, that
                          layer rebuilt, its incoming gradient and the MLP's gradients
    checkpointing: ds_config's activation_checkpointing (recompute=full through DeepSpeed:
    partition_activations keeps 1/t of each checkpoint's input, cpu_checkpointing moves them to the host).
    recompute_layers: with full, the layers per checkpoint (k: L/k inputs kept, k layers rebuilt at
    once); with block, how many layers, from the first, are checkpointed one by one.
    device: "cpu" or "gpu" (torch keeps different tensors: RMSNorm, dropout masks, sdpa's kernel).
    fusions: BenchConfig.fusions, megatron's jit fusions asked for (on GPU a fused SwiGLU keeps 3f
    where the eager one keeps 5f: swiglu_fused); False, the default here, counts the eager ops.
    tiles: tiled_mlp's tiles per sequence (models/sequence.py mlp_tiles; 0 untiled): the MLP keeps
    nothing but its input, and its backward one tile's intermediates (backward_transients).
    offload: recompute_offload with full/block: the checkpointed inputs counted in `host`, not on
    the device; in backward the last checkpoint's input is back on the device.
    sequence_parallel: megatron's sequence parallelism at tp > 1 (RankLayout.sequence_parallel):
    the terms outside the tp-split regions divided by t (the module docstring).
    ulysses_sp: Ulysses' degree (parallel.sp): seq_len / sp tokens of each sequence per rank, the same bytes
    per token (attention: every token of heads / sp heads after the all-to-all).
    layers, first, last: one pipeline stage (estimate/pipeline.py): the (global) indices of the layers it
    holds (None: all), whether it holds the embedding (first) and the final norm, output layer and
    loss (last); a stage's input, received from the stage before, is its first layer's input (the
    input norm's term). One micro-batch's bytes: the micro-batches in flight are pipeline.py's.
    Returns bytes: per_layer (one layer, no recompute), layers (L layers through the forward),
    recomputed (what the last checkpoint rebuilds in backward: one layer, or recompute=full's k), embedding, logits, logits_transient, scratch
    (unfused attention's buffer), host (cpu_checkpointing), saved, the three moments and total.
    """
    m, s, B, h = model, model.seq_len, BYTES[precision], model.hidden_size
    sp = sequence_parallel and tp > 1
    kinds = layer_kinds(m, tp, precision, device, fusions, tiles, sp, ulysses_sp, layers)
    terms = kinds[-1][1]  # the last layer's, whose backward the moments below are about
    ck, L = checkpointing or {}, (m.num_layers if layers is None else len(layers))
    flags = m.moe_layers if layers is None else [m.moe_layers[i] for i in layers]
    # recompute=full: megatron's uniform method, recompute_layers layers per checkpoint (the last
    # chunk's flags); block checkpoints one layer at a time
    k = layers_per_checkpoint(recompute, recompute_layers, L)
    chunk = flags[(-(-L // k) - 1) * k:]
    if recompute == Recompute.block and recompute_layers >= L:
        recompute = "full"  # every layer recomputed, one per checkpoint
    block = recompute == Recompute.block
    if block:
        n = recompute_layers
        kept_inputs, recomputed, host = _layers(m, tp, precision, "full", ck, kinds, device, offload, sp)
        kept_inputs, host = kept_inputs * n / L, host * n / L
        layers = kept_inputs + _layers(m, tp, precision, "none", ck, kinds)[0] * (L - n) / L
    else:
        layers, recomputed, host = _layers(m, tp, precision, recompute, ck, kinds, device, offload, sp, chunk)
    head = head_terms(m, tp, precision, device, loss, sp)
    if not last:  # a stage before the last: no final norm, output layer, logits or loss
        head.update(logits_softmax_fp32=0, loss_bookkeeping=0, final_norm=0, output_layer_input=0)
    if not first:  # a stage after the first: no token ids, no embedding dropout
        head.update(token_ids=0, embedding_dropout_mask=0)
    softmax = head.pop("logits_softmax_fp32")
    logits = softmax + head.pop("loss_bookkeeping")
    embedding = sum(head.values())
    transient = logits_transient(m, tp, B, loss) if last else 0
    # GlobalMemoryBuffer "mpu": unfused attention's scores; with sequence parallelism also each
    # column-parallel linear's all-gathered input (s x h), in the same buffer
    scratch = max(B * dims(m, tp)["A"] if m.attention == "unfused" else 0, B * h if sp else 0)
    saved = layers + embedding + logits + scratch
    # The last layer's backward: the output side (logits, final norm, output-layer input) is gone.
    released = logits + head["final_norm"] + head["output_layer_input"]
    grads = backward_transients(m, tp, precision, device, min(tiles, s), fusions)
    exchange = 0.0
    if ulysses_sp > 1:  # one all-to-all in flight beside the attention's backward (estimate/ulysses.py)
        exchange = exchange_bytes(m, tp, precision)
        grads["attention"] = max(grads["attention"], exchange)
    # linear_proj's input is freed after its backward, unless the flash kernel saved the same tensor
    # (at Ulysses' sp > 1 it is the all-to-all's copy, ulysses_context, whatever the kernel).
    flash = m.attention == "sdpa" and sdpa_kernel(m, device) == "flash"
    context = (terms.get("ulysses_context", 0) if (flash and recompute != Recompute.selective)
               else terms["attention_context"])
    rebuilt_mlp = recomputed if recompute in (Recompute.full, Recompute.op) else 0.0
    incoming = B * h  # the gradient of the layer's output, flowing into its backward
    moments = {
        "end_of_forward": saved + max(transient, incoming),
        "mlp_backward": saved - released + rebuilt_mlp + incoming + grads["mlp"],
        "attention_backward": (saved - released - mlp_part(terms) - terms["attention_dropout_mask"] - context
                               + (0.0 if block else recomputed) + incoming + grads["attention"]),
    }
    if loss in ("bf16", "fp32"):
        # torch's cross entropy differentiated: the log-probabilities' gradient and the logits'
        # (megatron's loss writes its gradient into the softmax it kept; chunked, one chunk's)
        moments["loss_backward"] = saved + 2 * softmax
    if block:
        moments["block_rebuild"] = embedding + scratch + kept_inputs + recomputed + incoming + grads["mlp"]
    out = {"per_layer": sum(terms.values()), "layers": layers, "recomputed": recomputed, "embedding": embedding,
           "logits": logits, "logits_transient": transient, "scratch": scratch, "host": host, "saved": saved,
           **moments, "total": max(moments.values())}
    if ulysses_sp > 1:
        out["ulysses_exchange"] = exchange
    # Ulysses (sp > 1): a rank keeps seq_len / sp tokens of each sequence; after the all-to-all its
    # attention holds every token of heads / sp heads, the same bytes per local token (the unfused
    # scores a * s per token: "A" stays the whole sequence's), plus what the exchange changes in the
    # layer's terms (estimate/ulysses.py: the context copy, repeated K/V) and its transient.
    return {k: int(round(v * s / ulysses_sp)) for k, v in out.items()}
