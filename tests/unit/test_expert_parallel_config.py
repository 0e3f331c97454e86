"""parallel.ep: the key composes, refuses in one line what no engine runs, keeps the trial keys
of stored results at ep 1, and names itself in the label."""
from __future__ import annotations

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.schema import ConfigError
from zero_bench.models.megatron import expert_parallel_args

from conftest import cpu_cfg


def bench(*overrides: str):
    return from_cfg(compose(["hardware=cpu", *overrides]))


@pytest.mark.parametrize("overrides, message", [
    (["model=llama-tiny", "parallel.ep=2"], "parallel.ep=2: expert parallelism splits a mixture of experts' experts"),
    (["model=moe-tiny", "parallel.ep=3", "parallel.dp=3"], "parallel.ep=3: must divide model.num_experts=8"),
    (["model=moe-tiny", "parallel.ep=4", "zero=1"], "parallel.ep=4: must divide parallel.dp=2"),
    (["model=moe-tiny", "parallel.ep=2", "zero=3"], "DeepSpeed refuses its MoE with ZeRO stage 3"),
    (["model=moe-tiny", "parallel.ep=2", "zero=0"], "DeepSpeed's ZeRO-0 clips the gradients by the ranks' averaged norm"),
    (["model=moe-tiny", "parallel.ep=2", "parallel.dp=4", "engine=fsdp2", "zero=3", "parallel.dp_shard=2"],
     "hybrid sharding with expert parallelism is not modelled"),
    (["model=moe-tiny", "parallel.ep=0"], "parallel.ep=0: must be an integer >= 1"),
])
def test_refusals_name_the_key_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        bench(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_ep_runs_with_zero_1_2_and_fsdp2():
    for overrides in (["zero=1"], ["zero=2"], ["engine=fsdp2", "zero=3"], ["engine=fsdp2", "zero=2"]):
        b = bench("model=moe-tiny", "parallel.ep=2", *overrides)
        assert b.parallel.ep == 2 and "ep=2" in b.label(), b.label()


def test_ep1_keeps_the_stored_keys_and_ep2_is_its_own():
    one, two = cpu_cfg("moe-tiny", zero=2), bench("model=moe-tiny", "parallel.ep=2", "zero=2")
    assert "ep" not in one._key_dict()["parallel"] and two._key_dict()["parallel"]["ep"] == 2
    assert one.trial_key() != two.trial_key() and "ep=" not in one.label() and "ep=2" in two.label()


def test_megatron_gets_the_expert_groups_and_the_alltoall_dispatcher_at_ep_above_1():
    assert expert_parallel_args(cpu_cfg("moe-tiny")) == {}
    two = bench("model=moe-tiny", "parallel.ep=2", "zero=2")
    assert expert_parallel_args(two) == {"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall"}


@pytest.mark.parametrize("override, key", [("+ds.zero_optimization.reduce_scatter=false", "reduce_scatter=false"),
                                           ("+ds.zero_optimization.contiguous_gradients=false",
                                            "contiguous_gradients=false")])
def test_deepspeed_settings_its_moe_path_asserts_are_refused_before_launch(override, key):
    from zero_bench.engines.ds_config import check_with_deepspeed

    with pytest.raises(ConfigError) as err:
        check_with_deepspeed(bench("model=moe-tiny", "parallel.ep=2", "zero=2", override))
    assert f"ds.zero_optimization.{key}" in str(err.value) and "\n" not in str(err.value)
    check_with_deepspeed(bench("model=moe-tiny", "zero=2", override))  # ep 1: DeepSpeed's dense path takes it
