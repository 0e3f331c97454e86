"""Pipeline parallelism (parallel.pp > 1) in the memory estimate: each stage's memory, the largest
one the rank's peak.

A stage is the tp x dp ranks of one pipeline rank. What each holds (config/layout.py RankLayout,
`stage_params` / `stage_layers`): num_layers / pp layers (interleaved: vpp chunks of num_layers /
(pp x vpp) layers, chunk c of rank r being virtual stage c x pp + r, megatron's
get_transformer_layer_offset), the embedding on the first, the final norm and the output layer on
the last, and with tied embeddings a second copy of the word embedding on the last (megatron-core's
output_layer.weight there, kept equal through the embedding group's gradient all-reduce). The
engine's estimate (estimate/deepspeed.py, estimate/fsdp2.py) runs unchanged on a config whose
layout is the stage's (`stage_bench`): its states, ZeRO partitions over the stage's dp ranks, FSDP2's
per-layer groups, its buffers, and one micro-batch's activations of the stage's layers
(activations.py: the embedding only on the first stage, the logits and the loss only on the last).
`pipelined` then adds what the schedule changes:

- Micro-batches in flight (`in_flight`), in micro-batches' worth of the stage's activations:
    gpipe       all m (batch.grad_accum) forwards before the first backward (Huang et al. 2019,
                GPipe; torch.distributed.pipelining ScheduleGPipe)
    1f1b        min(pp - stage, m) on stage `stage` (0-based): pp - stage - 1 warm-up forwards and
                one more before the first backward (Narayanan et al. 2021, PipeDream-Flush;
                megatron-core schedules.py forward_backward_pipelining_without_interleaving:
                num_warmup_microbatches = pp - rank - 1; torch's Schedule1F1B alike)
    interleaved min(2 (pp - stage - 1) + (vpp - 1) pp + 1, m vpp) chunk micro-batches (of
                num_layers / (pp vpp) layers each): megatron-core's
                forward_backward_pipelining_with_interleaving warm-up (microbatch_group_size_per_vp_stage
                = pp) + 1, forward k on chunk (k mod pp vpp) // pp (chunks_in_flight); in the stage's
                activations that is (warm-up + 1) / vpp, on stage 0 pp + (pp - 1) / vpp = pp x (1 +
                (pp - 1) / (pp vpp)), Korthikanti et al. 2022, section 4.2.3 ("Reducing Activation
                Recomputation in Large Transformer Models").
  The micro-batch in backward is at its peak moment (activations.py's total); each other one in
  flight holds what its forward saved (extra_in_flight: per chunk, its layers' share, the
  embedding on virtual stage 0, the final norm, output layer's input and logits on the last; not the
  scratch buffer megatron's GlobalMemoryBuffer keeps once per rank), in every phase with
  activations. So with interleaving the last rank holds one micro-batch's logits, not (warm-up + 1)
  / vpp of them.
- Point-to-point buffers, as torch.distributed.pipelining allocates them (torch 2.13, stage.py
  PipelineStage._setup_forward_recv_info and _create_grad_recv_info, called for each of the m
  micro-batches at the first step and kept): every stage but the first holds m activation receive
  buffers, every stage but the last m gradient receive buffers, each one micro-batch's hidden
  states [micro, seq_len / (sp x tp with sequence parallelism), h] in the activation dtype; per
  model chunk with interleaving. The receive buffers of the micro-batches in flight are those
  micro-batches' inputs, counted with their activations: not again. (megatron's own p2p, which
  allocates a receive tensor per transfer, holds about one each way.)
- Gradients across micro-batches: with 1f1b or interleaving, a stage runs backwards before its last
  forward (m > in_flight), so every micro-batch's forward and backward after the first backward run
  beside the stage's whole gradients: DeepSpeed's phase with the activations counts them all
  (gpipe, and m <= in_flight, keep the first backward's).
- FSDP2 under torch.distributed.pipelining (stage.py backward_maybe_with_nosync): every backward
  runs with set_requires_gradient_sync(False) and set_reshard_after_backward(False); the
  reduce-scatter and the reshard come once, after the last backward (perform_reduce_grad). So:
  the stage's first backward gathers each layer as at pp = 1 (the engine's per-layer buffers, with
  the micro-batches in flight), holds no sharded gradient and no reduce-scatter input, and keeps
  the layers above the one in backward unsharded with their unsharded gradients; every later
  backward (`later_in_flight`: 1f1b's steady state and cool-down, GPipe's second on) runs beside
  the whole stage's unsharded gradients (the reduce dtype: FSDPParam.to_accumulated_grad_if_needed)
  and either the whole stage's unsharded parameters (no forward since the first backward) or, where
  a forward ran in between and zero=3 resharded each layer after it (FSDPParamGroup.post_forward),
  the per-layer gathers again (phase pipeline_backward). pipeline_reduce is the final
  reduce-scatter: the unsharded parameters and gradients beside the sharded gradients it writes.
  Measured (llama-tiny, pp=2, fp32, 1F1B, micro 1 / 2, each micro-batch's forward and backward marked
  apart): stage 0's peak is its first backward (2 micro-batches in flight, 48.7 / 73.4 MiB live),
  its second 45.5 / 58.8 (the whole parameters and gradients unsharded: 12.8 MiB above the states);
  stage 1's is its second backward (42.8 / 56.1), the first 37.9 / 50.9: 5 MiB less, its layers'
  gradients. Counting every parameter and gradient unsharded in every phase with activations (the
  bound this replaced) put stage 0 15 % / 8 % above the measurement.

Not modelled: a stage's unequal layer split (megatron's account_for_embedding_in_pipeline_split and
friends; pp x vpp must divide num_layers), zero-bubble schedules, megatron's deallocate_output_tensor
(it frees a sent output's data; torch's stages keep the output until its backward, as counted).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from zero_bench.config.schema import BenchConfig, PipelineSchedule
from zero_bench.engines.specs import spec
from zero_bench.estimate.prediction import Buffer, Phase, PhaseBytes, Prediction
from zero_bench.estimate.states import master_bytes
from zero_bench.units import BYTES


def nosync_sharded(bench: BenchConfig) -> bool:
    """The engine is FSDP2 (fully_shard), which torch.distributed.pipelining drives with its no-sync,
    no-reshard backward (stage.py backward_maybe_with_nosync's FSDPModule branch): asked of the
    engine's spec, as the one engine that reads no DeepSpeed config. (engines/specs.py is the
    training side's; an EngineSpec field saying how a pipeline drives the engine belongs there once
    pipelines train.)"""
    return not spec(bench.engine).reads_ds_config


def micro_batches(bench: BenchConfig) -> int:
    """The micro-batches one pipeline step runs through the stages: batch.grad_accum."""
    return bench.batch.grad_accum


def round_size(pp: int, m: int) -> int:
    """Micro-batches per round of an interleaved schedule: pp where m is a multiple of it (megatron's
    microbatch_group_size_per_vp_stage), torch's m // max(1, m // pp) in general
    (ScheduleInterleaved1F1B's microbatches_per_round)."""
    return m // max(1, m // pp)


def warmup_chunks(schedule: str, pp: int, vpp: int, stage: int, m: int) -> int:
    """Forwards (of one model chunk each) a stage runs before its first backward, as megatron-core's
    and torch's schedules count them (before the cap by the micro-batches)."""
    if schedule == PipelineSchedule.interleaved_1f1b:
        return 2 * (pp - stage - 1) + (vpp - 1) * round_size(pp, m)
    return pp - stage - 1


def chunks_in_flight(schedule: str, pp: int, vpp: int, stage: int, m: int) -> list[int]:
    """Micro-batches in flight on each model chunk of the stage at its first backward: gpipe [m];
    1f1b [min(pp - stage, m)]; interleaved the warm-up's forwards and one more (at most m x vpp),
    forward k running chunk (k mod (g x vpp)) // g, g = round_size (pp where m is a multiple of
    it: megatron-core's get_model_chunk_id with microbatch_group_size_per_vp_stage = pp; torch's
    ScheduleInterleaved1F1B alike); the first backward runs the last chunk."""
    if pp == 1:
        return [1]
    if schedule == PipelineSchedule.gpipe:
        return [m] * vpp
    if schedule == PipelineSchedule.interleaved_1f1b:
        out, group = [0] * vpp, round_size(pp, m)
        for k in range(min(warmup_chunks(schedule, pp, vpp, stage, m) + 1, m * vpp)):
            out[(k % (group * vpp)) // group] += 1
        return out
    return [min(pp - stage, m)]


def in_flight(schedule: str, pp: int, vpp: int, stage: int, m: int) -> float:
    """Micro-batches' worth of the stage's activations alive at its peak (the module's docstring):
    gpipe m; 1f1b min(pp - stage, m); interleaved min(warm-up + 1, m x vpp) / vpp."""
    return sum(chunks_in_flight(schedule, pp, vpp, stage, m)) / max(1, vpp if pp > 1 else 1)


def extra_in_flight(bench: BenchConfig, act: dict, counts: list[int]) -> float:
    """Bytes per sample the micro-batches in flight beside the one in backward hold: each chunk's
    saved tensors times its micro-batches in flight, less the one micro-batch activations.py counts
    (a chunk's share: its layers, the embedding on virtual stage 0, the final norm, output layer's
    input and logits on the last virtual stage; the scratch buffer is one per rank)."""
    layout = bench.layout
    vpp, stage = len(counts), layout.stage or 0
    edge = act.get("embedding", 0)  # rank 0: the embedding's terms; the last rank: the head's
    out = 0.0
    for c, n in enumerate(counts):
        virtual = c * layout.pp + stage
        saved = act.get("layers", 0) / vpp
        if virtual == 0:
            saved += edge
        if virtual == layout.pp * layout.vpp - 1:
            saved += edge + act.get("logits", 0)
        out += (n - 1) * saved
    return max(0.0, out)


def stage_bench(bench: BenchConfig, stage: int) -> BenchConfig:
    """`bench` for the ranks of pipeline stage `stage`: a copy whose layout (the cached
    BenchConfig.layout) is RankLayout.at_stage(stage), so every estimate that reads bench.layout
    (the states, the buffers, FSDP2's groups, activations.sequence_args) answers for that stage."""
    out = dataclasses.replace(bench)
    out.__dict__["layout"] = bench.layout.at_stage(stage)  # functools.cached_property's slot
    return out


def boundary_bytes(bench: BenchConfig) -> int:
    """Bytes of one sample's hidden states between two stages: seq_len / sp tokens (/ tp with megatron's
    sequence parallelism, whose stages exchange their sequence shard) x hidden_size, activation dtype."""
    layout, m = bench.layout, bench.model
    return m.seq_len // (layout.sp * layout.seq_shard) * m.hidden_size * BYTES[bench.precision]


def p2p_per_sample(bench: BenchConfig, counts: list[int]) -> int:
    """The receive buffers' bytes per sample of the micro-batch (module docstring): m activation
    buffers on each model chunk but virtual stage 0, less the micro-batches in flight on it (their
    inputs, counted with their activations), and m gradient buffers on each chunk but the last
    virtual stage. counts: chunks_in_flight's."""
    layout, m = bench.layout, micro_batches(bench)
    pp, s = layout.pp, layout.stage or 0
    buffers = 0
    for c, n in enumerate(counts):
        virtual = c * pp + s
        buffers += (max(0, m - n) if virtual > 0 else 0) + (m if virtual < pp * layout.vpp - 1 else 0)
    return buffers * boundary_bytes(bench)


def later_in_flight(schedule: str, pp: int, vpp: int, stage: int, m: int) -> tuple[list[int], bool]:
    """Micro-batches in flight on each model chunk of the stage at its second backward ([] where it
    runs one backward), and whether a forward ran on the stage between its first backward and that
    one: gpipe m - 1, none; 1f1b (one forward between backwards in the steady state) min(pp - stage,
    m) where m exceeds it, else (the cool-down) one less; interleaved: the first backward's counts,
    a forward between (a bound)."""
    counts = chunks_in_flight(schedule, pp, vpp, stage, m)
    if schedule == PipelineSchedule.gpipe:
        out, between = [m - 1] * vpp, False
    elif schedule == PipelineSchedule.interleaved_1f1b:
        out, between = counts, True
    else:
        flight = counts[0]
        out, between = [flight if m > flight else flight - 1], m > flight
    return ([] if m * vpp <= 1 or not any(out) else out), between


def nosync_fsdp2(bench: BenchConfig, pred: Prediction, buffers: list, counts: list[int]) -> tuple[list, list[int]]:
    """FSDP2's buffers under torch.distributed.pipelining's no-sync, no-reshard backwards (module
    docstring), and the micro-batches in flight at a later backward ([]: none runs). The engine's
    per-layer gathers stay in its phases (the first backward's); held_reduce_scatter_input goes (no
    reduce-scatter until the last backward); layer i's phase adds the unsharded parameters and
    gradients of the layers above it; the whole stage's unsharded gradients, and its unsharded
    parameters unless a forward resharded them (zero=3), join pipeline_backward and pipeline_reduce."""
    from zero_bench.estimate.fsdp2 import groups, layer_phases
    from zero_bench.models.params import ROOT

    layout, p = bench.layout, bench.parallel
    m, stage = micro_batches(bench), layout.stage or 0
    later, between = later_in_flight(p.pp_schedule, layout.pp, layout.vpp, stage, m)
    b, w = BYTES[bench.precision], master_bytes(bench.states)
    whole = sum(q.numel for q in layout.params)
    g = groups(layout)
    g.pop(ROOT, None)
    G = max((sum(q.numel for q in ps) for ps in g.values()), default=0)
    L = len(layout.stage_layers())
    block = bench.recompute_layers if bench.recompute == "block" and bench.recompute_layers < L else 0
    out = [x for x in buffers if x.name != "held_reduce_scatter_input"]
    for name, i in layer_phases(L, block).items():
        if name in pred.phases and L - 1 - i > 0:
            out.append(Buffer(f"pipeline_unsharded_above_{i}", (L - 1 - i) * (b + w) * G, (name,),
                              "torch.distributed.pipelining: the layers above, not resharded after their backward, "
                              "with their unsharded gradients"))
    regathered = between and bench.zero == 3
    again = (Phase.pipeline_backward,) if later else ()
    if regathered:  # zero=3 resharded each layer after the forward in between: gathered again per layer
        out = [dataclasses.replace(x, phases=tuple(x.phases) + again)
               if x.name in ("root_gathered", "layer_gathered") else x for x in out]
    out += [Buffer("pipeline_unsharded_params", b * whole, (() if regathered else again) + (Phase.pipeline_reduce,),
                   "torch.distributed.pipelining: reshard_after_backward=False through the micro-batches"),
            Buffer("pipeline_unsharded_grads", w * whole, again + (Phase.pipeline_reduce,),
                   "torch.distributed.pipelining: requires_gradient_sync=False, accumulated in the reduce dtype")]
    return out, later


def pipelined(bench: BenchConfig, pred: Prediction) -> Prediction:
    """The engine's prediction for one stage (`bench`: stage_bench's) with what the schedule adds
    (module docstring): the micro-batches in flight, the p2p buffers, the gradients held across
    micro-batches; FSDP2's unsharded stage."""
    layout, p = bench.layout, bench.parallel
    m = micro_batches(bench)
    counts = chunks_in_flight(p.pp_schedule, layout.pp, layout.vpp, layout.stage or 0, m)
    flight = sum(counts) / layout.vpp
    extra = int(extra_in_flight(bench, pred.activations, counts))
    p2p = p2p_per_sample(bench, counts)
    fsdp2 = nosync_sharded(bench)
    steady = p.pp_schedule != PipelineSchedule.gpipe and m > flight  # a backward before the last forward
    phases, buffers = {}, list(pred.buffers)
    grads_after_backward = max((ph.grads for ph in pred.phases.values()), default=0)
    for name, ph in pred.phases.items():
        grads, per = ph.grads, ph.per_sample
        if per:
            per += extra
            if fsdp2:
                grads = 0  # no sharded gradient until the final reduce-scatter
            elif steady:
                grads = max(grads, grads_after_backward)
        phases[name] = PhaseBytes(int(grads), int(per + p2p))
    held = pred.held_across_micro_batches
    if fsdp2:
        buffers, later = nosync_fsdp2(bench, pred, buffers, counts)
        if later:  # a later backward: the micro-batch in backward and what the others in flight saved
            one = max(ph.per_sample for ph in pred.phases.values())
            phases[Phase.pipeline_backward] = PhaseBytes(0, int(one + extra_in_flight(bench, pred.activations, later)
                                                               + p2p))
        step = pred.phases.get(Phase.step)
        phases[Phase.pipeline_reduce] = PhaseBytes(step.grads if step else 0, p2p)
        held = 0
    act = {**pred.activations, "pipeline_in_flight": flight, "pipeline_extra_in_flight": extra, "p2p_buffers": p2p}
    return dataclasses.replace(pred, phases=phases, buffers=buffers, activations=act,
                               act_per_sample=max(v.per_sample for v in phases.values()),
                               held_across_micro_batches=held)


def refusal(bench: BenchConfig) -> str:
    """Why the estimate does not answer for this configuration under a pipeline ("" where it does):
    what no engine runs. DeepSpeed's PipelineEngine asserts ZeRO stage < 2 (deepspeed/runtime/pipe/
    engine.py: "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism")."""
    p = bench.parallel
    if p.pp > 1 and spec(bench.engine).reads_ds_config and bench.zero >= 2:  # DeepSpeed's engine
        return (f"zero={bench.zero}: DeepSpeed runs pipeline parallelism at ZeRO 0-1 only (its PipelineEngine refuses "
                f"ZeRO-2/3); allowed with parallel.pp={p.pp}: zero=0 or 1, or engine=fsdp2")
    return ""


def stage_name(stage: Optional[int], pp: int) -> str:
    """How the estimate names a stage: "stage 0 of 4"."""
    return "" if stage is None or pp == 1 else f"stage {stage} of {pp}"
