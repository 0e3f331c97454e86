"""Pipeline parallelism (parallel.pp > 1) in the time per optimizer step: one rank is one stage's, the
step is the slowest stage's work on its micro-batches, plus the pipeline's bubble and its sends.

- The stage: predict_time computes the layout's terms (the optimizer step, the data-parallel
  collectives, offload) on the slowest stage's layout (slowest_stage: its parameters, partitioned
  over its dp ranks), and `pipeline_terms` scales the terms of the layers' per-micro-batch work
  (forward, backward, recompute, memory-bound ops, the tensor-parallel, Ulysses and expert
  collectives: LAYER_WORK), which compute.py and comm.py count for the whole model, by the stage's
  share of the model's forward FLOPs (stage_share: its num_layers / pp layers' matmuls and
  attention, and on the last stage the output layer's 2 s V h; the embedding is a lookup). The
  slowest stage is the one with the largest share: the last one (the output layer) when the layers
  split evenly.
- The bubble: the pipeline's idle fill and drain, (pp - 1) / (m x vpp) of the stage's work on its m
  micro-batches (batch.grad_accum): Narayanan et al. 2021 ("Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", SC'21, section 2.2: the 1F1B bubble fraction
  (p - 1) / m, interleaved (p - 1) / (v m)); GPipe's is the same (p - 1) / m (Huang et al. 2019).
  Exposed: nothing runs in it.
- The sends: each micro-batch's hidden states [micro, seq_len / (sp x tp with sequence
  parallelism), h] in the activation dtype cross each stage boundary forward, their gradient
  backward; a rank sends and receives one of each per micro-batch per model chunk (vpp with
  interleaving). Neighbouring stages are tp x dp ranks apart (ranks laid out tp fastest, then dp,
  then pp: RankLayout.spans["pp_hop"]), so intra-node only where one hop stays on a node. Exposed
  (megatron's p2p waits for them; its overlap_p2p_comm is not modelled).
- FSDP2 under torch.distributed.pipelining (fsdp2_collective): one reduce-scatter a step, after
  the last backward (exposed), the parameters gathered once a step (zero=2) or once per forward.
- Tied embeddings: the first and the last stage all-reduce the word embedding's gradient
  (megatron's embedding group, LanguageModule: _allreduce_word_embedding_grads) once a step.
MFU and tokens/s divide by the world tp x dp x pp (predict_time, ParallelConfig.world_size).
"""
from __future__ import annotations

from zero_bench.config.schema import BenchConfig
from zero_bench.devices.rates import HardwareRates
from zero_bench.estimate.pipeline import boundary_bytes, nosync_sharded, stage_bench
from zero_bench.estimate.time.comm import ALL_REDUCE, collective, link
from zero_bench.estimate.time.record import TimeTerm
from zero_bench.models.flops import attention_flops_per_seq, dense_flops_per_seq

# the terms of the layers' work per micro-batch (compute.py, comm.py), by their names' start
LAYER_WORK = ("forward", "backward", "recompute", "tensor-parallel", "Ulysses", "expert")
BUBBLE_SOURCE = ("Narayanan et al. 2021 (Megatron-LM, SC'21) sec. 2.2: (pp - 1) / (m x vpp) of the stage's "
                 "work; GPipe (Huang et al. 2019) (pp - 1) / m")


def stage_share(bench: BenchConfig, stage: int) -> float:
    """Of the model's forward FLOPs per sequence, those of pipeline stage `stage`: its layers' share of
    the layers' matmuls and attention, and on the last stage the output layer's."""
    m, layout = bench.model, bench.layout
    head = 2 * m.seq_len * m.padded_vocab(1) * m.hidden_size
    total = dense_flops_per_seq(m) + attention_flops_per_seq(m)
    layers = len(layout.stage_layers(stage)) / m.num_layers
    return ((total - head) * layers + (head if stage == layout.pp - 1 else 0)) / total


def slowest_stage(bench: BenchConfig) -> BenchConfig:
    """`bench` for the stage with the most work (estimate/pipeline.py stage_bench); itself at pp 1."""
    pp = bench.layout.pp
    if pp == 1:
        return bench
    return stage_bench(bench, max(range(pp), key=lambda s: (stage_share(bench, s), s)))


def fsdp2_collective(bench: BenchConfig, t: TimeTerm) -> TimeTerm:
    """FSDP2's collectives as torch.distributed.pipelining runs them (stage.py backward_maybe_with_nosync,
    perform_reduce_grad): the gradients reduce-scattered (and, HSDP, all-reduced) once a step after
    the last backward, exposed; the parameters gathered once a step at zero=2, at zero=3 once per
    micro-batch's forward (no reshard after backward). comm.py counts them per micro-step."""
    if not nosync_sharded(bench):
        return t
    ga, passes = bench.batch.grad_accum, 2 if bench.zero == 3 else 1
    if t.name.startswith(("gradient reduce-scatter", "gradient all-reduce across replicas")):
        return TimeTerm(t.name, t.seconds / ga, True, f"{t.source}; under a pipeline once a step, after the last "
                        "backward (torch.distributed.pipelining perform_reduce_grad)")
    if t.name.startswith("parameter all-gather"):
        times = ga if bench.zero == 3 else 1
        return TimeTerm(t.name, t.seconds * times / (passes * ga), t.exposed,
                        f"{t.source}; under a pipeline {times} a step (no reshard after backward)")
    return t


def pipeline_terms(bench: BenchConfig, rates: HardwareRates, micro: int, terms: list[TimeTerm]) -> list[TimeTerm]:
    """`terms` (the slowest stage's, its layers' work counted for the whole model) with the layers'
    work scaled to the stage, the bubble and the sends (module docstring); unchanged at pp 1."""
    layout = bench.layout
    if layout.pp == 1:
        return terms
    staged = slowest_stage(bench)
    share = stage_share(bench, staged.layout.stage)
    out, work = [], 0.0
    for t in terms:
        t = fsdp2_collective(bench, t)
        if t.name.startswith(LAYER_WORK):
            t = TimeTerm(t.name, t.seconds * share, t.exposed,
                         f"{t.source}; x {share:.3f}, pipeline stage {staged.layout.stage} of {layout.pp}'s share "
                         "of the forward FLOPs")
            work += t.seconds if t.exposed else 0.0
        out.append(t)
    m, vpp = bench.batch.grad_accum, layout.vpp
    out.append(TimeTerm("pipeline bubble", work * (layout.pp - 1) / (m * vpp), True,
                        f"{BUBBLE_SOURCE}; pp {layout.pp}, {m} micro-batches, vpp {vpp}, {bench.parallel.pp_schedule}"))
    nbytes = 2 * m * vpp * micro * boundary_bytes(bench)  # activations forward + gradients backward
    bw = link(bench, rates, layout.spans["pp_hop"])
    where = "intra-node" if bw is rates.intra_node_bytes_per_s else "inter-node"
    out.append(TimeTerm("pipeline sends", nbytes / bw.value, True,
                        f"hidden states forward and their gradients backward, {m} micro-batches x {vpp} chunk(s), "
                        f"between stages {layout.spans['pp_hop'] - 1} ranks apart, {where} at {bw.source}"))
    if bench.model.tie_embeddings:
        word = bench.model.padded_vocab(layout.tp) // layout.tp * bench.model.hidden_size
        out.append(collective(bench, rates, "tied embedding all-reduce", ALL_REDUCE, word * 4, 2, layout.world_size,
                              True, "megatron's embedding group: the word embedding's fp32 gradient between the "
                              "first and the last stage"))
    return out
