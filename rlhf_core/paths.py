"""Where things live: the project root, the state directory, and how relative paths resolve."""

from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    """The checkout that holds data/ and configs/ (the package is installed editable from it)."""
    return Path(__file__).resolve().parent.parent


def state_dir() -> Path:
    """Project-local state (built models, MLflow store, Prefect home): $RLHF_HOME or ./.rlhf."""
    return Path(os.environ.get("RLHF_HOME", ".rlhf")).resolve()


def resolve_path(path: str | Path) -> Path:
    """A user path as given (absolute or relative to the current directory), else relative to the
    project root, so `data/arith/train.jsonl` works from anywhere inside or outside the checkout."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p.resolve()
    candidate = project_root() / p
    return candidate.resolve() if candidate.exists() else p.resolve()


def resolve_model_path(path: str) -> Path:
    """'tiny' → the locally built tiny model (built on first use); anything else → a local dir."""
    if path == "tiny":
        from rlhf_core.models.tiny import ensure_tiny_model

        return ensure_tiny_model(state_dir() / "models" / "tiny")
    resolved = resolve_path(path)
    if not resolved.exists():
        raise FileNotFoundError(
            f"model path {path!r} not found; give a local Hugging Face model directory "
            f"(no hub downloads here) or 'tiny' for the locally built tiny model"
        )
    return resolved
