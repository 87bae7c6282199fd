"""Every key of the schema says why its default is what it is (issue 18: 18 keys said only "seed.").

The reason is the docstring under the field (rlhf_core/config/schema.py). A key named after verl's
says whether its default is verl's; a key of ours says what the value buys. A section (a field
whose value is another dataclass) is explained by its own fields.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from rlhf_core import notes
from rlhf_core.config import load_config, schema

REPO = Path(__file__).resolve().parents[3]

MIN_WORDS = 5
"""Fewer words than this cannot both name the default's source and give a reason ("verl.", "seed.")."""
PLACEHOLDERS = {"seed", "verl", "todo", "tbd", "default", "see above"}


def _reasons() -> dict[str, str | None]:
    """``Class.field`` → the docstring under it (None when there is none), for every leaf field."""
    tree = ast.parse(open(schema.__file__, encoding="utf-8").read())
    out: dict[str, str | None] = {}
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        sections = _section_fields(getattr(schema, cls.name))
        for i, node in enumerate(cls.body):
            if not isinstance(node, ast.AnnAssign) or node.target.id in sections:
                continue
            after = cls.body[i + 1] if i + 1 < len(cls.body) else None
            is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str)
            out[f"{cls.name}.{node.target.id}"] = after.value.value if is_doc else None
    return out


def _section_fields(cls) -> set[str]:
    """Fields whose value is a nested section (their reasons live on the section's own fields)."""
    if not dataclasses.is_dataclass(cls):
        return set()
    return {f.name for f in dataclasses.fields(cls)
            if f.default_factory is not dataclasses.MISSING and isinstance(f.default_factory(), schema.Section)}


def _placeholder(reason: str | None) -> bool:
    if reason is None:
        return True
    words = re.findall(r"[A-Za-z][\w'’.-]*", reason)
    return len(words) < MIN_WORDS or reason.strip().rstrip(".:").lower() in PLACEHOLDERS


def test_every_key_gives_the_reason_for_its_default():
    reasons = _reasons()
    assert len(reasons) > 150  # every leaf key of every section was read
    missing = [f"{key}: {reason!r}" for key, reason in reasons.items() if _placeholder(reason)]
    assert not missing, "keys without a reason for their default:\n" + "\n".join(missing)


def test_the_check_catches_a_placeholder():
    assert _placeholder("seed.") and _placeholder("verl.") and _placeholder(None) and _placeholder("0 = greedy.")
    assert not _placeholder("verl's default; gradient clipping at norm 1 keeps early steps stable.")


def test_trust_remote_code_is_named_as_having_no_effect():
    # the reason above says "no effect here": a pasted verl command that sets it is told so once
    load_config(REPO / "configs" / "demo.yaml", ["critic.model.trust_remote_code=true"])
    assert any("critic.model.trust_remote_code=true has no effect" in line for line in notes.said())
