"""Entry point: `zero_bench [run|maxbatch|report|estimate|doctor] [hydra overrides]`.

One Hydra app serves every sub-command (a `command` key), so `python -m zero_bench ...`,
`zero_bench run ...` and Hydra's multirun (`-m zero=0,1,2,3`) all compose the same config.
"""
from __future__ import annotations

import sys
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


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args and args[0] in COMMANDS else "run"
    args = ["json=true" if a == "--json" else a for a in args]
    try:
        check_group_overrides(args)
    except ConfigError as exc:
        print(f"zero_bench: error: {exc}", file=sys.stderr)
        raise SystemExit(2)
    sys.argv = [sys.argv[0], f"command={command}", *args]
    app()


if __name__ == "__main__":
    main()
