"""parallel.ep > 1 in the engines, at their seams, in one process: DeepSpeed's expert groups and
parameter tags (engines/deepspeed.py deepspeed_moe), FSDP2's expert sharding and clipping
(engines/fsdp2.py shard_layer, clip_grad_norm). Rank 0 of 8 fake ranks (torch's "fake" backend:
collectives are no-ops), tp 1, ep 2: megatron's real groups, no training. That the engines train
as at ep=1 (losses, grad norms, weights after 3 steps) is a 2-process check, not a unit test."""
from __future__ import annotations

import types

import pytest
import torch

from zero_bench.engines import deepspeed as ds_engine, fsdp2


@pytest.fixture
def megatron_ep2():
    """megatron's groups at tp 1, ep 2 over 8 fake ranks: ep groups of 2 consecutive ranks, this
    rank's expert-data-parallel group the 4 ranks holding the same experts."""
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2,
                                 create_gloo_process_groups=False)
    yield ps
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture
def ds_tables(monkeypatch):
    """DeepSpeed's expert group tables, fresh for the test (one stale entry, as a forked trial
    would inherit from its parent) and put back after it."""
    from deepspeed.utils import groups

    stale = object()
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):
        monkeypatch.setattr(groups, name, {"ep_size_4": stale})
    return groups


def moe_model() -> torch.nn.Module:
    """A megatron MoELayer (not built: only its class and config matter here) holding two expert
    parameters as megatron marks them at ep > 1, a router (allreduce=True, as megatron marks
    non-expert linears) and a norm weight without the attribute."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = MoELayer.__new__(MoELayer)
    torch.nn.Module.__init__(mlp)
    mlp.config = types.SimpleNamespace(num_moe_experts=8)
    mlp.experts = torch.nn.Linear(4, 4, bias=True)
    for p in mlp.experts.parameters():
        p.allreduce = False
    mlp.router = torch.nn.Linear(4, 8, bias=False)
    mlp.router.weight.allreduce = True
    model = torch.nn.Module()
    model.mlp, model.norm = mlp, torch.nn.LayerNorm(4, bias=False)
    return model


# -- DeepSpeed -------------------------------------------------------------------------------------

def test_ep1_hands_deepspeed_the_parameters_as_before(ds_tables):
    import deepspeed.runtime.engine as runtime_engine

    model, before = moe_model(), runtime_engine.MoE
    with ds_engine.deepspeed_moe(model, 1) as parameters:
        assert not isinstance(parameters, list) and runtime_engine.MoE is before
        assert [id(p) for p in parameters] == [id(p) for p in model.parameters()]
    assert not any(hasattr(p, "group_name") for p in model.parameters())
    assert ds_tables._EXPERT_PARALLEL_GROUP.keys() == {"ep_size_4"}  # nothing registered


def test_megatron_expert_groups_become_deepspeeds(megatron_ep2, ds_tables):
    ps = megatron_ep2
    name = ds_engine.register_expert_groups(2, ps.get_expert_model_parallel_group(),
                                            ps.get_expert_data_parallel_group())
    assert name == "ep_size_2"
    assert ds_tables._EXPERT_PARALLEL_GROUP == {name: ps.get_expert_model_parallel_group()}
    assert ds_tables._EXPERT_DATA_PARALLEL_GROUP == {name: ps.get_expert_data_parallel_group()}
    assert ds_tables._EXPERT_PARALLEL_GROUP_RANKS == {name: [0, 1]}
    assert ds_tables._EXPERT_DATA_PARALLEL_GROUP_RANKS == {name: [0, 2, 4, 6]}
    # what DeepSpeed reads back: the size from the name, the groups by name
    assert ds_tables._get_max_expert_size() == 2
    assert ds_tables._get_expert_parallel_group(name) is ps.get_expert_model_parallel_group()
    assert ds_tables._get_expert_data_parallel_group(name) is ps.get_expert_data_parallel_group()


def test_expert_params_tagged_and_split_by_deepspeed():
    """DeepSpeed's own split (engine.py:2330 configure_moe_param_groups) puts the tagged experts in
    their group, named for their expert-data-parallel group; the router and the norm stay dense."""
    from deepspeed.moe.utils import configure_moe_param_groups, is_moe_param

    model = moe_model()
    assert ds_engine.tag_expert_params(model, "ep_size_2") == 2
    assert model.mlp.num_experts == 8  # what engine.py:2104 lists
    experts = set(map(id, model.mlp.experts.parameters()))
    assert {id(p) for p in model.parameters() if is_moe_param(p)} == experts
    assert all(p.group_name == "ep_size_2" for p in model.mlp.experts.parameters())
    assert not hasattr(model.mlp.router.weight, "group_name") and not hasattr(model.norm.weight, "group_name")
    groups = configure_moe_param_groups(list(model.parameters()))
    by_name = {g["name"]: g for g in groups}
    assert by_name.keys() == {"dense-params", "ep_size_2"} and by_name["ep_size_2"]["moe"]
    assert {id(p) for p in by_name["ep_size_2"]["params"]} == experts
    assert not by_name["dense-params"].get("moe") and len(by_name["dense-params"]["params"]) == 2


def test_megatron_moe_layer_counted_only_during_initialize(megatron_ep2, ds_tables):
    import deepspeed.runtime.engine as runtime_engine
    from deepspeed.moe.layer import MoE
    from megatron.core.transformer.moe.moe_layer import MoELayer

    model = moe_model()
    with ds_engine.deepspeed_moe(model, 2) as parameters:
        assert isinstance(parameters, list) and len(parameters) == 4  # moe/utils.py:157 asserts a list
        assert isinstance(model.mlp, runtime_engine.MoE)  # engine.py:2102 has_moe_layers
        assert ds_tables._EXPERT_DATA_PARALLEL_GROUP_RANKS == {"ep_size_2": [0, 2, 4, 6]}
    assert runtime_engine.MoE is MoE
    with pytest.raises(ValueError), ds_engine.deepspeed_moe(model, 2):
        raise ValueError("deepspeed.initialize failed")
    assert runtime_engine.MoE is MoE and not issubclass(MoELayer, runtime_engine.MoE)


# -- FSDP2 -----------------------------------------------------------------------------------------

def layer_with_experts() -> torch.nn.Module:
    """The attributes shard_layer reads off a megatron TransformerLayer with an MoE mlp."""
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = torch.nn.Linear(4, 16, bias=False)  # this rank's experts: 16 rows
    layer.mlp.router = torch.nn.Linear(4, 8, bias=False)
    return layer


def layer_options(ps) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    mesh = DeviceMesh.from_group(ps.get_data_parallel_group(), "cpu", mesh_dim_names=("dp",))
    return dict(mesh=mesh, reshard_after_forward=True, mp_policy=MixedPrecisionPolicy(),
                offload_policy=OffloadPolicy())


def test_experts_sharded_over_their_expert_data_parallel_ranks(megatron_ep2):
    from torch.distributed.fsdp import FSDPModule

    kw = layer_options(megatron_ep2)
    experts_kw = fsdp2.expert_shard_options(kw, on_cpu=True, ep=2)
    assert experts_kw["mesh"].size() == 4 and {k: v for k, v in experts_kw.items() if k != "mesh"} == \
        {k: v for k, v in kw.items() if k != "mesh"}  # the layer's options, its own mesh
    layer = layer_with_experts()
    fsdp2.shard_layer(layer, kw, experts_kw)
    experts, router = layer.mlp.experts.weight, layer.mlp.router.weight
    assert isinstance(layer.mlp.experts, FSDPModule) and isinstance(layer, FSDPModule)
    assert experts.device_mesh is experts_kw["mesh"] and router.device_mesh is kw["mesh"]
    assert experts.to_local().shape == (16 // 4, 4) and router.to_local().shape == (8 // 8, 4)
    # gradients averaged over the 8 data-parallel ranks, not over the 4 FSDP2 reduces them over
    [group] = layer.mlp.experts._get_fsdp_state()._fsdp_param_groups
    assert group.gradient_divide_factor == 8.0
    assert [g.gradient_divide_factor for g in layer._get_fsdp_state()._fsdp_param_groups] == [None]


def test_ep1_shards_each_layer_whole(megatron_ep2):
    from torch.distributed.fsdp import FSDPModule

    kw = layer_options(megatron_ep2)
    assert fsdp2.expert_shard_options(kw, on_cpu=True, ep=1) is None
    layer = layer_with_experts()
    fsdp2.shard_layer(layer, kw, None)
    assert not isinstance(layer.mlp.experts, FSDPModule)
    experts = layer.mlp.experts.weight
    assert experts.device_mesh is kw["mesh"] and experts.to_local().shape == (16 // 8, 4)


def test_clipping_over_two_meshes(megatron_ep2, monkeypatch):
    """torch's clip_grad_norm_ refuses gradients on two meshes; at ep > 1 the norm is the plain
    sum of the local squares over the world (all-reduced: a no-op with the fake backend, so this
    rank's squares here) and every local gradient takes the same scale. ep=1 stays torch's."""
    from torch.distributed.tensor import DTensor

    kw, layer = layer_options(megatron_ep2), layer_with_experts()
    fsdp2.shard_layer(layer, kw, fsdp2.expert_shard_options(kw, on_cpu=True, ep=2))
    for p, value in zip(layer.parameters(), (3.0, 4.0)):  # experts (4 x 4) 3s, router (1 x 4) 4s
        p.grad = DTensor.from_local(torch.full_like(p.to_local(), value), p.device_mesh, p.placements)
    with pytest.raises(RuntimeError, match="same mesh"):
        torch.nn.utils.get_total_norm([p.grad for p in layer.parameters()])
    named = list(layer.named_parameters())
    norm = fsdp2.clip_grad_norm(named, 1.0, 0, 1, frozenset(), ep=2)
    assert norm == pytest.approx((16 * 9 + 4 * 16) ** 0.5)
    coef = 1.0 / (norm + 1e-6)
    experts, router = (p.grad.to_local() for _, p in named)
    assert torch.allclose(experts, torch.full_like(experts, 3 * coef))
    assert torch.allclose(router, torch.full_like(router, 4 * coef))
    calls = []
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda ps, max_norm: calls.append(max_norm) or 0.5)
    assert fsdp2.clip_grad_norm(named, 1.0, 0, 1, frozenset()) == 0.5 and calls == [1.0]
