"""maxseq without launches: the one boundary procedure over the sequence dimension (simulated
peaks that grow with s and s^2), its grid, the estimate's longest sequence, the refusals, the stored
answer and the report's sentence. A real search on CPU: tests/integration/test_maxseq_cpu.py."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import ConfigError, HardwareConfig, SearchConfig
from zero_bench.estimate.seq import longest_seq, peak_at, seed_seq
from zero_bench.records import Dimension, Entry, RankRecord, SearchResult, SearchStatus, Seed, Status, TrialResult
from zero_bench.search.boundary import FIT_LAUNCHES, Known, next_plan, verdict
from zero_bench.search.dimension import Grow, check_positions, past_positions, seq_grid, with_seq_len
from zero_bench.search.maxbatch import Search, SearchOptions
from zero_bench.store import Store

from conftest import cpu_cfg

MiB = 2**20
SEQ = Grow(Dimension.SEQ)
ROOT = Path(__file__).resolve().parents[2]


def seq_trial(s: int, ok: bool, fresh: bool, peak: int, mode: str = "measure") -> TrialResult:
    return TrialResult(search_key="k", trial_key=f"t{s}", label="sim", micro=1, global_batch=2,
                       status=Status.OK if ok else Status.OOM, mode=mode, fresh=fresh,
                       config={"model": {"seq_len": s}}, time_per_step_s=0.01 * s if ok else None,
                       ranks=[RankRecord(rank=0, event="end", peak_rss_bytes=peak)])


def simulate(peak, cap: int, grid: SearchConfig, seed=None) -> tuple[Known, list[TrialResult]]:
    """next_plan against a memory model peak(s), one size a launch as maxseq runs it."""
    trials: list[TrialResult] = []
    for launches in range(60):
        known = Known.from_trials(trials, "cpu", SEQ.size)
        plan = next_plan(known, grid, cap, seed, allow_fit=launches < FIT_LAUNCHES + 1)
        if not plan:
            return known, trials
        assert len(plan) == 1, "maxseq launches one sequence length at a time"
        s = plan[0].micro
        assert (s - grid.min) % grid.granularity == 0 and grid.min <= s <= grid.max
        trials.append(seq_trial(s, peak(s) <= cap, True, peak(s), plan[0].mode))
    raise AssertionError(f"no answer: {[(SEQ.size(t), t.status) for t in trials]}")


def quadratic(base=400 * MiB, per_token=60_000, per_token2=3.0):
    """Unfused attention: a x s x s scores per layer on top of the linear terms."""
    return lambda s: int(base + per_token * s + per_token2 * s * s)


@pytest.mark.parametrize("boundary", [256, 1024, 4352, 30720, 131072])
@pytest.mark.parametrize("strategy", ["fit", "doubling"])
@pytest.mark.parametrize("seeded", [False, True])
def test_the_boundary_procedure_finds_the_longest_sequence_fresh(boundary, strategy, seeded):
    """s fits and s + 256 fails, both fresh, on the 256-token grid, whether the peak is linear or
    quadratic in s, seeded by a guess 30 % high or not seeded."""
    grid = seq_grid(SearchConfig(strategy=strategy), RankLayout())
    for peak in (quadratic(), quadratic(per_token2=0.0)):
        cap = (peak(boundary) + peak(boundary + 256)) // 2
        seed = Seed(int(boundary * 1.3) // 256 * 256, peak(boundary + 1) - peak(boundary)) if seeded else None
        known, trials = simulate(peak, cap, grid, seed)
        assert verdict(known, grid) == SearchStatus.DONE
        assert (known.lo, known.hi) == (boundary, boundary + 256)
        assert known.fresh[boundary][-1] and not known.fresh[boundary + 256][-1]


def test_a_sequence_that_never_fits_and_the_top_of_the_range():
    grid = seq_grid(SearchConfig(seq_max=4096), RankLayout())
    known, _ = simulate(quadratic(), 100 * MiB, grid)
    assert verdict(known, grid) == SearchStatus.DOES_NOT_FIT
    known, _ = simulate(quadratic(), 10**12, grid)
    assert verdict(known, grid) == SearchStatus.DONE and known.lo == 4096 and known.hi is None


def test_the_grid_is_a_multiple_of_tp_times_sp_rounded_to_256():
    assert seq_grid(SearchConfig(), RankLayout(tp=2)).granularity == 256
    assert seq_grid(SearchConfig(), RankLayout(tp=3)).granularity == 768
    assert seq_grid(SearchConfig(), RankLayout(tp=512)).granularity == 512
    grid = seq_grid(SearchConfig(seq_granularity=64, seq_min=128, seq_max=2048), RankLayout(tp=2))
    assert (grid.min, grid.max, grid.granularity, grid.multi) == (128, 2048, 64, False)
    with pytest.raises(ConfigError, match=r"^search.seq_granularity=100: must be a multiple of tp x sp = 8"):
        seq_grid(SearchConfig(seq_granularity=100), RankLayout(tp=8))
    with pytest.raises(ConfigError, match=r"^search.seq_min=300: must be a multiple of tp x sp = 8"):
        seq_grid(SearchConfig(seq_min=300), RankLayout(tp=8))


def test_learned_positions_are_refused_past_their_table_and_rope_is_not():
    gpt, llama = cpu_cfg("gpt-mini"), cpu_cfg("llama-tiny")
    with pytest.raises(ConfigError, match=r"^search.seq_max=1048576: model.position_embedding=learned"):
        check_positions(gpt, seq_grid(SearchConfig(), gpt.layout))
    check_positions(gpt, seq_grid(SearchConfig(seq_max=gpt.model.seq_len), gpt.layout))
    check_positions(llama, seq_grid(SearchConfig(), llama.layout))


def test_a_range_past_a_rope_checkpoints_positions_warns_in_one_line():
    cfg = cpu_cfg("llama-tiny")
    hf = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_config=str(ROOT / "tests/data/hf/Llama-3-8B")))
    line = past_positions(hf, seq_grid(SearchConfig(seq_max=16384), hf.layout))
    assert line and "max_position_embeddings=8192" in line and "\n" not in line
    assert past_positions(hf, seq_grid(SearchConfig(seq_max=8192), hf.layout)) is None
    assert past_positions(cfg, seq_grid(SearchConfig(), cfg.layout)) is None


def test_maxseq_refuses_learned_positions_before_any_launch(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "zero_bench", "maxseq", "model=gpt-mini", "hardware=cpu"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    errors = [x for x in p.stderr.splitlines() if x.startswith("zero_bench: error:")]
    assert len(errors) == 1 and "search.seq_max=1048576" in errors[0] and "model.position_embedding=learned" in errors[0]
    assert "launch" not in p.stdout and not (tmp_path / "results").exists()


def test_the_key_is_the_config_without_its_sequence_and_apart_from_maxbatch():
    cfg = cpu_cfg("llama-tiny")
    assert SEQ.key(cfg) == SEQ.key(with_seq_len(cfg, 4096)) != Grow().key(cfg)
    assert SEQ.key(cfg.with_micro(1)) != SEQ.key(cfg.with_micro(2))
    assert SEQ.entries(with_seq_len(cfg, 512), [Entry(512)]) == [Entry(cfg.batch.micro)]


def test_the_time_limit_pace_grows_with_the_sequence():
    """A step at 2,048 tokens measured 1 s: at 8,192 the pace is at least 4x (FLOPs, s^2 included)."""
    cfg = cpu_cfg("llama-tiny").with_micro(1)
    t = dataclasses.replace(seq_trial(2048, True, True, 500 * MiB), time_per_step_s=1.0)
    short, long = SEQ.pace([t], with_seq_len(cfg, 2048)), SEQ.pace([t], with_seq_len(cfg, 8192))
    assert short.s_per_sample == pytest.approx(1.0) and long.s_per_sample >= 4.0


def budget(name: str, gb: float, **kw):
    cfg = cpu_cfg(name, **kw)
    return dataclasses.replace(cfg, hardware=HardwareConfig(device="cpu", memory_gb=gb))


def test_the_estimates_longest_sequence_is_its_boundary_on_the_grid():
    cfg = budget("llama-tiny", 1.0).with_micro(1)
    grid = seq_grid(SearchConfig(), cfg.layout)
    s = longest_seq(cfg, 1, grid)
    peak, cap = peak_at(cfg, s, 1)
    assert s % 256 == 0 and peak <= cap < peak_at(cfg, s + 256, 1)[0]
    seed = seed_seq(cfg, 1, grid)
    assert seed.micro == s and seed.per_sample > 0
    assert longest_seq(cfg, 2, grid) < s  # two sequences per rank leave room for a shorter one
    unfused = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="unfused"))
    assert longest_seq(unfused, 1, grid) < s  # a x s x s scores per layer
    assert longest_seq(budget("llama-tiny", 0.05), 1, grid) == 0
    gpt = budget("gpt-mini", 1.0)  # learned positions: not past the table
    assert longest_seq(gpt, 1, seq_grid(SearchConfig(), gpt.layout)) == gpt.model.seq_len


def test_estimate_prints_the_longest_sequence_beside_the_max_batch():
    from zero_bench.config.configure import compose
    from zero_bench.estimate.table import estimate_report

    out = estimate_report(compose(["model=llama3-8b", "parallel=dp8", "hardware=h100_80gb", "zero=3"]),
                          frozenset({"model", "parallel", "hardware", "zero"}))
    line = next(x for x in out.splitlines() if x.startswith("max seq len"))
    assert line.startswith("max seq len at micro 1 (predicted, multiples of 256 from 256 to 1,048,576): zero3 ")
    assert int(line.rsplit(" ", 1)[1].replace(",", "")) > 8192  # ZeRO-3 on 8 x 80 GB fits past Llama 3's 8K


def test_a_seq_search_stores_the_longest_sequence(tmp_path):
    """The stored answer: max_seq_len, the first failure, the measurement, the config at the answer,
    under maxseq's key; a second run answers from the store."""
    cfg = budget("llama-tiny", 1.0).with_micro(1)
    grid = seq_grid(SearchConfig(), cfg.layout)
    store = Store(tmp_path / "s.sqlite")
    search = Search(cfg, grid, store, tmp_path, SearchOptions(progress=lambda s: None, grow=SEQ))
    for t in (seq_trial(2048, True, True, 600 * MiB), seq_trial(2304, False, True, 700 * MiB)):
        search.record(t)
    res = search.finish()
    assert (res.status, res.dimension, res.max_seq_len, res.first_fail_seq_len) == (SearchStatus.DONE, "seq", 2048, 2304)
    assert res.search_key == SEQ.key(cfg) and res.config["model"]["seq_len"] == 2048 and res.measure.fresh
    assert all(t.search_key == res.search_key for t in store.trials())
    again = Search(cfg, grid, store, tmp_path, SearchOptions(progress=lambda s: None, grow=SEQ)).run()
    assert again.max_seq_len == 2048 and SearchResult.from_json(again.to_json()).dimension == Dimension.SEQ


def test_the_report_has_the_column_and_the_sentence():
    import pandas as pd

    from zero_bench.report.recommend import recommend

    df = pd.DataFrame([
        {"Model": "M", "num_layers": 4, "hidden_size": 256, "num_heads": 8, "device": "gpu", "# gpus": 8,
         "ZeRO Stage": z, "search": "maxseq", "Max seq len": s, "micro batch": 1, "Max Global BSZ": 8,
         "Throughput (samples/sec)": 1.0, "tokens/s": tps, "status": "done", "config": f"z{z}"}
        for z, s, tps in ((1, 32768, 9000.0), (3, 65536, 8000.0))])
    (advice,) = recommend(df)
    assert advice.heading == "M on 8 GPUs, longest sequence"
    assert advice.picks[0].sentence == ("At 8 GPUs, ZeRO-3 trains 65,536 tokens per sequence (micro 1) at 8,000 "
                                        "tokens/s, 2.00x ZeRO-1 (32,768).")


def test_with_checkpoint_offload_the_line_names_the_host_ram_at_the_longest_sequence():
    """recompute_offload moves every layer's input to the host, so at the predicted longest sequence
    the node's RAM is the next wall: the line gives it, and it is the estimate's own host figure there."""
    from zero_bench.config.configure import compose, from_cfg
    from zero_bench.estimate import estimate
    from zero_bench.estimate.seq import host_at
    from zero_bench.estimate.table import estimate_report

    keys = ["model=llama3-8b", "parallel=dp8", "parallel.sp=8", "hardware=h100_80gb", "zero=3", "offload=true",
            "offload_param=false", "recompute=full", "search.seq_max=4194304"]
    explicit = frozenset({"model", "parallel", "parallel.sp", "hardware", "zero", "offload", "offload_param",
                          "recompute", "recompute_offload"})

    def line(*more):
        out = estimate_report(compose([*keys, *more]), explicit)
        return next(x for x in out.splitlines() if x.startswith("max seq len"))

    assert "host RAM" not in line()  # the inputs stay on the device: the host holds the optimizer only
    with_offload = line("recompute_offload=true")
    s = int(with_offload.split(": zero3+offload ")[1].split(" ")[0].replace(",", ""))
    bench = from_cfg(compose([*keys, "recompute_offload=true"]), here=False)
    host = host_at(bench, s, 1)
    assert with_offload.endswith(f"{s:,} (host RAM {host / 2**30:,.0f} GiB per node)")
    # the checkpoints grow with the sequence, the optimizer's host states do not
    assert host > host_at(bench, s // 2, 1) > estimate(with_seq_len(bench, s // 2)).states.host * 8
    assert host_at(dataclasses.replace(bench, recompute_offload=False), s, 1) is None


def test_each_of_alsts_savers_lengthens_the_predicted_sequence_in_the_published_order():
    """ALST's 8 x H100 ablation for Llama-3.1-8B (benchmarks/heldout_long_context.py has the figures
    and the source): no sp < 1.1M at sp 8 < 1.2M with the tiled MLP < 2.4M with checkpoint offload
    < 3.8M with both (the 160K recipe named for the run without sp sets sp 8 at the pinned commit,
    so no published length stands for sp 1). The estimate keeps that order: each saver removes a
    term it counts."""
    from zero_bench.config.configure import compose, from_cfg, search_from_cfg

    common = ["model=llama3-8b", "hardware=h100_80gb", "zero=3", "offload=true", "offload_param=false",
              "recompute=full", "loss=chunked", "parallel=dp8", "search.seq_max=8388608"]

    def longest(*keys):
        cfg = compose([*common, *keys])
        bench = from_cfg(cfg, here=False)
        return longest_seq(bench, 1, seq_grid(search_from_cfg(cfg), bench.layout))

    order = [longest(), longest("parallel.sp=8"), longest("parallel.sp=8", "tiled_mlp=auto"),
             longest("parallel.sp=8", "recompute_offload=true"),
             longest("parallel.sp=8", "tiled_mlp=auto", "recompute_offload=true")]
    assert order == sorted(order) and len(set(order)) == 5, order


def test_the_details_sheet_puts_the_estimates_longest_sequence_beside_the_measured_one():
    """A stored maxseq answer's row carries the estimate's longest sequence for the same stored
    configuration and micro-batch (maxseq's default grid): predicted beside measured; a max-batch row
    has none, and a configuration with no known capacity leaves it empty."""
    import pandas as pd

    from zero_bench.config.configure import compose, from_cfg
    from zero_bench.report.rows import Row
    from zero_bench.report.tables import SEQ_ESTIMATE, Peaks, summary_frame

    def row(keys, seq, dim=Dimension.SEQ):
        cfg = from_cfg(compose(["model=llama3-8b", "parallel=dp8", "zero=3", "batch.micro=1",
                                f"model.seq_len={seq}", *keys]), here=False)
        return cfg, Row(config=cfg.to_dict(), label=cfg.label(), key=f"{dim}-{seq}-{len(keys)}", status="done",
                        note="", source="s.sqlite", measure=None, max_global_batch=cfg.global_batch, max_micro=1,
                        dimension=dim, max_seq_len=seq if dim == Dimension.SEQ else None)

    h100, r1 = row(["hardware=h100_80gb"], 16384)
    _, r2 = row(["hardware=gpu"], 8192)  # no capacity known
    _, r3 = row(["hardware=h100_80gb", "recompute=full"], 8192, Dimension.BATCH)
    df = summary_frame([r1, r2, r3], Peaks(env={})).set_index("search key")
    assert SEQ_ESTIMATE in df.columns
    assert df.at[r1.key, SEQ_ESTIMATE] == longest_seq(h100, 1, seq_grid(SearchConfig(), h100.layout)) > 8192
    assert pd.isna(df.at[r2.key, SEQ_ESTIMATE]) and pd.isna(df.at[r3.key, SEQ_ESTIMATE])
