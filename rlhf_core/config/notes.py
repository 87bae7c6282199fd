"""Notes about a config that the user reads once: a renamed key, a verl key with no effect here, a
fall-back to what this machine can do. A config is loaded several times per run (CLI, flow, each
stage), so each line is logged once per process, on the ``rlhf.config`` logger."""

from __future__ import annotations

import logging

log = logging.getLogger("rlhf.config")
_SAID: set[str] = set()


def say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        log.warning(line)


def said() -> list[str]:
    """Every note said so far in this process (for tests and the run's closing summary)."""
    return sorted(_SAID)
