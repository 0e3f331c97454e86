"""zero_bench.estimate: formulas on hand-derived values, the CLI and pre-flight refusal (no launch).
The estimate against real CPU trials: tests/integration/test_estimate_vs_measured.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import BenchConfig
from zero_bench.errors import ConfigError
from zero_bench.estimate import (CPU_ACTIVATION_FACTOR, GiB, MiB, activation_bytes_per_sample, deepspeed_buffers, estimate,
                                 model_states_bytes, param_numels, seed_micro)

from conftest import cpu_cfg, model
from zero_bench.models.params import params_per_shard

ROOT = Path(__file__).resolve().parents[2]
P = 1_000_000


def bench(model="gpt-small", zero=2, dp=2, precision="fp32", micro=1, **hw) -> BenchConfig:
    m = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    return from_cfg({"model": m, "parallel": {"tp": 1, "dp": dp},
                     "hardware": {"device": "cpu", **hw}, "zero": zero, "offload": False,
                     "precision": precision, "batch": {"micro": micro, "grad_accum": 1},
                     "steps": {"warmup": 1, "timed": 1}, "timeout_s": 300})


# -- model states: the ZeRO paper (mixed precision, K = 12) ----------------------------------------
@pytest.mark.parametrize("stage,expected", [(0, 16 * P), (1, 4 * P + 12 * P // 8), (2, 2 * P + 14 * P // 8),
                                            (3, 16 * P // 8)])
def test_mixed_precision_totals(stage, expected):
    s = model_states_bytes(P, stage, RankLayout(dp=8), precision="bf16")
    assert s.device == expected and s.host == 0
    assert s.params + s.grads + s.optimizer == expected


def test_paper_example_7_5b_on_64_gpus():
    # ZeRO paper, Figure 1: 7.5B parameters, Nd = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    got = [model_states_bytes(7.5e9, z, RankLayout(dp=64), precision="fp16").device / 1e9 for z in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)


def test_mixed_split():
    s = model_states_bytes(P, 2, RankLayout(dp=4), precision="bf16")
    assert (s.params, s.grads, s.master, s.moments) == (2 * P, P // 2, P, 2 * P)


@pytest.mark.parametrize("stage,expected", [(0, 16 * P), (1, 8 * P + 12 * P // 2), (2, 4 * P + 16 * P // 2),
                                            (3, 20 * P // 2)])
def test_fp32_totals(stage, expected):
    assert model_states_bytes(P, stage, RankLayout(dp=2), precision="fp32").device == expected


def test_fp32_field_notes_77_7m():
    # field notes: 77.7M params, DP=2, after the step (gradients freed): 889 / 741 / 741 MiB
    n = 77.7e6
    after = lambda z: (lambda s: (s.device - s.grads) / MiB)(model_states_bytes(n, z, RankLayout(dp=2), precision="fp32"))  # noqa: E731
    assert after(0) == pytest.approx(889, abs=1)
    assert after(1) == pytest.approx(741, abs=1)
    assert after(2) == pytest.approx(741, abs=1)


def test_num_params_is_one_tp_shards():
    """num_params is P, one tensor-parallel shard's (the paper's: the whole model's / tp): the
    layout's tp divides nothing again."""
    at_tp4 = model_states_bytes(8 * P / 4, 3, RankLayout(tp=4, dp=2), precision="bf16")
    assert at_tp4 == model_states_bytes(2 * P, 3, RankLayout(dp=2), "bf16")


def test_offload():
    # ZeRO-2 + offload, bf16, dp=4: device keeps 2P params; host 12P/4 optimizer + 4P/4 fp32 grads
    s = model_states_bytes(P, 2, RankLayout(dp=4), precision="bf16", offload_optimizer=True)
    assert s.device == 2 * P and s.host == 3 * P + P
    # ZeRO-3 + offload params too: nothing persistent on the device
    s = model_states_bytes(P, 3, RankLayout(dp=4), precision="bf16", offload_optimizer=True, offload_param=True)
    assert s.device == 0 and s.host == P // 2 + 3 * P + P
    # ZeRO-1 + offload: the full bf16 gradients stay on the device
    s = model_states_bytes(P, 1, RankLayout(dp=4), precision="bf16", offload_optimizer=True)
    assert s.device == 4 * P and s.host == 4 * P


# -- activations (Korthikanti et al., as megatron-core keeps them) -----------------------------------
def test_activation_formula_by_hand():
    """gpt-mini (L=4, h=256, a=4, s=256, V=8192; GeLU 4h, LayerNorm, learned positions, no dropout,
    unfused attention), bf16 on GPU. Per layer and token Korthikanti's 32h without dropout (norm and
    QKV inputs 2h each, QKV output 6h, context 2h, fc1 input 2h, GeLU input and fc2 input 16h), +16
    for the two norms' statistics, and 6 bytes per score where Korthikanti counts 2: megatron-core's
    unfused softmax keeps its fp32 output and the bmm its bf16 copy."""
    m = bench("gpt-mini").model
    s, h, a, V = 256, 256, 4, 8192
    x = activation_bytes_per_sample(m, 1, "bf16")
    assert x["per_layer"] == s * (32 * h + 16 + 6 * a * s)  # 3,674,112
    assert x["logits"] == s * (4 * V + 13) and x["logits_transient"] == s * 2 * V  # fp32 softmax; bf16 logits
    assert x["embedding"] == s * (8 + (2 * h + 8) + 2 * h)  # token ids, final norm, output layer's input
    assert x["scratch"] == s * 2 * a * s  # unfused attention's baddbmm buffer
    assert x["saved"] == 4 * x["per_layer"] + x["embedding"] + x["logits"] + x["scratch"]
    assert x["total"] == max(x["end_of_forward"], x["mlp_backward"], x["attention_backward"]) >= x["saved"]
    f = activation_bytes_per_sample(m, 1, "fp32")
    assert f["per_layer"] == s * (64 * h + 16 + 4 * a * s)  # fp32: no 16-bit copy of the scores
    t = activation_bytes_per_sample(m, 2, "bf16")
    assert t["per_layer"] == s * ((2 * h + 8) * 2 + 2 * 2 * h + (3 * h + h + 8 * h) + 6 * a * s // 2)


def test_recompute_by_hand():
    m = bench("gpt-mini").model
    s, h, a = 256, 256, 4
    none = activation_bytes_per_sample(m, 1, "bf16")
    sel = activation_bytes_per_sample(m, 1, "bf16", "selective")
    # selective drops the scores and re-runs the core attention from its inputs (the QKV output, kept)
    assert sel["layers"] == 4 * s * (32 * h + 16) and sel["recomputed"] == s * (6 * h + 6 * a * s)
    full = activation_bytes_per_sample(m, 1, "bf16", "full")
    assert full["layers"] == 4 * 2 * h * s and full["recomputed"] == none["per_layer"] - 2 * h * s
    assert full["total"] < sel["total"] < none["total"]
    # partition_activations divides the kept inputs by tp; cpu_checkpointing moves them to the host
    t = activation_bytes_per_sample(m, 2, "bf16", "full", {"partition_activations": True})
    assert t["layers"] == 4 * h * s
    hst = activation_bytes_per_sample(m, 2, "bf16", "full", {"partition_activations": True,
                                                             "cpu_checkpointing": True})
    assert hst["layers"] == 0 and hst["host"] == 4 * h * s and hst["total"] == t["total"] - t["layers"]


def test_full_recompute_keeps_one_input_per_checkpoint_of_recompute_layers():
    """megatron-core 0.16.1's uniform method (transformer_block.py _checkpointed_forward) checkpoints
    recompute_layers layers at a time: L / k inputs kept, and a chunk's backward rebuilds its k layers
    before the top one's backward runs. The formula counted L inputs and one rebuilt layer whatever k
    (-18 % at k 2, -41 % at k 4 against the trace: tests/unit/test_traced.py). FLOPs: every layer's
    forward re-run once, whatever k. The host's inputs (cpu_checkpointing, recompute_offload) follow."""
    from zero_bench.models.flops import hardware_flops_per_seq

    m = bench("gpt-mini").model  # 4 layers
    s, h = 256, 256
    none = activation_bytes_per_sample(m, 1, "bf16")
    for k in (2, 4):
        f = activation_bytes_per_sample(m, 1, "bf16", "full", recompute_layers=k)
        assert f["layers"] == (4 // k) * 2 * h * s
        assert f["recomputed"] == k * none["per_layer"] - 2 * h * s
        assert f["mlp_backward"] - f["layers"] > activation_bytes_per_sample(m, 1, "bf16", "full")["mlp_backward"]
        assert hardware_flops_per_seq(m, "full", k) == hardware_flops_per_seq(m, "full")
    hst = activation_bytes_per_sample(m, 2, "bf16", "full", {"partition_activations": True, "cpu_checkpointing": True},
                                      recompute_layers=2)
    assert hst["layers"] == 0 and hst["host"] == 2 * h * s  # 2 checkpoints, each input split over tp 2
    off = activation_bytes_per_sample(m, 1, "bf16", "full", recompute_layers=2, offload=True)
    assert off["host"] == 2 * 2 * h * s and off["recomputed"] == 2 * none["per_layer"]  # the input back too
    # block checkpoints one layer each, whatever recompute_layers says
    assert activation_bytes_per_sample(m, 1, "bf16", "block", recompute_layers=4)["layers"] == 4 * 2 * h * s


def test_modern_terms_by_hand():
    """llama-tiny (GQA 8 heads / 2 groups, SwiGLU f=704, RMSNorm, RoPE, untied, sdpa), bf16 on GPU
    with megatron's fusions off (the formula's default; fused: tests/unit/test_jit_fusions.py):
    SwiGLU keeps 5f, sdpa keeps Q, K, V (flash takes GQA's 2 groups) and the log-sum-exp, nothing s x s."""
    m = model("llama-tiny")
    s, h, q, kv, f, a = 256, 256, 256, 64, 704, 8
    x = activation_bytes_per_sample(m, 1, "bf16")
    norms, inputs = 2 * (2 * h + 8), 2 * 2 * h
    assert x["per_layer"] == s * (norms + inputs + 2 * (q + 2 * kv) + 4 * a + 2 * q + 5 * f * 2)
    assert x["scratch"] == 0
    # fp32 on GPU runs the memory-efficient kernel, which takes no GQA: K and V expanded to 8 heads
    fp32 = activation_bytes_per_sample(m, 1, "fp32")
    assert fp32["per_layer"] == s * (2 * (4 * h + 8) + 2 * 4 * h + 4 * 3 * q + 4 * a + 4 * q + 5 * f * 4)
    unfused = activation_bytes_per_sample(dataclasses.replace(m, attention="unfused"), 1, "bf16")
    # unfused: Q and K, V repeated to 8 heads, the fp32 scores and their bf16 copy; the context a copy
    assert unfused["per_layer"] == s * (norms + inputs + 2 * 3 * q + 6 * a * s + 2 * q + 5 * f * 2)
    drop = activation_bytes_per_sample(dataclasses.replace(m, attention="unfused", dropout=0.1), 1, "bf16")
    # dropout (GPU: 1-byte masks) on the scores and after attention and MLP; its output replaces the bf16 copy
    assert drop["per_layer"] - unfused["per_layer"] == s * (1 * a * s + 2 * h * 1)
    cpu = activation_bytes_per_sample(m, 1, "bf16", device="cpu")
    # CPU's RMSNorm (torch's composite) keeps fp32 input and x*rsqrt: 8 bytes per element whatever the dtype
    assert cpu["per_layer"] - x["per_layer"] == 2 * s * (8 * h - 2 * h)


def test_qk_norm_and_head_dim_terms_by_hand():
    """qwen3-tiny (8 heads of 64 on h 256, 2 groups: q 512, kv 128, qk-norm) against itself without
    qk-norm, per token and layer. CPU fp32 (measured with benchmarks/activation_memory.py's
    instrument: saved bytes exact): the query copy 4q, the fp32 normalised q and k, an rsqrt per head,
    and the QKV output the key's view pins. GPU bf16 (fused RMSNorm, read from the code): the query
    copy, rstd per head and the pinned QKV output."""
    m = model("qwen3-tiny")
    s, q, kv, rows = 256, 512, 128, 8 + 2
    plain = dataclasses.replace(m, qk_norm=False)
    cpu = [activation_bytes_per_sample(x, 1, "fp32", device="cpu")["per_layer"] for x in (m, plain)]
    assert cpu[0] - cpu[1] == s * (4 * q + 4 * (q + kv) + 4 * rows + 4 * (q + 2 * kv)) == s * 7720
    gpu = [activation_bytes_per_sample(x, 1, "bf16")["per_layer"] for x in (m, plain)]
    assert gpu[0] - gpu[1] == s * (2 * q + 4 * rows + 2 * (q + 2 * kv))
    # selective: the checkpoint's inputs already hold the QKV output; the norms' own tensors stay
    sel = [activation_bytes_per_sample(x, 1, "fp32", "selective", device="cpu")["layers"] for x in (m, plain)]
    assert sel[0] - sel[1] == 4 * s * (4 * q + 4 * (q + kv) + 4 * rows)
    # the head width, not h / a, sizes Q, K, V and the context (q = 512 on h = 256)
    assert activation_bytes_per_sample(plain, 1, "bf16")["per_layer"] == s * (
        2 * (2 * 256 + 8) + 2 * 2 * 256 + 2 * (q + 2 * kv) + 4 * 8 + 2 * q + 5 * 768 * 2)


def test_vocab_padded_like_megatron():
    m = bench("gpt345m").model
    assert m.vocab_size == 50257 and m.padded_vocab(1) == 50304 and m.padded_vocab(8) == 51200
    assert sum(param_numels(m, 8)) == params_per_shard(m, 8)
    act = activation_bytes_per_sample(m, 8, "fp16")
    assert act["logits"] == 1024 * (51200 // 8 * 4 + 13) and act["logits_transient"] == 1024 * 51200 // 8 * 2


def test_param_numels_match_config():
    for name in ("gpt-mini", "gpt-small", "gpt5.8b"):
        m = bench(name).model
        for tp in (1, 2, 4):
            if m.num_heads % tp == 0:
                assert sum(param_numels(m, tp)) == params_per_shard(m, tp)


def test_buffers_from_ds_config():
    b = bench("gpt-small", zero=2)  # CPU: buckets scaled to P/16
    P_ = params_per_shard(b.model, 1)
    buf = {x.name: x.bytes for x in deepspeed_buffers(b)}
    assert buf["reduce_bucket"] == (P_ // 16) * 4
    assert buf["allgather_bucket"] == 0
    b0 = {x.name: x.bytes for x in deepspeed_buffers(bench("gpt-small", zero=0))}
    assert b0["allreduce_flat"] == 4 * P_
    gpu3 = dataclasses.replace(bench("gpt-small", zero=3), hardware=dataclasses.replace(bench().hardware, device="gpu"))
    b3 = {x.name: x.bytes for x in deepspeed_buffers(gpu3, ds={"stage3_prefetch_bucket_size": 1000,
                                                               "stage3_max_live_parameters": 10**9})}
    assert b3["live_params"] == (16384 * 768 + 1000) * 4
    assert b3["reduce_bucket"] == int(5e8) * 4  # DeepSpeed's default when the config leaves it out


def test_seed_micro_and_monotone():
    b = bench("gpt-mini", zero=2, memory_gb=2)
    e = estimate(b)
    seed = seed_micro(b)
    m = seed.micro
    assert m and m == e.max_micro()
    assert e.peak_bytes(m) <= 2 * GiB < e.peak_bytes(m + 1)
    # the search's slope at the guess: on CPU the live bytes a sample adds (without the RSS factor)
    assert seed.per_sample == int((e.peak_bytes(m + 1) - e.peak_bytes(m)) / CPU_ACTIVATION_FACTOR) > 0
    assert seed.per_sample < e.peak_bytes(m + 1) - e.peak_bytes(m)
    assert seed_micro(bench("gpt-mini", zero=2, memory_gb=0.3)) is None  # not even the overhead fits


# -- CLI ---------------------------------------------------------------------------------------------
def _cli(*args, timeout=120):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "zero_bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_cli_table_all_stages(tmp_path):
    r = _cli("estimate", "model=gpt5.8b", "parallel=dp8", "hardware.memory_gb=40", "hardware.device=gpu",
             f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    for cfg in ("zero0", "zero1", "zero1+offload", "zero2", "zero2+offload", "zero3"):
        assert f" {cfg} " in r.stdout
    assert "bf16" in r.stdout and "40.00 GiB" in r.stdout


def test_cli_json_one_stage(tmp_path):
    r = _cli("estimate", "model=gpt345m", "zero=2", "--json", "hardware.device=cpu", "precision=fp32",
             f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout[r.stdout.index("{"):])
    assert [c["config"] for c in doc["configs"]] == ["zero2"]
    c = doc["configs"][0]
    n = doc["params_per_shard"]
    assert c["device_states"] == 4 * n + 16 * n // 2 and doc["precision"] == "fp32"


def test_cli_refuses_gpt2_5b(tmp_path):
    store = tmp_path / "s.sqlite"
    r = _cli("model=gpt2.5b", f"store={store}", f"hydra.run.dir={tmp_path / 'run'}")
    out = [line for line in r.stdout.splitlines() if line.strip()]
    assert r.returncode == 3, r.stderr  # run: the trial did not fit
    assert len(out) == 1 and out[0].startswith("does not fit (estimated):") and "force=true" in out[0]
    assert not list((tmp_path / "run").glob("rank*.jsonl")) and not (tmp_path / "run" / "trial.json").exists()
    from zero_bench.store import Store

    (t,) = Store(store).trials()
    assert t.status == "estimated_oom" and t.phase == "init"


def test_preflight_force_and_small():
    from zero_bench.search.preflight import preflight

    big = bench("gpt2.5b", zero=2)
    assert preflight(big, force=True) is None
    assert preflight(bench("gpt-tiny")) is None
    r = preflight(big)
    assert r.status == "estimated_oom" and "GiB per rank x 2 ranks" in r.reason


def test_preflight_gpu_cannot_initialize():
    from zero_bench.search.preflight import preflight

    b = bench("gpt5.8b", zero=0, precision="bf16", memory_gb=40)
    b = dataclasses.replace(b, hardware=dataclasses.replace(b.hardware, device="gpu"))
    r = preflight(b)
    assert r is not None and r.reason.startswith("cannot initialize (estimated)")


# -- against real trials ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, count", [("Llama-3-8B", 8_030_261_248), ("Mistral-7B-v0.1", 7_241_732_096),
                                         ("Qwen2.5-7B", 7_615_616_512), ("Qwen3-8B", 8_190_735_360)])
def test_cli_estimates_a_hugging_face_config_with_its_published_count(tmp_path, name, count):
    r = _cli("estimate", "model=hf", f"model.hf_config={ROOT}/tests/data/hf/{name}/config.json", "model.seq_len=4096",
             "parallel=dp8", "hardware=h100_80gb", "--json", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout[r.stdout.index("{"):])
    assert (doc["model"], doc["num_params"], doc["description"]["seq_len"]) == (name, count, 4096)
    assert doc["capacity_bytes"] == 81559 * MiB  # nvidia-smi's total for an H100 80GB HBM3
    assert len(doc["configs"]) == 7 and all(c["act_per_sample"] > 0 for c in doc["configs"])


def test_cli_refuses_an_unsupported_model_type_in_one_line(tmp_path):
    path = tmp_path / "gemma" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"model_type": "gemma2", "hidden_size": 2304, "num_attention_heads": 8}))
    r = _cli("estimate", "model=hf", f"model.hf_config={path}", "model.seq_len=4096", f"hydra.run.dir={tmp_path}")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and r.stdout.strip() == ""
    assert lines == ["zero_bench: error: model.hf_config: model_type=gemma2: other families are not modelled; "
                     "zero_bench reads llama, mistral, qwen2, qwen3, mixtral, qwen3_moe (nearest: qwen2)"], r.stderr


# -- mixture of experts ------------------------------------------------------------------------------

def test_cli_estimates_mixtral_naming_total_and_active_parameters(tmp_path):
    r = _cli("estimate", "model=mixtral-8x7b", "parallel=dp8", "hardware=h100_80gb", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    head = next(x for x in r.stdout.splitlines() if x.startswith("zero_bench estimate:"))  # after DeepSpeed's notice
    assert head.startswith("zero_bench estimate: Mixtral-8x7B (46,702,792,704 params, 12,879,925,248 active per "
                           "token, "), head


def test_moe_activation_terms_by_hand():
    """moe-tiny in bf16 on GPU (B 2, h 256, E 8, k 2, f_e 256, SwiGLU, aux loss on): per MoE layer
    and token the router keeps its input 2h, indices 8k, the top-k fp32 softmax 4k and the aux
    loss's softmax 4E; dispatch 2E + 8k; the k rows their input k*2h and k*(5 f_e + f_e + 1)*2."""
    from zero_bench.estimate.activations import layer_terms, mlp_part

    m = model("moe-tiny")
    t = layer_terms(m, 1, "bf16", "gpu", moe=True)
    moe = {k: t[k] for k in ("router_input", "router", "dispatch", "expert_inputs", "experts", "shared_expert")}
    assert moe == {"router_input": 512, "router": 16 + 8 + 32, "dispatch": 16 + 16, "expert_inputs": 1024,
                   "experts": 2 * (6 * 256 + 1) * 2, "shared_expert": 0}
    dense = layer_terms(m, 1, "bf16", "gpu", moe=False)
    assert mlp_part(t) - mlp_part(dense) == sum(moe.values()) - (512 + 5 * 704 * 2)
    # every layer is MoE: the L layers keep L x the MoE layer's terms
    act = activation_bytes_per_sample(m, 1, "bf16", "none", None, "gpu")
    assert act["layers"] == m.num_layers * sum(t.values()) * m.seq_len


def test_block_recompute_lies_between_none_and_full():
    """recompute=block (megatron's method block): the first recompute_layers layers keep only their
    input, the others everything; all of them is full. llama-tiny on CPU, measured against the same
    terms (docs/verified.md, "Block recompute"): saved within 0.1 %, peak within 1.5 %."""
    from zero_bench.models.flops import hardware_flops_per_seq

    m = model("llama-tiny")
    act = {n: activation_bytes_per_sample(m, 1, "fp32", "block", device="cpu", recompute_layers=n) for n in (1, 2, 3, 4)}
    none = activation_bytes_per_sample(m, 1, "fp32", device="cpu")
    full = activation_bytes_per_sample(m, 1, "fp32", "full", device="cpu")
    assert none["saved"] > act[1]["saved"] > act[2]["saved"] > act[3]["saved"] > full["saved"] == act[4]["saved"]
    per_layer = (none["saved"] - full["saved"]) / m.num_layers  # what recomputing one more layer saves
    assert act[1]["saved"] - act[2]["saved"] == pytest.approx(per_layer, abs=m.seq_len)
    assert act[3]["total"] == act[3]["block_rebuild"] > act[3]["end_of_forward"]  # the rebuilt layer decides
    assert hardware_flops_per_seq(m, "none") < hardware_flops_per_seq(m, "block", 2) < hardware_flops_per_seq(m, "full")
    with pytest.raises(ConfigError, match="^recompute_layers=5: with recompute=block at most model.num_layers=4"):
        from_cfg(compose(["hardware=cpu", "model=llama-tiny", "recompute=block", "recompute_layers=5"]))
    assert cpu_cfg("llama-tiny", recompute="block", recompute_layers=2).label().endswith("recompute=block(2)")


def test_the_losses_logits_as_each_loop_keeps_them():
    """Per token at bf16 (llama-tiny, V 1024): megatron keeps its fp32 softmax (4V), torch's cross
    entropy on bf16 logits its bf16 log-softmax (2V), on upcast logits an fp32 one (4V) and at the
    start of backward two fp32 gradients beside it; chunked keeps none. Measured on CPU within
    1.3 % of the peak, 2.7 % over for chunked in fp32 (docs/verified.md, "The loss's logits")."""
    m, V, s = model("llama-tiny"), 1024, 256
    act = {k: activation_bytes_per_sample(m, 1, "bf16", device="cpu", loss=k)
           for k in ("megatron", "bf16", "fp32", "chunked")}
    assert act["megatron"]["saved"] - act["chunked"]["saved"] == 4 * V * s
    assert act["megatron"]["saved"] - act["bf16"]["saved"] == 2 * V * s
    assert act["fp32"]["saved"] == act["megatron"]["saved"]
    assert act["fp32"]["total"] == act["fp32"]["loss_backward"] == act["fp32"]["saved"] + 8 * V * s
    assert act["chunked"]["total"] < act["bf16"]["total"] <= act["megatron"]["total"] < act["fp32"]["total"]
    with pytest.raises(ConfigError, match="^loss=chunked: runs at parallel.tp=1"):
        from_cfg(compose(["hardware=cpu", "model=llama-tiny", "loss=chunked", "parallel=tp2"]))
    assert cpu_cfg("llama-tiny", loss="chunked").label().endswith("loss=chunked")
    assert "loss" not in cpu_cfg("llama-tiny")._key_dict()
