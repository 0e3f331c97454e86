"""The loss as a training loop builds it from the logits (`loss`), on megatron's GPTModel.

megatron   megatron's vocab-parallel cross entropy: the 16-bit logits, an fp32 copy inside the loss,
           whose softmax it keeps for backward (4 bytes per token and vocabulary row)
bf16       torch's cross entropy on the logits as the output layer makes them (bf16 training: its
           log-softmax in bf16 kept for backward, 2 bytes per row)
fp32       the logits upcast to fp32, then torch's cross entropy (Hugging Face's and torchtitan's
           loops): its fp32 log-softmax kept, and at the end of the forward the 16-bit logits,
           their fp32 copy and the log-softmax alive together
chunked    the output layer and the loss computed CHUNK_TOKENS tokens at a time, each chunk under a
           checkpoint (Liger's and torchtune's way): no logits kept for backward, one chunk's alive

chunked stays torch's checkpoint per chunk rather than DeepSpeed 0.19.8's TiledFusedLogitsLoss
(ulysses_sp.py, ALST's tiled logits + loss), which does not fit a training step here: it returns
the mean over its shards, not the per-token losses GPTModel hands back; it runs the backward
inside the forward and scales only the hidden states' gradient by the incoming one, so the output
weight's gradient misses the engine's 1/grad_accum and fp16 loss scale (measured on CPU with the
loss divided by 4: the weight's gradient 4.0x torch's, the hidden states' 1.0x); and that gradient
is accumulated during the forward, where ZeRO's and FSDP2's reduce hooks do not expect it.

Each is real in trials: the output layer's forward is replaced on the instance (its parameter and
name stay, so ZeRO-3's and FSDP2's hooks still gather the weight around it) and computes the
per-token loss itself from the labels GPTModel is called with; compute_language_model_loss then
passes that loss through. tp 1 (configure refuses the rest: the vocabulary would be split).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 256  # tokens per chunk: one chunk of Llama-3 logits (V 128256) is 0.33 GB in flight


def install_loss(gpt: torch.nn.Module, kind: str) -> None:
    """Make `gpt` (a GPTModel at tp 1) compute its loss the `kind` way; megatron's is left alone."""
    if kind == "megatron":
        return
    head = gpt.output_layer
    labels: dict = {}

    def keep_labels(module, args, kwargs):
        labels["now"] = kwargs.get("labels")

    gpt.register_forward_pre_hook(keep_labels, with_kwargs=True)
    head.forward = functools.partial(_token_losses, head, labels, kind)
    # GPTModel hands the output layer's result to compute_language_model_loss: here already the loss
    gpt.compute_language_model_loss = lambda _labels, losses: losses.transpose(0, 1).contiguous()


def _token_losses(head, labels: dict, kind: str, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
    """[s, b] per-token losses from the final hidden states [s, b, h] (the output layer's forward)."""
    w = head.weight if weight is None else weight
    target = labels["now"].transpose(0, 1)  # [b, s] -> [s, b], as megatron's loss transposes them
    if kind == "chunked":
        flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        parts = [checkpoint(_cross_entropy, flat_h[i:i + CHUNK_TOKENS], w, flat_t[i:i + CHUNK_TOKENS], "fp32",
                            use_reentrant=False)
                 for i in range(0, flat_h.shape[0], CHUNK_TOKENS)]
        return torch.cat(parts).view(target.shape), None
    return _cross_entropy(hidden, w, target, kind).view(target.shape), None


def _cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    if kind != "bf16":
        logits = logits.float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.reshape(-1), reduction="none").float()
