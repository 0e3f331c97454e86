"""parallel.sequence_parallel (megatron's sequence parallelism with tp, issue 45 item 2): the key,
its refusals, the stored keys of configurations from before it, the spec and config megatron is
given, and the estimate's terms (Korthikanti et al. 2022). The trials: tests/integration/
test_sequence_parallel_trials.py."""
from __future__ import annotations

import dataclasses

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import BenchConfig, ConfigError, ParallelConfig
from zero_bench.estimate import activation_bytes_per_sample, estimate
from zero_bench.models.description import ModelConfig


def bench(*overrides: str) -> BenchConfig:
    return from_cfg(compose(["hardware=cpu", "precision=fp32", *overrides]), here=False)


def llama(**kw) -> ModelConfig:
    return dataclasses.replace(bench("model=llama-tiny").model, **kw)


def test_on_by_default_at_tp_above_1_and_nothing_at_tp_1():
    assert bench("parallel=tp2").layout.sequence_parallel
    assert bench("parallel=tp2").layout.seq_shard == 2
    assert not bench("parallel=tp2", "parallel.sequence_parallel=false").layout.sequence_parallel
    one = bench("parallel=dp2")
    assert one.parallel.sequence_parallel is None and not one.layout.sequence_parallel and one.layout.seq_shard == 1
    with pytest.raises(ConfigError, match=r"^parallel\.sequence_parallel=true: .*parallel\.tp=1"):
        RankLayout(tp=1, sequence_parallel=True)


def test_a_sequence_tp_does_not_divide_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        bench("model=llama-tiny", "parallel=tp2", "model.seq_len=255")
    msg = str(e.value)
    assert msg.startswith("model.seq_len=255: must be a multiple of parallel.tp=2") and "\n" not in msg, msg
    assert "parallel.sequence_parallel=false" in msg
    # without sequence parallelism each tp rank holds the whole sequence: any length
    assert bench("model=llama-tiny", "parallel=tp2", "model.seq_len=255", "parallel.sequence_parallel=false")


def test_deepspeeds_partitioned_activations_are_refused_with_it():
    """partition_activations splits each checkpointed input as if it were the same on every tp rank:
    asked for explicitly beside the megatron_deepspeed preset (whose own default is off), refused."""
    preset = ["model=gpt-mini", "parallel=tp2", "recompute=full", "ds_preset=megatron_deepspeed"]
    on = "parallel.sequence_parallel=true"
    with pytest.raises(ConfigError, match=r"^parallel\.sequence_parallel=true: DeepSpeed's activation_checkpointing"):
        bench(*preset, on)
    assert bench(*preset, "parallel.sequence_parallel=false")
    assert bench(*preset, on, "+ds.activation_checkpointing.partition_activations=false").layout.sequence_parallel
    assert bench("model=gpt-mini", "parallel=tp2", "ds_preset=megatron_deepspeed", on)  # no recompute: not called


def test_the_reference_preset_runs_without_it_unless_asked():
    """ds_preset=megatron_deepspeed reproduces the 2021 Megatron-DeepSpeed of the reference table,
    which predates sequence parallelism: off there unless the key is given; on elsewhere at tp > 1.
    It keeps the search key such a configuration had before the key existed."""
    preset = ["model=gpt-mini", "parallel=tp2", "recompute=full", "ds_preset=megatron_deepspeed"]
    b = bench(*preset)
    assert b.parallel.sequence_parallel is False and not b.layout.sequence_parallel and b.layout.seq_shard == 1
    assert b.search_key() == bench(*preset, "parallel.sequence_parallel=false").search_key()
    assert bench("model=gpt-mini", "parallel=tp2", "recompute=full").layout.sequence_parallel  # default preset


def test_the_documented_reference_estimate_answers_at_tp_8():
    """docs/commands.md's reference command at mp8 (tp 8): it exited 2 on partition_activations."""
    from zero_bench.estimate.table import estimate_report

    args = ["model=gpt345m", "parallel=mp8", "hardware=a100_40gb", "precision=fp16", "recompute=full",
            "ds_preset=megatron_deepspeed"]
    out = estimate_report(compose(args), frozenset(a.split("=")[0] for a in args))
    assert out.startswith("zero_bench estimate: GPT-345M") and "tp=8 dp=1" in out.splitlines()[0]
    with pytest.raises(ConfigError, match=r"^parallel\.sequence_parallel=true: DeepSpeed's"):
        estimate_report(compose([*args, "parallel.sequence_parallel=true"]),
                        frozenset(a.split("=")[0] for a in [*args, "parallel.sequence_parallel=true"]))


def test_records_from_before_the_key_keep_their_search_key_and_meaning():
    """tp > 1 ran without sequence parallelism before the key existed: a stored config without it
    reads as sequence_parallel=false and keeps its key; the default (on) is another search."""
    off = bench("parallel=tp2", "parallel.sequence_parallel=false")
    on = bench("parallel=tp2")
    old = off.to_dict()
    del old["parallel"]["sequence_parallel"]
    stored = BenchConfig.from_dict(old)
    assert not stored.parallel.sequence_parallel and stored.search_key() == off.search_key()
    assert on.search_key() != off.search_key()
    assert "sequence_parallel=false" in off.label() and "sequence_parallel" not in on.label()
    one = bench("parallel=dp2")  # tp 1: the key does not enter (nothing changes)
    assert one.search_key() == dataclasses.replace(
        one, parallel=dataclasses.replace(one.parallel, sequence_parallel=False)).search_key()


def test_megatron_is_given_the_flag_and_the_tp_summed_norms():
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from zero_bench.models.megatron import layer_spec, transformer_config
    from zero_bench.models.sequence_parallel import SequenceParallelNorm

    b = bench("model=llama-tiny", "parallel=tp2")
    assert transformer_config(b, on_cpu=True, initialize=False).sequence_parallel
    off = bench("model=llama-tiny", "parallel=tp2", "parallel.sequence_parallel=false")
    assert not transformer_config(off, on_cpu=True, initialize=False).sequence_parallel
    spec = layer_spec(b.model, sequence_parallel=True)
    assert isinstance(spec, TransformerBlockSubmodules) and len(spec.layer_specs) == b.model.num_layers
    assert spec.layer_norm is SequenceParallelNorm
    layer = spec.layer_specs[0].submodules
    assert layer.input_layernorm is SequenceParallelNorm and layer.pre_mlp_layernorm is SequenceParallelNorm
    assert layer_spec(b.model).submodules.input_layernorm is not SequenceParallelNorm


def test_the_estimate_divides_korthikantis_ten_by_tp():
    """Korthikanti et al. 2022: per layer sbh(10 + 24/t + 5as/(ht)) bytes without sequence
    parallelism, sbh(34/t + 5as/(ht)) with (16-bit, dropout). The 10 are both norms' inputs (4),
    the QKV and fc1 inputs (4) and the two dropout masks (2); the formula adds the norms'
    statistics (8 bytes per norm, megatron's fused LayerNorm). gpt-mini, bf16 on GPU, dropout."""
    m = dataclasses.replace(bench("model=gpt-mini").model, dropout=0.1)
    s, h = m.seq_len, m.hidden_size
    for t in (2, 4):
        off = activation_bytes_per_sample(m, t, "bf16")
        on = activation_bytes_per_sample(m, t, "bf16", sequence_parallel=True)
        assert off["per_layer"] - on["per_layer"] == s * (10 * h + 16) * (t - 1) / t
        # outside the layers: the final norm, the output layer's input, the embedding's dropout mask
        assert off["embedding"] - on["embedding"] == s * ((2 * h + 8) + 2 * h + h) * (t - 1) / t
        full_off = activation_bytes_per_sample(m, t, "bf16", "full")
        full_on = activation_bytes_per_sample(m, t, "bf16", "full", sequence_parallel=True)
        assert full_on["layers"] * t == full_off["layers"]  # each layer's input: its sequence shard
    assert activation_bytes_per_sample(m, 1, "bf16", sequence_parallel=True) == activation_bytes_per_sample(m, 1, "bf16")


def test_the_estimate_a_configuration_gets_follows_the_key():
    on, off = (estimate(bench("model=llama-tiny", "parallel=tp2", *x)) for x in ([], ["parallel.sequence_parallel=false"]))
    assert on.act_per_sample < off.act_per_sample
    assert on.activations["per_layer"] < off.activations["per_layer"]
