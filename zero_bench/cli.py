"""Entry point: `zero_bench [run|maxbatch|maxseq|report|estimate|doctor|status|calibrate] [hydra overrides]`.

One Hydra app serves every sub-command (the `command` key), so `python -m zero_bench ...`,
`zero_bench run ...` and Hydra's multirun (`-m zero=0,1,2,3`) compose the same config. Before Hydra
starts, the overrides are composed once per swept value and checked (`precheck`): a bad key or
value is one line and exit 2 for every sub-command, before anything is launched, instead of
Hydra's multi-line error. Exit codes: zero_bench.commands.subcommands (and `zero_bench --help`).
"""
from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Optional

from zero_bench.commands.calibrate import DEFAULT_MODEL as CALIBRATE_MODEL
from zero_bench.commands.subcommands import COMMANDS, Invocation
from zero_bench.config.configure import check_all, compose, keys_help
from zero_bench.config.schema import CONF_DIR
from zero_bench.errors import ConfigError, MachineBusy
from zero_bench.search.sweeps import current_sweep, swept_values
from zero_bench.trial.pool import PoolSlot

GROUPS = ("model", "parallel", "hardware", "sweep")
BAD_INPUT, BUSY = 2, 5
HEADER = """zero_bench [run|maxbatch|maxseq|report|estimate|doctor|status|calibrate] [key=value ...] [-m for a sweep]
  run       one trial at batch.micro          maxbatch  the largest global batch that fits
  maxseq    the longest model.seq_len that fits at batch.micro (1 unless given)
  report    store -> .xlsx / .csv / .md       estimate  predicted memory per rank, no launch
  doctor    what this machine can run         status    zero_bench status <sweep dir>: each job's state
  calibrate this machine's fixed terms, measured in one short launch (model=gpt-tiny unless given)
            and stored for the estimate"""
FOOTER = """Exit codes: 0 answered (maxbatch, maxseq: a boundary, or "does not fit" / "cannot initialize");
2 bad input (one line names the key and what is allowed); 3 run: the trial did not fit;
4 a trial or search ended in error, timeout, flaky or incomplete; 5 another zero_bench holds
this machine's trial lock (DeepSpeed's cleanup would kill each other's trials).
Hydra's own flags: --hydra-help; `python -m zero_bench --cfg job` prints the composed config (the flag
anywhere on the line; with model=hf, the fields config.json resolved to)."""


def help_text() -> str:
    groups = [f"  {g}={'|'.join(group_options(g))}" for g in GROUPS]
    return "\n".join([HEADER, "", "Presets (conf/):", *groups, "", "Keys (key=default (choices)  meaning):",
                       *keys_help(), "", FOOTER])


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_group_overrides(overrides: list[str]) -> None:
    """Hydra's own error for an unknown preset is a multi-line traceback; say it in one line."""
    for ov in overrides:
        key, _, value = ov.lstrip("~+").partition("=")
        if key in GROUPS and value:
            for v in value.split(","):
                if v not in group_options(key):
                    raise ConfigError(f"{key}={v}: unknown option; allowed: {', '.join(group_options(key))}")


def precheck(overrides: list[str]) -> None:
    """Compose the config as each job of the command line would get it (each swept value in turn,
    the other keys at their first value) and check every section's values, whatever the
    sub-command uses. Checks across keys are left to the jobs: in a grid, a failing combination is
    recorded as skipped."""
    check_group_overrides(overrides)
    ours = [o for o in overrides if "=" in o and not o.startswith("-") and not o.lstrip("+~").startswith("hydra")]
    swept = swept_values(ours)
    first = [o for o in ours if o.lstrip("+~").partition("=")[0] not in swept]
    variants = [first + [f"{k}={vs[0]}" for k, vs in swept.items()]]
    for key, values in swept.items():
        others = [f"{k}={vs[0]}" for k, vs in swept.items() if k != key]
        variants += [first + others + [f"{key}={v}"] for v in values[1:]]
    for variant in variants:
        check_all(compose(variant))


def fail(exc: Exception, code: int) -> None:
    print(f"zero_bench: error: {exc}", file=sys.stderr)
    raise SystemExit(code)


class Session:
    """This process's run of Hydra: one job, or the jobs of a multirun Hydra runs here; the pool they
    share (the ranks are launched once per sweep) and the worst exit code among them."""

    def __init__(self, explicit: frozenset):
        self.explicit = explicit
        self.exit_code = 0
        self.pools = None  # pool.PoolSlot, started by the first in-process multirun job that needs it
        self.said: set = set()  # warnings printed by its jobs: each once per command (commands.warn_once)

    def job(self, cfg) -> None:
        from hydra.core.hydra_config import HydraConfig

        sweep = current_sweep(self._pools(HydraConfig.get()))
        inv = Invocation(out=Path(HydraConfig.get().runtime.output_dir), sweep=sweep, explicit=self.explicit,
                         said=self.said)
        try:
            code = COMMANDS[cfg.command](cfg, inv)
        except ConfigError as exc:  # one line, no traceback, before any launch
            fail(exc, BAD_INPUT)
        except MachineBusy as exc:
            fail(exc, BUSY)
        self.exit_code = max(self.exit_code, code)

    def _pools(self, hc):
        from hydra.types import RunMode

        if hc.mode == RunMode.MULTIRUN and self.pools is None:
            self.pools = PoolSlot(Path(hc.sweep.dir).resolve() / "pool")
        return self.pools

    def close(self) -> None:
        if self.pools is not None:
            self.pools.close()


COMMAND_NAMES = ("run", "maxbatch", "maxseq", "report", "estimate", "doctor", "status", "calibrate")


def unknown_command(word: str) -> ConfigError:
    """A first word that is no command, no override and no flag: a mistyped command (Hydra would
    print its override grammar's error about it)."""
    close = difflib.get_close_matches(word, COMMAND_NAMES, n=1)
    hint = f"; did you mean {close[0]}?" if close else ";"
    return ConfigError(f"unknown command '{word}'{hint} commands: {', '.join(COMMAND_NAMES)}")


def parse(argv: list[str]) -> tuple[str, list[str]]:
    """(sub-command, Hydra arguments). ConfigError for a first word that is neither a command nor
    an override (key=value, ~key) nor a flag."""
    args = list(argv)
    if args and args[0] not in COMMAND_NAMES and "=" not in args[0] and not args[0].startswith(("-", "~", "+")):
        raise unknown_command(args[0])
    command = args.pop(0) if args and args[0] in COMMAND_NAMES else "run"
    if command == "status" and args and "=" not in args[0] and not args[0].startswith("-"):
        args[0] = f"status_dir={args[0]}"  # `zero_bench status <sweep dir>`
    if command == "calibrate" and not any(a.lstrip("+~").startswith("model") for a in args):
        args.insert(0, f"model={CALIBRATE_MODEL}")  # a short launch, unless the user names the model
    return command, ["json=true" if a == "--json" else a for a in args]


# Hydra's flags that take a value (hydra-core 1.3, hydra/_internal/utils.py get_args_parser): the
# value moves with its flag when the command line is reordered; --info's is optional.
VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
               "-cd", "--experimental-rerun")
INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def split_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, the overrides), each in the order typed. Hydra's argparse
    takes the overrides as one positional run: an override typed after a flag (`... --cfg job`,
    or the `command=` main appends) was 'unrecognized arguments'."""
    flags, overrides, i = [], [], 0
    while i < len(args):
        a = args[i]
        takes = a in VALUE_FLAGS or (a in ("--info", "-i") and i + 1 < len(args) and args[i + 1] in INFO_CHOICES)
        if a.startswith("-"):
            flags += args[i:i + 2] if takes else [a]
            i += 2 if takes else 1
        else:
            overrides.append(a)
            i += 1
    return flags, overrides


def flag_value(flags: list[str], *names: str) -> Optional[str]:
    for i, f in enumerate(flags):
        key, eq, value = f.partition("=")
        if key in names:
            return value if eq else (flags[i + 1] if i + 1 < len(flags) else None)
    return None


def show_resolved_job(command: str, flags: list[str], overrides: list[str]) -> bool:
    """`--cfg job` with model.hf_config: the job's config with the fields config.json resolved to
    (Hydra's own print shows the hf preset's placeholders: name ???, gelu, layernorm). True when
    printed; a sweep or --package is left to Hydra."""
    from omegaconf import OmegaConf

    from zero_bench.config.configure import _plain, with_hf_model

    if flag_value(flags, "--cfg", "-c") != "job" or flag_value(flags, "--package", "-p") or swept_values(overrides):
        return False
    plain = _plain(compose([*overrides, f"command={command}"]))
    if (plain.get("model") or {}).get("hf_config") is None:
        return False
    sys.stdout.write(OmegaConf.to_yaml(OmegaConf.create(with_hf_model(plain))))
    return True


def main(argv: Optional[list[str]] = None) -> None:
    import hydra

    try:
        command, args = parse(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        fail(exc, BAD_INPUT)
    if any(a in ("--help", "-h") for a in args):
        print(help_text())
        return
    flags, overrides = split_flags(args)
    if not any(a in ("--hydra-help", "--info", "-i") for a in flags):
        try:
            precheck(overrides)
            if show_resolved_job(command, flags, overrides):
                return
        except ConfigError as exc:
            fail(exc, BAD_INPUT)
    session = Session(frozenset(a.lstrip("~+").partition("=")[0] for a in overrides if "=" in a))
    sys.argv = [sys.argv[0], *flags, *overrides, f"command={command}"]  # argparse wants positionals together

    @hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
    def app(cfg) -> None:
        session.job(cfg)

    try:
        app()
    finally:
        session.close()  # a multirun's shared pool ends with the sweep
    if session.exit_code:
        raise SystemExit(session.exit_code)


if __name__ == "__main__":
    main()
