"""Which weights a stage should use: the last committed checkpoint, else the initial models.

``last_good.json`` is the only pointer that survives a crash or a CLI rerun: it moves (atomically)
when the KL guard commits an iteration, and rollout/score/update of the next iteration read their
actor and critic from it. Checkpoint layout (written by the update stage)::

    iter_<k>/checkpoint/actor/        Hugging Face causal LM (safetensors) + tokenizer
    iter_<k>/checkpoint/critic/       Hugging Face token-classification value model (1 label)
    iter_<k>/checkpoint/deepspeed/    optimizer / scheduler state for exact resume
    iter_<k>/checkpoint/trainer_state.json   KL controller state, RNG, data position
    iter_<k>/checkpoint/manifest.json        sha256 of every file above
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.io.rundir import RunDir
from rlhf_core.paths import resolve_model_path


def read_last_good(run: RunDir) -> Optional[dict]:
    """{"iteration": k, "checkpoint": "iter_k/checkpoint", "time": ...} or None before any commit."""
    return run.read_json(run.last_good_path)


def write_last_good(run: RunDir, iteration: int) -> dict:
    record = {"iteration": iteration, "checkpoint": str(run.checkpoint(iteration).relative_to(run.root)),
              "time": time.time()}
    atomic_write_json(run.last_good_path, record)
    return record


def last_good_checkpoint(run: RunDir) -> Optional[Path]:
    record = read_last_good(run)
    return run.root / record["checkpoint"] if record else None


def checkpoint_before(run: RunDir, iteration: int) -> Optional[Path]:
    """The checkpoint iteration ``iteration`` started from: that of the latest earlier iteration the
    KL guard committed (None: the initial models). While the pipeline moves forward this is the
    last-good checkpoint; for a rerun of an old iteration it is the one that iteration really used,
    so `rlhf stage score --iteration 1` after iteration 2 committed still scores with the initial actor."""
    from rlhf_core.errors import CheckpointError
    from rlhf_core.io.manifest import read_manifest

    last_good = read_last_good(run)
    for k in range(iteration - 1, 0, -1):
        committed = read_manifest(run, k).get("guard", {}).get("committed")
        if committed or (last_good and last_good.get("iteration") == k):
            ckpt = run.checkpoint(k)
            if not (ckpt / "actor").is_dir():
                raise CheckpointError(
                    f"iteration {iteration} started from {ckpt}, which was pruned (checkpoints are kept every "
                    f"trainer.save_freq iterations and for last-good); rerun that iteration's stages only when "
                    f"its starting checkpoint is kept")
            return ckpt
    return None


def _start_checkpoint(run: RunDir, iteration: Optional[int]) -> Optional[Path]:
    return last_good_checkpoint(run) if iteration is None else checkpoint_before(run, iteration)


def initial_actor_path(cfg: RLHFConfig) -> Path:
    """The policy the run starts from: the warm-started (SFT) model when
    actor_rollout_ref.model.warm_start.enable, else actor_rollout_ref.model.path. The reference and
    the critic's backbone follow it. The warm start is cached, so after the first call this only
    hashes its inputs."""
    if cfg.actor_rollout_ref.model.warm_start.enable:
        from rlhf_core.sft import warm_start

        return warm_start(cfg)
    return resolve_model_path(cfg.actor_rollout_ref.model.path)


def reference_path(cfg: RLHFConfig) -> Path:
    """The frozen reference policy: ref.model_path, else the actor's initial model."""
    ref = cfg.actor_rollout_ref.ref.model_path
    return resolve_model_path(ref) if ref else initial_actor_path(cfg)


def actor_path(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None) -> Path:
    """The actor to sample from / train next: last-good checkpoint's actor, else the initial model.
    With ``iteration``: the actor that iteration started from (``checkpoint_before``)."""
    ckpt = _start_checkpoint(run, iteration)
    return ckpt / "actor" if ckpt else initial_actor_path(cfg)


def critic_path(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None) -> Path:
    """The value model to score with / train next: the last-good critic, else the run's initial
    critic (built once by ``ensure_initial_critic`` so scoring and update start from the same head).
    With ``iteration``: the critic that iteration started from (``checkpoint_before``)."""
    ckpt = _start_checkpoint(run, iteration)
    if ckpt is not None and (ckpt / "critic").is_dir():
        return ckpt / "critic"
    return ensure_initial_critic(cfg, run)


def ensure_initial_critic(cfg: RLHFConfig, run: RunDir) -> Path:
    """Materialise the initial critic under models/critic_init: the backbone (critic.model.path, else
    the actor's initial model) with a fresh one-output token-classification head, seeded by
    trainer.seed. Saved once so every stage that needs "the critic before training" agrees."""
    out = run.models_dir / "critic_init"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from rlhf_core.io.atomic import atomic_dir

    backbone = resolve_model_path(cfg.critic.model.path) if cfg.critic.model.path else initial_actor_path(cfg)
    torch.manual_seed(cfg.trainer.seed)
    model = AutoModelForTokenClassification.from_pretrained(backbone, num_labels=1, dtype=torch.float32)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(backbone).save_pretrained(tmp)
    return out


def verified_last_good(run: RunDir) -> Optional[dict]:
    """The last-good record after checking its checkpoint against its sha256 manifest; when that
    checkpoint is damaged, fall back to the newest earlier committed checkpoint that verifies.

    A fallback from iteration b to g (< b) puts the run back as if g were the last commit: the
    gae/update/guard records of g+1..b become ``stale`` (they rerun; rollout and score stay valid,
    they started from g's models), the KL controller returns to its state before g+1, last_good.json
    moves to g (atomic), and a ``checkpoint_corrupt_fallback`` event and a stderr line say so. Each
    step is idempotent, so a crash in between is repaired by resuming again. Raises
    ``CheckpointError`` naming every damaged file when no committed checkpoint verifies and some were
    pruned; when none was pruned (every commit is damaged) the run falls back to the initial models.
    """
    from rlhf_core.errors import CheckpointError
    from rlhf_core.training.checkpoint import verify_checkpoint

    record = read_last_good(run)
    if not record or not (run.root / record["checkpoint"]).exists():
        return record  # nothing on disk to judge: the stage that needs it names the missing directory
    errors: list[str] = []
    for k in _committed_newest_first(run, int(record["iteration"])):
        try:
            verify_checkpoint(run.checkpoint(k))
        except CheckpointError as exc:
            errors.append(f"iteration {k}: {exc}")
            continue
        return record if k == record["iteration"] else _fall_back(run, int(record["iteration"]), k, errors)
    if len(errors) == record["iteration"]:  # every commit tried, none pruned: start again from the initial models
        return _fall_back(run, int(record["iteration"]), 0, errors)
    raise CheckpointError(
        f"no committed checkpoint of {run.root} verifies:\n  " + "\n  ".join(errors or ["(none kept)"])
        + "\nkeep more checkpoints (trainer.save_freq=1, trainer.max_ckpt_to_keep>=2) or start a new run")


def _committed_newest_first(run: RunDir, last_good: int) -> list[int]:
    """Iterations up to ``last_good`` whose guard committed them and whose checkpoint is kept."""
    from rlhf_core.io.manifest import read_manifest

    out = []
    for k in range(last_good, 0, -1):
        committed = k == last_good or read_manifest(run, k).get("guard", {}).get("committed")
        if committed and run.checkpoint(k).is_dir():
            out.append(k)
    return out


def _fall_back(run: RunDir, bad: int, good: int, errors: list[str]) -> dict:
    import sys

    from rlhf_core.guard import restore_kl_controller
    from rlhf_core.io.manifest import read_manifest, write_manifest

    for j in range(good + 1, bad + 1):  # undo the commits after ``good``: they rerun from its models
        manifest = read_manifest(run, j)
        for stage in ("gae", "update", "guard"):
            if stage in manifest:
                manifest[stage]["status"] = "stale"
        if "guard" in manifest:
            manifest["guard"].update(committed=False,
                                     checkpoint_corrupt=any(e.startswith(f"iteration {j}:") for e in errors))
        write_manifest(run, j, manifest)
    restore_kl_controller(run, good + 1)
    if good:
        record = write_last_good(run, good)
    else:
        run.last_good_path.unlink(missing_ok=True)
        record = {"iteration": 0, "checkpoint": None}
    target = f"the checkpoint of iteration {good}" if good else "the initial models (no checkpoint verifies)"
    message = (f"last-good checkpoint of iteration {bad} is damaged ({errors[0].split(': ', 1)[1]}); falling back "
               f"to {target}: iterations {good + 1}..{bad} will be rerun")
    run.append_event("checkpoint_corrupt_fallback", good, corrupt_iteration=bad, errors=errors, message=message)
    print(f"rlhf: warning: {message}", file=sys.stderr)
    return {**record, "fell_back_from": bad, "message": message}
