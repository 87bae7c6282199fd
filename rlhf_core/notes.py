"""Notes the user reads once: a renamed config key, a verl key with no effect here, a fall-back to
what this machine can do. Apart from ``rlhf_core.config`` so that modules which only read a run
(``rlhf query``) say them without loading the config's schema, and with it torch. A config is loaded several times per run (CLI, flow, each
stage), so each line is logged once per process, on the ``rlhf.config`` logger."""

from __future__ import annotations

import logging

log = logging.getLogger("rlhf.config")
_SAID: dict[str, str] = {}
"""topic -> the line said about it."""


def say_once(line: str, topic: str | None = None) -> None:
    """Log ``line`` unless this process said it already, or already said a line on ``topic`` (the same
    choice made for another role: the critic's dtype after the actor's)."""
    topic = line if topic is None else topic
    if topic not in _SAID:
        _SAID[topic] = line
        log.warning(line)


def said() -> list[str]:
    """Every note said so far in this process (for tests and the run's closing summary)."""
    return sorted(_SAID.values())
