"""FSDP2's memory per rank (engine=fsdp2): exact model states and the phases of a step.

Notation (elements of one tensor-parallel shard): P parameters; R the root group (word embedding
V/tp x h, learned positions S x h, the final norm, an untied output layer V/tp x h); G one
transformer layer (the largest, where MoE and dense layers mix); L layers; b the compute dtype's
bytes (fp32 4, bf16 2); dp ranks. Every shape is models/params.py's, for every model family.

Model states (exact, what engines/fsdp2.count_states reports; FSDP2 pads each shard to
ceil(dim0 / dp) rows):
  params (fp32) or master (bf16): 4 * sum ceil(d0/dp) * rest                ~ 4P/dp
  optimizer: AdamW's m and v on the unpadded local shard + a 4-byte step each  ~ 8P/dp
  grads (sharded fp32, from the reduce-scatter to the step):                   ~ 4P/dp
  = 12P/dp between steps, 16P/dp at the step, fp32 and bf16 alike (no 16-bit copy persists).

Transient, measured on CPU with FSDP2's record_function ranges (issue 29's prototype) and read in
torch 2.13's torch/distributed/fsdp/_fully_shard:
- the root group is gathered through the whole forward and backward (b*R: the root is not resharded
  after forward, _fsdp_state.py _lazy_init), and the output layer's unsharded gradient (tied: the
  word embedding's) with the final norm's lives from the output layer's backward to the end
  (b*R_out; FSDP2 reduce-scatters the root's gradients last);
- in forward each group's all-gather output is freed only after the next group's copy-out
  (_fsdp_param_group.py wait_for_unshard, AllGatherState), the last layer's only when the root's
  forward returns (_fsdp_state.py _post_forward): megatron computes the loss inside GPTModel's
  forward, so one layer's all-gather output (b*G) is alive while it does;
- zero=3: in backward the layer being differentiated plus the one FSDP2 prefetches (the root's
  pre-backward prefetches the top layer: its all-gather output is alive from the loss's backward
  on); on CPU, gloo's all_gather_into_tensor allocates a second output-sized buffer; the previous
  layer's reduce-scatter input (fp32, 4G) is held until the next reduce-scatter;
- zero=2: every layer stays gathered from its forward to its own backward (b*P at forward's end);
- grad_accum > 1: the sharded gradients of the micro-batches before are accumulated into
  (_fsdp_collectives.py foreach_reduce, `grad._local_tensor += new_sharded_grad`), so every
  phase of the last micro-batch holds all of them (4P/dp), not only the layers reduced so far.
The peak is the largest of these phases (`phases`), on top of the persistent 12P/dp; act: the
activations of estimate/activations.py (saved: every layer's, the embedding's, the loss's, the
attention's scratch buffer), per sample:
  forward_end:    bR + b*G (the last all-gather) (+ z2: L*bG)   + saved + the loss's transient logits
  loss_backward:  bR + (z3: bG | z2: L*bG)                      + saved + the cross entropy's two
                  gradients (torch's losses, loss=bf16 / fp32: activations.py's loss_backward)
  backward_start: bR + bR_out + (z3: bG | z2: L*bG)             + saved - the loss's softmax + the
                  logits' gradient B*V + the output layer's input gradient B*h
  layer_i (the pre-backward of layer i, which prefetches layer i-1):
                  bR + bR_out + (z3: bG + bG (+ bG gloo) | z2: (i+1)*bG) + [i < L-1] 4G
                  + (L-1-i) * 4G/dp (sharded gradients of the layers above) + activations of layers
                  0..i + the layer i rebuilds where it is recomputed + the scratch buffer
  step:           4P/dp (all sharded gradients) + AdamW's temporaries (CPU: single-tensor AdamW)
With recompute=block the first recompute_layers (n) layers keep their inputs and are rebuilt in
their own backward, the others keep everything and rebuild nothing (megatron's block method): a
layer phase holds min(i+1, n) inputs, max(0, i+1-n) whole layers, and a rebuilt layer for i < n.
With recompute=full of k layers per checkpoint (megatron's uniform method) layer i holds the inputs
of checkpoints 0..i//k and its own checkpoint rebuilt less the layers above i in it; at zero=3 those
rebuilt layers stay gathered too (FSDP2's post_forward reshards nothing during backward's
recompute: layers k*(i//k)..i, where the formula otherwise counts two).
Every layer phase is linear in i between the breaks (n-1 | n with block; L-2 | L-1, where the held
reduce-scatter input ends; with k per checkpoint, within a checkpoint and from one checkpoint's top
to the next), so its maximum is at i = L-1, L-2, 1, n-1 or n (k: also L-k and k-1): only those are kept.
Activations are megatron's, as for ZeRO (estimate/activations.py; measured per-sample slopes equal
ZeRO-3's), FSDP2's bf16 (fp32 shards, MixedPrecisionPolicy) keeping what DeepSpeed's bf16 module
keeps: the logits follow the `loss` recipe as there (megatron: the fp32 softmax 4V and at the end
of the forward the 16-bit logits beside it; chunked: none, one chunk's as a buffer). Left out: the
gradients inside one layer's backward (with recompute=full the peak moves there: -5 % on gpt-mini).
How close this comes to CPU measurements: docs/engines.md, "The estimate for FSDP2".

Where each parameter is sharded is the layout's answer (config/layout.py RankLayout.partition_ranks):
over the shard group (dp, or dp_shard with hybrid sharding), and with expert parallelism
(parallel.ep > 1, tp 1) a rank's num_experts / ep routed experts per MoE layer (models/params.py,
Param.expert) over the dp / ep ranks that hold the same experts (the expert-data-parallel mesh),
each parameter's dim 0 padded to a multiple of its own shard count. A layer's gathered group is its
dense parameters and its local experts (G above, with E / ep experts). Hybrid sharding with ep > 1
is refused (RankLayout), so dp is all data-parallel ranks there.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import BenchConfig, Device, Loss, Recompute
from zero_bench.estimate.activations import (activation_bytes_per_sample, bench_activations, layers_per_checkpoint,
                                             loss_chunk_bytes, output_layer_backward, sequence_args)
from zero_bench.estimate.prediction import Buffer, Phase, PhaseBytes, Prediction, causal_mask
from zero_bench.estimate.states import master_bytes, moment_bytes
from zero_bench.models.params import ROOT, Param
from zero_bench.records import ModelStates
from zero_bench.units import BYTES

ADAM_TEMPORARIES = 2  # single-tensor AdamW: sqrt(v), then its quotient, of one parameter's shard


def groups(layout: RankLayout) -> dict[str, list[Param]]:
    """One rank's parameters by FSDP2 group ("root", "layer0", ...), from the layout's list
    (with ep > 1 each MoE layer's group holds the rank's E / ep experts)."""
    out: dict[str, list[Param]] = {}
    for p in layout.params:
        out.setdefault(p.group, []).append(p)
    return out


def _shard(p: Param, layout: RankLayout, rank: int, padded: bool) -> int:
    """Elements of p's shard on `rank` (a rank of the shard group) over the ranks the layout shards it on."""
    return shard_elems(p.shape, layout.partition_ranks(p), layout.partition_index(p, rank), padded)


def local_numel(layout: RankLayout, rank: int = 0) -> int:
    """Elements of `rank`'s unpadded shards, what engines/fsdp2.count_states reports as numel_local
    (over the dp ranks at tp 1 they add up to num_params, ep or not)."""
    return sum(_shard(p, layout, rank, padded=False) for p in layout.params)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def shard_elems(shape: tuple[int, ...], dp: int, rank: int, padded: bool) -> int:
    """Elements of one parameter's dim-0 shard on `rank` (torch.chunk; padded to chunk 0's size)."""
    rows = -(-shape[0] // dp)
    if not padded:
        rows = max(0, min(rows, shape[0] - rank * rows))
    return rows * _numel(shape[1:])


def model_states(layout: RankLayout, precision: str = "fp32", offload: bool = False, rank: int = 0,
                 states: str = "mixed") -> ModelStates:
    """Exact bytes of one rank's states (rank 0 holds the most), the record estimate/states.py
    gives for ZeRO: params, grads (at the step), master, moments, and host; each parameter sharded
    over the ranks the layout says (RankLayout.partition_ranks: the shard group, dp / ep for a
    routed expert's with ep > 1).
    offload (CPUOffloadPolicy): all of them in host memory. states=bf16 (pure bf16): the shards,
    gradients and AdamW's moments in bf16, no master; adam8bit: 8-bit moments, fp32 shards."""
    every = layout.params
    w = master_bytes(states)  # the sharded parameters' dtype (the master with mixed bf16)
    held = w * sum(_shard(p, layout, rank, padded=True) for p in every)
    moments = sum(moment_bytes(_shard(p, layout, rank, padded=False), states, w) for p in every) + 4 * len(every)
    mixed = precision == "bf16" and states != "bf16"
    weights, master = (0, held) if mixed else (held, 0)
    out = ModelStates(params=weights, master=master, moments=int(moments), grads=held)
    return dataclasses.replace(out, host=out.total if offload else 0)


def layer_phases(L: int, block: int = 0, chunk: int = 1) -> dict[Phase, int]:
    """The layer phases kept (phase -> i): the top layer, the one below it, and layer 1; with
    recompute=block of `block` layers also the top recomputed layer and the lowest kept one; with
    recompute=full of `chunk` layers per checkpoint also the lowest layer of the top checkpoint and
    the top layer of the lowest one (a layer phase is linear in i within a checkpoint and from one
    checkpoint's top to the next: its maximum is at one of these)."""
    out: dict[Phase, int] = {}
    named = [(Phase.layer_last, L - 1), (Phase.layer_next, L - 2), (Phase.layer_first, 1)]
    if 0 < block < L:
        named += [(Phase.layer_recomputed_top, block - 1), (Phase.layer_kept_lowest, block)]
    if 1 < chunk < L:
        named += [(Phase.layer_chunk_lowest, L - chunk), (Phase.layer_first_chunk_top, chunk - 1)]
    for name, i in named:
        if 1 <= i <= L - 1 and i not in out.values():
            out[name] = i
    return out


def stored_states(s: BenchConfig) -> ModelStates:
    """model_states for a stored config as the report reads it (config.stored.stored_config): the
    fsdp2 spec's stored_states. Sharded over the shard group (hybrid sharding: dp_shard ranks)."""
    return model_states(s.layout.largest_stage, s.precision, s.offload, states=s.states)


def predict(bench: BenchConfig, ds: Optional[Mapping] = None) -> Prediction:
    """engine=fsdp2's prediction for one rank (its spec's `predict`; `ds` unread: no DeepSpeed
    config): states, buffers (gathered parameters, unsharded gradients), the gradients and the
    activation bytes per sample of each phase, and the peak while the model is built."""
    # every state is sharded over the shard group (hybrid sharding: dp_shard ranks), not all dp
    # ranks, the experts over dp / ep ranks (the layout's partition_ranks)
    m, tp, layout = bench.model, bench.parallel.tp, bench.layout
    on_cpu = bench.hardware.device == Device.cpu
    states = model_states(layout, bench.precision, bench.offload, states=bench.states)
    g = groups(layout)
    root, layer = g.pop(ROOT, []), max(g.values(), key=lambda ps: sum(p.numel for p in ps))
    b, L = BYTES[bench.precision], len(layout.stage_layers())  # a pipeline stage's layers (all at pp 1)
    R, G = sum(p.numel for p in root), sum(p.numel for p in layer)
    # Sharded gradients live in host memory with offload on a GPU: none on the device.
    dev_grads = 0 if bench.offload and not on_cpu else 1
    w = master_bytes(bench.states)  # sharded parameters, gradients and the update: fp32 or pure bf16
    layer_grads = dev_grads * w * sum(_shard(p, layout, 0, padded=True) for p in layer)
    block = bench.recompute_layers if bench.recompute == Recompute.block and bench.recompute_layers < L else 0
    layers = layer_phases(L, block, chunk_layers(bench, L))
    torch_loss = bench.loss in (Loss.bf16, Loss.fp32)  # activations.py's loss_backward moment
    head = (Phase.forward_end,) + ((Phase.loss_backward,) if torch_loss else ()) + (Phase.backward_start,)
    buffers = _buffers(bench, b, R, G, layers, on_cpu, head)
    if bench.loss == Loss.chunked:
        buffers.append(Buffer("loss_chunk", loss_chunk_bytes(m, bench.precision),
                              (Phase.forward_end, Phase.backward_start), "loss=chunked: one chunk's logits"))
    buffers.append(Buffer("root_grads", b * sum(p.numel for p in root if _graded_first(p, m.tie_embeddings)),
                          (Phase.backward_start, *layers), "the output layer's and the final norm's unsharded gradients"))
    if on_cpu:  # fused AdamW (GPU) makes no temporaries
        largest = max(_shard(p, layout, 0, padded=True) for p in root + layer)
        buffers.append(Buffer("adamw_temporaries", ADAM_TEMPORARIES * w * largest, (Phase.step,),
                              "single-tensor AdamW's temporaries of the largest shard"))
    act = bench_activations(bench)
    # recompute_offload: the inputs on the host, which on CPU is the memory measured
    host = act["host"] if on_cpu else 0
    saved = act["saved"] + host
    out = output_layer_backward(m, tp, bench.precision, bench.loss, layout.sp)
    # grad_accum > 1: the last micro-batch accumulates into every sharded gradient of the ones before
    held = dev_grads * states.grads if bench.batch.grad_accum > 1 else 0
    phases = {Phase.forward_end: PhaseBytes(held, saved + act["logits_transient"])}
    if torch_loss:  # torch's cross entropy differentiated, before the output layer's backward
        phases[Phase.loss_backward] = PhaseBytes(held, act["loss_backward"] + host)
    phases[Phase.backward_start] = PhaseBytes(held, saved - out["softmax"] + out["logits_grad"] + out["input_grad"])
    by_layer = _layer_activations(bench, act, host, block)
    for n, i in layers.items():
        phases[n] = PhaseBytes(int(held or (L - 1 - i) * layer_grads),
                               int(by_layer(i) + act["embedding"] + act["scratch"]))
    phases[Phase.step] = PhaseBytes(int(dev_grads * states.grads))
    buffers += causal_mask(m, phases)
    P = R + sum(p.numel for ps in g.values() for p in ps)
    return Prediction(states=states, buffers=buffers, phases=phases, activations=act,
                      act_per_sample=max(v.per_sample for v in phases.values()),
                      init_peak=init_peak(bench, R, G, P - R, _per_rank(layer, layout),
                                          _per_rank([p for ps in g.values() for p in ps], layout)),
                      phase_grads=dev_grads * states.grads, held_across_micro_batches=held)


def _per_rank(ps: list[Param], layout: RankLayout) -> int:
    """Elements of these parameters per rank, each group of shard ranks divided evenly (no padding):
    sum // shard_size at ep 1."""
    by: dict[int, int] = {}
    for p in ps:
        n = layout.partition_ranks(p)
        by[n] = by.get(n, 0) + p.numel
    return sum(total // n for n, total in by.items())


def init_peak(bench: BenchConfig, R: int, G: int, layers: int, G_shard: Optional[int] = None,
              layers_shard: Optional[int] = None) -> int:
    """The build's peak (engines/fsdp2: each layer sharded as megatron builds it, the root last), fp32:
    the root whole (the embeddings are built first, the output layer last) and every layer's shard,
    plus the larger of one layer whole while it is sharded and the root's own shards as they are
    made. With offload on a GPU the shards go to the host: the device sees the root and one layer.
    G_shard, layers_shard: one layer's and all layers' elements per rank (ep > 1: the experts over
    dp / ep ranks); None: G // dp, layers // dp, dp the shard group (RankLayout.shard_size)."""
    dp = bench.layout.shard_size
    if bench.offload and bench.hardware.device != Device.cpu:
        return 4 * (R + G)
    G_shard = G // dp if G_shard is None else G_shard
    layers_shard = layers // dp if layers_shard is None else layers_shard
    return 4 * (R + layers_shard + max(G + G_shard, R // dp))


def _graded_first(p: Param, tied: bool) -> bool:
    """A root parameter whose unsharded gradient lives from the start of backward to its end (FSDP2
    reduce-scatters the root's gradients after the whole backward): the output layer's weight (tied:
    the word embedding it reuses) and the final norm. The embeddings' own gradients come last, when
    the activations are gone."""
    return not p.name.startswith("embedding.") or (tied and p.name == "embedding.word_embeddings.weight")


def _buffers(bench: BenchConfig, b: int, R: int, G: int, layers: dict[Phase, int], on_cpu: bool,
             head: tuple[Phase, ...]) -> list[Buffer]:
    """Gathered parameters and unsharded gradients, each with the phases it is alive in. head: the
    phases before the layers' backward (forward_end, loss_backward where torch's loss runs,
    backward_start)."""
    L, names, bR, bG = len(bench.layout.stage_layers()), tuple(layers), b * R, b * G
    after_forward = tuple(p for p in head if p != Phase.forward_end)
    out = [Buffer("root_gathered", bR, head + names, "the root group, gathered through forward and backward"),
           # each forward all-gather's output is freed after the next one's copy-out, the last
           # layer's when the root's forward returns: after megatron's loss, computed inside it
           Buffer("forward_allgather_output", bG, (Phase.forward_end,),
                  "the last layer's all-gather output, freed after the root's forward")]
    if bench.zero == 3:
        # the root's pre-backward prefetches the top layer: its all-gather output from the loss's backward on
        out.append(Buffer("layer_gathered", bG, after_forward + names, "the layer in backward"))
        out.append(Buffer("layer_prefetched", bG, names, "the layer FSDP2 prefetches"))
        k = chunk_layers(bench, L)
        for n, i in layers.items():
            if i % k >= 2:  # layers k*c..i gathered: two counted above (i and the prefetched i - 1)
                out.append(Buffer(f"rebuilt_chunk_gathered_{i}", (i % k - 1) * bG, (n,),
                                  "recompute=full, recompute_layers > 2: FSDP2 reshards nothing in backward's "
                                  "recompute (post_forward under is_bw), the rebuilt checkpoint's layers below "
                                  "stay gathered to their own backward"))
        # FSDP2 skips the all-gather over a shard group of one rank (FSDPParamGroup._all_gather's
        # world_size == 1 branch: the unsharded parameters are copied from the sharded ones), so gloo
        # copies nothing there (measured under a pipeline at dp 1: estimate/pipeline.py)
        if on_cpu and bench.layout.shard_size > 1:
            out.append(Buffer("gloo_allgather_copy", bG, names, "gloo's all_gather_into_tensor output copy"))
    else:  # zero=2: layers 0..i stay gathered until their own backward
        for n, i in layers.items():
            out.append(Buffer(f"layers_0_{i}_gathered", (i + 1) * bG, (n,) + (head if i == L - 1 else ()),
                              "zero=2: every layer gathered from its forward to its backward"))
        if L - 1 not in layers.values():
            out.append(Buffer(f"layers_0_{L - 1}_gathered", L * bG, head,
                              "zero=2: every layer gathered from its forward to its backward"))
    held = tuple(n for n, i in layers.items() if i < L - 1)
    if held:
        # reduced in fp32 whatever the compute dtype; pure bf16 reduces in bf16
        out.append(Buffer("held_reduce_scatter_input", master_bytes(bench.states) * G, held,
                          "the previous layer's reduce-scatter input, held to the next"))
    return out


def chunk_layers(bench: BenchConfig, L: int) -> int:
    """Layers per checkpoint of the stage's L (activations.layers_per_checkpoint)."""
    return layers_per_checkpoint(bench.recompute, bench.recompute_layers, L)


def _whole_layer(bench: BenchConfig, L: int) -> float:
    """Activation bytes per sample one layer keeps without recompute (the mean over the stage's layers)."""
    a = activation_bytes_per_sample(bench.model, bench.parallel.tp, bench.precision, Recompute.none,
                                    device=bench.hardware.device, loss=bench.loss, fusions=bench.fusions,
                                    **sequence_args(bench))
    return a["layers"] / L


def _layer_activations(bench: BenchConfig, act: dict, host: int, block: int):
    """i -> the activation bytes per sample of layers 0..i in layer i's backward, the layer it
    rebuilds included. recompute=block (`block` layers, megatron's block method: the first ones are
    checkpointed): min(i+1, block) inputs, the layers above whole, a rebuilt layer only for i <
    block. Otherwise every layer keeps what recompute leaves (evenly) and one is rebuilt (none: 0)."""
    L = len(bench.layout.stage_layers())
    k = chunk_layers(bench, L)
    checkpoints = block or -(-L // k)
    # recompute_offload on CPU: the rebuilt checkpoint's input, brought back for a GPU, is among the
    # kept inputs already (the host is the device)
    rebuilt = act["recomputed"] - (host / checkpoints if host else 0)
    if not block:
        kept = (act["layers"] + host) / checkpoints  # one per layer, or per checkpoint of k layers
        if k == 1:
            return lambda i: (i + 1) * kept + rebuilt
        # layer i is layer i % k of checkpoint i // k: the inputs of checkpoints 0..i // k, and the
        # rebuilt chunk less its layers above i, freed by their own backward
        whole = _whole_layer(bench, L)
        return lambda i: (i // k + 1) * kept + rebuilt - (k - 1 - i % k) * whole
    per_layer = {}
    for kind in (Recompute.full, Recompute.none):  # the layers' inputs; the layers whole
        a = activation_bytes_per_sample(bench.model, bench.parallel.tp, bench.precision, kind,
                                        device=bench.hardware.device, loss=bench.loss, fusions=bench.fusions,
                                        **sequence_args(bench))
        per_layer[kind] = (a["layers"] + (a["host"] if host else 0)) / L
    inputs, whole = per_layer[Recompute.full], per_layer[Recompute.none]
    return lambda i: min(i + 1, block) * inputs + max(0, i + 1 - block) * whole + (rebuilt if i < block else 0)
