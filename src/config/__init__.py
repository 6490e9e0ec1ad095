"""lbannpy.config: the run configuration (spec YAML and config.h5), one schema for both.

>>> from lbannpy.config import load_config, validate, apply_overrides
>>> cfg = load_config("config.h5")                      # doctest: +SKIP
>>> cfg = apply_overrides(cfg, ["trainer.steps=3"])     # doctest: +SKIP
>>> cfg = validate(cfg, ranks=4)                        # doctest: +SKIP

A config is a plain tree of dicts and lists in the normal form of :data:`SCHEMA` (every default filled);
``cfg["trainer"]["batch_size"]`` is always there. Every user error is a :class:`ConfigError` naming the key.
"""
from .checks import check_data, check_graph, check_memory, check_ranks, check_references, validate
from ..config_errors import ConfigError
from .io import FORMAT, VERSION, load_config, parse_yaml, read_h5, read_raw, save_config, to_yaml, write_h5
from .overrides import apply_overrides
from .schema import (COMMON_LAYER_KEYS, INPUT_NAME, INPUT_NAMES, LAYER_TYPES, SCHEMA, layer_params,
                     layer_type, layer_types, normalize, schema_text)


def parse_spec(spec) -> dict:
    """A parsed spec (dict) in normal form, with names, parents and cycles checked."""
    cfg = normalize(spec)
    check_references(cfg)
    return cfg


__all__ = ["ConfigError", "SCHEMA", "LAYER_TYPES", "COMMON_LAYER_KEYS", "INPUT_NAME", "INPUT_NAMES", "FORMAT",
           "VERSION",
           "apply_overrides", "check_data", "check_graph", "check_memory", "check_ranks", "check_references",
           "layer_params",
           "layer_type", "layer_types", "load_config", "normalize", "parse_spec", "parse_yaml", "read_h5",
           "read_raw", "save_config", "schema_text", "to_yaml", "validate", "write_h5"]
