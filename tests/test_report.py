"""zero_bench report: stores -> .xlsx / .csv / .md, read back with openpyxl and pandas.

Two real CPU searches (one module fixture, marked slow) give the measured rows; failed, skipped and
GPU configurations are added to the store directly, since they only test how a report renders them.
"""
import dataclasses
import shutil
from pathlib import Path

import openpyxl
import pandas as pd
import pytest
from omegaconf import OmegaConf

from zero_bench import report
from zero_bench.config import BenchConfig, ConfigError, HardwareConfig, ModelConfig, ParallelConfig, StepsConfig
from zero_bench.metrics import mfu_hfu
from zero_bench.results import SearchResult, Store, TrialResult

MiB = 2 ** 20
TINY = ModelConfig(name="GPT-tiny", num_layers=2, hidden_size=64, num_heads=4, seq_len=64, vocab_size=1024)
NUMERIC = ["num_layers", "hidden_size", "num_heads", "# gpus", "data parallel", "model parallel", "ZeRO stage",
           "Max Global BSZ", "micro batch", "grad accum", "time/it (ms)", "throughput (samples/s)", "tokens/s",
           "tokens/s per GPU", "model TFLOP/s per GPU", "MFU", "HFU", "num params", "peak memory used"]


# -- synthetic results: what a GPU sweep and its failures leave in a store ---------------------------

def gpu_cfg(name, layers, hidden, heads, dp=8, tp=1, zero=1, offload=False) -> BenchConfig:
    return BenchConfig(model=ModelConfig(name, layers, hidden, heads, 1024, 50304), zero=zero,
                       parallel=ParallelConfig(tp=tp, dp=dp), hardware=HardwareConfig(device="gpu"),
                       offload_optimizer=offload, precision="bf16")


def measured(cfg: BenchConfig, micro: int, step_s: float, used_mib: list, total_mib=40537, **kw) -> TrialResult:
    c = cfg.with_micro(micro)
    sps = c.global_batch / step_s
    return TrialResult(search_key=cfg.search_key(), trial_key=c.trial_key(), label=cfg.label(), micro=micro,
                       global_batch=c.global_batch, status="ok", mode="measure", time_per_step_s=step_s,
                       samples_per_s=sps, tokens_per_s=sps * cfg.model.seq_len, config=c.to_dict(),
                       devices={f"gpu{i}": {"peak_bytes": u * MiB, "total_bytes": total_mib * MiB}
                                for i, u in enumerate(used_mib)},
                       ranks=[{"rank": i, "model_states": {"params": 700 * MiB, "master": 0, "optimizer": 600 * MiB,
                                                           "grads": 0}} for i in range(len(used_mib))],
                       cmd=f"deepspeed --num_gpus {len(used_mib)} -m zero_bench.worker",
                       ds_config={"zero_optimization": {"stage": cfg.zero}}, **kw)


def failed(cfg: BenchConfig, status: str, note: str) -> SearchResult:
    return SearchResult(search_key=cfg.search_key(), label=cfg.label(), status=status, note=note,
                        config=cfg.to_dict())


SKIPPED_CONFIG = {  # what preflight.skipped_search stores: the raw Hydra dict, keys as the user wrote them
    "model": dataclasses.asdict(TINY), "parallel": {"tp": 3, "dp": 1}, "zero": 2, "offload": True,
    "offload_param": None, "precision": "auto", "batch": {"micro": 2, "grad_accum": 1},
    "hardware": {"device": "auto", "memory_gb": None}}

GPT345 = gpu_cfg("GPT-345M", 24, 1024, 16, zero=1)
EXPECTED_NOTES = {  # search key -> text its row's Notes must hold
    gpu_cfg("GPT-2.5B", 48, 2048, 16, zero=0).search_key(): "cannot even initialize model",
    gpu_cfg("GPT-5.8B", 72, 2560, 32, dp=1, tp=8, zero=2).search_key(): "error at micro=2: rank 3: NCCL timeout",
    "skip-0123456789ab": "skipped: parallel.tp=3: must divide model.num_heads=4",
    gpu_cfg("GPT-8.3B", 72, 3072, 24, zero=0).search_key(): "does not fit (estimated): model states 133 GiB",
    gpu_cfg("GPT-5.8B", 72, 2560, 32, zero=1).search_key(): "batch 8 does not fit",
    GPT345.search_key(): "OOM at global batch 1024",
}


def add_synthetic(store: Store) -> dict:
    """Failed/skipped/GPU configurations and two lone `run` trials; returns {search key: status}."""
    keys = list(EXPECTED_NOTES)
    store.put_search(failed(gpu_cfg("GPT-2.5B", 48, 2048, 16, zero=0), "cannot_initialize",
                            "cannot even initialize model (rank 0: CUDA out of memory)"))
    store.put_search(failed(gpu_cfg("GPT-5.8B", 72, 2560, 32, dp=1, tp=8, zero=2), "error",
                            "error at micro=2: rank 3: NCCL timeout"))
    store.put_search(SearchResult(search_key=keys[2], label="GPT-tiny tp3 dp1 zero2+offload auto", status="skipped",
                                  note="parallel.tp=3: must divide model.num_heads=4", config=SKIPPED_CONFIG))
    store.put_search(failed(gpu_cfg("GPT-8.3B", 72, 3072, 24, zero=0), "estimated_oom",
                            "model states 133 GiB > 40 GiB per GPU"))
    store.put_search(failed(gpu_cfg("GPT-5.8B", 72, 2560, 32, zero=1), "does_not_fit",
                            "batch 8 does not fit (peak 41000 MiB > capacity 40537 MiB)"))
    m = measured(GPT345, 64, 3.330348869, [35786] + [36074] * 6 + [35786])
    store.add_trial(m)
    store.put_search(SearchResult(search_key=GPT345.search_key(), label=GPT345.label(), status="done", max_micro=64,
                                  max_global_batch=512, first_fail_micro=128, note="OOM at global batch 1024",
                                  config=GPT345.to_dict(), measure=dataclasses.asdict(m),
                                  repeats=[3.31, 3.330348869, 3.35]))
    lone = gpu_cfg("GPT-345M", 24, 1024, 16, zero=3)
    store.add_trial(measured(lone, 32, 1.9, [30000] * 8))
    big = gpu_cfg("GPT-8.3B", 72, 3072, 24, zero=1)
    store.add_trial(TrialResult(search_key=big.search_key(), trial_key=big.trial_key(), label=big.label(), micro=2,
                                global_batch=16, status="estimated_oom", reason="model states 70 GiB > 40 GiB",
                                config=big.to_dict()))
    return {lone.search_key(): "ok", big.search_key(): "estimated_oom"}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ZERO_BENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def synthetic(tmp_path) -> Path:
    store = Store(tmp_path / "synthetic.sqlite")
    add_synthetic(store)
    return store.path


# -- fast: rendering, atomic writes, inputs ---------------------------------------------------------

def test_crash_mid_export_keeps_the_previous_report(synthetic, tmp_path, monkeypatch):
    out = tmp_path / "reports" / "r.xlsx"
    paths = report.write_reports(runs=synthetic, out=out)
    before = {p: p.read_bytes() for p in paths}

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report, "_charts_sheet", boom)  # after the Summary sheet is already written
    with pytest.raises(RuntimeError):
        report.write_reports(runs=synthetic, out=out)
    assert {p: p.read_bytes() for p in paths} == before
    assert openpyxl.load_workbook(out).sheetnames[0] == "Summary"
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.csv", "r.md", "r.xlsx"]  # no temp left

    monkeypatch.undo()
    monkeypatch.setattr(pd.DataFrame, "to_csv", boom)
    with pytest.raises(RuntimeError):
        report.write_reports(runs=synthetic, out=out)
    assert paths[1].read_bytes() == before[paths[1]]
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.csv", "r.md", "r.xlsx"]


def test_gpu_rows_get_mfu_from_the_datasheet_peak(synthetic):
    rows = report.rows_of(report.load([synthetic]))
    df = report.summary_frame(rows, report.Peaks({"gpu": "NVIDIA A100-SXM4-40GB", "gpu count": 8}))
    row = df[df["search key"] == GPT345.search_key()].iloc[0]
    m = GPT345.model
    sps = 512 / 3.330348869
    assert row["throughput (samples/s)"] == pytest.approx(sps)
    assert row["MFU"] == pytest.approx(mfu_hfu(m.num_params, m.num_layers, m.hidden_size, m.seq_len, sps, 8,
                                               312e12)[0])
    assert row["model TFLOP/s per GPU"] == pytest.approx(row["MFU"] * 312)
    assert [row[f"Dev{i} used MiB"] for i in range(8)] == [35786] + [36074] * 6 + [35786]
    assert row["Dev7 total MiB"] == 40537
    assert row["peak memory used"] == pytest.approx(36074 / 40537)
    assert (row["time/it median (ms)"], row["time/it min (ms)"], row["time/it max (ms)"], row["repeats"]) == \
        pytest.approx((3330.348869, 3310, 3350, 3))
    unknown = report.summary_frame(rows, report.Peaks({"gpu": "none visible"}))
    assert unknown["MFU"].isna().all()  # no peak known: left empty, never a made-up figure


def test_estimate_columns_are_skipped_when_the_estimate_fails(synthetic, monkeypatch):
    import zero_bench.estimate as estimate

    rows = report.rows_of(report.load([synthetic]))
    peaks = report.Peaks({"gpu": "none visible"})
    monkeypatch.setattr(estimate, "model_states_bytes", lambda *a, **k: 1 / 0, raising=False)
    assert report.ESTIMATE_COLUMNS[0] not in report.summary_frame(rows, peaks).columns
    monkeypatch.setattr(estimate, "model_states_bytes", lambda *a, **k: {"gpu": 1300 * MiB, "cpu": 0, "grads": 0},
                        raising=False)
    df = report.summary_frame(rows, peaks)
    row = df[df["search key"] == GPT345.search_key()].iloc[0]
    assert (row[report.ESTIMATE_COLUMNS[1]], row[report.ESTIMATE_COLUMNS[2]]) == pytest.approx((1300, 0))


def test_runs_may_be_a_store_a_directory_or_a_glob(synthetic, tmp_path):
    nested = tmp_path / "runs" / "sweep1"
    nested.mkdir(parents=True)
    shutil.copy(synthetic, nested / "a.sqlite")
    assert report.find_stores(synthetic) == [synthetic]
    assert report.find_stores(tmp_path / "runs") == [nested / "a.sqlite"]
    assert report.find_stores(str(tmp_path / "*.sqlite")) == [synthetic]
    with pytest.raises(ConfigError, match="no store"):
        report.write_reports(runs=tmp_path / "nothing-here", out=tmp_path / "x.xlsx")


def test_the_report_subcommand_prints_the_paths(synthetic, tmp_path, capsys):
    from zero_bench import commands

    cfg = OmegaConf.create({"store": str(synthetic), "report": {"runs": None, "out": str(tmp_path / "o.xlsx"),
                                                                "compare": None}})
    commands.report(cfg, tmp_path)
    assert capsys.readouterr().out.split() == ["wrote", str(tmp_path / "o.xlsx"), "wrote", str(tmp_path / "o.csv"),
                                               "wrote", str(tmp_path / "o.md")]


# -- slow: two real CPU searches (dp=2 and dp=1, the latter with 2 repeats) ---------------------------

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from zero_bench.search import SearchSpec, run_search

    tmp = tmp_path_factory.mktemp("real")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZERO_BENCH_CACHE", str(tmp / "cache"))
        store = Store(tmp / "cpu.sqlite")
        cfg = BenchConfig(model=TINY, zero=1, precision="fp32", hardware=HardwareConfig(device="cpu", memory_gb=0.5),
                          steps=StepsConfig(warmup=1, timed=2), timeout_s=300)
        spec = SearchSpec(max=4, strategy="doubling")
        quiet = dict(progress=lambda s: None)
        dp2 = run_search(cfg, spec, store, tmp / "run-dp2", **quiet)
        dp1 = run_search(dataclasses.replace(cfg, parallel=ParallelConfig(tp=1, dp=1)), spec, store, tmp / "run-dp1",
                         repeats=2, **quiet)
        assert dp2.status == dp1.status == "done", (dp2.note, dp1.note)
        lone = add_synthetic(store)
        paths = report.write_reports(runs=store.path, out=tmp / "reports" / "zero_bench.xlsx")
        yield dict(store=store, dp2=dp2, dp1=dp1, lone=lone, paths=paths, tmp=tmp)


def summary_of(real) -> pd.DataFrame:
    return pd.read_excel(real["paths"][0], sheet_name="Summary")


def row_of(df: pd.DataFrame, key: str) -> pd.Series:
    (i,) = df.index[df["search key"] == key]
    return df.loc[i]


@pytest.mark.slow
def test_every_configuration_has_a_row(real):
    df = summary_of(real)
    expected = {real["dp2"].search_key, real["dp1"].search_key, *EXPECTED_NOTES, *real["lone"]}
    assert sorted(df["search key"]) == sorted(expected)
    assert list(df.columns[:len(report.SEED_COLUMNS)]) == report.SEED_COLUMNS
    assert {"Dev0 used MiB", "Dev0 total MiB", "Dev7 used MiB", "Notes"} <= set(df.columns)


@pytest.mark.slow
def test_cells_hold_numbers_not_text(real):
    df = summary_of(real)
    for col in NUMERIC + [c for c in df.columns if c.startswith("Dev")]:
        assert pd.api.types.is_numeric_dtype(df[col]), col
    ws = openpyxl.load_workbook(real["paths"][0])["Summary"]
    header = [c.value for c in ws[1]]
    for col in NUMERIC:
        cells = [r[header.index(col)] for r in ws.iter_rows(min_row=2, values_only=True)]
        assert all(v is None or isinstance(v, (int, float)) for v in cells), (col, cells)
        assert any(isinstance(v, (int, float)) for v in cells), col


@pytest.mark.slow
def test_failed_configurations_keep_their_reason(real):
    df = summary_of(real)
    for key, text in EXPECTED_NOTES.items():
        assert text in row_of(df, key)["Notes"]
    for key in list(EXPECTED_NOTES)[:-1]:  # all but the GPT-345M search that succeeded
        assert pd.isna(row_of(df, key)["Max Global BSZ"])
    skipped = row_of(df, "skip-0123456789ab")
    assert (skipped["model parallel"], skipped["CPU offload"], skipped["precision"]) == (3, "Yes", "auto")
    oom_run = row_of(df, [k for k, s in real["lone"].items() if s == "estimated_oom"][0])
    assert oom_run["Notes"] == "does not fit (estimated): model states 70 GiB > 40 GiB"


@pytest.mark.slow
def test_measured_rows_carry_the_search_results(real):
    df = summary_of(real)
    for res in (real["dp2"], real["dp1"]):
        row, m = row_of(df, res.search_key), TrialResult(**res.measure)
        assert row["Max Global BSZ"] == res.max_global_batch and row["micro batch"] == res.max_micro
        assert row["time/it (ms)"] == pytest.approx(m.time_per_step_s * 1e3)
        assert row["throughput (samples/s)"] == pytest.approx(m.samples_per_s)
        assert row["tokens/s per GPU"] == pytest.approx(m.tokens_per_s / res.config["parallel"]["dp"])
        assert 0 < row["MFU"] < 1 and row["HFU"] == row["MFU"]
        assert row["num params"] == TINY.num_params
        assert row["memory of"] == "rank RSS" and row["Dev0 total MiB"] == 512
        assert row["Dev0 used MiB"] == pytest.approx(m.devices["rank0"]["peak_bytes"] / MiB)
    dp1 = row_of(df, real["dp1"].search_key)
    times = sorted(t * 1e3 for t in real["dp1"].repeats)
    assert dp1["repeats"] == 2 == len(times)
    assert (dp1["time/it min (ms)"], dp1["time/it max (ms)"]) == pytest.approx((times[0], times[-1]))
    assert not pd.isna(row_of(df, real["dp2"].search_key)["Dev1 used MiB"])
    assert pd.isna(dp1["Dev1 used MiB"])  # one rank, one device


@pytest.mark.slow
def test_sheets_are_formatted_for_a_reader(real):
    wb = openpyxl.load_workbook(real["paths"][0])
    assert wb.sheetnames == ["Summary", "Trials", "Charts", "Environment", "Scaling"]
    ws = wb["Summary"]
    header = [c.value for c in ws[1]]
    assert ws.freeze_panes == "B2" and ws.auto_filter.ref == ws.dimensions
    assert ws.cell(2, header.index("MFU") + 1).number_format == "0.00%"
    assert ws.cell(2, header.index("time/it (ms)") + 1).number_format == "#,##0.0"
    letter = openpyxl.utils.get_column_letter(header.index("peak memory used") + 1)
    (rng,) = [str(cf.sqref) for cf in ws.conditional_formatting]
    assert rng == f"{letter}2:{letter}{ws.max_row}"
    assert all(ws.column_dimensions[openpyxl.utils.get_column_letter(i)].width >= 8 for i in range(1, 10))


@pytest.mark.slow
def test_charts_point_at_the_summary_columns(real):
    wb = openpyxl.load_workbook(real["paths"][0])
    header = [c.value for c in wb["Summary"][1]]
    last = wb["Summary"].max_row

    def ref(col):
        letter = openpyxl.utils.get_column_letter(header.index(col) + 1)
        return f"'Summary'!${letter}$2:${letter}${last}"

    charts = wb["Charts"]._charts
    assert [c.title.tx.rich.p[0].r[0].t for c in charts] == [
        "Max global batch per configuration", "Throughput per configuration",
        "Peak memory per device per configuration"]
    assert [s.val.numRef.f for s in charts[0].series] == [ref("Max Global BSZ")]
    assert [s.val.numRef.f for s in charts[1].series] == [ref("throughput (samples/s)")]
    assert [s.val.numRef.f for s in charts[2].series] == [ref(f"Dev{i} used MiB") for i in range(8)]
    assert all(s.cat.strRef.f == ref("config") for c in charts for s in c.series)


@pytest.mark.slow
def test_trials_sheet_lists_every_trial(real):
    trials = pd.read_excel(real["paths"][0], sheet_name="Trials")
    stored = real["store"].trials()
    assert len(trials) == len(stored)
    assert set(trials["outcome"]) == {t.status for t in stored}
    ok_real = trials[(trials["outcome"] == "ok") & trials["config"].str.startswith("GPT-tiny")]
    assert len(ok_real) and ok_real["Dev0 peak MiB"].gt(300).all() and ok_real["duration (s)"].gt(0).all()
    assert sorted(ok_real["micro batch"].unique()) == [1, 2, 4]


@pytest.mark.slow
def test_environment_sheet_says_what_ran_where(real):
    ws = openpyxl.load_workbook(real["paths"][0])["Environment"]
    text = "\n".join(str(v) for row in ws.iter_rows(values_only=True) for v in row if v is not None)
    import torch
    assert torch.__version__ in text and "deepspeed" in text and "megatron-core" in text
    assert "matmul microbenchmark" in text  # where the CPU peak came from
    for res in (real["dp2"], real["dp1"]):
        assert res.measure["cmd"] in text
        assert '"stage": 1' in text


@pytest.mark.slow
def test_scaling_sheet_compares_world_sizes(real):
    sc = pd.read_excel(real["paths"][0], sheet_name="Scaling")
    assert list(sc["data parallel"]) == [1, 2]
    t1, t2 = real["dp1"].measure["samples_per_s"], real["dp2"].measure["samples_per_s"]
    assert list(sc["speedup"]) == pytest.approx([1.0, t2 / t1])
    assert list(sc["scaling efficiency"]) == pytest.approx([1.0, t2 / t1 / 2])


@pytest.mark.slow
def test_csv_and_markdown_carry_the_same_rows(real):
    xlsx, csv, md = real["paths"]
    summary = summary_of(real)
    from_csv = pd.read_csv(csv)
    assert list(from_csv.columns) == list(summary.columns)
    pd.testing.assert_series_equal(from_csv["Max Global BSZ"], summary["Max Global BSZ"])
    text = md.read_text()
    main, scaling = text.split("## Scaling")
    table = [line for line in main.splitlines() if line.startswith("| ")]
    assert len(table) == len(summary) + 2  # header, rule, one line per configuration
    assert len([line for line in scaling.splitlines() if line.startswith("| ")]) == 2 + 2
    assert "| Dev0 MiB |" in table[0] and "36,074 / 40,537" in text
    for note in EXPECTED_NOTES.values():
        assert note in text


@pytest.mark.slow
def test_compare_sheet_shows_deltas_and_ratios(real):
    tmp = real["tmp"]
    other = Store(tmp / "h100.sqlite")
    faster = {real["dp2"].search_key: 2.0, GPT345.search_key(): 4.0}
    for s in real["store"].searches():
        if s.search_key in faster:  # same configurations, measured faster elsewhere
            m = dict(s.measure)
            m["samples_per_s"] *= faster[s.search_key]
            m["tokens_per_s"] *= faster[s.search_key]
            m["time_per_step_s"] /= faster[s.search_key]
            other.put_search(dataclasses.replace(s, measure=m, max_global_batch=s.max_global_batch * 2))
    xlsx, _, _ = report.write_reports(runs=real["store"].path, out=tmp / "cmp" / "a_vs_b.xlsx", compare=other.path)
    cmp = pd.read_excel(xlsx, sheet_name="Compare")
    base = summary_of(real)
    assert len(cmp) == len(base)  # every configuration of either side, matched where both have it
    for key, factor in faster.items():
        b = row_of(base, key)
        (i,) = cmp.index[(cmp["Model"] == b["Model"]) & (cmp["ZeRO stage"] == b["ZeRO stage"])
                         & (cmp["data parallel"] == b["data parallel"])]
        r = cmp.loc[i]
        assert r["throughput (samples/s) [cpu]"] == pytest.approx(b["throughput (samples/s)"])
        assert r["throughput (samples/s) [h100]"] == pytest.approx(b["throughput (samples/s)"] * factor)
        assert r["throughput (samples/s) Δ"] == pytest.approx(b["throughput (samples/s)"] * (factor - 1))
        assert r["throughput (samples/s) ratio"] == pytest.approx(factor)
        assert r["time/it (ms) ratio"] == pytest.approx(1 / factor)
        assert r["Max Global BSZ ratio"] == pytest.approx(2.0)
    assert cmp["throughput (samples/s) [h100]"].notna().sum() == len(faster)  # the rest: this side only
    # a report already written can be the other side too
    again, _, _ = report.write_reports(runs=real["store"].path, out=tmp / "cmp" / "self.xlsx", compare=xlsx)
    same = pd.read_excel(again, sheet_name="Compare")
    assert same["throughput (samples/s) ratio"].dropna().tolist() == pytest.approx([1.0] * 4)


@pytest.mark.slow
def test_estimate_matches_the_counted_model_states(real):
    df = summary_of(real)
    if report.ESTIMATE_COLUMNS[2] not in df.columns:
        pytest.skip("zero_bench.estimate.model_states_bytes is not available")
    for res in (real["dp2"], real["dp1"]):
        assert abs(row_of(df, res.search_key)[report.ESTIMATE_COLUMNS[2]]) < 5
