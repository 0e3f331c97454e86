"""Composition, validation (one clear line per bad input) and the DeepSpeed JSON a trial gets."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from zero_bench.config.configure import compose, from_cfg, search_from_cfg
from zero_bench.config.schema import ConfigError
from zero_bench.devices import cpu_features
from zero_bench.engines import ds_config
from zero_bench.models.params import num_params, params_per_shard
from zero_bench.search.preflight import validate_machine



def composed(*overrides: str):
    return compose(["hardware=cpu", *overrides])


def bench(*overrides: str):
    return from_cfg(composed(*overrides))


def test_defaults_are_the_cpu_default():
    b = bench()
    auto = cpu_features.detect().auto_precision  # precision=auto: bf16 where this CPU has it natively
    assert (b.model.name, b.zero, b.parallel.world_size, b.precision) == ("GPT-mini", 2, 2, auto)
    assert b.global_batch == b.batch.micro * b.parallel.dp


def test_the_demo_sweep_runs_at_the_precision_this_cpu_computes():
    c = composed("+sweep=cpu_demo")
    b = from_cfg(c)
    auto = cpu_features.detect().auto_precision  # bf16 where native, fp32 on AVX2-only CPUs
    assert (b.model.name, b.precision, c.search.cpu_budget_gb, c.search.granularity, c.store) == (
        "GPT-zero-demo", auto, 0.95, 1, "results/demo.sqlite")
    from zero_bench.search.sweeps import sweep_size

    assert sweep_size(["+sweep=cpu_demo"]) == 3  # ZeRO 0, 1, 3


def test_seed_table_models_have_the_published_shapes():
    for name, shape in {"gpt345m": (24, 1024, 16), "gpt2.5b": (48, 2048, 16), "gpt5.8b": (72, 2560, 32)}.items():
        m = bench(f"model={name}").model
        assert (m.num_layers, m.hidden_size, m.num_heads) == shape
    assert num_params(bench("model=gpt345m").model) == pytest.approx(355e6, rel=0.02)


def test_a_probe_may_profile_its_first_step():
    # steps.probe=0: an entry after the launch's first profiles its first step at its size
    # (tests/integration/test_estimate_vs_measured.py measures so); the first entry still steps once
    assert bench("steps.probe=0").steps.probe == 0


def test_offload_true_moves_params_too_only_with_zero3():
    assert (bench("zero=3", "offload=true").offload_param, bench("zero=2", "offload=true").offload_param) == (True, False)


@pytest.mark.parametrize("overrides, message", [
    (["zero=5"], "zero=5: allowed values are 0, 1, 2, 3"),
    (["zero=0", "offload=true"], "offload=true: needs ZeRO stage 1, 2 or 3"),
    (["parallel.tp=3"], "parallel.tp=3: must divide model.num_heads=4"),
    (["precision=fp16"], "precision=fp16: not supported by DeepSpeed's CPU accelerator"),
    (["precision=int8"], "precision=int8: allowed values are auto, fp32, bf16, fp16"),
    (["batch.micro=0"], "batch.micro=0: must be an integer >= 1"),
    (["zero=2", "offload_param=true"], "offload_param=true: needs zero=3"),
    # every numeric key has a range
    (["model.seq_len=0"], "model.seq_len=0: must be an integer >= 1"),
    (["model.vocab_size=-5"], "model.vocab_size=-5: must be an integer >= 1"),
    (["steps.timed=0"], "steps.timed=0: must be an integer >= 1"),
    (["steps.probe=-1"], "steps.probe=-1: must be an integer >= 0"),
    (["timeout_s=0"], "timeout_s=0: must be a number > 0"),
    (["hardware.memory_gb=-1"], "hardware.memory_gb=-1: must be a number > 0"),
    (["zero=true"], "zero=true: must be an integer"),
    (["zero=abc"], "zero=abc: must be an integer"),
    (["+fault.kind=melt"], "fault: unknown key"),  # test faults are no user key (zero_bench.trial.faults)
    (["recompute=some"], "recompute=some: allowed values are none, selective, full"),
    (["recompute=full", "recompute_layers=3"], "recompute_layers=3: must divide model.num_layers=4"),
    (["recompute_layers=0"], "recompute_layers=0: must be an integer >= 1"),
    (["compile=maybe"], "compile=maybe: allowed values are true, false"),
    (["model.pad_vocab_to=0"], "model.pad_vocab_to=0: must be an integer >= 1"),
    (["precision=auto", "hardware.device=tpu"], "hardware.device=tpu: allowed values are auto, cpu, gpu"),
    (["hardware.memory_gb=1", "hardware.memory_mib=1024"], "hardware.memory_mib=1024: give memory_gb or memory_mib"),
    (["steps.warmup=-1"], "steps.warmup=-1: must be an integer >= 0"),
    (["seed=-3"], "seed=-3: must be an integer in [0, 4294967295]"),
    (["batch.grad_accum=0"], "batch.grad_accum=0: must be an integer >= 1"),
    (["hardware.num_nodes=0"], "hardware.num_nodes=0: must be an integer >= 1"),
    (["hardware.launcher=ssh"], "hardware.launcher=ssh: allowed values are pdsh, openmpi"),
    (["nonexistent_key=1"], "nonexistent_key: unknown key"),
    (["+model.foo=1"], "model.foo: unknown key; allowed: name, num_layers"),
])
def test_bad_input_is_one_line_naming_key_and_allowed(overrides, message):
    with pytest.raises(ConfigError) as err:
        bench(*overrides)
    assert message in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["+model.foo=1"], "model.foo: unknown key; allowed: name, num_layers"),
    (["hardware.device=tpu"], "hardware.device=tpu: allowed values are auto, cpu, gpu"),
    (["hardware.device=CPU"], "hardware.device=CPU: allowed values are auto, cpu, gpu"),
    (["hardware.launcher=ssh"], "hardware.launcher=ssh: allowed values are pdsh, openmpi"),
    (["hardware.num_nodes=0"], "hardware.num_nodes=0: must be an integer >= 1"),
    (["hardware.num_nodes=two"], "hardware.num_nodes=two: must be an integer"),
    (["hardware.num_nodes=2"], "hardware.num_nodes=2: needs hardware.hostfile"),  # a job's check, not precheck's
    (["hardware.memory_gb=1", "hardware.memory_mib=1024"], "hardware.memory_mib=1024: give memory_gb or memory_mib"),
    (["hardware.memory_gb=inf"], "hardware.memory_gb=inf: must be a finite number"),
    (["batch.grad_accum=0"], "batch.grad_accum=0: must be an integer >= 1"),
    (["batch.grad_accum=1.5"], "batch.grad_accum=1.5: must be an integer"),
    (["steps.warmup=-1"], "steps.warmup=-1: must be an integer >= 0"),
    (["steps.warmup=true"], "steps.warmup=true: must be an integer"),
    (["seed=-3"], "seed=-3: must be an integer"),
    (["seed=99999999999999999999"], "seed=99999999999999999999: must be an integer in [0, 4294967295]"),
    (["search.min=0"], "search.min=0: must be an integer >= 1"),
    (["search.min=x"], "search.min=x: must be an integer"),
    (["search.min=16", "search.max=8"], "search.max=8: must be >= search.min=16"),
    (["search.cpu_budget_gb=0"], "search.cpu_budget_gb=0: must be a number > 0"),
    (["search.cpu_budget_gb=abc"], "search.cpu_budget_gb=abc: must be a number"),
    (["search.cpu_budget_gb=inf"], "search.cpu_budget_gb=inf: must be a finite number"),
])
@pytest.mark.parametrize("command", ["run", "maxbatch"])
def test_cli_bad_input_is_exit_2_one_line_naming_the_key_and_nothing_launched(
        command, overrides, message, tmp_path, monkeypatch, capsys):
    """The command line as a user types it (zero_bench.cli.main, in this process): exit code 2,
    exactly one line on stderr naming the key, and no launch, no store, no run folder written."""
    from zero_bench import cli
    from zero_bench.commands import subcommands as commands

    launched = []
    monkeypatch.setattr(commands, "run_launch", lambda *a, **k: launched.append(a) or pytest.fail("launched"))
    monkeypatch.setattr(commands, "run_search", lambda *a, **k: launched.append(a) or pytest.fail("searched"))
    monkeypatch.setattr(sys, "argv", ["zero_bench"])
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "hardware=cpu", "model=gpt-tiny", *overrides, f"store={tmp_path}/s.sqlite",
                  f"hydra.run.dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.splitlines() == [f"zero_bench: error: {err.strip()[len('zero_bench: error: '):]}"], err
    assert message in err and "Traceback" not in err, err
    assert not launched and not (tmp_path / "s.sqlite").exists()
    assert not list(tmp_path.rglob("cmd.txt")) and not list(tmp_path.rglob("*.json"))


def test_world_size_beyond_devices():
    """CPU ranks are processes: up to two per core, whatever this host's core count."""
    from zero_bench.search.preflight import available_devices

    limit = 2 * available_devices("cpu")
    validate_machine(bench(f"parallel.dp={limit}"))
    with pytest.raises(ConfigError, match=rf"world size tp\*dp\*pp={limit + 2} exceeds"):
        validate_machine(bench(f"parallel.dp={limit + 2}"))


def test_cli_errors_are_one_line_without_traceback():
    for args, key in ((["model=gpt9"], "model=gpt9: unknown option; allowed: gpt-mini"),
                      (["ds_preset=megatron"], "ds_preset=megatron: allowed values are default, megatron_deepspeed"),
                      (["zero=7"], "zero=7: allowed values"),
                      (["nonexistent_key=1"], "nonexistent_key: unknown key"),
                      (["-m", "zero=0,7"], "zero=7: allowed values"),
                      (["repeats=0"], "repeats=0: must be an integer >= 1"),  # run does not use it: refused anyway
                      (["estimate", "search.max=0"], "search.max=0: must be an integer >= 1"),
                      (["report", "report.nope=1"], "report.nope: unknown key"),
                      # was Hydra's override-grammar error
                      (["mxbatch"], "unknown command 'mxbatch'; did you mean maxbatch? commands: run, maxbatch, "
                                    "maxseq, report, estimate, doctor, status, calibrate"),
                      # trained as if the key were absent (one group of all dp ranks, under DeepSpeed)
                      (["engine=deepspeed", "parallel.dp_shard=2"], "parallel.dp_shard=2: hybrid sharding runs "
                                                                    "with engine=fsdp2")):
        p = subprocess.run([sys.executable, "-m", "zero_bench", *args], capture_output=True, text=True)
        assert p.returncode == 2, (args, p.stderr)
        assert key in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_ds_config_layers_templates_values_and_user_keys():
    b = bench("zero=3", "offload=true", "batch.micro=3", "batch.grad_accum=2", "precision=bf16")
    ds = ds_config.build(b)
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (3, 2, 12)
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["torch_adam"]  # CPU: no JIT op
    # buckets scaled to the model on CPU, unless the user set them
    assert z["reduce_bucket_size"] == max(500_000, params_per_shard(b.model, 1) // 16)
    user = from_cfg(composed("zero=3", "+ds.zero_optimization.reduce_bucket_size=12345"))
    assert ds_config.build(user)["zero_optimization"]["reduce_bucket_size"] == 12345
    assert "_comment" not in ds


def test_megatron_deepspeed_preset_is_the_reference_setup():
    """DeepSpeedExamples' Megatron-LM GPT-2 settings: 5e8 buckets (ZeRO-2 tutorial), 5e7 with ZeRO-3
    or offload (whose scripts also checkpoint to the host, contiguously), dynamic fp16 loss scale."""
    z2 = ds_config.build(bench("ds_preset=megatron_deepspeed", "zero=2", "recompute=full"))
    zo = z2["zero_optimization"]
    assert (zo["reduce_bucket_size"], zo["allgather_bucket_size"], zo["overlap_comm"], zo["contiguous_gradients"]) \
        == (500_000_000, 500_000_000, True, True)  # on CPU too: the preset's buckets, not scaled ones
    assert z2["fp16"] == {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2,
                          "min_loss_scale": 1}
    assert z2["activation_checkpointing"]["partition_activations"]
    assert not z2["activation_checkpointing"]["cpu_checkpointing"]
    off = ds_config.build(bench("ds_preset=megatron_deepspeed", "zero=2", "offload=true", "recompute=full"))
    ck = off["activation_checkpointing"]
    assert off["zero_optimization"]["reduce_bucket_size"] == 50_000_000
    assert ck["cpu_checkpointing"] and ck["contiguous_memory_optimization"] and ck["number_checkpoints"] == 4
    assert ds_config.build(bench("ds_preset=megatron_deepspeed", "zero=3"))["zero_optimization"][
        "reduce_bucket_size"] == 50_000_000
    assert "activation_checkpointing" not in ds_config.build(bench())


def test_new_keys_are_in_the_search_key_and_label():
    base = bench()
    for ov in ("recompute=full", "recompute=selective", "ds_preset=megatron_deepspeed", "compile=true"):
        other = bench(ov)
        assert other.search_key() != base.search_key() and other.label() != base.label(), ov
    assert bench("recompute=full").label().endswith("recompute=full")


def test_zero0_gets_no_zero_buckets():
    z = ds_config.build(bench("zero=0"))["zero_optimization"]
    assert z == {"stage": 0}


def test_keys_separate_configs_but_not_batches():
    a, b = bench("zero=1"), bench("zero=2")
    assert a.search_key() != b.search_key()
    assert a.search_key() == a.with_micro(7).search_key() and a.trial_key() != a.with_micro(7).trial_key()


@pytest.mark.parametrize("overrides, message", [
    (["search.min=10", "search.max=5"], "search.max=5: must be >= search.min=10"),
    (["search.granularity=0"], "search.granularity=0: must be an integer >= 1"),
    (["search.strategy=random"], "search.strategy=random: allowed values are fit, doubling"),
    (["search.max_trials=1"], "search.max_trials=1: must be an integer >= 2"),
    (["search.pool=maybe"], "search.pool=maybe: allowed values are true, false"),
    (["+search.bogus=1"], "search.bogus: unknown key"),
    (["search.min=0"], "search.min=0: must be an integer >= 1"),
    (["search.cpu_budget_gb=0"], "search.cpu_budget_gb=0: must be a number > 0"),
])
def test_search_keys_are_checked(overrides, message):
    with pytest.raises(ConfigError) as err:
        search_from_cfg(composed(*overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_raw_ds_keys_are_checked_by_deepspeed_before_launch():
    with pytest.raises(ConfigError, match=r"ds: DeepSpeed refuses the config: zero_optimization.stage=7"):
        validate_machine(bench("+ds.zero_optimization.stage=7"))


def test_search_key_carries_software_versions(tmp_path, monkeypatch):
    """Another installed torch (the distribution importlib.metadata finds first on sys.path, as a
    venv switch or an upgrade changes it) is another search key: old measurements are not reused."""
    from zero_bench.config import schema as config

    b = bench()
    key = b.search_key()
    info = tmp_path / "torch-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config.software_versions.cache_clear()
    try:
        assert dict(config.software_versions())["torch"] == "0.0"
        assert b.search_key() != key
    finally:
        monkeypatch.undo()
        config.software_versions.cache_clear()
    assert b.search_key() == key


def test_cli_exit_codes_and_one_line_errors(tmp_path):
    from zero_bench.records import SearchResult, SearchStatus
    from zero_bench.store import Store

    Store(tmp_path / "s.sqlite").put_search(SearchResult(search_key="k", label="l", status=SearchStatus.SKIPPED,
                                                         config={}))
    (tmp_path / "bad.sqlite").write_text("not a database " * 50)
    cases = [(["maxbatch", "search.min=10", "search.max=5"], 2, "search.max=5: must be >= search.min=10"),
             (["maxbatch", "+ds.zero_optimization.stage=7"], 2, "zero_optimization.stage=7"),
             (["maxbatch", f"store={tmp_path}/bad.sqlite"], 2, "not a zero_bench SQLite store"),
             (["report", f"report.runs={tmp_path}/nothing.sqlite"], 2, "report.runs="),
             (["report", f"store={tmp_path}/s.sqlite", f"report.compare={tmp_path}/none"], 2,
              f"report.compare={tmp_path}/none: no store")]
    for args, code, text in cases:
        p = subprocess.run([sys.executable, "-m", "zero_bench", *args, f"hydra.run.dir={tmp_path}/run"],
                           capture_output=True, text=True)
        assert p.returncode == code, (args, p.stderr)
        assert text in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_mistyped_command_is_named_with_the_nearest_and_the_list():
    from zero_bench.cli import COMMAND_NAMES, parse

    for word, near in (("mxbatch", "maxbatch"), ("estimat", "estimate"), ("stauts", "status")):
        with pytest.raises(ConfigError) as e:
            parse([word, "zero=1"])
        assert str(e.value) == f"unknown command '{word}'; did you mean {near}? commands: {', '.join(COMMAND_NAMES)}"
    with pytest.raises(ConfigError, match=r"^unknown command 'xyzzy'; commands: run, maxbatch"):
        parse(["xyzzy"])
    assert parse(["zero=1"]) == ("run", ["zero=1"]) and parse(["-m", "zero=0,1"])[0] == "run"
    assert parse(["~ds_preset"]) == ("run", ["~ds_preset"]) and parse(["+ds.x=1"]) == ("run", ["+ds.x=1"])


def test_help_lists_exit_codes_presets_and_every_key():
    p = subprocess.run([sys.executable, "-m", "zero_bench", "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "Exit codes: 0 answered" in p.stdout and "5 another zero_bench" in p.stdout
    assert "model=gpt-mini|" in p.stdout and "  search.granularity=1  The boundary is confirmed" in p.stdout
    assert "  precision=auto (auto | fp32 | bf16 | fp16)" in p.stdout


def test_defaults_live_in_the_schema_only():
    """conf/ holds presets and Hydra's settings; no default value is written twice."""
    import yaml

    from zero_bench.config.schema import CONF_DIR

    top = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    assert set(top) == {"defaults", "hydra"}
    assert composed().search.max == 4096 and search_from_cfg(composed()).max == 4096


def test_stored_configs_of_older_versions_still_read():
    from zero_bench.config.schema import BenchConfig

    b = bench()
    old = b.to_dict()
    old["offload_optimizer"] = old.pop("offload")
    old["ds_preset"] = {"name": "default"}
    old["fault"] = None  # a key this version does not have
    assert BenchConfig.from_dict(old) == b


def test_the_report_reads_stored_configs_through_the_schema():
    """The report's one reader (config.stored.stored_config, through report.rows.bench_of) reads a
    stored config as a resume does (BenchConfig.from_dict's migrations and defaults), and keeps a
    skipped grid entry's partial model as far as it is stored."""
    from zero_bench.config.schema import BenchConfig
    from zero_bench.models.description import describes
    from zero_bench.report.rows import bench_of

    old = bench("parallel.dp=4").to_dict()
    old["offload_optimizer"] = not old.pop("offload")
    old["ds_preset"] = {"name": "megatron_deepspeed"}
    for k in ("engine", "states", "compile", "recompute_layers"):  # stored before these keys existed
        old.pop(k)
    del old["parallel"]["ep"], old["parallel"]["dp_shard"]
    s, want = bench_of(old), BenchConfig.from_dict(old)
    assert s == want
    assert (s.parallel.dp, s.offload, s.ds_preset, s.engine, s.states, s.compile, s.recompute_layers, s.parallel.ep,
            s.parallel.dp_shard) == (4, want.offload, "megatron_deepspeed", "deepspeed", "mixed", False, 1, 1, None)
    skipped = {**old, "model": {"name": "half", "num_layers": "???"}, "command": "maxbatch", "search": {"max": 8}}
    got = bench_of(skipped)
    assert got.model.name == "half" and not describes(got.model) and got.parallel == s.parallel
    assert describes(s.model)
