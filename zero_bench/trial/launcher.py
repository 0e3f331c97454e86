"""How the deepspeed launcher is started and ended: its command line, the environment the ranks
start with (also for remote nodes), a free master port, and killing the whole tree afterwards.
Shared by a trial's own launch (zero_bench.trial.launch) and a search's pool (zero_bench.trial.pool).
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from zero_bench.config.hosts import check_hostfile, device_tokens, local_ranks, master_addr
from zero_bench.config.schema import BenchConfig, Device
from zero_bench.devices.cpu_features import onednn_limit, torch_capability
from zero_bench.devices.gpu import DEVICES_ENV
from zero_bench.devices.metrics import cache_dir
from zero_bench.devices.toolkit import extensions_dir
from zero_bench.engines import ds_config as dsc
from zero_bench.engines.specs import spec
from zero_bench.trial.sampler import RANK_MODULE

# Variables a remote rank needs from this process. Over pdsh/ssh only PYTHON*/UCX*/MV2*/MLFLOW*
# (and NCCL* on CUDA) pass by themselves; the rest must travel in the env file (DS_ENV_FILE).
REMOTE_PASS = ("LD_LIBRARY_PATH", "HF_HOME")  # CUDA_DEVICE_ORDER: gpu_order_env sets it everywhere

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial_env(cfg: BenchConfig) -> dict:
    """Environment of the rank processes (also written to the env file for remote nodes).

    PATH leads with this interpreter's bin directory (the venv: the `deepspeed` scripts and the ninja
    DeepSpeed's JIT ops are built with) on every node: remote commands start from a login shell of
    sshd/srun with its own PATH, and two ninja versions (pip's in the venv, the system's) do not
    read each other's build log, so ranks that alternate between them rebuild the op every time.
    Multi-node: library/cache paths set here are passed on. The working directory needs nothing:
    DeepSpeed's pdsh runner itself runs `cd <launch cwd>` on every node.
    """
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    if cfg.hardware.device == Device.cpu:
        # glibc keeps freed blocks otherwise and RSS hides what ZeRO frees (field notes).
        env.update(DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    else:
        env["DS_ACCELERATOR"] = "cuda"
        env["CUDA_MODULE_LOADING"] = cfg.hardware.cuda_module_loading.upper()  # the context the estimate sizes
        env.update(gpu_order_env(cfg))
        # TORCH_NCCL_ASYNC_ERROR_HANDLING stays torch's default (3, SkipCleanUp): its watchdog ends a
        # rank whose collective failed or timed out, without ncclCommAbort, which can itself hang
        # (ProcessGroupNCCL.hpp). No value makes a collective return early when a peer died: the
        # runner ends the peers of a failed rank itself (FAILURE_GRACE_S, PoolTrial.kill).
        tokens = device_tokens(cfg)
        if tokens is not None:
            # The exact GPUs, in the user's spelling (UUIDs and MIG too, which DeepSpeed's --include
            # cannot express): each rank sets CUDA_VISIBLE_DEVICES to this list and uses its local rank.
            env[DEVICES_ENV] = ",".join(tokens[:local_ranks(cfg)])
    env["TORCH_EXTENSIONS_DIR"] = extensions_dir()
    env["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
    env["PATH"] = venv_path()
    if cfg.hardware.hostfile:
        for k in REMOTE_PASS:
            if os.environ.get(k):
                env[k] = os.environ[k]
    return env


def gpu_order_env(cfg: BenchConfig) -> dict:
    """CUDA variables every GPU rank gets, whichever engine runs.

    CUDA_DEVICE_ORDER=PCI_BUS_ID: a GPU index means what nvidia-smi and NVML mean by it. CUDA's
    default order (FASTEST_FIRST) numbers mixed GPUs differently, while zero_bench resolves indices
    with NVML (PCI order, nvml.Nvml.resolve), and GPU UUIDs become NVML indices (gpu.select_devices):
    under one order for all three, a rank runs on, and is sampled on, the GPU the user named.
    CUDA_DEVICE_MAX_CONNECTIONS=1 where megatron's tensor-parallel overlap is all that overlaps
    (one_hardware_queue). A value the user exported is kept."""
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if one_hardware_queue(cfg):
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return env


def one_hardware_queue(cfg: BenchConfig) -> bool:
    """Whether the ranks get CUDA_DEVICE_MAX_CONNECTIONS=1: at tp > 1, unless the engine overlaps
    data-parallel collectives of its own with the compute (overlaps_data_parallel).

    What needs it in megatron-core 0.16.1, with the TransformerConfig zero_bench builds (no sequence
    parallelism, no tp_comm_overlap, which needs Transformer Engine, no gradient_accumulation_fusion):
    only ColumnParallelLinear's asynchronous all-reduce of the input gradient at tp > 1
    (allreduce_dgrad = tp > 1 and not sequence_parallel), which LinearWithGradAccumulationAnd-
    AsyncCommunication.backward issues before the weight-gradient GEMM it overlaps, "Here we rely on
    CUDA_DEVICE_MAX_CONNECTIONS=1" (tensor_parallel/layers.py): one hardware queue runs kernels in
    the order they were launched. It buys the overlap, not correctness ("necessary for a speedup but
    not for correctness", linear_with_grad_accumulation_and_async_allreduce's docstring).
    The same single queue makes every other stream wait behind the compute launched before it: the
    reduce-scatters and all-gathers FSDP2 and ZeRO-3 run on streams of their own, to overlap
    backward and forward, are serialized (torchtitan#1147; Megatron-LM's validate_args leaves the
    variable unset when tp > 1 meets FSDP, warning that the two want different values). So it is
    set only where megatron's overlap is the only one."""
    return cfg.hardware.device != Device.cpu and cfg.parallel.tp > 1 and not overlaps_data_parallel(cfg)


def overlaps_data_parallel(cfg: BenchConfig) -> bool:
    """Whether the engine runs data-parallel collectives on streams of their own during forward and
    backward. An engine that takes DeepSpeed's JSON: as that JSON says, in DeepSpeed 0.19.8's terms -
    ZeRO-3 always (parameter_offload.py's all-gather stream prefetches parameters; overlap_comm,
    on by default at stage 3, adds the reduce-and-partition stream), ZeRO-1/2 with overlap_comm
    (stage_1_and_2.py's reduction_stream; off by default, on in the megatron_deepspeed preset or
    with ds.zero_optimization.overlap_comm=true), ZeRO-0 never (its all-reduce follows backward on
    the compute stream). An engine without DeepSpeed's JSON is taken to overlap, as FSDP2 always
    does (its all-gather and reduce-scatter streams); there an unset variable costs at most
    megatron's dgrad overlap, a set one the engine's."""
    if not spec(cfg.engine).reads_ds_config:
        return True
    if cfg.zero == 3:
        return True
    overlap = (dsc.build(cfg).get("zero_optimization") or {}).get("overlap_comm")
    return cfg.zero in (1, 2) and bool(overlap)


def inductor_cache_dir() -> str:
    """Where torch.compile's kernels are cached for this CPU's kernel choice: a folder per torch
    capability and oneDNN limit, under TORCHINDUCTOR_CACHE_DIR where that is set (inductor itself
    sets it in a process that compiled, to its default /tmp/torchinductor_<user>), else under
    zero_bench's cache. Inductor's own cache does not tell kernels built under ATEN_CPU_CAPABILITY /
    ONEDNN_MAX_CPU_ISA from those built without: a compile=true trial that reused the other kind's
    aborted ("malloc(): unaligned tcache chunk detected", measured), and passed with a folder of its own."""
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(cache_dir() / "inductor")
    kind = f"{torch_capability()}-{onednn_limit() or 'unset'}".lower()
    return os.path.join(base, f"zero_bench-{kind}")


def venv_path() -> str:
    """PATH with this interpreter's bin directory first."""
    bin_dir = os.path.dirname(sys.executable)
    path = [p for p in os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep) if p]
    return os.pathsep.join([bin_dir] + [p for p in path if p != bin_dir])


def launcher_cmd(cfg: BenchConfig, target: Path, port: int, flag: str = "--spec") -> list[str]:
    """DeepSpeed's own launcher; a hostfile makes it a multi-node launch through hw.launcher.
    The ranks run `zero_bench.trial.rank --spec trial.json` (one trial) or `--pool DIR` (zero_bench.trial.pool).

    --no_ssh_check: DeepSpeed's pre-check runs a plain `ssh host hostname` that ignores the pdsh
    ssh options (port, -F config); a host that cannot be reached fails the launch anyway, with
    pdsh's message in stderr.log. Extra launcher flags (e.g. openmpi's --mca ...) come from
    ZERO_BENCH_LAUNCHER_ARGS.
    """
    hw = cfg.hardware
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(port)]
    if hw.hostfile:
        hosts = check_hostfile(cfg)
        ranks_per_node = cfg.parallel.world_size // hw.num_nodes
        cmd += ["--hostfile", hw.hostfile, "--num_nodes", str(hw.num_nodes), "--num_gpus",
                str(ranks_per_node), "--launcher", hw.launcher, "--no_ssh_check"]
        addr = master_addr(hosts)
        if addr:
            cmd += ["--master_addr", addr]
        if os.environ.get("ZERO_BENCH_LAUNCHER_ARGS"):
            cmd += ["--launcher_args", os.environ["ZERO_BENCH_LAUNCHER_ARGS"]]
    else:
        cmd += ["--num_gpus", str(cfg.parallel.world_size)]
    return cmd + ["--no_local_rank", "--module", RANK_MODULE, flag, str(target)]


def launch_env(cfg: BenchConfig, run_dir: Path, cmd: list[str]) -> tuple[dict, str]:
    """The launcher's environment and command line as text; writes the env file remote ranks read
    and cmd.txt (to re-run it by hand)."""
    ours = trial_env(cfg)
    env_file = run_dir / ".deepspeed_env"  # what remote ranks get (only PYTHON* passes otherwise)
    env_file.write_text("".join(f"{k}={v}\n" for k, v in ours.items()))
    env = {**os.environ, **ours, "DS_ENV_FILE": str(env_file)}
    # DeepSpeed's runner would turn CUDA_VISIBLE_DEVICES into --include (integers only) or
    # ignore it next to --num_gpus; the devices travel in DEVICES_ENV instead.
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if not cfg.hardware.hostfile:
        env["ZERO_BENCH_PARENT_PID"] = str(os.getpid())  # ranks end themselves if we are killed
    text = " ".join(f"{k}={shlex.quote(v)}" for k, v in ours.items()) + " " + shlex.join(cmd)
    (run_dir / "cmd.txt").write_text(text + "\n")
    return env, text


def kill_tree(proc: subprocess.Popen, known: list[psutil.Process], multi_node: bool = False) -> None:
    """SIGKILL the launch's process group and every worker the sampler saw (even if re-parented).

    Multi-node: SIGTERM the runner first, so DeepSpeed's own cleanup (pdsh pkill on every node)
    reaches the remote ranks before the local tree goes.
    """
    if multi_node and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in known:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
