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


def initial_actor_path(cfg: RLHFConfig) -> Path:
    return resolve_model_path(cfg.actor_rollout_ref.model.path)


def reference_path(cfg: RLHFConfig) -> Path:
    """The frozen reference policy: ref.model_path, else the actor's initial model."""
    ref = cfg.actor_rollout_ref.ref.model_path
    return resolve_model_path(ref) if ref else initial_actor_path(cfg)


def actor_path(cfg: RLHFConfig, run: RunDir) -> Path:
    """The actor to sample from / train next: last-good checkpoint's actor, else the initial model."""
    ckpt = last_good_checkpoint(run)
    return ckpt / "actor" if ckpt else initial_actor_path(cfg)


def critic_path(cfg: RLHFConfig, run: RunDir) -> Path:
    """The value model to score with / train next: the last-good critic, else the run's initial
    critic (built once by ``ensure_initial_critic`` so scoring and update start from the same head)."""
    ckpt = last_good_checkpoint(run)
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
