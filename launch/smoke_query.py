"""What launch/gpu_smoke.sh compares, read from its store (or, `device`, from one GPU directly).

  smoke_query.py STORE last_ok      the last ok trial: n_gpus uuids(comma-joined) time/it peak>0
  smoke_query.py STORE search       the last search: status max_micro first_fail real_ooms total_MiB
                                    forked launched (its trials forked from a pool / launched fresh)
  smoke_query.py STORE gpu_mem      per rank of the last ok trial, the memory figures it recorded
  smoke_query.py - device INDEX     one GPU, a 1 GiB tensor alive: nvidia-smi, NVML v1/v2, CUDA, torch

One line per answer, fields separated by single spaces (the shell reads them with `read`); a
missing value is "-". `device` runs under CUDA_VISIBLE_DEVICES=INDEX, CUDA_DEVICE_ORDER=PCI_BUS_ID,
so NVML's index, CUDA's device 0 and `nvidia-smi -i INDEX` are the same GPU.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's zero_bench

from zero_bench.records import Status, TrialResult  # noqa: E402
from zero_bench.store import Store  # noqa: E402

MiB = 2**20
POOL_REQUEST = "# request "  # in the command text of a trial a pool's ranks forked (zero_bench.trial.pool)


def mib(value: Optional[float]) -> str:
    return "-" if value is None else str(int(value // MiB))


def last_ok(trials: list[TrialResult]) -> str:
    oks = [t for t in trials if t.status == Status.OK]
    if not oks:
        return "0 - - 0"
    t = oks[-1]
    gpus = t.devices_of("gpu")
    uuids = ",".join(d.uuid for d in gpus) or "-"  # one field, however many GPUs
    tps = f"{t.time_per_step_s:.4f}" if t.time_per_step_s else "-"
    return f"{len(gpus)} {uuids} {tps} {int(bool(gpus) and gpus[0].peak_bytes > 0)}"


def last_search(store: Store, trials: list[TrialResult]) -> str:
    searches = store.searches()
    if not searches:
        return "none - - 0 0 0 0"
    s = searches[-1]
    ooms = [t for t in trials if t.search_key == s.search_key and t.status == Status.OOM]
    real = sum("out of memory" in t.reason.lower() for t in ooms)
    gpus = s.measure.devices_of("gpu") if s.measure else []
    total = gpus[0].total_bytes if gpus and gpus[0].total_bytes else 0
    mine = [t for t in trials if t.search_key == s.search_key]
    forked = sum(POOL_REQUEST in (t.cmd or "") for t in mine)  # pool.Pool.submit's command text
    return (f"{s.status} {s.max_micro or '-'} {s.first_fail_micro or '-'} {real} {total // MiB} "
            f"{forked} {len(mine) - forked}")


def gpu_mem(trials: list[TrialResult]) -> str:
    """Per rank: what it recorded about its GPU at the end of the entry (MiB)."""
    oks = [t for t in trials if t.status == Status.OK and t.ranks]
    if not oks:
        return "no ok trial"
    lines = []
    for r in oks[-1].ranks:
        lines.append(f"rank{r.rank} {r.gpu_uuid or '-'} v1_used={mib(r.nvml_used_v1_bytes)} "
                     f"v2_used={mib(r.nvml_used_bytes)} nvml_reserved={mib(r.nvml_reserved_bytes)} "
                     f"torch_peak_reserved={mib(r.torch_peak_reserved)} torch_peak_allocated={mib(r.torch_peak_allocated)} "
                     f"outside={mib(r.outside_bytes)} device_peak={mib(r.device_peak_bytes)} "
                     f"cuda_total={mib(r.cuda_total_bytes)} processes={r.gpu_processes if r.gpu_processes is not None else '-'} "
                     f"fraction={r.memory_fraction if r.memory_fraction is not None else '-'} (MiB)")
    return "\n".join(lines)


def smi(index: int) -> str:
    """nvidia-smi's own used / reserved / total (a driver without memory.reserved: used / total)."""
    for fields in ("memory.used,memory.reserved,memory.total", "memory.used,memory.total"):
        out = subprocess.run(["nvidia-smi", "-i", str(index), f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True)
        if out.returncode == 0:
            return f"smi({fields.replace('memory.', '')})={out.stdout.strip().replace(' ', '')}"
    return "smi=n/a"


def device(index: int) -> str:
    """One GPU with a known 1 GiB tensor alive: which figure is nvidia-smi's used?
    Expected: smi used = v2 used = cuda_total - cuda_free, and v1 used = v2 used + reserved."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB through the allocator
    torch.cuda.synchronize()
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    try:
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        v2s = f"v2_used={mib(v2.used)} v2_reserved={mib(v2.reserved)}"
    except pynvml.NVMLError as exc:
        v2s = f"v2=n/a({type(exc).__name__})"
    free, total = torch.cuda.mem_get_info()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    procs = len(pynvml.nvmlDeviceGetComputeRunningProcesses(h))
    del x
    return (f"gpu{index} {smi(index)} v1_used={mib(v1.used)} {v2s} nvml_total={mib(v1.total)} cuda_total={mib(total)} "
            f"cuda_free={mib(free)} torch_reserved={mib(reserved)} torch_allocated={mib(allocated)} "
            f"outside={mib(total - free - reserved)} processes={procs} (MiB)")


def main(argv: list[str]) -> str:
    where, what = argv[0], argv[1]
    if what == "device":
        return device(int(argv[2]))
    store = Store(where)
    trials = store.trials()
    queries = {"last_ok": lambda: last_ok(trials), "search": lambda: last_search(store, trials),
               "gpu_mem": lambda: gpu_mem(trials)}
    return queries[what]()


if __name__ == "__main__":
    print(main(sys.argv[1:]))
