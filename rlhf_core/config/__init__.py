"""Typed configuration (YAML presets + dotted overrides)."""

from rlhf_core.config.errors import ConfigError
from rlhf_core.config.loader import (
    apply_overrides,
    config_from_dict,
    config_hash,
    flatten,
    load_config,
    to_dict,
    to_yaml,
    valid_keys,
)
from rlhf_core.config.schema import RLHFConfig
from rlhf_core.config.validate import effective_deepspeed

__all__ = [
    "ConfigError", "RLHFConfig", "apply_overrides", "config_from_dict", "config_hash",
    "effective_deepspeed", "flatten", "load_config", "to_dict", "to_yaml", "valid_keys",
]
