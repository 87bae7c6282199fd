"""Reading a checkpoint back, after ``io.checksums.verify_checkpoint``: each rank's optimizer shard
reassembled into full tensors when the world size or ZeRO stage changed, the optimizer state, the
trainer state and the RNG. The layout and the writing: ``training.checkpoint``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from rlhf_core.errors import CheckpointError
from rlhf_core.training.checkpoint import SHARD_FILE, shard_name
from rlhf_core.training.engines import TrainEngine
from rlhf_core.training.optim_state import SEP, prime_optimizer, restore_optimizer_state
from rlhf_core.training.train_state import restore_optim, restore_rng


def _shard_metas(directory: Path, role: str) -> list[dict]:
    """The role's shard metas, rank order; CheckpointError when any rank's shard is missing."""
    found = {}
    for p in (directory / "deepspeed").glob(f"{role}_shard.rank*-of-*.json"):
        m = SHARD_FILE.match(p.name)
        if m and m["role"] == role:
            found[(int(m["rank"]), int(m["world"]))] = p
    if not found:
        raise CheckpointError(f"{directory / 'deepspeed'} holds no optimizer state for the {role} (neither "
                              f"{role}_optim.safetensors nor {role}_shard.rank*-of-*.json); rerun the update "
                              "stage that writes it or roll back to another checkpoint")
    worlds = {w for _, w in found}
    world = max(worlds)
    missing = [shard_name(role, r, world) for r in range(world) if (r, world) not in found]
    if len(worlds) > 1 or missing:
        raise CheckpointError(f"{directory / 'deepspeed'}: the {role}'s optimizer shards are incomplete "
                              f"(missing {missing or 'none'}, world sizes {sorted(worlds)}); rerun the update "
                              "stage or roll back to another checkpoint")
    return [json.loads(found[(r, world)].read_text()) for r in range(world)]


def _load_shard(directory: Path, role: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "deepspeed" / f"{shard_name(role, rank, world)}.safetensors"))


def reassemble(directory: Path, role: str, metas: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors by ``<name>::<key>`` from every rank's shard (the old gathered format's content)."""
    full: dict[str, torch.Tensor] = {}
    shapes = {}
    for rank, meta in enumerate(metas):
        tensors = _load_shard(directory, role, rank, len(metas))
        for key, t in tensors.items():
            name = key.rsplit(SEP, 1)[0]
            offset, numel, full_numel, shape = meta["fragments"][name]
            dest = full.setdefault(key, torch.zeros(full_numel, dtype=t.dtype))
            shapes[key] = shape
            valid = max(0, min(numel, full_numel - offset))  # ZeRO-3: the last partition is padded
            dest[offset:offset + valid] = t[:valid]
        del tensors
    return {key: t.view(shapes[key]) for key, t in full.items()}


def load_optimizer_files(directory: Path, role: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The role's optimizer state as full tensors by parameter name + counters, from either layout
    (the sharded one is reassembled from every rank's file: for a changed world size or stage)."""
    from safetensors.torch import load_file

    old = directory / "deepspeed" / f"{role}_optim.safetensors"
    if old.is_file():
        tensors = load_file(str(old))
        meta = json.loads((directory / "deepspeed" / f"{role}_state.json").read_text())
        return tensors, meta
    metas = _shard_metas(directory, role)
    return reassemble(directory, role, metas), metas[0]


def load_optimizer_state(directory: Path, te: TrainEngine, zero_loss: Callable[[], torch.Tensor]) -> None:
    """Put checkpoint ``directory``'s optimizer state + counters into a freshly built engine (every
    rank calls it; priming the optimizer is collective). Same world size, ZeRO stage and dtype as
    saved: only this rank's shard is read. Otherwise the shards (or an old-format file) are
    reassembled into full tensors and scattered into this engine's partitions."""
    import torch.distributed as tdist

    directory = Path(directory)
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    where = directory / "deepspeed"
    try:
        if not (where / f"{te.role}_optim.safetensors").is_file():
            metas = _shard_metas(directory, te.role)
            m = metas[0]
            if (m["world_size"], m["zero_stage"], m["dtype"]) == (world, te.zero_stage, te.dtype):
                own = metas[rank]
                if own["has_state"]:
                    prime_optimizer(te, zero_loss)
                restore_optim(te, _load_shard(directory, te.role, rank, world), own)
                return
        tensors, meta = load_optimizer_files(directory, te.role)
        restore_optimizer_state(te, tensors, meta, zero_loss)
    except CheckpointError:
        raise
    except (KeyError, ValueError, RuntimeError, AssertionError) as exc:
        raise CheckpointError(f"{where} does not fit the {te.role} being trained ({exc}); was the model or "
                              "LoRA setting changed mid-run? Keep them for this run, or start a new run") from None


def load_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "trainer_state.json").read_text())


def load_rng(directory: Path) -> None:
    from safetensors.torch import load_file

    restore_rng(load_file(str(directory / "rng.safetensors")), load_trainer_state(directory)["rng"])
