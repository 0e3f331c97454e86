"""Synthetic results for report tests: what a GPU sweep and its failures leave in a store.

Failed, skipped and GPU configurations only test how a report renders them, so they are written to
the store directly; the measured CPU rows come from real searches (tests/integration).
"""
import dataclasses

import pandas as pd

from zero_bench.config.schema import BenchConfig, HardwareConfig, ModelConfig, ParallelConfig
from zero_bench.records import DeviceMemStats, RankRecord, SearchResult, TrialResult
from zero_bench.store import Store

from conftest import model

MiB = 2 ** 20
TINY = model("gpt-tiny")
NUMERIC = ["num_layers", "hidden_size", "num_heads", "# gpus", "data parallel", "model parallel", "ZeRO Stage",
           "Max Global BSZ", "micro batch", "grad accum", "time/it (ms)", "Throughput (samples/sec)", "tokens/s",
           "tokens/s per GPU", "model TFLOP/s per GPU", "MFU", "HFU", "num params", "peak memory used"]


# -- synthetic results: what a GPU sweep and its failures leave in a store ---------------------------

def gpu_cfg(name, layers, hidden, heads, dp=8, tp=1, zero=1, offload=False) -> BenchConfig:
    return BenchConfig(model=ModelConfig(name, layers, hidden, heads, 1024, 50304), zero=zero,
                       parallel=ParallelConfig(tp=tp, dp=dp), hardware=HardwareConfig(device="gpu"),
                       offload=offload, precision="bf16")


def measured(cfg: BenchConfig, micro: int, step_s: float, used_mib: list, total_mib=40537, **kw) -> TrialResult:
    c = cfg.with_micro(micro)
    sps = c.global_batch / step_s
    return TrialResult(search_key=cfg.search_key(), trial_key=c.trial_key(), label=cfg.label(), micro=micro,
                       global_batch=c.global_batch, status="ok", mode="measure", time_per_step_s=step_s,
                       samples_per_s=sps, tokens_per_s=sps * cfg.model.seq_len, config=c.to_dict(),
                       devices=[DeviceMemStats(kind="gpu", id=i, peak_bytes=u * MiB, total_bytes=total_mib * MiB)
                                for i, u in enumerate(used_mib)],
                       ranks=[RankRecord(rank=i, event="end", model_states={"params": 700 * MiB, "master": 0,
                                                                            "optimizer": 600 * MiB, "grads": 0})
                              for i in range(len(used_mib))],
                       cmd=f"deepspeed --num_gpus {len(used_mib)} -m zero_bench.trial.rank",
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
                                  config=GPT345.to_dict(), measure=m,
                                  repeats=[3.31, 3.330348869, 3.35]))
    lone = gpu_cfg("GPT-345M", 24, 1024, 16, zero=3)
    store.add_trial(measured(lone, 32, 1.9, [30000] * 8))
    big = gpu_cfg("GPT-8.3B", 72, 3072, 24, zero=1)
    store.add_trial(TrialResult(search_key=big.search_key(), trial_key=big.trial_key(), label=big.label(), micro=2,
                                global_batch=16, status="estimated_oom", reason="model states 70 GiB > 40 GiB",
                                config=big.to_dict()))
    return {lone.search_key(): "ok", big.search_key(): "estimated_oom"}



def summary_of(real) -> pd.DataFrame:
    return pd.read_excel(real["paths"][0], sheet_name="Details")


def row_of(df: pd.DataFrame, key: str) -> pd.Series:
    (i,) = df.index[df["search key"] == key]
    return df.loc[i]


