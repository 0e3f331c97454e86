"""The estimate's longest sequence against published long-context runs zero_bench never saw: the ALST
recipes (Arctic Long Sequence Training, Bekman et al. 2025, arXiv 2506.13996) for Llama-3.1-8B on
H100 80GB, each the longest `max_length` its authors ran with one set of savers switched on.

    python benchmarks/heldout_long_context.py

Source: snowflakedb/ArcticTraining at commit 2771b4b1b9c8cbb54895ccb940dcaa76d33bf7ef,
projects/sequence-parallelism/<recipe>.yml (the paper's 500K on one GPU and 3.7M on one node are the
first and last rows; the paper prints 3.7M, the recipe runs 3.8M). Every recipe: micro 1, bf16,
DeepSpeed ZeRO-3 with the optimizer offloaded to the CPU (cpu_adam), Hugging Face activation
checkpointing (ArcticTraining's default, `disable_activation_checkpoint: false`): recompute=full;
Liger's fused linear cross entropy: loss=chunked; flash_attention_2 or sdpa: attention=sdpa (no
s x s scores); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; 8 x H100 nodes with 1.9 TB of
host memory (the project README's "Environment used").

The 160K recipe (`...-no-ulysses-yes-liger-no-extras.yml`) is named for a run without Ulysses, but
at the pinned commit it sets `sequence_parallel_size: 8` (ArcticTraining e622b40, "fix SP size",
changed it from 1), its other keys those of the 1.1M recipe: zero_bench's keys for it are the 1.1M
row's, and its 160K is a length that ran, not the longest for those keys. It is shown, and checked
only to fit (the estimate's longest at least its length), not compared as a boundary.

What differs from what zero_bench runs, and so from what its estimate counts: ALST trains Hugging
Face's LlamaForCausalLM with Liger's kernels (`model.type: liger`: Liger's RMSNorm, RoPE, SwiGLU
unless the MLP is tiled, fused linear cross entropy), flash_attention_2 through Hugging Face's
varlen path (packed samples), with the checkpoint offload a reentrant checkpoint
(ArcticTraining's CheckpointFunctionWithCPUOffload, monkey_patches.py); zero_bench megatron-core's GPTModel (fused QKV) with torch's sdpa. The published figure is
the longest length the authors reported running, not a bisected boundary; ALST's Ulysses all-to-all
runs in bf16 (`seq_parallel_communication_data_type`). The estimate keeps its ZeRO-3 fragmentation
factor (x1.23) although the runs used expandable segments.

The accuracy stated (BAND, KNOWN_MISSES) is checked on every run: a boundary row outside BAND, a
known miss back inside it, or a row whose published length the estimate does not fit where it
should, exits 1. Nothing in the estimate was fitted to these figures.
Pure arithmetic, no GPU. The figures live here only (docs/long-context.md shows this script's output).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from zero_bench.config.configure import compose, from_cfg, search_from_cfg
from zero_bench.estimate.seq import host_at, longest_seq
from zero_bench.search.dimension import seq_grid

SOURCE = ("https://github.com/snowflakedb/ArcticTraining/blob/2771b4b1b9c8cbb54895ccb940dcaa76d33bf7ef/"
          "projects/sequence-parallelism/")
COMMON = ["model=llama3-8b", "hardware=h100_80gb", "precision=bf16", "zero=3", "offload=true",
          "recompute=full", "loss=chunked", "model.attention=sdpa", "search.seq_max=8388608"]
GiB = 2**30
BAND = (0.75, 1.25)
"""est / published for a boundary row (the longest length its authors ran for its keys): one band
for every row, stated, not fitted to any."""
# boundary rows known to miss BAND, and why; each must still miss it (else the statement is stale)
KNOWN_MISSES = {
    "run-h100-sp1-llama-8b.yml": "both savers on: the peak is one layer's recompute and backward, where "
                                 "Hugging Face's layer under ALST holds more than megatron's (docs/long-context.md)",
    "run-h100-sp8-llama-8b.yml": "as the 1-GPU row",
}


@dataclass(frozen=True)
class Recipe:
    """One published run: its file, the longest max_length it trained, and zero_bench's keys for it."""
    file: str
    published: int
    keys: tuple[str, ...]
    savers: str
    boundary: bool = True  # the published length is the longest its authors ran with these keys


RECIPES = [
    Recipe("run-h100-sp1-llama-8b.yml", 500_000,
           ("parallel=dp1", "offload_param=true", "tiled_mlp=auto", "recompute_offload=true"),
           "1 GPU, params offloaded too, tiled MLP, checkpoint offload"),
    Recipe("run-h100-sp8-llama-8b-no-ulysses-yes-liger-no-extras.yml", 160_000,
           ("parallel=dp8", "parallel.sp=8", "offload_param=false"), "sp 8 (named no-ulysses; a run, not a longest)",
           boundary=False),
    Recipe("run-h100-sp8-llama-8b-no-mlp-no-act-offload.yml", 1_100_000,
           ("parallel=dp8", "parallel.sp=8", "offload_param=false"), "sp 8"),
    Recipe("run-h100-sp8-llama-8b-yes-mlp.yml", 1_200_000,
           ("parallel=dp8", "parallel.sp=8", "offload_param=false", "tiled_mlp=auto"), "sp 8, tiled MLP"),
    Recipe("run-h100-sp8-llama-8b-yes-act-offload.yml", 2_400_000,
           ("parallel=dp8", "parallel.sp=8", "offload_param=false", "recompute_offload=true"),
           "sp 8, checkpoint offload"),
    Recipe("run-h100-sp8-llama-8b.yml", 3_800_000,
           ("parallel=dp8", "parallel.sp=8", "offload_param=false", "tiled_mlp=auto", "recompute_offload=true"),
           "sp 8, tiled MLP, checkpoint offload"),
]


def predicted(r: Recipe) -> tuple[int, int | None, int | None]:
    """(the estimate's longest sequence at micro 1, the host RAM per node there, and at the published
    length), on maxseq's own grid."""
    cfg = compose([*COMMON, *r.keys])
    bench = from_cfg(cfg, here=False)
    grid = seq_grid(search_from_cfg(cfg), bench.layout)
    s = longest_seq(bench, 1, grid)
    step = grid.granularity
    return s, host_at(bench, s, 1), host_at(bench, r.published // step * step, 1)


def broken(r: Recipe, s: int) -> str:
    """What of the stated accuracy this row breaks ('' where it holds)."""
    ratio = s / r.published
    inside = BAND[0] <= ratio <= BAND[1]
    if not r.boundary:
        return "" if s >= r.published else f"{r.file}: the estimate fits {s:,}, below the {r.published:,} that ran"
    if r.file in KNOWN_MISSES:
        return f"{r.file}: {ratio:.2f} is inside {BAND}, listed as a known miss" if inside else ""
    return "" if inside else f"{r.file}: est / published {ratio:.2f}, stated within {BAND}"


def main() -> int:
    print(f"ALST's recipes ({SOURCE}), Llama-3.1-8B, H100 80GB, micro 1: the longest sequence published "
          "vs the estimate's")
    print(f"{'savers':<58} {'published':>10} {'estimate':>10} {'est/pub':>7} {'host GiB/node at est':>21} "
          f"{'at pub':>7}")
    problems = []
    for r in RECIPES:
        s, host, host_pub = predicted(r)
        show = (lambda b: "-" if b is None else f"{b / GiB:,.0f}")
        ratio = f"{s / r.published:.2f}" if r.boundary else "-"
        print(f"{r.savers:<58} {r.published:>10,} {s:>10,} {ratio:>7} {show(host):>21} {show(host_pub):>7}")
        problems.append(broken(r, s))
    print(f"boundary rows within {BAND[0]:.2f}-{BAND[1]:.2f} of the published length, known misses: "
          f"{', '.join(KNOWN_MISSES)}")
    for p in filter(None, problems):
        print("NOT AS STATED:", p)
    return 1 if any(problems) else 0


if __name__ == "__main__":
    sys.exit(main())
