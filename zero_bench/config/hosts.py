"""Where ranks run: the GPUs of a node, the hostfile DeepSpeed's launcher reads, the master address."""
from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
import dataclasses
import subprocess
from typing import Optional

from zero_bench.config.schema import BenchConfig
from zero_bench.errors import ConfigError


def local_ranks(cfg: BenchConfig) -> int:
    """Ranks on one node (the deepspeed launcher spreads them evenly)."""
    return max(1, cfg.parallel.world_size // max(1, cfg.hardware.num_nodes))


def read_hostfile(path: str) -> dict[str, int]:
    """host -> slots, in file order, parsed as DeepSpeed parses it (`host slots=N`, # comments)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        # DeepSpeed itself would warn and silently run on this host only.
        raise ConfigError(f"hardware.hostfile={path}: cannot read it ({exc.strerror})") from None
    hosts: dict[str, int] = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+)\s+slots=(\d+)", line)
        if not m:
            raise ConfigError(f"hardware.hostfile={path}: bad line {line!r}; expected 'HOST slots=N'")
        if m.group(1) in hosts:
            raise ConfigError(f"hardware.hostfile={path}: host {m.group(1)} listed twice")
        hosts[m.group(1)] = int(m.group(2))
    if not hosts:
        raise ConfigError(f"hardware.hostfile={path}: no 'HOST slots=N' line")
    return hosts


def check_hostfile(cfg: BenchConfig) -> dict[str, int]:
    """The hosts a multi-node launch will use; every mismatch with the config is one-line ConfigError."""
    hw, world = cfg.hardware, cfg.parallel.world_size
    hosts = read_hostfile(hw.hostfile)
    if hw.num_nodes > len(hosts):
        raise ConfigError(f"hardware.num_nodes={hw.num_nodes}: the hostfile {hw.hostfile} lists only "
                          f"{len(hosts)} hosts")
    if world % hw.num_nodes:
        raise ConfigError(f"hardware.num_nodes={hw.num_nodes}: must divide the world size tp*dp*pp={world}")
    per_node = world // hw.num_nodes
    used = dict(list(hosts.items())[:hw.num_nodes])
    short = {h: s for h, s in used.items() if s < per_node}
    if short:
        raise ConfigError(f"hardware.hostfile={hw.hostfile}: {per_node} ranks per node but "
                          + ", ".join(f"{h} has slots={s}" for h, s in short.items()))
    return used


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def master_addr(hosts: dict[str, int]) -> Optional[str]:
    """--master_addr for a multi-node launch, or None to let DeepSpeed find it.

    MASTER_ADDR from the environment wins (Slurm scripts set it); a first host written as an IP
    address is used as is. Otherwise DeepSpeed runs a plain `ssh <first host> hostname -I`, which
    ignores PDSH_SSH_ARGS_APPEND (ports, config files) - so prefer one of the two above.
    """
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    first = next(iter(hosts))
    return first if _is_ip(first) else None


def device_tokens(cfg: BenchConfig) -> Optional[list[str]]:
    """The GPUs ranks may use on each node, as CUDA_VISIBLE_DEVICES spells them, or None (0..N-1).

    hardware.devices wins; else this shell's CUDA_VISIBLE_DEVICES, on a single-node run only (on
    other nodes the launching shell's variable says nothing). Like CUDA, the list ends at "-1".
    """
    text = cfg.hardware.devices
    if text is None and not cfg.hardware.hostfile:
        text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    tokens = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok or tok == "-1":
            break
        tokens.append(tok)
    return tokens


def with_slurm_hostfile(cfg: BenchConfig, run_dir: Path) -> BenchConfig:
    """hardware.hostfile=slurm: the nodes of this Slurm allocation as a DeepSpeed hostfile.

    A job of a multi-node sweep (Hydra's submitit_slurm with nodes > 1) runs one zero_bench per
    allocation, which reaches the other nodes through DeepSpeed's launcher (pdsh over ssh, as
    launch/slurm_maxbatch.sbatch does); the first node is the master.
    """
    if cfg.hardware.hostfile != "slurm":
        return cfg
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ConfigError("hardware.hostfile=slurm: not inside a Slurm allocation (SLURM_JOB_NODELIST is unset)")
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               check=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(f"hardware.hostfile=slurm: `scontrol show hostnames` failed ({exc})") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "hostfile"
    path.write_text("".join(f"{h} slots={local_ranks(cfg)}\n" for h in hosts))
    os.environ.setdefault("MASTER_ADDR", hosts[0])
    return dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, hostfile=str(path)))
