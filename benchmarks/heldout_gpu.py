"""The estimate's activations against GPU measurements zero_bench never saw: Megatron-LM's own CI
GPT runs (NVIDIA/Megatron-LM, tests/functional_tests/test_cases/gpt/<case>/golden_values_*.json:
`mem-max-allocated-bytes` and `mem-allocated-bytes` per step, torch.cuda's counters as megatron's
training loop logs them, with the run's arguments in the case's model_config.yaml).

    python benchmarks/heldout_gpu.py

The activation peak of a step = max allocated - allocated after the step (the parameters, the
gradient buffer and the optimizer's states stay allocated between steps; megatron's DDP keeps its
gradients in that persistent buffer, so what the peak adds is activations and their transients).
Predicted: micro x the estimate's activation peak per sample (estimate/activations.py, GPU,
loss=megatron, fusions on as in megatron's runs), beside the same with the softmax upcast to fp32
(what the estimate counted for the unfused attention on GPU before). Pure arithmetic, no GPU.
The figures live here only (docs/estimate.md shows this script's output)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from unittest import mock

from zero_bench.estimate import activations
from zero_bench.estimate.activations import activation_bytes_per_sample
from zero_bench.models import ModelConfig

MiB = 2**20
REPO = "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/"
CASES = "tests/functional_tests/test_cases/gpt/"

# Megatron-LM's arguments where the CI cases do not set them: LayerNorm, GeLU 4h, biases, learned
# positions, tied embeddings, hidden and attention dropout 0.1, vocab padded to 128 x tp.
CI_GPT = ModelConfig(name="megatron-ci-gpt", num_layers=12, hidden_size=512, num_heads=8, seq_len=1024,
                     vocab_size=50257, pad_vocab_to=128, dropout=0.1, attention="unfused")
CI_7B = dataclasses.replace(CI_GPT, name="megatron-ci-7b", num_layers=32, hidden_size=4096, num_heads=32,
                            num_query_groups=8, seq_len=8192, vocab_size=131073, tie_embeddings=False)


@dataclass(frozen=True)
class Row:
    """One CI case's last logged step: its golden file, the two counters, and how zero_bench
    expresses the run (attention: unfused for `--attention-backend unfused` and the local spec,
    sdpa where Transformer Engine picks a flash / cuDNN kernel)."""
    case: str
    golden: str
    max_allocated: int
    allocated: int
    model: ModelConfig
    tp: int = 1
    micro: int = 4
    recompute: str = "none"
    precision: str = "bf16"
    note: str = ""


def _gpt(attention: str, **kw) -> ModelConfig:
    return dataclasses.replace(CI_GPT, attention=attention, **kw)


ROWS = [
    Row("gpt3_mcore_te_tp1_pp1_dist_optimizer_no_mmap_bin_files", "golden_values_dev_dgx_h100.json",
        4702430720, 581489664, _gpt("unfused"), note="TE, unfused backend"),
    Row("gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer", "golden_values_dev_dgx_h100.json",
        2691792384, 581489664, _gpt("sdpa"), note="TE, flash / cuDNN"),
    Row("gpt3_mcore_te_tp1_pp1_uniform_full_recompute", "golden_values_dev_dgx_a100.json",
        2534070272, 1232487936, _gpt("unfused"), recompute="full", note="TE, unfused, full recompute"),
    Row("gpt3_mcore_te_tp1_pp1_resume_torch_dist_uniform_full_recompute", "golden_values_dev_dgx_h100.json",
        2561334272, 1259751936, _gpt("sdpa"), recompute="full", note="TE, flash, full recompute"),
    Row("gpt3_mcore_te_tp2_pp1_multi_dist_optimizer_instances", "golden_values_dev_dgx_a100.json",
        2658182656, 462388736, _gpt("unfused"), tp=2, note="TE, unfused backend"),
    Row("gpt3_mcore_te_tp2_pp1_resume_torch_dist_multi_dist_optimizer_instances", "golden_values_dev_dgx_h100.json",
        1684322304, 492011008, _gpt("sdpa"), tp=2, note="TE, flash / cuDNN"),
    Row("gpt3_mcore_te_tp4_pp1_dist_optimizer_overlap_grad_reduce_param_gather", "golden_values_dev_dgx_h100.json",
        1543416320, 299728384, _gpt("unfused"), tp=4, note="TE, unfused backend"),
    Row("gpt3_mcore_te_tp4_pp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce_param_gather",
        "golden_values_dev_dgx_h100.json", 1041940992, 299728384, _gpt("sdpa"), tp=4, note="TE, flash / cuDNN"),
    Row("gpt3_mcore_te_tp4_pp1_qk_layernorm_test_mode", "golden_values_dev_dgx_a100.json",
        1643008512, 368387584, _gpt("unfused", qk_norm=True), tp=4, note="TE, unfused, qk LayerNorm"),
    Row("gpt3_mcore_te_tp4_pp1_resume_torch_dist_qk_layernorm_test_mode", "golden_values_dev_dgx_h100.json",
        1177314304, 398273024, _gpt("sdpa", qk_norm=True), tp=4, note="TE, flash, qk LayerNorm"),
    Row("gpt3_mcore_tp1_pp1_dist_optimizer_overlap_grad_reduce_param_gather", "golden_values_dev_dgx_a100.json",
        4735983616, 615042560, _gpt("unfused"), note="local spec (megatron's DotProductAttention)"),
    Row("gpt3_mcore_tp1_pp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce_param_gather",
        "golden_values_dev_dgx_h100.json", 4608815616, 518880768, _gpt("unfused"), precision="fp16",
        note="local spec, fp16"),
    Row("gpt3_7b_tp4_pp1_memory_speed", "golden_values_dev_dgx_h100.json", 57143791616, 20663519232,
        dataclasses.replace(CI_7B, attention="sdpa"), tp=4, micro=2, note="TE, flash, GQA 32/8, s 8192"),
]


def predicted(row: Row, upcast: bool = False) -> float:
    """The estimate's activation peak of the row's micro-batch, bytes; upcast: with the unfused
    attention's softmax in fp32 on GPU (what the formula counted before)."""
    def act() -> dict:
        return activation_bytes_per_sample(row.model, row.tp, row.precision, row.recompute, device="gpu",
                                           loss="megatron", fusions=True)
    if upcast:
        with mock.patch.object(activations, "softmax_upcast", lambda precision, device, fusions=False: True):
            return row.micro * act()["total"]
    return row.micro * act()["total"]


def main() -> None:
    print(f"{'Megatron-LM CI case (golden file)':92} {'measured':>9} {'pred':>9} {'err %':>6} "
          f"{'fp32 sm':>9} {'err %':>6}")
    within = within_before = 0
    for row in ROWS:
        measured = (row.max_allocated - row.allocated) / MiB
        now, before = predicted(row) / MiB, predicted(row, upcast=True) / MiB
        e, eb = 100 * (now - measured) / measured, 100 * (before - measured) / measured
        within, within_before = within + (abs(e) <= 15), within_before + (abs(eb) <= 15)
        name = f"{row.case} ({row.golden.removeprefix('golden_values_').removesuffix('.json')})"
        print(f"{name:92} {measured:9.1f} {now:9.1f} {e:+6.1f} {before:9.1f} {eb:+6.1f}  {row.note}")
    print(f"within 15 %: {within}/{len(ROWS)} (softmax upcast to fp32, as before: {within_before}/{len(ROWS)}); "
          f"MiB of activation peak per rank (max allocated - allocated), source {REPO}{CASES}")


if __name__ == "__main__":
    main()
