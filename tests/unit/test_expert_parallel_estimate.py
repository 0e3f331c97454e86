"""Expert parallelism (parallel.ep) in the estimate: the parameters a rank holds, DeepSpeed ZeRO-1/2's
and FSDP2's model states per rank, the report's estimate and the estimate's header. Every expected
figure is moe-tiny's shape arithmetic written out here (conf/model/moe-tiny.yaml), not the
functions under test; ep=1 keeps today's figures (given as numbers)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.layout import RankLayout
from zero_bench.errors import ConfigError
from zero_bench.estimate import estimate
from zero_bench.estimate.buffers import deepspeed_buffers
from zero_bench.estimate.fsdp2 import local_numel, model_states
from zero_bench.estimate.states import model_states_bytes
from zero_bench.estimate.table import estimate_report
from zero_bench.models.params import dense_params, num_params, params, params_per_shard, routed_expert_params
from zero_bench.report.rows import bench_of
from zero_bench.report.tables import estimate_or_error

from conftest import model

# moe-tiny: h 256, 4 layers, 8 heads of 32 / 2 query groups, vocabulary 1024 (padded to 128: 1024
# rows), untied, RMSNorm, no biases, 8 SwiGLU experts of 256 in every layer, no shared expert.
H, L, HEADS, GROUPS, D, V, E, F = 256, 4, 8, 2, 32, 1024, 8, 256
ROOT = [(V, H), (H,), (V, H)]  # word embedding, final norm, output layer
LAYER_DENSE = [(H,), (H, HEADS * D), ((HEADS + 2 * GROUPS) * D, H), (H,), (E, H)]  # norm, proj, qkv, norm, router
EXPERT = [(2 * F, H), (H, F)]  # fc1 (gate and up), fc2
DENSE = sum(map(math.prod, ROOT)) + L * sum(map(math.prod, LAYER_DENSE))
ONE_EXPERT = sum(map(math.prod, EXPERT))
EXPERTS = L * E * ONE_EXPERT  # all of them


def local(ep: int) -> int:
    """Parameters one rank holds whole: the dense ones and E / ep experts per layer."""
    return DENSE + EXPERTS // ep


def partition(dp: int, ep: int) -> int:
    """A rank's ZeRO partition: the dense group over dp ranks, its experts over the dp / ep holding them."""
    return DENSE // dp + (EXPERTS // ep) // (dp // ep)


def bench(*overrides: str):
    return from_cfg(compose(["model=moe-tiny", "hardware.device=cpu", *overrides]), here=False)


def test_moe_tiny_shape_arithmetic():
    m = model("moe-tiny")
    assert (DENSE, EXPERTS, DENSE + EXPERTS) == (1_190_144, 6_291_456, num_params(m))


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_a_rank_holds_the_dense_params_and_its_experts(ep):
    m = model("moe-tiny")
    layout = RankLayout(dp=ep, ep=ep, model=m)
    assert layout.experts_per_rank == E // ep
    assert layout.held_params == local(ep) == sum(p.numel for p in layout.params)
    assert (layout.dense_params, layout.held_expert_params) == (DENSE, EXPERTS // ep)
    assert (layout.tp_shard_params, layout.tp_shard_expert_params) == (DENSE + EXPERTS, EXPERTS)
    assert (dense_params(m, 1), routed_expert_params(m, 1, experts=E // ep)) == (DENSE, EXPERTS // ep)
    names = [p.name for p in layout.params if p.expert]
    assert len(names) == L * (E // ep) * len(EXPERT) and all(".mlp.experts.local_experts." in n for n in names)
    assert {int(n.split("local_experts.")[1].split(".")[0]) for n in names} == set(range(E // ep))
    assert not any(p.expert for p in layout.params if "local_experts" not in p.name)


def test_ep_1_is_todays_list_and_ep_must_divide_the_experts():
    m = model("moe-tiny")
    one = RankLayout(model=m)
    assert list(one.params) == params(m) and one.held_params == params_per_shard(m, 1) == 7_481_600
    assert local(2) == 4_335_872
    for bad, mm in ((3, m), (2, model("llama-tiny"))):
        with pytest.raises(ConfigError, match=f"^parallel.ep={bad}: "):
            RankLayout(dp=bad, ep=bad, model=mm)
    assert routed_expert_params(model("llama-tiny"), 1) == 0


# -- DeepSpeed ZeRO-1/2 ----------------------------------------------------------------------------

def deepspeed_expected(zero: int, dp: int, ep: int, precision: str) -> dict:
    """params whole (2 or 4 bytes of the local ones); ZeRO-1 the gradients whole, ZeRO-2 partitioned;
    the fp32 master (cloned also in fp32) and Adam's two fp32 moments on the partition."""
    b, whole, part = (2 if precision == "bf16" else 4), local(ep), partition(dp, ep)
    return {"params": b * whole, "grads": b * (whole if zero == 1 else part), "master": 4 * part,
            "moments": 8 * part, "optimizer": 12 * part}


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("dp, ep", [(2, 1), (2, 2), (4, 2), (4, 4), (8, 2)])
def test_deepspeed_states_per_rank(zero, precision, dp, ep):
    want = deepspeed_expected(zero, dp, ep, precision)
    got = model_states_bytes(DENSE + EXPERTS, zero, RankLayout(dp=dp, ep=ep), precision=precision,
                             expert_params=EXPERTS)
    assert {k: getattr(got, k) for k in want} == want
    assert got.device == want["params"] + want["grads"] + want["optimizer"] and got.host == 0
    e = estimate(bench(f"zero={zero}", f"precision={precision}", f"parallel.dp={dp}", f"parallel.ep={ep}"))
    assert {k: getattr(e.states, k) for k in want} == want
    assert e.params_per_shard == local(ep) and e.ep == ep


def test_deepspeed_ep2_moe_tiny_in_bytes():
    """The figures the 2-rank trials (dp 2, ep 2, bf16) are to measure, per rank."""
    z1 = estimate(bench("zero=1", "precision=bf16", "parallel.dp=2", "parallel.ep=2")).states
    z2 = estimate(bench("zero=2", "precision=bf16", "parallel.dp=2", "parallel.ep=2")).states
    assert (z1.params, z1.master, z1.moments, z1.grads) == (8_671_744, 14_963_200, 29_926_400, 8_671_744)
    assert (z2.params, z2.master, z2.moments, z2.grads) == (8_671_744, 14_963_200, 29_926_400, 7_481_600)


@pytest.mark.parametrize("zero", [1, 2])
def test_deepspeed_ep_1_is_todays(zero):
    """ep=1 (expert_params given or not) is the formula as before: moe-tiny bf16, dp 2."""
    n = DENSE + EXPERTS
    today = model_states_bytes(n, zero, RankLayout(dp=2), precision="bf16")
    assert model_states_bytes(n, zero, RankLayout(dp=2, ep=1), precision="bf16", expert_params=EXPERTS) == today
    grads = 14_963_200 if zero == 1 else 7_481_600
    assert (today.params, today.master, today.moments, today.grads) == (14_963_200, 14_963_200,
                                                                                  29_926_400, grads)
    assert estimate(bench(f"zero={zero}", "precision=bf16")).states == today


def test_deepspeed_offload_and_refusals():
    """offload_optimizer: the master, moments and the fp32 gradient partition on the host, each the
    rank's partition; ep must divide dp."""
    s = model_states_bytes(DENSE + EXPERTS, 2, RankLayout(dp=4, ep=2), precision="bf16", offload_optimizer=True,
                           expert_params=EXPERTS)
    part = partition(4, 2)
    assert (s.device, s.host, s.grads) == (2 * local(2), 16 * part, 4 * part)
    e = estimate(bench("zero=1", "precision=bf16", "parallel.dp=4", "parallel.ep=2", "offload=true",
                       "hardware.device=gpu"))
    # the 16-bit gradients; the fp32 partition is on the host
    assert e.prediction.phase_grads == 2 * local(2)
    with pytest.raises(ConfigError, match="^parallel.ep=2: must divide parallel.dp=3"):
        RankLayout(dp=3, ep=2)


def test_deepspeed_buffers_per_param_group():
    """The experts are their own param group: ZeRO-1's fp32 gradient partition holds both groups'
    partitions; the step flattens (and torch Adam updates) one group at a time: the larger one.
    deepspeed.initialize flattens one group at a time: the model plus the larger group."""
    assert RankLayout(dp=2, ep=2, model=model("moe-tiny")).zero_partitions == [DENSE // 2, EXPERTS // 2]
    assert RankLayout(dp=4, model=model("moe-tiny")).zero_partitions == [(DENSE + EXPERTS) // 4]
    b = bench("zero=1", "precision=bf16", "parallel.dp=2", "parallel.ep=2")
    buf = {x.name: x.bytes for x in deepspeed_buffers(b)}
    assert buf["grad_partition_fp32"] == 4 * partition(2, 2)
    assert buf["grad_flat_fp32"] == buf["adam_temp"] == 4 * max(DENSE // 2, EXPERTS // 2)
    assert estimate(b).prediction.init_peak == 2 * local(2) + 2 * max(DENSE, EXPERTS // 2)
    one = {x.name: x.bytes for x in deepspeed_buffers(bench("zero=1", "precision=bf16", "parallel.dp=2"))}
    assert one["grad_partition_fp32"] == one["grad_flat_fp32"] == one["adam_temp"] == 4 * (DENSE + EXPERTS) // 2


# -- FSDP2 -----------------------------------------------------------------------------------------

def fsdp2_shapes(ep: int) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, expert) of every tensor a rank holds, in any order."""
    out = [(s, False) for s in ROOT] + [(s, False) for s in LAYER_DENSE * L]
    return out + [(s, True) for s in EXPERT * (L * E // ep)]


def fsdp2_expected(dp: int, ep: int, precision: str) -> dict:
    """Rank 0: each tensor's dim 0 padded to a multiple of its shard count (dp; an expert's: dp / ep),
    the fp32 shards (params, or the master with bf16 compute), the gradients alike; AdamW's m and v on
    the unpadded shard (rank 0's is the full ceil) + a 4-byte step per tensor."""
    held = unpadded = 0
    for shape, expert in fsdp2_shapes(ep):
        n = dp // ep if expert else dp
        rows, rest = -(-shape[0] // n), math.prod(shape[1:])
        held += rows * rest
        unpadded += min(rows, shape[0]) * rest
    moments = 8 * unpadded + 4 * len(fsdp2_shapes(ep))
    p, m = (0, 4 * held) if precision == "bf16" else (4 * held, 0)
    return {"params": p, "master": m, "grads": 4 * held, "moments": moments, "optimizer": m + moments}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("dp, ep", [(2, 1), (2, 2), (4, 2), (6, 2), (8, 4)])
def test_fsdp2_states_per_rank(precision, dp, ep):
    want = fsdp2_expected(dp, ep, precision)
    got = model_states(RankLayout(dp=dp, ep=ep, model=model("moe-tiny")), precision)
    assert {k: getattr(got, k) for k in want} == want
    if dp in (2, 4, 8):  # bench needs the group sizes the config allows (dp_shard None)
        e = estimate(bench("engine=fsdp2", "zero=3", f"precision={precision}", f"parallel.dp={dp}",
                           f"parallel.ep={ep}"))
        assert {k: getattr(e.states, k) for k in want} == want


def test_fsdp2_ep2_moe_tiny_in_bytes():
    """dp 2, ep 2, bf16 (zero 2 and 3 alike): the experts whole on their rank (one rank per expert
    group), the dense half each."""
    s = estimate(bench("engine=fsdp2", "zero=3", "precision=bf16", "parallel.dp=2", "parallel.ep=2")).states
    part = DENSE // 2 + EXPERTS // 2
    tensors = len(ROOT) + L * (len(LAYER_DENSE) + E // 2 * len(EXPERT))
    assert (s.params, s.master, s.moments, s.grads) == (0, 4 * part, 8 * part + 4 * tensors, 4 * part)
    assert (s.master, s.moments) == (14_963_200, 29_926_620)
    today = model_states(RankLayout(dp=2, model=model("moe-tiny")), "bf16")
    assert (today.master, today.moments) == (14_963_200, 29_926_748)  # ep 1: 32 more tensors' step


@pytest.mark.parametrize("dp, ep", [(2, 2), (4, 2), (6, 2), (8, 4)])
def test_fsdp2_unpadded_shards_add_up_to_the_model(dp, ep):
    """numel_local as engines/fsdp2.count_states reports it: over the dp ranks, every parameter once."""
    m = model("moe-tiny")
    assert sum(local_numel(RankLayout(dp=dp, ep=ep, model=m), r) for r in range(dp)) == num_params(m)


def test_fsdp2_gathered_layer_holds_the_local_experts():
    """zero=3: a gathered MoE layer is its dense part and its E / ep experts, in the compute dtype."""
    layer = sum(map(math.prod, LAYER_DENSE))
    for ep in (1, 2):
        e = estimate(bench("engine=fsdp2", "zero=3", "precision=bf16", "parallel.dp=2", f"parallel.ep={ep}"))
        assert e.prediction.buffer("layer_gathered").bytes == 2 * (layer + E // ep * ONE_EXPERT)
        assert e.prediction.buffer("held_reduce_scatter_input").bytes == 4 * (layer + E // ep * ONE_EXPERT)


# -- the report and `zero_bench estimate` ------------------------------------------------------------

def test_report_estimate_follows_the_stored_ep():
    for overrides in (["zero=2", "precision=bf16"], ["engine=fsdp2", "zero=3", "precision=bf16"]):
        b = bench(*overrides, "parallel.dp=2", "parallel.ep=2")
        stored = b.to_dict()
        s = bench_of(stored)
        assert s.parallel.ep == 2
        want = estimate(b).states
        assert estimate_or_error(s) == (want.total, "")
        old = json.loads(json.dumps(stored))
        del old["parallel"]["ep"]  # stored before parallel.ep existed
        assert bench_of(old).parallel.ep == 1
        one = estimate(dataclasses.replace(b, parallel=dataclasses.replace(b.parallel, ep=1))).states
        assert estimate_or_error(bench_of(old)) == (one.total, "")


def test_estimate_header_names_ep_only_above_1():
    base = ["model=moe-tiny", "hardware=cpu", "zero=2", "parallel.dp=2"]
    head = estimate_report(compose([*base, "parallel.ep=2"]), frozenset({"zero"})).splitlines()[0]
    assert " tp=1 dp=2 ep=2 on cpu" in head and f"{local(2):,} per rank with 4 of 8 experts" in head
    head = estimate_report(compose(base), frozenset({"zero"})).splitlines()[0]
    assert " tp=1 dp=2 on cpu" in head and "ep=" not in head


def test_the_gpu_estimate_counts_the_expert_groups_communicators():
    """ep > 1 adds the expert-parallel group (all-to-all) and the expert-data-parallel group."""
    from zero_bench.estimate.gpu import communicators

    assert communicators(RankLayout(dp=8)) == [8, 8]
    assert communicators(RankLayout(dp=8, ep=2)) == [8, 8, 2, 4]
    assert communicators(RankLayout(dp=2, ep=2)) == [2, 2, 2]  # the expert-data-parallel group of one needs no buffers
