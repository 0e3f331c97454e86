"""The one model description: the parameter list the estimate counts is the list of the model
megatron-core builds from it, for every preset (built on the meta device: shapes, no memory)."""
from __future__ import annotations

import pytest
import torch

from zero_bench.config import BenchConfig, CONF_DIR, HardwareConfig
from zero_bench.models import param_numels
from zero_bench.models.megatron import build_gpt, transformer_config

from conftest import model

PRESETS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


@pytest.fixture(scope="module")
def megatron_tp1(tmp_path_factory):
    """megatron's parallel state on a real one-rank gloo group (tensor-parallel degree 1)."""
    from megatron.core import parallel_state

    store = tmp_path_factory.mktemp("pg") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("name", PRESETS)
def test_param_list_is_the_live_models(name, megatron_tp1):
    cfg = BenchConfig(model=model(name), hardware=HardwareConfig(device="cpu"), precision="bf16")
    with torch.device("meta"):
        gpt = build_gpt(cfg, transformer_config(cfg, on_cpu=True), on_cpu=True)
    assert [p.numel() for p in gpt.parameters()] == param_numels(cfg.model, 1)
    assert sum(p.numel() for p in gpt.parameters()) == cfg.model.num_params


def test_published_sizes():
    """Megatron-LM's GPT-2 sizes as their names say (vocabulary padded to 50304 rows)."""
    for name, billions in (("gpt345m", 0.355), ("gpt1.3b", 1.3), ("gpt2.5b", 2.5), ("gpt5.8b", 5.8), ("gpt8.3b", 8.3)):
        assert model(name).num_params == pytest.approx(billions * 1e9, rel=0.04), name
