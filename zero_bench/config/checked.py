"""A plain dict (a composed config, a stored record) checked against a dataclass of the schema and
turned into one: an unknown key or a bad value is one line naming the key and what is allowed
(OmegaConf's errors in zero_bench's words); the stored configs' migrations live here too. No
dataclass of the schema is named here, so schema.py and configure.py both build on it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from zero_bench.errors import ConfigError


def composition_error(exc: BaseException, overrides: list[str]) -> str:
    """One line for an exception Hydra raised while composing: the key, the value, what is allowed."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    cause = exc
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    key = getattr(cause, "full_key", None)
    if key and isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return f"{key}: unknown key; `zero_bench --help` lists the keys"
    if key and isinstance(cause, OmegaConfBaseException):
        given = next((o.lstrip("+~").partition("=")[2] for o in overrides
                      if o.lstrip("+~").partition("=")[0] == key), None)
        return f"{key}={given if given is not None else getattr(cause, 'value', '?')}: {_allowed(cause)}"
    if text.startswith("Could not override '"):  # a key the schema does not have
        return f"{text.split(chr(39))[1]}: unknown key; `zero_bench --help` lists the keys"
    return text


def _allowed(cause: BaseException) -> str:
    """What OmegaConf wanted, in zero_bench's words."""
    msg = str(cause).strip().splitlines()[0]
    if "expected one of" in msg:
        return "allowed values are " + msg.split("[", 1)[1].rstrip("]").strip()
    for kind, words in (("Integer", "must be an integer"), ("Boolean", "allowed values are true, false"),
                        ("valid bool", "allowed values are true, false"), ("Float", "must be a number")):
        if kind in msg:
            return words
    return msg


def migrated(d: dict) -> dict:
    """A stored config with the keys older versions of zero_bench wrote under other names or shapes
    mapped to today's: the one place these migrations live (BenchConfig.from_dict, stored_config)."""
    d = dict(d)
    if "offload_optimizer" in d:  # the field's name before it matched the user's key
        d["offload"] = d.pop("offload_optimizer")
    if isinstance(d.get("ds_preset"), dict):  # once a config group {name: ...}
        d["ds_preset"] = d["ds_preset"].get("name", "default")
    par = d.get("parallel")
    if isinstance(par, dict) and "sequence_parallel" not in par and (par.get("tp") or 1) > 1:
        d["parallel"] = {**par, "sequence_parallel": False}  # stored before the key: tp > 1 ran without it
    return d


def structured(cls, values: dict, prefix: str = "") -> Any:
    """`values` (a plain dict; `prefix` names its section in messages) checked against dataclass `cls`
    and turned into an instance of it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    check_known(values, cls, prefix)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    except MissingMandatoryValue as exc:
        raise ConfigError(f"{prefix}{exc.full_key}: missing; the preset or an override must set it") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(prefix + composition_error(exc, [])) from None


def check_known(values: dict, cls, prefix: str = "") -> None:
    """An unknown key (`+model.foo=1`, a typo in a preset) is an error, not silently dropped."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k, v in values.items():
        if k not in fields:
            raise ConfigError(f"{prefix}{k}: unknown key; allowed: {', '.join(fields)}")
        kind = _dataclass_of(cls, k)
        if kind is not None and isinstance(v, dict):
            check_known(v, kind, f"{prefix}{k}.")


def known_only(values: dict, cls) -> dict:
    """`values` without the keys `cls` does not have (a record written by another version)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for k, v in values.items():
        if k in fields:
            kind = _dataclass_of(cls, k)
            out[k] = known_only(v, kind) if kind is not None and isinstance(v, dict) else v
    return out


def _dataclass_of(cls, name: str):
    """The dataclass type of a field (annotations are strings under `from __future__ import annotations`)."""
    hint = _hints(cls).get(name)
    return hint if dataclasses.is_dataclass(hint) else None


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    """typing.get_type_hints, once per class: the report reads every stored config through the schema."""
    import typing

    return typing.get_type_hints(cls)
