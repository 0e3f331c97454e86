"""Stored configs read back: the one reader of a TrialResult's or SearchResult's config (the report,
the estimate of a stored row, a trace of it), through the schema and the stored model's description."""
from __future__ import annotations

import dataclasses
import functools

from zero_bench.config.checked import composition_error, known_only, migrated
from zero_bench.config.schema import BenchConfig
from zero_bench.errors import ConfigError
from zero_bench.models import ModelConfig
from zero_bench.models.description import from_stored


def stored_config(d: dict) -> BenchConfig:
    """A stored config (TrialResult.config, SearchResult.config) as the report reads it, the one
    reader: its settings through the schema (BenchConfig.from_dict's migrations, defaults and
    types, so a key an old record lacks means what it means on resume), its model through
    models.description.from_stored (any version's keys). A skipped grid entry stores the composed
    config as given, whose model may not describe one: its model is then ModelConfig's unfilled
    defaults with the stored name (models.description.describes says which)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    values = known_only({k: v for k, v in migrated(d).items() if k != "model"}, BenchConfig)
    settings = [f.name for f in dataclasses.fields(BenchConfig) if f.name != "model"]
    try:
        merged = OmegaConf.merge(_schema(), values)
        read = OmegaConf.to_object(OmegaConf.masked_copy(merged, settings))
    except OmegaConfBaseException as exc:
        raise ConfigError(composition_error(exc, [])) from None
    stored = d.get("model") or {}
    model = from_stored(stored)
    if model is None:
        model = ModelConfig(name=str(stored.get("name", ModelConfig.name)))
    return BenchConfig(model=model, **read)


@functools.lru_cache(maxsize=1)
def _schema():
    """BenchConfig as an OmegaConf node, built once (OmegaConf.merge copies it, never changes it)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(BenchConfig)
