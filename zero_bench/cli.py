"""Entry point: `zero_bench [run|maxbatch|report|estimate|doctor] [hydra overrides]`.

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

from zero_bench.config import CONF_DIR, ConfigError, check_group_overrides

COMMANDS = ("run", "maxbatch", "report", "estimate", "doctor")


def _output_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def app(cfg: DictConfig) -> None:
    from zero_bench import commands

    try:
        getattr(commands, cfg.command)(cfg, _output_dir())
    except ConfigError as exc:
        # One line, no traceback. Under -m the sweep goes on: maxbatch records such jobs as skipped.
        print(f"zero_bench: error: {exc}", file=sys.stderr)
        raise SystemExit(2)


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
    for o in OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")]):
        if o.is_sweep_override():
            params[o.key_or_group] = len(list(o.sweep_iterator()))
    return math.prod(params.values()) if params else 1


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args and args[0] in COMMANDS else "run"
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
    app()


if __name__ == "__main__":
    main()
