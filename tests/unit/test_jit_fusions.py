"""megatron's jit fusions (bias-dropout-add, bias-activation) on GPU and what follows from them
(issue 43 items 6-8): the estimate's SwiGLU as the fusion megatron runs keeps it, a gated MoE
model with biases running eager, the `fusions` key, the first step's allowance for a cold
compile and `zero_bench doctor`'s tiny CUDA compile. No GPU: the GPU side is checked at its seams
(fusion_args and the formula with on_cpu=False / device="gpu", the doctor's probe faked), and
megatron's fused functions are run eagerly on CPU to see what they save."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from zero_bench.commands import doctor
from zero_bench.config.configure import from_cfg
from zero_bench.config.schema import CONF_DIR, BenchConfig, HardwareConfig, ParallelConfig
from zero_bench.estimate import estimate
from zero_bench.estimate.activations import activation_bytes_per_sample, layer_terms, swiglu_fused
from zero_bench.models.megatron import fusion_args, jit_fused, transformer_config
from zero_bench.trial.time_limits import COLD_COMPILE_S, FIRST_STEP, MARGIN, Limits, Pace, cold_compile_s

from conftest import cpu_cfg, model


def gpu_cfg(name="llama-tiny", **kw) -> BenchConfig:
    return BenchConfig(model=model(name), parallel=ParallelConfig(tp=1, dp=2), hardware=HardwareConfig(device="gpu"),
                       precision="bf16", **kw)


def gpu_bench(name="llama-tiny", **kw) -> BenchConfig:
    """A GPU configuration resolved as `zero_bench estimate hardware=...` resolves it (no GPU needed)."""
    import yaml

    m = yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())
    return from_cfg({"model": m, "parallel": {"tp": 1, "dp": 2}, "hardware": {"device": "gpu", "memory_gb": 80},
                     "zero": 2, "offload": False, "precision": "bf16", "batch": {"micro": 1, "grad_accum": 1},
                     **kw}, here=False)


def moe_with_biases():
    return dataclasses.replace(model("moe-tiny"), add_bias=True)


# -- what megatron-core 0.16.1 runs (read from the installed source, run eagerly on CPU) -------------

def test_megatrons_jit_fuser_is_torch_compile():
    """megatron/core/jit.py enable_jit_fuser: torch >= 2.2 makes jit_fuser torch.compile, so every
    function megatron decorates with it (fusions/fused_bias_swiglu.py swiglu ...) is compiled."""
    from megatron.core import jit
    from megatron.core.fusions import fused_bias_dropout, fused_bias_swiglu

    assert jit.jit_fuser is torch.compile
    for fn in (fused_bias_swiglu.swiglu, fused_bias_swiglu.swiglu_back, fused_bias_dropout.bias_dropout_add_fused_train):
        assert hasattr(fn, "_torchdynamo_orig_callable"), fn


def _saved(fn, *args) -> tuple:
    """(storages fn's autograd saves for backward, its output), torch.compile ignored (CPU: eager)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.compiler.set_stance("force_eager"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return {t.untyped_storage().data_ptr() for t in saved}, out


def test_megatrons_fused_swiglu_saves_only_its_input():
    """fused_bias_swiglu.py SwiGLUFunction / BiasSwiGLUFunction save their input (fc1's output, 2f)
    and the bias parameter; WeightedSwiGLUFunction its input and the routing weights. With fc2's
    input (the output, f) that is 3f per token where megatron's eager glu keeps 5f."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl

    f = 8
    y = torch.randn(2, 3, 2 * f, requires_grad=True)
    bias, w = torch.randn(2 * f, requires_grad=True), torch.rand(6, 1, requires_grad=True)
    at = lambda *ts: {t.untyped_storage().data_ptr() for t in ts}  # noqa: E731
    storages, out = _saved(bias_swiglu_impl, y, None)
    assert storages == at(y) and out.shape == (2, 3, f)
    assert _saved(bias_swiglu_impl, y, bias)[0] == at(y, bias)
    assert _saved(weighted_bias_swiglu_impl, y, None, w)[0] == at(y, w)


def test_megatrons_weighted_swiglu_refuses_a_bias():
    """Issue 43 item 7's cause: fused_bias_swiglu.py weighted_bias_swiglu_impl, what mlp.py MLP.forward
    calls for an expert (per_token_scale) with bias_activation_fusion, raises on fc1's bias."""
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    with pytest.raises(NotImplementedError, match="Bias is not supported"):
        weighted_bias_swiglu_impl(torch.randn(4, 16), torch.randn(16), torch.rand(4, 1))


# -- item 7: a gated MoE model with biases runs eager on GPU ------------------------------------------

def test_a_gated_moe_model_with_biases_keeps_the_activation_eager_on_gpu():
    m = moe_with_biases()
    args = fusion_args(m, on_cpu=False)
    assert args["bias_activation_fusion"] is False and args["bias_dropout_fusion"] is True
    tc = transformer_config(dataclasses.replace(gpu_cfg("moe-tiny"), model=m), on_cpu=False, initialize=False)
    assert tc.add_bias_linear and tc.gated_linear_unit and not tc.bias_activation_fusion
    # without biases, or dense with biases (bias_swiglu_impl takes one), the fusion stays on
    assert fusion_args(model("moe-tiny"), on_cpu=False)["bias_activation_fusion"] is True
    assert fusion_args(dataclasses.replace(model("llama-tiny"), add_bias=True), on_cpu=False)["bias_activation_fusion"]


# -- item 8: the fusions key ---------------------------------------------------------------------

def test_fusions_false_runs_megatrons_eager_ops_on_gpu():
    on = transformer_config(gpu_cfg(), on_cpu=False, initialize=False)
    assert on.bias_dropout_fusion and on.bias_activation_fusion
    off = transformer_config(gpu_cfg(fusions=False), on_cpu=False, initialize=False)
    assert not (off.bias_dropout_fusion or off.bias_activation_fusion)
    assert on.attention_softmax_in_fp32 is False and off.attention_softmax_in_fp32 is True
    for fusions in (True, False):  # CPU: eager whatever the key, the softmax upcast to fp32
        cpu = fusion_args(model("llama-tiny"), on_cpu=True, fusions=fusions)
        assert cpu.pop("attention_softmax_in_fp32") is True and not any(cpu.values())


def test_the_key_changes_neither_a_cpu_trial_nor_an_older_gpu_trial():
    """CPU runs eager either way: same trial, same key and label. On GPU fusions=false is another
    trial; the default leaves the key a GPU trial had before the key existed."""
    cpu = cpu_cfg()
    assert cpu.fusions is True
    off = dataclasses.replace(cpu, fusions=False)
    assert (off.trial_key(), off.search_key(), off.label()) == (cpu.trial_key(), cpu.search_key(), cpu.label())
    gpu = gpu_cfg()
    assert "fusions" not in gpu._key_dict() and "fusions" not in gpu.label()
    eager = gpu_cfg(fusions=False)
    assert eager.trial_key() != gpu.trial_key() and eager.label().endswith("fusions=false")
    assert BenchConfig.from_dict(eager.to_dict()).fusions is False
    assert BenchConfig.from_dict({k: v for k, v in gpu.to_dict().items() if k != "fusions"}).fusions is True


# -- item 6: the estimate's SwiGLU follows the fusion --------------------------------------------------

def test_a_fused_swiglu_keeps_3f_on_gpu_and_cpu_figures_do_not_move():
    """llama-tiny (f 704, s 256) in bf16: on GPU with the fusions, fc1's output 2f and fc2's input f
    per token and layer, 2f x 2 bytes fewer than megatron's eager glu; on CPU nothing changes."""
    m, s, f = model("llama-tiny"), 256, 704
    eager = activation_bytes_per_sample(m, 1, "bf16", device="gpu", fusions=False)
    fused = activation_bytes_per_sample(m, 1, "bf16", device="gpu", fusions=True)
    assert eager["per_layer"] - fused["per_layer"] == s * 2 * f * 2
    assert layer_terms(m, 1, "bf16", "gpu", fusions=True)["mlp"] == 3 * f * 2
    assert fused["total"] < eager["total"]
    for precision in ("fp32", "bf16"):
        for recompute in ("none", "selective", "full", "op"):
            assert (activation_bytes_per_sample(m, 1, precision, recompute, device="cpu", fusions=True)
                    == activation_bytes_per_sample(m, 1, precision, recompute, device="cpu"))


def test_moe_experts_and_the_shared_expert_follow_the_fusion():
    """moe-tiny (bf16, k 2, f_e 256): each routed row keeps weighted_bias_swiglu_impl's input 2f_e,
    fc2's input f_e and its weight (eager: 5f_e + the product's input f_e + the weight); a shared
    expert (bias_swiglu_impl) 3f. A gated MoE model with biases runs eager, and is counted so."""
    m = dataclasses.replace(model("moe-tiny"), moe_shared_expert_intermediate_size=512)
    fused = layer_terms(m, 1, "bf16", "gpu", moe=True, fusions=True)
    eager = layer_terms(m, 1, "bf16", "gpu", moe=True, fusions=False)
    assert fused["experts"] == 2 * (3 * 256 + 1) * 2 and eager["experts"] == 2 * (6 * 256 + 1) * 2
    assert fused["shared_expert"] == 3 * 512 * 2 and eager["shared_expert"] == 5 * 512 * 2
    biased = dataclasses.replace(m, add_bias=True)
    assert (layer_terms(biased, 1, "bf16", "gpu", moe=True, fusions=True)
            == layer_terms(biased, 1, "bf16", "gpu", moe=True, fusions=False))


def test_the_estimate_follows_the_key():
    fused, eager = estimate(gpu_bench()), estimate(gpu_bench(fusions=False))
    m = model("llama-tiny")
    per_layer = [x.prediction.activations["per_layer"] for x in (eager, fused)]
    assert per_layer[0] - per_layer[1] == m.seq_len * 2 * m.ffn * 2
    assert fused.act_per_sample < eager.act_per_sample
    fsdp = [estimate(gpu_bench(engine="fsdp2", zero=3, fusions=x)).act_per_sample for x in (True, False)]
    assert fsdp[0] < fsdp[1]


def test_the_estimate_asks_megatron_which_swiglu_runs():
    """swiglu_fused answers CPU, fusions=false and ungated models without torch; the rest is
    models/megatron.py bias_activation_fused's, the TransformerConfig's own source."""
    names = ["gpt-tiny", "llama-tiny", "qwen3-tiny", "moe-tiny", "llama3-8b", "mixtral-8x7b"]
    models = [model(n) for n in names] + [dataclasses.replace(model(n), add_bias=True) for n in names]
    for m in models:
        for device in ("cpu", "gpu"):
            for on in (True, False):
                megatron = fusion_args(m, on_cpu=device == "cpu", fusions=on)["bias_activation_fusion"]
                assert swiglu_fused(m, device, on) == (m.gated and megatron), (m.name, m.add_bias, device, on)


# -- item 8: the first step's time allows for a cold compile -------------------------------------------

def test_the_first_step_allows_for_a_cold_compile_where_the_fusions_compile():
    fast = Pace(1e-4, "estimated")  # an H100: the expected step is ~0, the floor would decide
    gpu = Limits.for_trial(gpu_cfg(), fast)
    assert gpu.step_s(4, first=True) == pytest.approx(60.0 + COLD_COMPILE_S)
    assert gpu.step_s(4) == 60.0  # later steps: compiled already
    assert "cold compile" in gpu.describe()
    slow = Limits.for_trial(gpu_cfg(), Pace(10.0, "measured"))
    assert slow.step_s(4, first=True) == pytest.approx(MARGIN * FIRST_STEP * 40.0 + COLD_COMPILE_S)
    for cfg in (gpu_cfg(fusions=False), cpu_cfg()):
        lim = Limits.for_trial(cfg, fast)
        assert lim.compile_s == 0 and lim.step_s(4, first=True) == cfg.timeout_s
        assert "compile" not in lim.describe()


def test_the_allowance_follows_where_megatron_compiles():
    for device in ("cpu", "gpu"):
        for on in (True, False):
            cfg = dataclasses.replace(gpu_cfg(fusions=on), hardware=HardwareConfig(device=device))
            assert (cold_compile_s(cfg) > 0) == jit_fused(device == "cpu", on) == fusion_args(
                cfg.model, device == "cpu", on)["bias_dropout_fusion"]


# -- item 8: zero_bench doctor's tiny CUDA compile -------------------------------------------------------

def _never():
    raise AssertionError("the probe ran where nothing compiles")


def test_doctor_tries_no_compile_where_nothing_compiles():
    for bench in (cpu_cfg(), gpu_cfg(fusions=False)):
        c = doctor.check_jit_fusions(bench, probe=_never)
        assert c.status == doctor.NA and "nothing compiled" in c.detail
    assert doctor.check_jit_fusions(None, probe=_never).status == doctor.NA  # the config did not resolve
    c = doctor.check_jit_fusions(gpu_cfg(), probe=lambda: doctor.CompileProbe(False))
    assert c.status == doctor.NA and "no device" in c.detail


def test_doctor_says_the_compile_works():
    c = doctor.check_jit_fusions(gpu_cfg(), probe=lambda: doctor.CompileProbe(True, 21.3), prerequisites=_never)
    assert c.status == doctor.OK and "21.3 s" in c.detail


@pytest.mark.parametrize("error, missing, fix", [
    ("torch._inductor.exc.InductorError: RuntimeError: Failed to find C compiler. Please specify via CC "
     "environment variable.", "a C compiler", "apt-get install gcc"),
    ("/tmp/x/cuda_utils.c:6:10: fatal error: Python.h: No such file or directory\ncompilation terminated.\n"
     "subprocess.CalledProcessError: Command '['/usr/bin/gcc', ...]' returned non-zero exit status 1.",
     "Python's headers", "-dev"),
    ("AssertionError: libcuda.so cannot found!\nPlease make sure GPU is set up and then run \"/sbin/ldconfig\"",
     "libcuda.so.1", "ldconfig"),
    ("RuntimeError: Cannot find a working triton installation. Either the package is not installed or it is too old.",
     "Triton", "pip install"),
])
def test_doctor_names_what_a_failed_compile_misses(error, missing, fix):
    c = doctor.check_jit_fusions(gpu_cfg(), probe=lambda: doctor.CompileProbe(True, 3.0, error),
                                 prerequisites=lambda: [])
    assert c.status == doctor.FIX and f"missing: {missing}" in c.detail
    assert fix in c.fix and "fusions=false" in c.fix


def test_doctor_adds_what_the_machine_visibly_lacks_to_an_unrecognised_failure():
    lacks = [("a C compiler", "apt-get install gcc (or set CC)")]
    c = doctor.check_jit_fusions(gpu_cfg(), probe=lambda: doctor.CompileProbe(True, 1.0, "Boom\nOSError: odd"),
                                 prerequisites=lambda: lacks)
    assert c.status == doctor.FIX and "(OSError: odd)" in c.detail and "missing: a C compiler" in c.detail
    assert c.fix.startswith("apt-get install gcc")


def test_the_real_probe_says_no_gpu_here():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the probe would compile")
    assert doctor.tiny_cuda_compile() == doctor.CompileProbe(False)
