"""The configuration error type, apart from the loader so that validation rules can raise it."""

from __future__ import annotations

from rlhf_core.errors import RLHFError


class ConfigError(RLHFError, ValueError):
    """A configuration problem; the message names the key and how to fix it."""
