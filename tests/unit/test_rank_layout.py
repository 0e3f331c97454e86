"""One layout object (issue 44 item 1): config/layout.py's RankLayout holds the parallel degrees,
validates them once against the model and answers every size derived from them; nothing else in
the package divides by ep or dp_shard, and no other module raises a degree's refusal but the
engines' own (engines/refusals.py). The source scans follow tests/unit/test_engine_specs.py's."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from zero_bench.config import layout as layout_module
from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.layout import RankLayout
from zero_bench.errors import ConfigError
from zero_bench.estimate import estimate
from zero_bench.units import BYTES

from conftest import model

PACKAGE = Path(__file__).resolve().parents[2] / "zero_bench"
LAYOUT = "config/layout.py"
DEGREES = {"ep", "dp_shard"}  # the degrees whose arithmetic is the layout's alone
ARITHMETIC = (ast.Div, ast.FloorDiv, ast.Mod, ast.Mult)
# a degree's refusal ("parallel.ep=2: must divide ..."): the layout's, and each engine's own limits
REFUSED_KEYS = ("parallel.tp=", "parallel.dp_shard=", "parallel.ep=")
MAY_REFUSE = {LAYOUT, "engines/refusals.py"}


def _named(node: ast.AST) -> str:
    """The name a direct operand reads: `ep`, `self.ep`, `b.parallel.ep` -> "ep"."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def degree_arithmetic(source: str) -> list[int]:
    """Lines where ep or dp_shard is an operand of /, //, % or * (strings and comments never are)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ARITHMETIC):
            operands = (node.left, node.right)
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ARITHMETIC):
            operands = (node.target, node.value)
        else:
            continue
        if any(_named(o) in DEGREES for o in operands):
            lines.append(node.lineno)
    return lines


def _text_start(node: ast.AST) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return ""


def degree_refusals(source: str) -> list[int]:
    """Lines raising ConfigError with a message that starts by naming a parallel degree's key."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and _named(node.exc.func) == "ConfigError"
                and node.exc.args and _text_start(node.exc.args[0]).startswith(REFUSED_KEYS)):
            lines.append(node.lineno)
    return lines


def _scan(check, allowed: set[str]) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        if rel in allowed:
            continue
        text = path.read_text()
        found += [f"zero_bench/{rel}:{n}: {text.splitlines()[n - 1].strip()}" for n in check(text)]
    return found


def test_no_ep_or_dp_shard_arithmetic_outside_the_layout():
    found = _scan(degree_arithmetic, {LAYOUT})
    assert not found, "ask zero_bench.config.layout.RankLayout instead:\n" + "\n".join(found)


def test_the_degrees_are_refused_only_by_the_layout_and_the_engines():
    found = _scan(degree_refusals, MAY_REFUSE)
    assert not found, "refuse a degree in config/layout.py (engine limits: engines/refusals.py):\n" + "\n".join(found)


def test_the_scans_see_what_they_look_for():
    assert degree_arithmetic("x = dp // ep") == [1] and degree_arithmetic("y = n % b.parallel.ep") == [1]
    assert degree_arithmetic("z = experts / self.ep / tp") == [1] and degree_arithmetic("w = a * (dp // dp_shard)")
    assert degree_arithmetic("n //= ep") == [1]
    assert not degree_arithmetic('s = "dp // ep"  # dp // ep') and not degree_arithmetic("if ep > 1: q = dp - ep")
    assert degree_refusals('raise ConfigError(f"parallel.ep={ep}: must divide")') == [1]
    assert degree_refusals('raise ConfigError("parallel.tp=3: no")') == [1]
    assert not degree_refusals('raise ConfigError(f"loss={x}: runs at parallel.tp=1")')
    assert layout_module.__file__.endswith(LAYOUT)  # the one file the scans leave out


# -- the layout itself ------------------------------------------------------------------------------

def test_derived_sizes_and_groups():
    plain = RankLayout(tp=2, dp=4)
    assert (plain.world_size, plain.shard_size, plain.replicas, plain.hybrid) == (8, 4, 1, False)
    assert plain.groups == {"world": 8, "dp": 4, "tp": 2} and plain.expert_data_parallel == 4
    experts = RankLayout(dp=8, ep=2, model=model("moe-tiny"))
    assert experts.groups == {"world": 8, "dp": 8, "tp": 1, "ep": 2, "expert_dp": 4}
    assert (experts.experts_per_rank, experts.expert_data_parallel) == (4, 4)
    assert [experts.expert_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    hybrid = RankLayout(dp=8, dp_shard=2)
    assert (hybrid.hybrid, hybrid.shard_size, hybrid.replicas) == (True, 2, 4)
    assert hybrid.groups == {"world": 8, "dp": 8, "tp": 1, "shard": 2, "replicate": 4}
    assert not RankLayout(dp=4, dp_shard=4).hybrid  # one group: plain sharding
    assert RankLayout(model=model("llama-tiny")).experts_per_rank is None


def test_where_each_parameter_lives():
    """Dense parameters over the shard group (dp, dp_shard with hybrid sharding); a routed expert's
    at ep > 1 over the dp / ep ranks holding it, indexed by rank // ep."""
    moe = RankLayout(dp=4, ep=2, model=model("moe-tiny"))
    dense = next(p for p in moe.params if not p.expert)
    expert = next(p for p in moe.params if p.expert)
    assert (moe.partition_ranks(dense), moe.partition_ranks(expert)) == (4, 2)
    assert [moe.partition_index(expert, r) for r in range(4)] == [0, 0, 1, 1]
    assert [moe.partition_index(dense, r) for r in range(4)] == [0, 1, 2, 3]
    hybrid = RankLayout(dp=4, dp_shard=2, model=model("llama-tiny"))
    assert {hybrid.partition_ranks(p) for p in hybrid.params} == {2}
    one = RankLayout(dp=4, model=model("moe-tiny"))  # ep 1: the experts with everything else
    assert {one.partition_ranks(p) for p in one.params} == {4}


def test_counts_follow_the_experts_a_rank_holds():
    m = model("moe-tiny")
    one, two = RankLayout(dp=2, model=m), RankLayout(dp=2, ep=2, model=m)
    assert two.dense_params == one.dense_params and two.held_expert_params * 2 == one.held_expert_params
    assert two.tp_shard_params == one.held_params == one.tp_shard_params
    assert two.held_params == two.dense_params + two.held_expert_params
    assert two.zero_partitions == [two.dense_params // 2, two.held_expert_params // 1]
    assert two.zero_groups(100, 40) == [30, 20] and one.zero_groups(100, 40) == [50]
    assert (two.held_whole(100, 40), one.held_whole(100, 40)) == (80, 100)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=4, dp_shard=3), "parallel.dp_shard=3: must divide parallel.dp=4"),
    (dict(tp=2, dp=2, dp_shard=1), "parallel.dp_shard=1: hybrid sharding is modelled at parallel.tp=1"),
    (dict(dp=2, ep=2, name="llama-tiny"), "parallel.ep=2: expert parallelism splits a mixture of experts' experts"),
    (dict(dp=3, ep=3, name="moe-tiny"), "parallel.ep=3: must divide model.num_experts=8"),
    (dict(dp=2, ep=4, name="moe-tiny"), "parallel.ep=4: must divide parallel.dp=2 (the experts are split"),
    (dict(dp=3, ep=2), "parallel.ep=2: must divide parallel.dp=3"),
    (dict(dp=4, ep=2, dp_shard=2, name="moe-tiny"), "parallel.ep=2: hybrid sharding with expert parallelism"),
    (dict(tp=3, name="gpt-mini"), "parallel.tp=3: must divide model.num_heads=4"),
    (dict(tp=4, name="llama-tiny"), "parallel.tp=4: must divide the query groups (model.num_query_groups=2)"),
    (dict(tp=2, name="moe-tiny"), "parallel.tp=2: megatron-core's MoE layer at tp > 1"),
    (dict(dp=0), "parallel.dp=0: must be an integer >= 1"),
    (dict(dp=3, sp=2), "parallel.sp=2: must divide parallel.dp=3"),
    (dict(dp=2, sp=2, ep=2, name="moe-tiny"), "parallel.sp=2: with expert parallelism not modelled"),
    (dict(dp=16, sp=16, name="llama-tiny"), "parallel.sp=16: must divide the attention heads per tensor-parallel rank"),
    (dict(pp=3, name="gpt-mini"), "parallel.pp=3: pp x vpp = 3 must divide model.num_layers=4"),
    (dict(pp=2, vpp=4, name="gpt-mini"), "parallel.pp=2: pp x vpp = 8 must divide model.num_layers=4"),
    (dict(vpp=2), "parallel.vpp=2: virtual stages split a pipeline"),
    (dict(pp=0), "parallel.pp=0: must be an integer >= 1"),
])
def test_refusals_are_one_line_naming_the_key(kwargs, message):
    name = kwargs.pop("name", None)
    with pytest.raises(ConfigError) as err:
        RankLayout(**kwargs, model=model(name) if name else None)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_the_config_asks_the_layout_once_and_the_estimate_builds_one_parameter_list(monkeypatch):
    b = from_cfg(compose(["model=moe-tiny", "hardware.device=cpu", "parallel.ep=2", "zero=1"]), here=False)
    assert b.layout is b.layout and b.layout == RankLayout(dp=2, ep=2, model=b.model)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.layout.ep = 1
    built = []
    real = layout_module.param_list
    monkeypatch.setattr(layout_module, "param_list", lambda *a, **k: built.append(a) or real(*a, **k))
    fresh = dataclasses.replace(b, zero=2)  # a new config: its own layout
    assert fresh.layout is not b.layout
    estimate(fresh)
    assert len(built) == 1  # states, buffers, the initialize peak and the ds_config's buckets share it


def test_ulysses_layout_and_what_it_is_not_run_with():
    """parallel.sp: a group of sp data-parallel ranks splits each sequence (dp / sp sequences per
    micro-step, seq_len / sp tokens per rank); fewer key/value heads than sp are replicated as
    DeepSpeed does; the combinations no trial has compared with sp = 1 are refused in one line."""
    lay = RankLayout(dp=4, sp=4, model=model("llama-tiny"))  # 2 key/value heads, replicated x2
    assert (lay.sequences, lay.local_seq_len) == (1, model("llama-tiny").seq_len // 4)
    base = ["model=llama-tiny", "hardware.device=cpu", "parallel.dp=2", "parallel.sp=2"]
    assert from_cfg(compose(base), here=False).layout.sp == 2
    tp2 = ["model=llama-tiny", "hardware.device=cpu", "parallel.tp=2", "parallel.dp=2", "parallel.sp=2"]
    for extra, key in ((["compile=true"], "compile at parallel.tp=2"), (["recompute=op"], "recompute=op at parallel.tp=2")):
        with pytest.raises(ConfigError) as err:  # compared at tp 1 only
            from_cfg(compose(tp2 + extra), here=False)
        assert str(err.value).startswith("parallel.sp=2: not compared with sp=1 together with " + key), str(err.value)
    # compared: test_ulysses_trials; compile by hand (docs/long-context.md)
    assert from_cfg(compose(base + ["tiled_mlp=2"]), here=False).tiled_mlp == "2"
    assert from_cfg(compose(base + ["recompute=op"]), here=False).recompute == "op"
    assert from_cfg(compose(base + ["compile=true"]), here=False).compile
    # MoE at ep 1, its load-balancing loss over the sequence (test_ulysses_ranks)
    assert from_cfg(compose(["model=moe-tiny", "hardware.device=cpu", "parallel.dp=2", "parallel.sp=2"]),
                    here=False).layout.sp == 2
    with pytest.raises(ConfigError, match="^parallel.sp=2: model.seq_len=255 must be divisible by tp x sp"):
        from_cfg(compose(base + ["model.seq_len=255"]), here=False)


def test_ulysses_estimate_keeps_a_ranks_share_of_each_sequence():
    """At sp=2 a rank keeps half of each sequence's activations (sdpa: every per-token term; the
    unfused scores: heads / 2 of them over the whole sequence) and what the all-to-all adds (sdpa's
    flash kernel: linear_proj's input is the exchange's copy, q bytes per local token and layer,
    estimate/ulysses.py; measured in tests/integration/test_ulysses_ranks.py); the model states are sp=1's."""
    from zero_bench.estimate import estimate

    def est(*extra):
        return estimate(from_cfg(compose(["model=llama-tiny", "hardware.device=cpu", "parallel.dp=2", *extra]),
                                 here=False))
    for attention in ("sdpa", "unfused"):
        one, two = est(f"model.attention={attention}"), est(f"model.attention={attention}", "parallel.sp=2")
        b = from_cfg(compose(["model=llama-tiny", "hardware.device=cpu"]), here=False)
        m, B = b.model, BYTES[b.precision]
        copy = m.num_layers * (m.seq_len // 2) * m.num_heads * m.kv_channels * B if attention == "sdpa" else 0
        assert two.activations["total"] == pytest.approx(one.activations["total"] / 2 + copy, abs=2)
        assert two.states == one.states
        # a group of sp ranks trains one sequence: the global batch is micro x dp / sp (schema's global_batch)
        assert two.row()["max_global_batch"] == two.row()["max_micro"] * 2 // 2


def test_ulysses_with_tensor_parallelism_splits_what_megatron_left_on_each_rank():
    """tp=2 x sp=2 (compared with sp=1 in tests/integration/test_ulysses_tp.py): the sequence must
    divide by tp x sp, the heads per tensor rank by sp; a rank keeps half of tp=2's activations
    (Megatron's sequence parallelism already split the norms' and residuals' share over tp)."""
    from zero_bench.estimate import estimate

    base = ["model=llama-tiny", "hardware.device=cpu", "parallel.tp=2", "parallel.dp=2"]
    one = from_cfg(compose(base), here=False)
    two = from_cfg(compose(base + ["parallel.sp=2"]), here=False)
    assert two.layout.sequence_parallel and (two.layout.sp, two.layout.sequences) == (2, 1)
    # and what the all-to-all adds (estimate/ulysses.py), per tensor rank: the context copy beside the flash
    # kernel's output, and K and V kept twice (one key/value head per tensor rank, repeated for sp=2)
    m, B = two.model, BYTES[two.precision]
    copy = m.num_layers * (m.seq_len // 2) * (m.num_heads // 2 + 2 * m.query_groups // 2) * m.kv_channels * B
    assert estimate(two).activations["total"] == pytest.approx(estimate(one).activations["total"] / 2 + copy, abs=2)
    with pytest.raises(ConfigError, match="^parallel.sp=2: model.seq_len=258 must be divisible by tp x sp = 4"):
        from_cfg(compose(base + ["parallel.sp=2", "model.seq_len=258"]), here=False)
    with pytest.raises(ConfigError, match="^parallel.sp=4: must divide the attention heads per tensor-parallel rank"):
        from_cfg(compose(["model=llama-tiny", "hardware.device=cpu", "parallel.tp=2", "parallel.dp=4",
                          "parallel.sp=4", "model.num_heads=4"]), here=False)  # 2 heads per tensor rank
