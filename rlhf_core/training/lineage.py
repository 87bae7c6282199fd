"""What identifies the state an update produced, and what it takes to rebuild it: ``iter_k/state.json``.

    {"iteration": k, "id": sha256, "start": j, "parent": id of j's state (null for the initial models),
     "inputs": {path: digest}, "config": the whole config the update trained with,
     "weights_sample": sha256, "environment": {library versions, processor}}

The id is a hash of the update's inputs — the advantages table's bytes, the id of the state it
started from (or the initial models' sha256), the config keys it reads
(``training.settings.update_keys``) — so it names the weights the update produced without reading
them: the same id whether the checkpoint is on disk, held in memory, or still to be rebuilt. Stage manifests use it for every checkpoint input
(``run.manifest.path_digest``), so no stage re-hashes weight files.

``weights_sample`` is a cheap fingerprint of the trained weights (``training.fingerprint``: every
tensor's sum and a fixed strided sample): a replay (``training.resident``) that does not reproduce it
stops instead of going on from different weights. This module reads and writes the records without
torch, so ``rlhf status`` can read them quickly.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

from rlhf_core.config import RLHFConfig, config_from_dict, config_hash, to_dict
from rlhf_core.errors import CheckpointError
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.lifecycle import checkpoint_before, committed_iterations
from rlhf_core.run.manifest import hash_paths
from rlhf_core.run.migrate import current_config_tree
from rlhf_core.run.models import actor_path, critic_path, initial_actor_path

def start_iteration(run: RunDir, k: int) -> int:
    """The committed iteration whose state iteration ``k``'s update starts from (0: the initial models)."""
    earlier = [j for j in committed_iterations(run) if j < k]
    return earlier[-1] if earlier else 0


def update_inputs(cfg: RLHFConfig, run: RunDir, k: int) -> list[Path]:
    """What iteration ``k``'s update reads: its advantages table, the actor (with LoRA: the frozen
    base and the adapters) and critic it starts from, and their optimizer state."""
    ckpt = checkpoint_before(run, k)
    if cfg.actor_rollout_ref.model.lora_rank > 0:  # the update trains adapters (training.engines.LoraSettings)
        paths = [run.advantages(k), initial_actor_path(cfg), critic_path(cfg, run, k)]
        if ckpt is not None:
            paths.append(ckpt / "actor_adapter")
    else:
        paths = [run.advantages(k), actor_path(cfg, run, k), critic_path(cfg, run, k)]
    paths = [p for p in paths if p is not None]  # critic_path: None without a critic
    if ckpt is not None:
        paths.append(ckpt / "deepspeed")
    return paths


def state_id(cfg: RLHFConfig, run: RunDir, k: int, keys: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """(id of the state iteration ``k``'s update produces, the input digests it is made of); ``keys``:
    the config keys the update reads (``training.settings.update_keys``)."""
    inputs = hash_paths(run, update_inputs(cfg, run, k))
    cfg_hash = config_hash(cfg, keys)
    blob = json.dumps({"iteration": k, "inputs": inputs, "config": cfg_hash}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest(), inputs


REPLAY_LIBRARIES = ("torch", "transformers", "deepspeed")


def environment() -> dict[str, Any]:
    """What a replay's arithmetic depends on besides its inputs: the libraries whose kernels run
    it and the processor they pick their code paths by. Recorded with each state, so `rlhf status`
    can say beforehand when a replay here is unlikely to reproduce one (``environment_changes``)."""
    versions = {}
    for name in REPLAY_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {**versions, "cpu": cpu_model(), "cpu_count": os.cpu_count()}


def cpu_model() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else the platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_changes(record: dict[str, Any]) -> list[str]:
    """How this machine differs from the one that recorded ``record`` (one clause each; [] for a
    record from before environments were recorded)."""
    then, now = record.get("environment") or {}, environment()
    return [f"{key} {then[key]} → {now.get(key)}" for key in sorted(then) if then[key] != now.get(key)]


def write_state_record(run: RunDir, k: int, identity: tuple[str, dict[str, str]], *, sample: str,
                       cfg: RLHFConfig) -> dict[str, Any]:
    """Write ``iter_k/state.json`` for the state iteration ``k``'s update just produced;
    ``identity``: its ``state_id``."""
    start = start_iteration(run, k)
    parent = (run.read_json(run.state_record(start)) or {}).get("id") if start else None  # None: a run from before
    ident, inputs = identity
    record = {"iteration": k, "id": ident, "start": start, "parent": parent, "inputs": inputs,
              "config": to_dict(cfg), "weights_sample": sample,  # no clock: reruns compare equal
              "environment": environment()}
    atomic_write_json(run.state_record(k), record)
    return record


def read_state_record(run: RunDir, k: int) -> dict[str, Any]:
    """Iteration ``k``'s state record; a missing or damaged one is a CheckpointError saying what is lost."""
    path = run.state_record(k)
    try:
        record = run.read_json(path)
    except StateFileError as exc:
        raise CheckpointError(f"{exc}: iteration {k}'s state cannot be rebuilt without it") from None
    if not isinstance(record, dict) or not record.get("id") or "config" not in record:
        raise CheckpointError(f"{path} is missing or incomplete: iteration {k}'s state cannot be rebuilt; "
                              f"rerun `rlhf stage update --run-dir {run.root} --iteration {k} --force`")
    return record


def recorded_config(record: dict[str, Any]) -> RLHFConfig:
    """The config an update trained with, as its state record saved it (a retry's changes included),
    without the keys of an older run format (``run.migrate.current_config_tree``)."""
    return config_from_dict(current_config_tree(record["config"]))
