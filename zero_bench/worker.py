"""One rank of a trial: started by the deepspeed launcher as `python -m zero_bench.worker --spec F`.

The spec (written by launch.py) holds the config and a plan: micro-batch sizes in ascending order,
each a "probe" (reach steady peak memory: steps.probe optimizer steps, then one profiled step) or
a "measure" (warm-up + timed steps + the profiled step). One engine serves the whole plan: model,
optimizer states and buckets do not depend on the batch (memory earlier sizes leave behind can
inflate later peaks, which is why the search decides its answer with fresh launches). After each
entry every rank appends a RankRecord to rank{R}.jsonl (fsync'ed), so whatever happens later,
finished entries are kept. Ranks agree on
"over capacity" with an all-reduce at the entry boundary, where no collective is in flight; a real
allocation failure instead ends this process (exit code OOM_EXIT) and the launch.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import signal
import statistics
import time
import traceback
from pathlib import Path
from typing import NoReturn

from zero_bench.capacity import compared_peak, over_capacity
from zero_bench.records import OOM_EXIT, RankRecord

PHASES = ("init", "forward", "backward", "step", "idle")


class Marks:
    """Phase timeline of this rank: (unix time, phase) pairs, joined later with memory samples."""

    def __init__(self):
        self.marks = [(time.time(), "init")]

    def __call__(self, phase: str) -> None:
        self.marks.append((time.time(), phase))


# Messages of allocation failures that do not arrive as torch.cuda.OutOfMemoryError: the CPU
# allocator, CUDA errors raised as plain RuntimeError (e.g. from a kernel launch or an extension),
# cuBLAS/cuDNN workspaces, NCCL buffers ("Cuda failure 'out of memory'"), the CUDA runtime's enum.
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory", "cudaerrormemoryallocation",
             "cublas_status_alloc_failed", "cudnn_status_alloc_failed", "cusolver_status_alloc_failed",
             "cufft_alloc_failed", "error_out_of_memory",
             # NCCL's own allocation failures (include/alloc.h: "Failed to CUDA calloc %ld bytes"),
             # and CUDA's error 2 as NCCL prints it ("Cuda failure 2 ...")
             "failed to cuda calloc", "failed to cuda malloc", "failed to cuda host alloc", "cuda failure 2 ")


def is_oom(exc: BaseException) -> bool:
    """An allocation failure (the batch does not fit), not a bug: the exception, its message, or
    any exception it was raised from (DeepSpeed and NCCL wrap the original in RuntimeErrors)."""
    try:
        import torch

        oom_types: tuple = (MemoryError, torch.cuda.OutOfMemoryError)
    except ImportError:
        oom_types = (MemoryError,)
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, oom_types):
            return True
        text = str(exc).lower()
        if any(t in text for t in _OOM_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage Python can reach, each storage once."""
    import torch

    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:  # storages of meta/fake tensors and the like
            continue
    seen.pop(0, None)
    return sum(seen.values())


def _storage_bytes(tensors) -> dict:
    out = {}
    for t in tensors:
        if t is not None and t.numel():
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


def model_state_bytes(engine) -> dict:
    """Exact bytes of this rank's model states, by walking DeepSpeed's objects (after a step).

    params: what the module holds (ZeRO-3: its partition ds_tensor); master: the tensors the inner
    optimizer updates when they are not the params themselves (fp32 copies); optimizer: the inner
    optimizer's state (Adam moments); grads: gradients/partitions still referenced by the params
    or by ZeRO's flat partition buffers.
    """
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    p_map = _storage_bytes(params)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    opt_params = [p for g in inner.param_groups for p in g["params"]]
    # ZeRO-3 hands its fp32 partitions to the inner optimizer only during step(); read them directly.
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        opt_params += list(getattr(engine.optimizer, attr, None) or [])
    m_map = {k: v for k, v in _storage_bytes(opt_params).items() if k not in p_map}
    states = [v for s in inner.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    o_map = _storage_bytes(states)
    grads = [p.grad for p in engine.module.parameters()] + [p.grad for p in opt_params]
    g_map = {k: v for k, v in _storage_bytes(grads).items() if k not in p_map and k not in m_map}
    return {"params": sum(p_map.values()), "master": sum(m_map.values()),
            "optimizer": sum(o_map.values()), "grads": sum(g_map.values()),
            "numel_local": sum(p.numel() for p in params)}


# An fp16 run that overflows this often in a row is broken (DeepSpeed halves the scale each time
# after the hysteresis: 2**16 reaches 1 in about 17 steps).
MAX_SKIPPED_STEPS = 40
COMPILE_WARMUP_STEPS = 2


def loss_scale(engine) -> float | None:
    """fp16's dynamic loss scale now; None without one (fp32, bf16)."""
    if not engine.fp16_enabled():
        return None
    return float(engine.optimizer.loss_scale)


def append_record(path: Path, record: RankRecord) -> None:
    """One JSON line, fsync'ed: whatever happens to the process next, this record is kept."""
    with open(path, "a") as f:
        f.write(json.dumps(record.to_dict()) + "\n")
        f.flush()
        os.fsync(f.fileno())


def failure_record(rank: int, exc: BaseException, event: str, **kw) -> RankRecord:
    return RankRecord(rank=rank, event=event, status="oom" if is_oom(exc) else "error",
                      error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:], **kw)


class Rank:
    def __init__(self, spec: dict):
        import deepspeed
        import torch

        from zero_bench.config import BenchConfig
        from zero_bench.model import build_gpt, init_parallel, install_checkpointing

        self.spec = spec
        self.cfg = BenchConfig.from_dict(spec["config"])
        self.on_cpu = self.cfg.hardware.device == "cpu"
        self.out = Path(spec["out_dir"])
        self.marks = Marks()
        self.torch = torch
        deepspeed.init_distributed()
        self.rank = torch.distributed.get_rank()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.log_path = self.out / f"rank{self.rank}.jsonl"
        self.gpu = None
        if not self.on_cpu:
            from zero_bench.gpu import RankGpu

            # Emulate a smaller card: allocations past the fraction raise a real CUDA OOM.
            self.gpu = RankGpu(torch, self.local_rank, spec.get("capacity_bytes"))
            self.gpu.emulate()
        start = RankRecord(rank=self.rank, event="start", pid=os.getpid(), host=os.uname().nodename,
                           local_rank=self.local_rank, node_rank=int(os.environ.get("CROSS_RANK", 0)),
                           **(self.gpu.record() if self.gpu else {}))
        self._emit(start)
        mpu = init_parallel(self.cfg.parallel.tp, self.cfg.seed, self.on_cpu)
        ds_config = json.loads(Path(spec["ds_config"]).read_text())
        install_checkpointing(self.cfg, mpu, ds_config)
        # ZeRO-3 partitions each parameter as its module is built: no rank ever holds the whole model.
        with deepspeed.zero.Init(config_dict_or_path=ds_config, mpu=mpu, enabled=self.cfg.zero == 3):
            model = build_gpt(self.cfg, self.on_cpu)
        self.zero_init = all(hasattr(p, "ds_id") for p in model.parameters())
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config, mpu=mpu)
        if self.gpu:
            self.gpu.emulate()  # again, now that NCCL's buffers exist
        self.compile_s = None
        if self.cfg.compile:
            self.engine.compile()  # torch.compile runs lazily, in the first step of each new shape
        self.device = torch.device("cpu") if self.on_cpu else torch.device("cuda", self.local_rank)
        self.states = None
        self.applied = self.applied_any = False  # was the last / any optimizer step applied

    # -- records -------------------------------------------------------------------------------
    def _emit(self, record: RankRecord) -> None:
        append_record(self.log_path, record)

    # -- one optimizer step ---------------------------------------------------------------------
    def _batch(self, micro: int):
        m = self.cfg.model
        g = self.torch.Generator().manual_seed(self.cfg.seed + self.engine.global_steps)
        tokens = self.torch.randint(0, m.vocab_size, (micro, m.seq_len + 1), generator=g)
        tokens = tokens.to(self.device)
        pos = self.torch.arange(m.seq_len, device=self.device).unsqueeze(0).expand(micro, -1)
        return tokens[:, :-1].contiguous(), pos, tokens[:, 1:].contiguous()

    def _causal_mask(self):
        # megatron's default mask is built with device="cuda"; pass our own (True = masked out).
        if getattr(self, "_mask", None) is None:
            s = self.cfg.model.seq_len
            self._mask = self.torch.triu(self.torch.ones(s, s, dtype=self.torch.bool, device=self.device),
                                         diagonal=1)[None, None]
        return self._mask

    def _sync(self) -> None:
        if not self.on_cpu:
            self.torch.cuda.synchronize()
        self.torch.distributed.barrier()

    def step(self, micro: int) -> tuple[float, float]:
        """One optimizer step (grad_accum micro-steps); returns (seconds, mean loss)."""
        self._maybe_inject(micro)
        self._sync()
        t0 = time.perf_counter()
        losses = []
        for _ in range(self.cfg.batch.grad_accum):
            inputs, pos, labels = self._batch(micro)
            self.marks("forward")
            loss = self.engine(inputs, pos, self._causal_mask(), labels=labels).float().mean()
            self.marks("backward")
            self.engine.backward(loss)
            self.marks("step")
            self.engine.step()
            losses.append(loss.item())
        self._sync()
        self.marks("idle")
        self._note_applied()
        return time.perf_counter() - t0, sum(losses) / len(losses)

    def _note_applied(self) -> None:
        # fp16: an overflow makes DeepSpeed skip the update and lower the loss scale.
        self.applied = self.engine.was_step_applied()
        self.applied_any = self.applied_any or self.applied

    def _maybe_inject(self, micro: int) -> None:
        """Fault injection for tests: `fault={rank: R, kind: raise|oom|kill|hang, min_micro: M}`."""
        f = self.cfg.fault
        if not f or f.get("rank", 1) != self.rank or micro < f.get("min_micro", 1):
            return
        if f["kind"] == "raise":
            raise RuntimeError(f"injected fault on rank {self.rank}")
        if f["kind"] == "oom":  # a real allocator failure, as an oversized batch would cause
            self.torch.empty(1 << 60, dtype=self.torch.uint8, device=self.device)
        if f["kind"] == "kill":  # what the kernel's OOM killer does
            os.kill(os.getpid(), signal.SIGKILL)
        if f["kind"] == "hang":  # a rank stuck in a collective that never completes
            time.sleep(1e6)

    # -- memory ---------------------------------------------------------------------------------
    def profiled_step(self, micro: int) -> tuple[float, float, int, str]:
        """A step whose peak live-tensor bytes are measured: (seconds, loss, peak bytes, phase).

        CPU: the live bytes at the start (gc walk) plus the largest net allocation the profiler's
        memory events show during the step; frees of blocks allocated before the profiler started
        are invisible to it, so this errs high, never low. GPU: torch's own peak counter.
        """
        torch = self.torch
        if not self.on_cpu:
            torch.cuda.reset_peak_memory_stats()
            secs, loss = self.step(micro)
            return secs, loss, torch.cuda.max_memory_allocated(), ""
        from torch.profiler import ProfilerActivity, profile

        base = live_tensor_bytes()
        first = len(self.marks.marks)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            secs, loss = self.step(micro)
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]")
        cur = peak = 0
        t_peak = None
        for t, n in events:
            cur += n
            if cur > peak:
                peak, t_peak = cur, t
        phase = "forward"
        if t_peak is not None:
            # Profiler clock and time.time() agree closely enough to name the phase.
            for t, ph in self.marks.marks[first:]:
                if t * 1e9 <= t_peak:
                    phase = ph
        return secs, loss, base + peak, phase

    def memory_now(self) -> dict:
        out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "host": os.uname().nodename}
        if not self.on_cpu:
            out["torch_peak_allocated"] = self.torch.cuda.max_memory_allocated()
            out["torch_peak_reserved"] = self.torch.cuda.max_memory_reserved()
            out.update(self.gpu.record())
        return out

    # -- plan -----------------------------------------------------------------------------------
    def run_entry(self, micro: int, mode: str) -> RankRecord:
        steps = self.cfg.steps
        n_warm = steps.warmup if mode == "measure" else steps.probe
        n_timed = steps.timed if mode == "measure" else 0
        if self.cfg.compile and n_timed:
            # Compiled, the first two steps compile: the second recompiles once, because megatron's
            # scratch buffer (a guarded dict) exists only after the first.
            n_warm = max(n_warm, COMPILE_WARMUP_STEPS)
        if not self.on_cpu:
            self.torch.cuda.reset_peak_memory_stats()
            self.gpu.reset_peak()
        losses, times, warm = [], [], []
        skipped = 0
        for i in range(n_warm + n_timed):
            secs, loss = self.step(micro)
            losses.append(loss)
            skipped += not self.applied
            if i < n_warm:
                warm.append(secs)
            elif self.applied:  # time/it counts applied steps only (fp16 overflows skip)
                times.append(secs)
        if self.cfg.compile and times and self.compile_s is None:
            # What compiling cost: the warm-up's time beyond steady steps (first measured entry).
            steady = statistics.median(times)
            self.compile_s = sum(max(0.0, w - steady) for w in warm)
        # Optimizer state is allocated at the first update: with fp16, go on until one was applied.
        while not self.applied_any and skipped < MAX_SKIPPED_STEPS:
            secs, loss = self.step(micro)
            losses.append(loss)
            skipped += not self.applied
        if self.states is None:  # model states exist once the first optimizer step has run
            self.states = model_state_bytes(self.engine)
        secs, loss, peak_live, phase = self.profiled_step(micro)
        skipped += not self.applied
        losses.append(loss)
        if not times:
            times.append(secs)
        return RankRecord(rank=self.rank, event="end", status="ok", micro=micro, mode=mode, loss=losses[-1],
                          losses=losses, step_times=times, time_per_step=statistics.median(times),
                          peak_live_bytes=peak_live, peak_phase=phase, model_states=self.states,
                          loss_scale=loss_scale(self.engine), skipped_steps=skipped, compile_s=self.compile_s,
                          zero_init=self.zero_init, marks=self.marks.marks, **self.memory_now())

    def over_capacity(self, rec: RankRecord) -> bool:
        """All ranks agree (max all-reduce) whether any rank's peak passed the capacity."""
        over = over_capacity(compared_peak(rec, self.cfg.hardware.device), self.spec.get("capacity_bytes"))
        flag = self.torch.tensor([1.0 if over else 0.0], device=self.device)
        self.torch.distributed.all_reduce(flag, op=self.torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def run(self) -> None:
        for entry in self.spec["plan"]:
            micro, mode = entry["micro"], entry["mode"]
            self._emit(RankRecord(rank=self.rank, event="begin", micro=micro, mode=mode))
            try:
                rec = self.run_entry(micro, mode)
            except BaseException as exc:  # noqa: BLE001 - every failure must be recorded
                kind = "oom" if is_oom(exc) else "error"
                self._emit(failure_record(self.rank, exc, "end", micro=micro, mode=mode,
                                          marks=self.marks.marks[-50:]))
                # Peers may wait in a collective we will never join: leave, the launcher ends them.
                os._exit(OOM_EXIT if kind == "oom" else 1)
            over = self.over_capacity(rec)
            self._emit(dataclasses.replace(rec, status="over_capacity" if over else "ok"))
            self.marks.marks = self.marks.marks[-1:]
            if over:
                break


def watch_parent() -> None:
    """End this rank when the process that ran the trial is gone (e.g. a sweep killed with SIGKILL):
    the launcher runs in its own session, so nothing else would stop an orphaned rank."""
    import threading

    pid = int(os.environ.get("ZERO_BENCH_PARENT_PID", 0))
    if not pid:
        return

    def watch():
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="zero_bench-parent-watch").start()


def adopt_launcher_env() -> None:
    """openmpi / slurm start ranks with their own variables; torch.distributed reads RANK & co."""
    if "RANK" in os.environ:
        return
    for prefix, names in (("OMPI_COMM_WORLD_", ("RANK", "SIZE", "LOCAL_RANK", None)),
                          ("SLURM_", ("PROCID", "NTASKS", "LOCALID", "NODEID"))):
        if prefix + names[0] in os.environ:
            for ours, theirs in zip(("RANK", "WORLD_SIZE", "LOCAL_RANK", "CROSS_RANK"), names):
                if theirs and prefix + theirs in os.environ:
                    os.environ.setdefault(ours, os.environ[prefix + theirs])
            return


def main(argv=None) -> None:
    from zero_bench.gpu import select_devices

    select_devices()  # before anything starts CUDA
    adopt_launcher_env()
    watch_parent()
    ap = argparse.ArgumentParser(description=__doc__)
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--spec", help="run this trial spec, then exit")
    how.add_argument("--pool", help="serve trial requests in this folder, one forked child each")
    args = ap.parse_args(argv)
    if args.pool:
        from zero_bench.pool_rank import serve

        serve(Path(args.pool))
    run_spec(json.loads(Path(args.spec).read_text()))


def run_spec(spec: dict) -> NoReturn:
    """Run one trial's plan in this process and end it (a fresh launch, or a pool's forked child)."""
    try:
        rank = Rank(spec)
    except BaseException as exc:  # noqa: BLE001 - an init failure is a result ("cannot initialize")
        r = int(os.environ.get("RANK", "0"))
        append_record(Path(spec["out_dir"]) / f"rank{r}.jsonl", failure_record(r, exc, "init_failed"))
        os._exit(OOM_EXIT if is_oom(exc) else 1)
    rank.run()
    rank._emit(RankRecord(rank=rank.rank, event="done"))
    # Skip interpreter teardown of process groups and threads: it can hang on gloo.
    os._exit(0)


if __name__ == "__main__":
    main()
