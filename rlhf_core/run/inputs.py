"""A config's inputs checked before any work: one error listing every missing file, directory or model.

Used by every entry point that starts work (`rlhf run`, the pipeline flow, the retrain flow), so a
typo or a model missing from the local Hugging Face cache fails before a run directory, a Prefect
server or an MLflow run exists. Nothing here builds, downloads or writes.

A model folder that exists is looked into too (``model_folder_problem``), reading only file names,
config.json, the safetensors headers and the pickle opcodes of pytorch_model*.bin weights: an empty
folder, one without weights or without a tokenizer, weights that do not fit its config.json, or
pickled weights holding objects torch's safe loader refuses would otherwise fail deep inside
transformers (the last as two 100-line tracebacks), after a run directory and an MLflow run were
made (or load with random weights).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Optional

from rlhf_core.config import ConfigError, RLHFConfig
from rlhf_core.data.readers import data_file_problem
from rlhf_core.paths import TINY, locate_model, model_problem, resolve_path

MODEL = "model"
TOKENIZER = "tokenizer"
"""What a model key needs its folder to hold: the model (config.json and weights), the tokenizer."""

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
"""Any one of these (or a ``*.tiktoken`` file) is a tokenizer transformers can load."""
MUST_HOLD = {MODEL: "config.json with its model_type and the weights (*.safetensors, or pytorch_model*.bin "
                    "holding tensors only)",
             TOKENIZER: "the tokenizer (tokenizer.json, tokenizer.model or vocab.json with merges.txt, beside "
                        "tokenizer_config.json)"}


def model_keys(cfg: RLHFConfig) -> list[tuple[str, str]]:
    """(key, value) of every model or tokenizer name the config sets (unset ones are left out)."""
    return [(key, value) for key, value, _ in model_needs(cfg)]


def model_needs(cfg: RLHFConfig) -> list[tuple[str, str, tuple[str, ...]]]:
    """(key, value, what its folder must hold) of every model or tokenizer name the config sets: the
    actor's folder also gives the tokenizer unless actor_rollout_ref.model.tokenizer_path names one."""
    arr = cfg.actor_rollout_ref
    actor = (MODEL,) if arr.model.tokenizer_path else (MODEL, TOKENIZER)
    keys = [("actor_rollout_ref.model.path", arr.model.path, actor),
            ("actor_rollout_ref.model.tokenizer_path", arr.model.tokenizer_path, (TOKENIZER,)),
            ("actor_rollout_ref.ref.model_path", arr.ref.model_path, (MODEL,)),
            ("critic.model.path", cfg.critic.model.path, (MODEL,)),
            ("critic.model.tokenizer_path", cfg.critic.model.tokenizer_path, (TOKENIZER,))]
    if cfg.reward_model.enable:
        keys += [("reward_model.model.path", cfg.reward_model.model.path, (MODEL, TOKENIZER)),
                 ("reward_model.model.input_tokenizer", cfg.reward_model.model.input_tokenizer, (TOKENIZER,))]
    return [(key, value, needs) for key, value, needs in keys if value]


def model_folder_problem(folder: Path, needs: tuple[str, ...]) -> Optional[str]:
    """Why ``folder`` cannot serve as a model folder that holds ``needs`` (MODEL, TOKENIZER), in
    one line naming the folder, what it lacks and what such a folder must hold; None when it can.
    A peft adapter folder (adapter_config.json) is left to peft."""
    if (folder / "adapter_config.json").is_file():
        return None
    lacks = []
    if MODEL in needs:
        lacks += _model_lacks(folder)
    if TOKENIZER in needs and not _has_tokenizer(folder):
        lacks.append("no tokenizer files")
    if not lacks:
        return None
    held = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    shown = ", ".join(held[:8]) + (f" and {len(held) - 8} more" if len(held) > 8 else "") if held else "nothing"
    return (f"{folder} is not a usable model folder ({'; '.join(lacks)}; it holds {shown}); a model folder "
            f"must hold {' and '.join(MUST_HOLD[n] for n in needs)}, as `save_pretrained` writes them")


def _model_lacks(folder: Path) -> list[str]:
    lacks = []
    config = _read_config(folder / "config.json")
    if isinstance(config, str):
        lacks.append(config)
    weights = sorted(p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern))
    safetensors = [p for p in weights if p.suffix == ".safetensors"]
    if not weights:
        lacks.append("no weights")
    elif not safetensors:  # transformers reads the pickles, with torch's safe loader
        lacks += filter(None, map(_unsafe_pickle, weights))
    elif isinstance(config, dict):
        mismatch = _weights_mismatch(config, safetensors)
        if mismatch:
            lacks.append(mismatch)
    return lacks


def _unsafe_pickle(path: Path) -> Optional[str]:
    """What torch's safe loader (``weights_only=True``, the only way a pickle is read here) would
    refuse in the pickle ``path``: the Python objects besides tensors it holds, read from its pickle
    opcodes without running them; None when it holds tensors only. torch is imported here, for the
    rare model kept as a pickle, so that checking a run's inputs (``rlhf status``) costs no torch import."""
    import torch
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        refused = get_unsafe_globals_in_checkpoint(path)
    except ValueError:  # not torch's zip format (an old torch.save): its safe load tells
        try:
            torch.load(path, weights_only=True, map_location="meta")
            refused = []
        except Exception as exc:  # noqa: BLE001 — whatever the safe loader refuses, it refuses
            refused = re.findall(r"GLOBAL (\S+)", str(exc)) or [str(exc).splitlines()[0][:120]]
    except OSError as exc:
        return f"weights file {path.name} cannot be read ({exc})"
    if not refused:
        return None
    return (f"its weights {path.name} are a pickle holding Python objects besides tensors "
            f"({', '.join(sorted(set(refused))[:3])}), which the safe load refuses (a pickle can run code); "
            f"convert them to safetensors where you trust the file: torch.load it with weights_only=False and "
            f"save its tensors with safetensors.torch.save_file as model.safetensors beside config.json "
            f"(or `save_pretrained(folder, safe_serialization=True)` of the loaded model)")


def _read_config(path: Path) -> dict | str:
    """config.json as a dict, else what is wrong with it."""
    if not path.is_file():
        return "no config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"config.json is not readable JSON ({exc})"
    if not isinstance(config, dict) or not config.get("model_type"):
        return "config.json has no model_type"
    return config


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken"))


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name → shape, from a safetensors file's header alone (8-byte little-endian length,
    then that much JSON); raises ValueError when the header cannot be read."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > 100_000_000:
            raise ValueError(f"a header length of {length} bytes")
        header = json.loads(f.read(length))
    return {name: list(spec.get("shape", [])) for name, spec in header.items() if name != "__metadata__"}


def _weights_mismatch(config: dict, files: list[Path]) -> Optional[str]:
    """Whether the safetensors weights fit config.json: a token embedding of shape
    [vocab_size, hidden_size] must be among them. Weights of another model load with every
    mismatched tensor freshly initialised (or fail deep in transformers); this sees it from the
    headers. None when they fit, or when config.json does not say both sizes (composite models)."""
    shapes: dict[str, list[int]] = {}
    for file in files:
        try:
            shapes.update(safetensors_shapes(file))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            return f"weights file {file.name} is damaged (its header cannot be read: {exc})"
    vocab = config.get("vocab_size")
    hidden = config.get("hidden_size") or config.get("n_embd") or config.get("d_model")
    if not shapes or not isinstance(vocab, int) or not isinstance(hidden, int):
        return None
    if [vocab, hidden] in shapes.values():
        return None
    name, shape = max(shapes.items(), key=lambda item: _size(item[1]))
    return (f"its weights do not fit its config.json ({config.get('model_type')}: no token embedding of "
            f"[vocab_size, hidden_size] = [{vocab}, {hidden}] among {len(shapes)} tensors, the largest being "
            f"{name} {shape}): weights of another model")


def _size(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_inputs(cfg: RLHFConfig) -> None:
    """Fail before any work when an input the config names is missing: data.train_files,
    data.val_files, every model / tokenizer (a local directory, a hub id in the local Hugging Face
    cache, or 'tiny'; an existing folder must hold what its key needs: ``model_folder_problem``) and
    an offline rollout file. One ConfigError lists every problem with its key."""
    problems = []
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        problems += [f"{key}: {problem}" for problem in filter(None, (data_file_problem(resolve_path(f)) for f in files))]
    by_problem: dict[str, list[str]] = {}  # the same missing model under several keys is said once
    for key, value, needs in model_needs(cfg):
        problem = model_problem(value) or (None if value == TINY else model_folder_problem(locate_model(value), needs))
        if problem:
            by_problem.setdefault(problem, []).append(key)
    problems += [f"{', '.join(keys)}: {problem}" for problem, keys in by_problem.items()]
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "offline" and rollout.offline_path and not resolve_path(rollout.offline_path).is_file():
        problems.append(f"actor_rollout_ref.rollout.offline_path: file {rollout.offline_path!r} not found")
    if problems:
        raise ConfigError("; ".join(problems) + ". Fix the path(s) in the preset or the run's overrides "
                          "(paths are absolute, or relative to the current directory or the project root)")
