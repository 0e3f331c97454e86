"""Errors the user sees as one line (cli.py prints them and exits with the code named here)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad key or value; its message is the one line the user sees (exit code 2)."""


class MachineBusy(RuntimeError):
    """Another zero_bench process runs trials on this machine (exit code 5)."""
