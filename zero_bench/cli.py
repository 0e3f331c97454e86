"""Entry point: `zero_bench [run|maxbatch|report|estimate|doctor] [hydra overrides]`.

Exit codes: see zero_bench.commands (and `zero_bench --help`).

One Hydra app serves every sub-command (a `command` key), so `python -m zero_bench ...`,
`zero_bench run ...` and Hydra's multirun (`-m zero=0,1,2,3`) all compose the same config.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from zero_bench.config import CONF_DIR, ConfigError
from zero_bench.errors import MachineBusy


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_group_overrides(overrides: list[str]) -> None:
    """Hydra's own error for an unknown option is a multi-line traceback; say it in one line."""
    for ov in overrides:
        key, _, value = ov.lstrip("~+").partition("=")
        if key in ("model", "parallel", "hardware", "sweep", "ds_preset") and value and "," not in value:
            if value not in group_options(key):
                raise ConfigError(f"{key}={value}: unknown option; allowed: {', '.join(group_options(key))}")


COMMANDS = ("run", "maxbatch", "report", "estimate", "doctor", "status")


def _output_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


# The worst exit code of the jobs this process ran (a multirun runs several in one process).
_exit = {"code": 0}


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def app(cfg: DictConfig) -> None:
    from zero_bench import commands

    try:
        code = getattr(commands, cfg.command)(cfg, _output_dir())
    except ConfigError as exc:
        # One line, no traceback, before any launch.
        print(f"zero_bench: error: {exc}", file=sys.stderr)
        raise SystemExit(commands.BAD_INPUT)
    except MachineBusy as exc:
        print(f"zero_bench: error: {exc}", file=sys.stderr)
        raise SystemExit(commands.BUSY)
    _exit["code"] = max(_exit["code"], code if isinstance(code, int) else 0)


def sweep_size(args: list[str]) -> int:
    """Jobs a multirun will launch: the product of swept values (command line over preset)."""
    import math

    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params: dict[str, int] = {}
    for a in args:
        if a.startswith("+sweep="):
            preset = yaml.safe_load((CONF_DIR / "sweep" / f"{a.split('=', 1)[1]}.yaml").read_text())
            for k, v in ((preset.get("hydra") or {}).get("sweeper") or {}).get("params", {}).items():
                params[k] = len(str(v).split(","))
    for o in OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")]):
        if o.is_sweep_override():
            params[o.key_or_group] = len(list(o.sweep_iterator()))
    return math.prod(params.values()) if params else 1


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args and args[0] in COMMANDS else "run"
    if command == "status" and args and "=" not in args[0] and not args[0].startswith("-"):
        args[0] = f"+status_dir={args[0]}"  # `zero_bench status <sweep dir>`
    args = ["json=true" if a == "--json" else a for a in args]
    try:
        check_group_overrides(args)
    except ConfigError as exc:
        print(f"zero_bench: error: {exc}", file=sys.stderr)
        raise SystemExit(2)
    if any(a in ("-m", "--multirun") or a.startswith("+sweep=") for a in args):
        os.environ["ZERO_BENCH_SWEEP_TOTAL"] = str(sweep_size(args))
        os.environ["ZERO_BENCH_SWEEP_T0"] = str(time.time())
    sys.argv = [sys.argv[0], *args, f"command={command}"]  # after flags: argparse wants positionals together
    try:
        app()
    finally:
        from zero_bench.commands import close_sweep_pools

        close_sweep_pools()  # a multirun's shared pool ends with the sweep
    if _exit["code"]:
        raise SystemExit(_exit["code"])


if __name__ == "__main__":
    main()
