"""The one model description: the parameter list the estimate counts is the list of the model
megatron-core builds from it, for every preset at tp 1, 2 and 8 (built on the meta device: shapes,
no memory), the published counts, the Hugging Face import, and one-line refusals."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from zero_bench.config.configure import compose, from_cfg
from zero_bench.config.schema import BenchConfig, CONF_DIR, HardwareConfig, ParallelConfig
from zero_bench.errors import ConfigError
from zero_bench.models import ModelConfig, param_numels
from zero_bench.models.description import from_stored
from zero_bench.models.megatron import build_gpt, transformer_config
from zero_bench.models.params import active_params, dense_params, expert_params, num_params, params, params_per_shard

from conftest import model

PRESETS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem != "hf")
HF_DIR = Path(__file__).resolve().parents[1] / "data" / "hf"
# Parameter counts as published (model cards; Qwen2.5-0.5B: tied embeddings). Qwen3's and
# Mistral-Nemo's cards round (MODEL_CARDS); the exact figures are their config.json's shapes summed,
# which the live model checks below.
PUBLISHED = {"llama3-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496, "llama3.1-405b": 405_853_388_800,
             "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512, "qwen3-8b": 8_190_735_360,
             "qwen3-0.6b": 596_049_920}
HF_PUBLISHED = {"Llama-3-8B": (8_030_261_248, "llama3-8b"), "Llama-3.1-70B": (70_553_706_496, "llama3.1-70b"),
                "Llama-3.1-405B": (405_853_388_800, "llama3.1-405b"),
                "Mistral-7B-v0.1": (7_241_732_096, "mistral-7b"), "Qwen2.5-7B": (7_615_616_512, "qwen2.5-7b"),
                "Qwen2.5-0.5B": (494_032_768, None), "Qwen3-8B": (8_190_735_360, "qwen3-8b"),
                "Qwen3-0.6B": (596_049_920, "qwen3-0.6b"), "Mistral-Nemo-Base-2407": (12_247_782_400, None),
                "Mixtral-8x7B-v0.1": (46_702_792_704, "mixtral-8x7b"), "Qwen3-30B-A3B": (30_532_122_624, "qwen3-30b-a3b")}
# (total, non-embedding) in billions as the model cards print them: Qwen/Qwen3-8B "8.2B / 6.95B",
# Qwen/Qwen3-0.6B "0.6B / 0.44B"; mistralai/Mistral-Nemo-Base-2407 "12B" (Hugging Face's page: 12.2B).
MODEL_CARDS = {"Qwen3-8B": (8.2, 6.95), "Qwen3-0.6B": (0.6, 0.44), "Mistral-Nemo-Base-2407": (12.2, None)}


@pytest.fixture
def fake_tp():
    """Rank 0 of 8 fake ranks (torch's "fake" backend: collectives are no-ops), so one process builds
    a tp-sharded GPTModel on the meta device. No gloo side groups: the fake backend cannot make them."""
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(tp: int) -> None:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)

    yield init
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def live_params(m: ModelConfig, tp: int) -> list[tuple]:
    cfg = BenchConfig(model=m, parallel=ParallelConfig(tp=tp, dp=1), hardware=HardwareConfig(device="cpu"),
                      precision="bf16")
    with torch.device("meta"):  # initialised (on meta: no values), as only the init marks the splits
        gpt = build_gpt(cfg, transformer_config(cfg, on_cpu=True), on_cpu=True)
    # megatron marks what it splits over tp (layers.py set_tensor_model_parallel_attributes)
    return [(n, tuple(p.shape), p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
            for n, p in gpt.named_parameters()]


def listed(m: ModelConfig, tp: int) -> list[tuple]:
    return [(p.name, p.shape, p.tp_dim) for p in params(m, tp)]


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_param_list_is_the_live_models(tp, fake_tp):
    """Name for name, shape for shape and in order, every preset the tp divides (405B included: meta device)."""
    fake_tp(tp)
    built = 0
    for name in PRESETS:
        m = model(name)
        if m.num_heads % tp or m.query_groups % tp or (m.is_moe and tp > 1):  # MoE: tp 1 (configure.py)
            continue
        assert live_params(m, tp) == listed(m, tp), name
        built += 1
    assert built == {1: 21, 2: 18, 8: 12}[tp]


def test_published_counts():
    for name, count in PUBLISHED.items():
        assert num_params(model(name)) == count, name
    assert params_per_shard(model("llama3-8b"), 8) == 1_004_015_616  # the live model's at tp 8
    # Megatron-LM's GPT-2 sizes as their names say (vocabulary padded to 50304 rows)
    for name, billions in (("gpt345m", 0.355), ("gpt1.3b", 1.3), ("gpt2.5b", 2.5), ("gpt5.8b", 5.8), ("gpt8.3b", 8.3)):
        assert num_params(model(name)) == pytest.approx(billions * 1e9, rel=0.04), name


@pytest.mark.parametrize("name", [p for p in PRESETS if p.startswith("gpt")])
def test_gpt_presets_keep_their_counts(name):
    """The GPT formula zero_bench had before the description grew: 12h^2 + 13h per layer, V h, S h, 2h;
    per tp shard the column/row splits with replicated norms, row biases and positions."""
    m = model(name)
    h, L, V, S = m.hidden_size, m.num_layers, m.padded_vocab(1), m.seq_len
    assert num_params(m) == L * (12 * h * h + 13 * h) + V * h + S * h + 2 * h
    for tp in (2, 4):
        if m.num_heads % tp == 0:
            split = L * (12 * h * h + 7 * h) + m.padded_vocab(tp) * h
            assert params_per_shard(m, tp) == split // tp + L * 6 * h + S * h + 2 * h


def test_reference_table_presets_carry_their_time_s_defaults():
    for name in ("gpt345m", "gpt1.3b", "gpt2.5b", "gpt5.8b", "gpt8.3b"):
        m = model(name)
        assert (m.dropout, m.attention) == (0.1, "unfused"), name
    for name in ("gpt-tiny", "gpt-mini", "gpt-small", "gpt-zero-demo", "llama-tiny", "qwen3-tiny"):
        assert model(name).dropout == 0.0, name


def test_stored_records_keep_their_meaning_and_key():
    """A record written before the description grew (shape keys only) is the same GPT, with the
    same search key, as today's description of it."""
    old = {"name": "GPT-mini", "num_layers": 4, "hidden_size": 256, "num_heads": 4, "seq_len": 256,
           "vocab_size": 8192, "pad_vocab_to": 128}
    assert from_stored(old) == model("gpt-mini")
    assert from_stored({**old, "num_layers": "???"}) is None
    a = BenchConfig.from_dict({"model": old})
    b = BenchConfig(model=model("gpt-mini"))
    assert a.search_key() == b.search_key() and a.trial_key() == b.trial_key()
    assert BenchConfig(model=dataclasses.replace(model("gpt-mini"), dropout=0.1)).search_key() != b.search_key()


# -- Hugging Face config.json --------------------------------------------------------------------

def hf_bench(path, *extra: str) -> BenchConfig:
    return from_cfg(compose(["model=hf", f"model.hf_config={path}", "model.seq_len=4096", *extra]), here=False)


@pytest.mark.parametrize("name", sorted(HF_PUBLISHED))
def test_hf_config_gives_the_published_count_and_the_preset(name):
    count, preset = HF_PUBLISHED[name]
    m = hf_bench(HF_DIR / name).model
    assert num_params(m) == count and m.name == name
    if preset:
        p = dataclasses.replace(model(preset), name=name, seq_len=4096)
        assert dataclasses.replace(m, hf_config=None) == p


def refusals(base: dict) -> list[tuple[str, dict]]:
    """(the field the one line must name, an altered Llama-3-8B config.json)."""
    def alter(**kw):
        return {**copy.deepcopy(base), **kw}

    return [
        ("model_type=gemma2", alter(model_type="gemma2")),
        ("hidden_act=gelu_pytorch_tanh", alter(hidden_act="gelu_pytorch_tanh")),
        ("attention_bias=true", alter(model_type="qwen3", attention_bias=True)),  # Q, K, V and O, no MLP
        ("attention_bias=true", alter(attention_bias=True)),
        ("mlp_bias=true", alter(mlp_bias=True)),
        ("rope_scaling.rope_type=yarn", alter(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
        ("rope_scaling.original_max_position_embeddings=4096",
         alter(rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 4096})),
        ("sliding_window=2048", alter(model_type="mistral", sliding_window=2048)),
        ("attention_dropout=0.1", alter(attention_dropout=0.1)),
    ]


def test_hf_refuses_what_it_cannot_honour_in_one_line(tmp_path):
    base = json.loads((HF_DIR / "Llama-3-8B" / "config.json").read_text())
    for i, (field, cfg) in enumerate(refusals(base)):
        path = tmp_path / f"c{i}" / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(cfg))
        with pytest.raises(ConfigError) as e:
            hf_bench(path)
        assert field in str(e.value) and "\n" not in str(e.value), (field, str(e.value))


def test_hf_keeps_the_users_keys_and_refuses_conflicting_ones():
    b = hf_bench(HF_DIR / "Mistral-7B-v0.1", "model.attention=unfused", "model.dropout=0.1", "model.name=mine",
                 "parallel.tp=8")
    assert (b.model.attention, b.model.dropout, b.model.name, b.model.seq_len) == ("unfused", 0.1, "mine", 4096)
    with pytest.raises(ConfigError, match=r"model.num_layers=2: model.hf_config=.* sets it to 32"):
        hf_bench(HF_DIR / "Mistral-7B-v0.1", "model.num_layers=2")
    with pytest.raises(ConfigError, match=r"model.seq_len: missing"):
        from_cfg(compose(["model=hf", f"model.hf_config={HF_DIR / 'Llama-3-8B'}"]), here=False)
    with pytest.raises(ConfigError, match=r"model.hf_config=.*nope.json: cannot read"):
        hf_bench(HF_DIR / "nope.json")
    with pytest.raises(ConfigError, match=r"parallel.tp=16: must divide the query groups"):
        hf_bench(HF_DIR / "Llama-3-8B", "parallel.tp=16")  # 32 heads, 8 query groups


def test_model_cards_round_to_the_counts():
    for name, (total, non_embedding) in MODEL_CARDS.items():
        m = hf_bench(HF_DIR / name).model
        embedding = m.padded_vocab(1) * m.hidden_size * (1 if m.tie_embeddings else 2)
        assert round(num_params(m) / 1e9, 1) == total, name
        assert non_embedding is None or round((num_params(m) - embedding) / 1e9, 2) == non_embedding, name


@pytest.mark.parametrize("name, tps", [("Mistral-Nemo-Base-2407", (1, 8)), ("Qwen2.5-0.5B", (1, 2))])
def test_hf_param_list_is_the_live_models(name, tps, fake_tp):
    """The config.json files no preset mirrors (head_dim 128 on 5120 / 32 heads; tied with QKV bias)."""
    m = hf_bench(HF_DIR / name).model
    for tp in tps:
        fake_tp(tp)
        assert live_params(m, tp) == listed(m, tp), (name, tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_qk_norm_and_head_dim_on_layernorm_are_the_live_models(tp, fake_tp):
    """LayerNorm's q/k norms have a bias too; heads of 48 on a 256-wide stream with 8 heads."""
    fake_tp(tp)
    m = dataclasses.replace(model("gpt-tiny"), hidden_size=256, num_heads=8, num_query_groups=2, head_dim=48,
                            qk_norm=True)
    assert live_params(m, tp) == listed(m, tp)


def hf_file(tmp_path, base: str, drop: tuple = (), **changes) -> Path:
    """tests/data/hf/`base` without the keys `drop` and with `changes`, written under tmp_path."""
    cfg = json.loads((HF_DIR / base / "config.json").read_text())
    cfg = {**{k: v for k, v in cfg.items() if k not in drop}, **changes}
    path = tmp_path / f"{base}-{len(list(tmp_path.iterdir()))}" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("base, drop, changes, expected", [
    # MistralConfig(num_key_value_heads=8): not multi-head (8,053,329,920). Vocabulary 32768 is
    # Mistral-7B-v0.3's, the figure issue 36 names: 7,248,023,552.
    ("Mistral-7B-v0.1", ("num_key_value_heads",), {"vocab_size": 32768},
     {"num_query_groups": 8, "num_params": 7_248_023_552}),
    # LlamaConfig: num_key_value_heads None -> num_attention_heads; head_dim None -> h / a;
    # rope_theta 10000, rms_norm_eps 1e-6, tie_word_embeddings false
    ("Llama-3-8B", ("num_key_value_heads", "rope_theta", "rms_norm_eps", "tie_word_embeddings"), {},
     {"num_query_groups": 32, "head_dim": None, "rope_base": 10000.0, "norm_eps": 1e-6, "tie_embeddings": False}),
    # Qwen2Config(num_key_value_heads=32), whatever num_attention_heads; max_window_layers and the
    # window only with use_sliding_window
    ("Qwen2.5-7B", ("num_key_value_heads", "sliding_window"), {}, {"num_query_groups": 32, "qkv_bias": True}),
    # Qwen3Config(head_dim=128, tie_word_embeddings=False); qk-norm always
    ("Qwen3-0.6B", ("head_dim", "tie_word_embeddings"), {},
     {"head_dim": 128, "tie_embeddings": False, "qk_norm": True}),
    ("Qwen3-8B", ("head_dim", "num_key_value_heads"), {}, {"head_dim": None, "num_query_groups": 32}),  # 128 = 4096/32
    # an explicit head_dim is honoured in every family (megatron's kv_channels): Q, K, V and O
    # shrink by 32 layers x 2 x 4096 x (32 + 8) x 32 = 335,544,320 from Llama-3-8B's 8,030,261,248
    ("Llama-3-8B", (), {"head_dim": 96}, {"head_dim": 96, "num_params": 7_694_716_928}),
])
def test_hf_absent_keys_take_transformers_defaults_per_model_type(tmp_path, base, drop, changes, expected):
    from zero_bench.models.hf import read_hf_config

    keys = read_hf_config(str(hf_file(tmp_path, base, drop, **changes)), 4096)
    got = {k: keys[k] for k in expected if k != "num_params"}
    assert got == {k: v for k, v in expected.items() if k != "num_params"}
    if "num_params" in expected:
        assert num_params(ModelConfig(name=base, seq_len=4096, **keys)) == expected["num_params"]


def test_hf_mistral_window_defaults_to_4096_and_null_is_none(tmp_path):
    """MistralConfig(sliding_window=4096): absent, a window shorter than seq_len 8192 is refused,
    saying where 4096 came from; "sliding_window": null is full attention (Mistral-Nemo)."""
    absent = hf_file(tmp_path, "Mistral-7B-v0.1", ("sliding_window",))
    with pytest.raises(ConfigError) as e:
        hf_bench(absent, "model.seq_len=8192")
    assert "sliding_window=4096 (absent: transformers 4.57.1's default for mistral)" in str(e.value)
    assert hf_bench(absent).model.seq_len == 4096
    null = hf_file(tmp_path, "Mistral-7B-v0.1", sliding_window=None)
    assert hf_bench(null, "model.seq_len=8192").model.seq_len == 8192


@pytest.mark.parametrize("changes, line", [
    ({"model_type": "olmo2"}, "model_type=olmo2: other families are not modelled; zero_bench reads llama, mistral, "
                              "qwen2, qwen3, mixtral, qwen3_moe (nearest: llama)"),
    ({"model_type": "qwen2_moe", "num_experts": 60},
     "model_type=qwen2_moe: mixture-of-experts (num_experts) of this family is not modelled; zero_bench reads "
     "llama, mistral, qwen2, qwen3, mixtral, qwen3_moe (nearest: qwen3_moe)"),
])
def test_hf_refuses_an_unmodelled_model_type_naming_the_modelled_and_the_nearest(tmp_path, changes, line):
    with pytest.raises(ConfigError) as e:
        hf_bench(hf_file(tmp_path, "Qwen3-8B", **changes))
    assert str(e.value) == f"model.hf_config: {line}"


def test_hf_seq_len_past_max_position_embeddings_is_one_warning_line(monkeypatch, capsys):
    from zero_bench.models import hf

    monkeypatch.setattr(hf, "_said", set())
    overrides = ["model=hf", f"model.hf_config={HF_DIR / 'Qwen3-0.6B'}", "model.seq_len=65536"]
    for _ in range(2):  # precheck and the job read the file again: said once
        assert from_cfg(compose(overrides), here=False).model.seq_len == 65536
    err = capsys.readouterr().err
    assert err.splitlines() == [f"zero_bench: warning: model.seq_len=65536: longer than max_position_embeddings="
                                f"40960 of model.hf_config={HF_DIR / 'Qwen3-0.6B'}; measured as asked"], err
    hf_bench(HF_DIR / "Qwen3-0.6B")  # 4096 <= 40960: nothing said
    assert capsys.readouterr().err == ""


# -- --cfg job -------------------------------------------------------------------------------------

def test_split_flags_keeps_each_flag_with_its_value():
    from zero_bench.cli import split_flags

    assert split_flags(["a=1", "--cfg", "job", "-m", "b=2", "--info", "c=3", "-i", "plugins", "--resolve"]) == (
        ["--cfg", "job", "-m", "--info", "-i", "plugins", "--resolve"], ["a=1", "b=2", "c=3"])


@pytest.mark.parametrize("where", ["before", "after"])
def test_cfg_job_anywhere_prints_what_config_json_resolved_to(where, monkeypatch, capsys):
    """`--cfg job` before or after the overrides (after: argparse refused `command=estimate`), with
    model=hf: the fields read from config.json, not the hf preset's placeholders."""
    import yaml

    from zero_bench import cli

    monkeypatch.setattr(sys, "argv", ["zero_bench"])
    ov = ["model=hf", f"model.hf_config={HF_DIR / 'Qwen3-0.6B'}", "model.seq_len=4096"]
    cli.main(["estimate", *(["--cfg", "job", *ov] if where == "before" else [*ov, "--cfg", "job"])])
    doc = yaml.safe_load(capsys.readouterr().out)
    m = doc["model"]
    assert doc["command"] == "estimate" and "hydra" not in doc
    assert (m["name"], m["num_layers"], m["hidden_size"], m["head_dim"], m["qk_norm"], m["activation"],
            m["normalization"], m["position_embedding"], m["tie_embeddings"]) == (
        "Qwen3-0.6B", 28, 1024, 128, True, "swiglu", "rmsnorm", "rope", True)


def test_cfg_job_after_the_overrides_without_hf_is_hydras(monkeypatch, capsys):
    import yaml

    from zero_bench import cli

    monkeypatch.setattr(sys, "argv", ["zero_bench"])
    cli.main(["estimate", "model=qwen3-tiny", "--cfg", "job"])
    doc = yaml.safe_load(capsys.readouterr().out)
    assert (doc["command"], doc["model"]["name"], doc["model"]["head_dim"]) == ("estimate", "Qwen3-tiny", 64)


# -- one line per bad key ----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["model.num_query_groups=3"], "model.num_query_groups=3: must divide model.num_heads=8"),
    (["model.num_query_groups=0"], "model.num_query_groups=0: must be an integer >= 1"),
    (["model.ffn_hidden_size=0"], "model.ffn_hidden_size=0: must be an integer >= 1"),
    (["model.activation=relu"], "model.activation=relu: allowed values are gelu, swiglu"),
    (["model.attention=flash"], "model.attention=flash: allowed values are unfused, sdpa"),
    (["model.dropout=1.0"], "model.dropout=1: must be in [0, 1)"),
    (["model.rope_base=0"], "model.rope_base=0: must be a number > 0"),
    (["model.position_embedding=learned", "model.rope_scaling_factor=8"],
     "model.rope_scaling_factor=8: needs model.position_embedding=rope"),
    (["parallel.tp=4", "parallel.dp=1"], "parallel.tp=4: must divide the query groups (model.num_query_groups=2)"),
    (["parallel.tp=2", "parallel.dp=1", "model.ffn_hidden_size=705"],
     "parallel.tp=2: must divide model.ffn_hidden_size=705"),
])
def test_bad_model_keys_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        from_cfg(compose(["model=llama-tiny", *overrides]), here=False)
    assert str(e.value) == message


# -- mixture of experts ------------------------------------------------------------------------------

# (total, active) parameters. Mixtral: Mistral AI's announcement (46.7B / 12.9B); Qwen3-30B-A3B: its
# model card (30.5B / 3.3B); exact: the config.json shapes summed (the live model agrees, above).
# By hand, Mixtral per layer: attention 2 x 4096^2 + 2 x 4096 x 1024, 8 experts x 3 x 4096 x 14336,
# router 8 x 4096, 2 norms; + 2 x 32000 x 4096 + 4096. Active: 2 experts of 8.
MOE_COUNTS = {"mixtral-8x7b": (46_702_792_704, 12_879_925_248), "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
              "moe-tiny": (7_481_600, 2_763_008)}
MOE_ROUNDED = {"mixtral-8x7b": (46.7, 12.9), "qwen3-30b-a3b": (30.5, 3.4)}  # 3.35B: the card's "3.3B" truncates


@pytest.mark.parametrize("name", sorted(MOE_COUNTS))
def test_moe_total_and_active_counts(name):
    m = model(name)
    assert (num_params(m), active_params(m)) == MOE_COUNTS[name]
    if name in MOE_ROUNDED:
        assert (round(num_params(m) / 1e9, 1), round(active_params(m) / 1e9, 1)) == MOE_ROUNDED[name]
    h, E, k, L = m.hidden_size, m.num_experts, m.moe_router_topk, m.num_layers
    assert expert_params(m, 1) == 3 * h * m.moe_ffn  # SwiGLU, no biases
    assert num_params(m) - active_params(m) == L * (E - k) * 3 * h * m.moe_ffn


def test_hf_moe_imports(tmp_path):
    """mixtral: router without bias, 8 experts of intermediate_size, always renormalised; qwen3_moe:
    qk-norm, head_dim, moe_intermediate_size, norm_topk_prob; absent keys take transformers 4.57.1's
    defaults (Qwen3MoeConfig: norm_topk_prob false, 128 experts top-8; mlp_only_layers /
    decoder_sparse_step give the dense layers)."""
    from zero_bench.models.hf import read_hf_config

    mix = read_hf_config(str(HF_DIR / "Mixtral-8x7B-v0.1"), 4096)
    assert (mix["num_experts"], mix["moe_router_topk"], mix["moe_ffn_hidden_size"], mix["norm_topk_prob"],
            mix["add_bias"], mix["qk_norm"], mix["moe_aux_loss_coeff"]) == (8, 2, 14336, True, False, False, 0.0)
    qwen = read_hf_config(str(hf_file(tmp_path, "Qwen3-30B-A3B", ("norm_topk_prob", "num_experts"),
                                      decoder_sparse_step=2, mlp_only_layers=[5], output_router_logits=True)), 4096)
    assert (qwen["num_experts"], qwen["moe_ffn_hidden_size"], qwen["head_dim"], qwen["qk_norm"],
            qwen["norm_topk_prob"], qwen["moe_aux_loss_coeff"]) == (128, 768, 128, True, False, 0.001)
    assert qwen["moe_dense_layers"] == [i for i in range(48) if i % 2 == 0 or i == 5]
    m = ModelConfig(name="q", seq_len=4096, **qwen)
    assert m.num_moe_layers == 23 and m.moe_layers[1] and not m.moe_layers[5]
    with pytest.raises(ConfigError, match=r"^model.hf_config: router_jitter_noise=0.1: router input jitter"):
        read_hf_config(str(hf_file(tmp_path, "Mixtral-8x7B-v0.1", router_jitter_noise=0.1)), 4096)


def test_moe_tiny_and_variants_are_the_live_models(fake_tp):
    """megatron-core 0.16.1's GPTModel with the MoE local spec (TopKRouter, SequentialMLP,
    SharedExpertMLP), built on the meta device: every tensor, in order, with dense layers between,
    a shared expert, biases (router bias too), GeLU, LayerNorm and qk-norm."""
    fake_tp(1)
    base = model("moe-tiny")
    for m in (base, dataclasses.replace(base, moe_dense_layers=[0, 2], moe_shared_expert_intermediate_size=384),
              dataclasses.replace(base, add_bias=True, activation="gelu", normalization="layernorm", qk_norm=True,
                                  norm_topk_prob=False)):
        assert live_params(m, 1) == listed(m, 1)
    assert sum(math.prod(s) for _, s, _ in live_params(base, 1)) == 7_481_600


def test_flops_count_active_parameters():
    """6 x active parameters per token (+ attention): Mixtral's MFU numerator is that of a 12.9B
    model, not 46.7B; the breakdown adds up to the same forward FLOPs."""
    from zero_bench.models.flops import attention_flops_per_seq, breakdown_per_token, flop_params, \
        model_flops_per_seq

    m = model("mixtral-8x7b")
    assert flop_params(m) == 12_879_925_248 - 32000 * 4096  # the input embedding is a lookup
    assert model_flops_per_seq(m) == 3 * (2 * flop_params(m) * m.seq_len + attention_flops_per_seq(m))
    parts = breakdown_per_token(m)
    norms = m.num_layers * 2 * m.hidden_size + m.hidden_size
    assert sum(parts.values()) - parts["attention_scores"] == 2 * (flop_params(m) - norms)


@pytest.mark.parametrize("overrides, message", [
    (["model.moe_router_topk=9"], "model.moe_router_topk=9: must be an integer in [1, 8]"),
    (["model.num_experts=0"], "model.num_experts=0: must be an integer >= 1"),
    (["model.moe_dense_layers=[4]"], "model.moe_dense_layers=[4]: must be distinct layer indices in [0, 3]"),
    (["parallel.tp=2", "parallel.dp=1"], "parallel.tp=2: megatron-core's MoE layer at tp > 1 (with sequence "
                                         "parallelism, expert tensor parallelism) is not modelled; allowed with "
                                         "model.num_experts: parallel.tp=1"),
])
def test_bad_moe_keys_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        from_cfg(compose(["model=moe-tiny", *overrides]), here=False)
    assert str(e.value) == message


def test_moe_keys_need_num_experts():
    with pytest.raises(ConfigError) as e:
        from_cfg(compose(["model=llama-tiny", "model.moe_ffn_hidden_size=64"]), here=False)
    assert str(e.value) == "model.moe_ffn_hidden_size=64: needs model.num_experts (a dense model has no experts)"


@pytest.mark.parametrize("name", ["moe-tiny", "mixtral-8x7b"])
def test_expert_parallel_param_list_is_the_live_models(name, fake_tp, monkeypatch):
    """parallel.ep=2: megatron-core's GPTModel of expert-parallel rank 0 (meta device) holds
    num_experts / 2 experts per MoE layer, numbered locally (local_experts.0 ..), and everything else
    whole; models/params.py's list marks exactly megatron's expert parameters (allreduce=False) as
    Param.expert. Per rank: the dense part + the experts / ep, so ep ranks hold num_params + (ep - 1)
    x the dense part."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    fake_tp(1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2,
                                 create_gloo_process_groups=False)
    # the alltoall dispatcher makes a CUDA stream unless one is set (models/shims.py does so on CPU)
    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", "cpu", raising=False)
    m = model(name)
    cfg = BenchConfig(model=m, parallel=ParallelConfig(tp=1, dp=2, ep=2), hardware=HardwareConfig(device="cpu"),
                      precision="bf16")
    with torch.device("meta"):
        gpt = build_gpt(cfg, transformer_config(cfg, on_cpu=True), on_cpu=True)
    live = [(n, tuple(p.shape), p.partition_dim if getattr(p, "tensor_model_parallel", False) else None,
             not getattr(p, "allreduce", True)) for n, p in gpt.named_parameters()]
    assert live == [(p.name, p.shape, p.tp_dim, p.expert) for p in cfg.layout.params]
    experts = m.num_moe_layers * m.num_experts * expert_params(m, 1)
    held = cfg.layout.held_params
    assert sum(math.prod(s) for _, s, _, _ in live) == held == num_params(m) - experts // 2
    assert 2 * held == num_params(m) + dense_params(m, 1)
    assert max(int(n.split("local_experts.")[1].split(".")[0]) for n, *_ in live if "local_experts" in n) == 3
