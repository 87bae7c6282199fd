"""The run's config as a command continues it: config.yaml when its seal verifies, else the config the
newest committed iteration recorded, with the difference named in one line.

config.yaml is the run's config between iterations: a resume's overrides, a KL-breach retry's changes
and the filled-in training-step count are written there before any stage runs on them, sealed with a
hash of its content (``layout.write_config``). Every update also records the whole config it trained
with (``iter_k/state.json``). A config.yaml that no longer matches its seal — a lost line, a cut
section, a hand edit — would otherwise change training without a word (the schema's defaults filling
what is missing); instead a command continues with the config the newest committed iteration
recorded and says which keys differ. A key is changed on purpose by passing it on the command line
(`rlhf run --resume RUN KEY=VALUE`), which is then written, sealed, into config.yaml.

A directory written before seals existed (run format < 4) has an unsealed config.yaml: it is trusted
as it is and sealed by the format upgrade (``run.migrate``).
"""

from __future__ import annotations

from typing import Any, Optional

import yaml

try:  # yaml.safe_load's rules, in C: `rlhf status` reads config.yaml twice (0.16 s in Python)
    from yaml import CSafeLoader
except ImportError:  # a PyYAML built without libyaml
    from yaml import SafeLoader as CSafeLoader

from rlhf_core.config.loader import flatten_tree
from rlhf_core.run.layout import RunDir, StateFileError, read_config_text
from rlhf_core.run.lifecycle import committed_iterations
from rlhf_core.run.migrate import SEALED_FORMAT, current_config_tree, run_format

SHOWN_KEYS = 4
"""Differences named one by one in the warning; more are counted per section."""


def parse_config(text: str, where: Any) -> dict:
    """A config.yaml's text as a tree; text that is not a YAML mapping raises ``StateFileError``."""
    try:
        tree = yaml.load(text, Loader=CSafeLoader) or {}
    except yaml.YAMLError as exc:
        raise StateFileError(f"{where} is damaged (not YAML: {str(exc).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise StateFileError(f"{where} is damaged (not a mapping of sections)")
    return tree


def recorded_config_tree(run: RunDir) -> Optional[tuple[int, dict]]:
    """(k, config) of the newest committed iteration whose state record holds the config its update
    trained with; None before any."""
    try:
        committed = committed_iterations(run)
    except StateFileError:
        return None
    for k in reversed(committed):
        try:
            record = run.read_json(run.state_record(k))
        except StateFileError:
            continue
        if isinstance(record, dict) and isinstance(record.get("config"), dict):
            return k, current_config_tree(record["config"])
    return None


def differences(have: dict, recorded: dict) -> str:
    """The keys where ``have`` differs from ``recorded``, as one clause: the first few by name and
    value, the rest counted per section."""
    a, b = flatten_tree(have), flatten_tree(recorded)
    keys = sorted(k for k in set(a) | set(b) if a.get(k, _MISSING) != b.get(k, _MISSING))
    shown = [f"{k}: {_show(a.get(k, _MISSING))} in config.yaml, {_show(b.get(k, _MISSING))} recorded"
             for k in keys[:SHOWN_KEYS]]
    rest: dict[str, int] = {}
    for k in keys[SHOWN_KEYS:]:
        section = k.split(".")[0]
        rest[section] = rest.get(section, 0) + 1
    shown += [f"{n} more under {section}." for section, n in rest.items()]
    return "; ".join(shown) if shown else "no key differs"


class _Missing:
    def __repr__(self) -> str:
        return "missing"


_MISSING = _Missing()


def _show(value: Any) -> str:
    return "missing" if value is _MISSING else repr(value)


def run_config_tree(run: RunDir) -> tuple[dict, Optional[str]]:
    """(the config tree a command continues ``run`` with, a warning line or None): config.yaml when its
    seal verifies (or it predates seals), else the config the newest committed iteration recorded;
    either read without the keys of an older run format (``migrate.current_config_tree``)."""
    tree, warning = _run_config_tree(run)
    return current_config_tree(tree), warning


def _run_config_tree(run: RunDir) -> tuple[dict, Optional[str]]:
    text, problem = read_config_text(run)
    if problem is None or _predates_seals(run):
        return parse_config(text, run.config_path), None
    found = recorded_config_tree(run)
    if found is None:
        return (parse_config(text, run.config_path),
                f"{run.config_path} {problem}, and no committed iteration recorded its config to compare it with: "
                "it is used as it is")
    k, recorded = found
    try:
        have = current_config_tree(parse_config(text, run.config_path))
    except StateFileError:
        have = {}
    return recorded, (f"{run.config_path} {problem} ({differences(have, recorded)}): continuing with the config "
                      f"iteration {k} trained with ({run.state_record(k).relative_to(run.root)}); pass KEY=VALUE "
                      "on the command line to change a key on purpose")


def _predates_seals(run: RunDir) -> bool:
    try:
        return run_format(run) < SEALED_FORMAT
    except StateFileError:  # a damaged format.json: `rlhf status` names it, a writing command repairs it
        return False
