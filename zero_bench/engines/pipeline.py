"""parallel.pp > 1: one rank's stages (models/stages.py) driven by torch.distributed.pipelining's
schedules, the part both engines share (engines/fsdp2.py and engines/deepspeed.py wrap the stages
their way and run their own reduction, clipping and optimizer step after it).

One optimizer step is one schedule.step over the worker's grad_accum micro-batches (its
n_microbatches): the micro-batches are stacked and the schedule splits them back along the batch,
so each is the one pp = 1 trains. The first stage is fed the tokens; positions and labels go to
every stage as keyword arguments (the schedule splits them alike); the last stage returns
megatron's per-token loss and the schedule's loss_fn (stage_loss) takes its mean divided by the
number of micro-batches, what the engines backpropagate at pp = 1 ((loss / grad_accum).backward()),
so scale_grads stays off and nothing rescales the gradients where an engine may have moved them.
The micro-batches' means are kept aside, and `shared` broadcasts them from the last stage to the
other ranks of its pipeline, so every rank records the same losses.

A schedule and its PipelineStage objects are made per micro-batch size (a plan's entries grow), each
stage told the shapes it receives and sends (`shapes`): the tokens [micro, s] or the hidden states
[s, micro, h] in, the hidden states or the per-token loss [micro, s] out. Without them PipelineStage
infers them in its first step by running every stage's forward and backward once more on that
micro-batch and exchanging what it found between the ranks (a step's worth of compute on top of
the first step of every entry).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from zero_bench.config.choices import PipelineSchedule
from zero_bench.config.schema import BenchConfig
from zero_bench.models.megatron import DTYPES


def schedule_class(kind: str):
    """torch's schedule of `parallel.pp_schedule`."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {PipelineSchedule.gpipe: ScheduleGPipe, PipelineSchedule.one_f_one_b: Schedule1F1B,
            PipelineSchedule.interleaved_1f1b: ScheduleInterleaved1F1B}[PipelineSchedule(kind)]


class Pipeline:
    """This rank's stages under the schedule `cfg.parallel.pp_schedule` asks for."""

    def __init__(self, cfg: BenchConfig, stages: list, device: torch.device):
        from megatron.core import parallel_state as ps

        self.cfg, self.stages, self.device = cfg, stages, device
        self.n = cfg.batch.grad_accum
        self.num_stages = cfg.parallel.pp * cfg.parallel.vpp
        self.group = ps.get_pipeline_model_parallel_group()
        self.last_rank = ps.get_pipeline_model_parallel_last_rank()  # global rank of this pipeline's last stage
        self.has_first = any(s.chunk.pre for s in stages)
        self.has_last = any(s.chunk.post for s in stages)
        self._schedule, self._micro = None, None
        self._means: list[torch.Tensor] = []

    def loss(self, output: torch.Tensor, target=None) -> torch.Tensor:
        """The schedule's loss_fn: the micro-batch's mean per-token loss (kept aside), divided by the
        number of micro-batches for the backward."""
        mean = output.float().mean()
        self._means.append(mean.detach())
        return mean / self.n

    def shapes(self, chunk, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of `chunk` at `micro` sequences per micro-batch, as meta tensors: what
        PipelineStage allocates its receive buffers from. The hidden states are megatron's [s, b, h]
        in the dtype its layers compute in; with megatron's sequence parallelism (tp > 1) each tp rank
        holds and sends its s / tp tokens."""
        m = self.cfg.model
        # requires_grad: the stage receives their gradient from the next one and sends its own back
        hidden = torch.empty(m.seq_len // self.cfg.layout.seq_shard, micro, m.hidden_size,
                             dtype=DTYPES[self.cfg.precision], device="meta", requires_grad=True)
        tokens = torch.empty(micro, m.seq_len, dtype=torch.long, device="meta")
        loss = torch.empty(micro, m.seq_len, dtype=torch.float32, device="meta")
        return tokens if chunk.pre else hidden, loss if chunk.post else hidden

    def schedule(self, micro: int):
        if micro != self._micro:
            from torch.distributed.pipelining import PipelineStage

            stages = []
            for s in self.stages:
                inputs, outputs = self.shapes(s.chunk, micro)
                stages.append(PipelineStage(s, s.chunk.stage, self.num_stages, self.device, input_args=inputs,
                                            output_args=outputs, group=self.group))
            cls = schedule_class(self.cfg.parallel.pp_schedule)
            one = cls is not schedule_class(PipelineSchedule.interleaved_1f1b)
            self._schedule = cls(stages[0] if one else stages, n_microbatches=self.n, loss_fn=self.loss,
                                 scale_grads=False)
            self._micro = micro
        return self._schedule

    def step(self, batches: list, mask: Optional[torch.Tensor], marks=None) -> list[float]:
        """Forward and backward of every micro-batch; the gradients are then accumulated on the stages'
        parameters (FSDP2: reduce-scattered at the last backward, the schedule's perform_reduce_grad).
        The micro-batches' mean losses on the rank holding the last stage, [] elsewhere. `marks`: the
        worker's phase marks, "forward" as each stage's forward of a micro-batch starts, "backward"
        as its backward does (the schedule interleaves them)."""
        inputs, pos, labels = (torch.cat([b[i] for b in batches]) for i in range(3))
        for s in self.stages:
            s.mask, s.marks = mask, marks
        self._means = []
        schedule = self.schedule(batches[0][0].shape[0])
        args = (inputs,) if self.has_first else ()
        schedule.step(*args, target=labels, pos=pos, labels=labels, return_outputs=False)
        return [float(m) for m in self._means] if self.has_last else []

    def shared(self, losses: list[float]) -> list[float]:
        """The last stage's losses on every rank of this pipeline (a reporting broadcast, outside
        the timed step)."""
        t = torch.tensor(losses if self.has_last else [0.0] * self.n, dtype=torch.float64, device=self.device)
        dist.broadcast(t, src=self.last_rank, group=self.group)
        return t.tolist()


class PipelineEngine:
    """What both engines' pipeline trainers (Fsdp2PipelineEngine, DeepSpeedPipelineEngine) add to
    their pp = 1 engine beside their own step: the losses shared over the pipeline, no compile."""
    pipeline: Pipeline

    def shared_losses(self, losses: list[float]) -> list[float]:
        return self.pipeline.shared(losses)

    def compile(self) -> None:
        raise NotImplementedError("compile under a pipeline (refused by configure.check_pipeline)")
