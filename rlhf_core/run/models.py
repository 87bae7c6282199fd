"""Which weights a stage uses: lookups only (they never build, train or write).

    initial actor   the warm-started (SFT) model when actor_rollout_ref.model.warm_start.enable, else
                    actor_rollout_ref.model.path (stage ``warm_start`` builds / trains what is missing)
    reference       actor_rollout_ref.ref.model_path, else the initial actor
    reward model    reward_model.model.path with reward_model.enable, else none (rule-based rewards)
    initial critic  models/critic_init of the run (stage ``init_critic`` builds it)
    actor / critic  the last-good checkpoint's, else the initial ones; with ``iteration``: the ones
                    that iteration started from (``lifecycle.checkpoint_before``)

Checkpoint layout (written by the update stage)::

    iter_<k>/checkpoint/actor/        Hugging Face causal LM (safetensors) + tokenizer
    iter_<k>/checkpoint/critic/       Hugging Face token-classification value model (1 label)
    iter_<k>/checkpoint/deepspeed/    optimizer / scheduler state for exact resume
    iter_<k>/checkpoint/trainer_state.json   RNG, data position
    iter_<k>/checkpoint/manifest.json        sha256 of every file above
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.config.resolve import uses_critic
from rlhf_core.errors import CheckpointError, RLHFError
from rlhf_core.paths import resolve_model_path
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import checkpoint_before, last_good_checkpoint
from rlhf_core.sft.warm_start import is_complete, warm_start_path


def initial_actor_path(cfg: RLHFConfig) -> Path:
    """The policy the run starts from; the reference and the critic's backbone follow it. Raises
    ``CheckpointError`` naming the stage to run when the warm-started model is not built yet."""
    if cfg.actor_rollout_ref.model.warm_start.enable:
        path = warm_start_path(cfg)
        if not is_complete(path):
            raise CheckpointError(f"the warm-started initial policy {path} is not built yet: run `rlhf stage "
                                  "warm_start --run-dir RUN` (`rlhf run` runs it first)")
        return path
    return resolve_model_path(cfg.actor_rollout_ref.model.path)


def reference_path(cfg: RLHFConfig) -> Path:
    """The frozen reference policy: ref.model_path, else the actor's initial model."""
    ref = cfg.actor_rollout_ref.ref.model_path
    return resolve_model_path(ref) if ref else initial_actor_path(cfg)


def reward_model_path(cfg: RLHFConfig) -> Optional[Path]:
    """The sequence-classification reward model; None for rule-based rewards."""
    if not cfg.reward_model.enable:
        return None
    if not cfg.reward_model.model.path:
        raise RLHFError("reward_model.enable=true needs reward_model.model.path=<sequence-classification "
                        "model>; or set reward_model.enable=false for rule-based rewards")
    return resolve_model_path(cfg.reward_model.model.path)


def critic_backbone(cfg: RLHFConfig) -> Path:
    """What the initial critic is built on: critic.model.path, else the actor's initial model."""
    return resolve_model_path(cfg.critic.model.path) if cfg.critic.model.path else initial_actor_path(cfg)


def initial_critic_path(run: RunDir) -> Path:
    """The run's initial critic (models/critic_init), which must be built already."""
    if not (run.critic_init / "config.json").is_file():
        raise CheckpointError(f"the initial critic {run.critic_init} is not built yet: run `rlhf stage init_critic "
                              f"--run-dir {run.root}` (`rlhf run` runs it first)")
    return run.critic_init


def _start_checkpoint(run: RunDir, iteration: Optional[int]) -> Optional[Path]:
    return last_good_checkpoint(run) if iteration is None else checkpoint_before(run, iteration)


def actor_path(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None) -> Path:
    """The actor to sample from / train next: last-good checkpoint's actor, else the initial model.
    With ``iteration``: the actor that iteration started from (``checkpoint_before``)."""
    ckpt = _start_checkpoint(run, iteration)
    return ckpt / "actor" if ckpt else initial_actor_path(cfg)


def critic_path(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None) -> Optional[Path]:
    """The value model to score with / train next: the last-good critic, else the run's initial
    critic. With ``iteration``: the critic that iteration started from (``checkpoint_before``).
    None in a run without a critic (``config.resolve.uses_critic``)."""
    if not uses_critic(cfg):
        return None
    ckpt = _start_checkpoint(run, iteration)
    # a checkpoint on disk without critic/ is from before the critic was saved; one only held in
    # memory (or to be rebuilt: resident models) always has its critic
    if ckpt is not None and ((ckpt / "critic").is_dir() or not (ckpt / "actor").is_dir()):
        return ckpt / "critic"
    return initial_critic_path(run)
