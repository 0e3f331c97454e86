"""`states`: where the precision of the model states lives (mixed, pure bf16, 8-bit AdamW): the key,
its refusals, DeepSpeed's JSON, and the states the estimate predicts for each engine."""
from __future__ import annotations

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import ConfigError
from zero_bench.engines import ds_config
from zero_bench.estimate import estimate
from zero_bench.estimate.fsdp2 import model_states
from zero_bench.estimate.states import model_states_bytes
from zero_bench.models.params import params
from zero_bench.search.preflight import validate_machine

from conftest import cpu_cfg, model


def bench(*overrides: str):
    return from_cfg(compose(["hardware=cpu", "precision=bf16", *overrides]), here=False)


@pytest.mark.parametrize("overrides, message", [
    (["states=fp8"], "states=fp8: allowed values are mixed, bf16, adam8bit"),
    (["states=bf16", "precision=fp32"], "states=bf16: needs precision=bf16 (got fp32); allowed with precision=fp32: "
                                        "states=mixed"),
    (["states=bf16", "zero=0"], "states=bf16: DeepSpeed keeps bf16 master weights and optimizer states with ZeRO 1-3 "
                                "only"),
    (["states=bf16", "zero=2", "offload=true"], "states=bf16: DeepSpeed offloads bf16 optimizer states only to its "
                                                "CPUAdam"),
])
def test_what_cannot_run_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        bench(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_adam8bit_is_estimated_and_its_trials_refused():
    b = bench("states=adam8bit", "zero=2")
    assert estimate(b).states.moments > 0
    with pytest.raises(ConfigError, match="^states=adam8bit: 8-bit AdamW needs torchao"):
        validate_machine(b)


def test_keys_of_mixed_configs_did_not_move_and_labels_say_the_states():
    mixed, pure = bench("zero=2"), bench("zero=2", "states=bf16")
    assert "states" not in mixed._key_dict() and pure._key_dict()["states"] == "bf16"
    assert mixed.search_key() != pure.search_key()
    assert pure.label() == "GPT-mini tp1 dp2 zero2 bf16 states=bf16" and mixed.label() == "GPT-mini tp1 dp2 zero2 bf16"


def test_deepspeed_json_asks_for_bf16_master_weights_and_states_only_when_pure():
    pure = ds_config.build(bench("zero=2", "states=bf16"))["bf16"]
    assert pure == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert ds_config.build(bench("zero=2"))["bf16"] == {"enabled": True}


def test_deepspeed_states_per_parameter():
    """Per parameter at dp 2, ZeRO-2: mixed 2 (params) + 4/2 (fp32 master) + 8/2 (moments) + 2/2
    (grads); pure bf16 halves the master and the moments; 8-bit AdamW keeps 2 bytes and a scale per
    256 values for both moments."""
    P = 1_000_000
    mixed = model_states_bytes(P, 2, RankLayout(dp=2), precision="bf16")
    pure = model_states_bytes(P, 2, RankLayout(dp=2), precision="bf16", states="bf16")
    int8 = model_states_bytes(P, 2, RankLayout(dp=2), precision="bf16", states="adam8bit")
    assert (mixed.master, mixed.moments) == (2 * P, 4 * P)
    assert (pure.params, pure.master, pure.moments, pure.grads) == (2 * P, P, 2 * P, P)
    assert (int8.master, int8.moments) == (2 * P, 2 * (P // 2 + 4 * 1954))  # ceil(500000 / 256) scales each


def test_fsdp2_pure_bf16_holds_half_of_everything():
    m = model("llama-tiny")
    two = RankLayout(dp=2, model=m)
    mixed, pure = model_states(two, precision="bf16"), model_states(two, precision="bf16", states="bf16")
    assert pure.master == 0 and pure.params == mixed.master // 2 and pure.grads == mixed.grads // 2
    steps = 4 * len(params(m))  # AdamW's fp32 step counter per tensor
    assert pure.moments - steps == (mixed.moments - steps) // 2
    e = estimate(cpu_cfg("llama-tiny", engine="fsdp2", zero=3, precision="bf16", states="bf16"))
    assert e.persistent == pure.params + pure.moments
