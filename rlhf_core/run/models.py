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

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.config.schema import DataConfig, ModelConfig
from rlhf_core.config.resolve import uses_critic
from rlhf_core.errors import CheckpointError, RLHFError
from rlhf_core.io.hashing import sha256_file, sha256_tree
from rlhf_core.paths import resolve_model_path, resolve_path, state_dir
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import checkpoint_before, last_good_checkpoint


# ---------------------------------------------------------------------------------------------
# where the warm start (``sft.warm_start``) lives: cached outside the run, keyed by its inputs
# ---------------------------------------------------------------------------------------------

SFT_FORMAT_VERSION = 2
"""Bumped when the warm start's training procedure changes, so old cached warm starts are not reused.
2: answers end with the chat template's end-of-turn token and its embedding trains when it is also the
pad token (SmolLM2); the tiny model's warm start is unchanged (the shipped demo model rebuilds to the
same weights)."""

# data settings that change which prompts are trained on or how they are tokenized
_DATA_KEYS = ("adapter", "prompt_key", "question_key", "answer_key", "id_key", "instruction", "system_prompt",
              "val_fraction", "max_val_samples", "train_max_samples", "val_max_samples", "max_prompt_length",
              "max_response_length", "filter_overlong_prompts", "truncation", "dedup", "seed", "data_source")


_ALWAYS = object()
_LATER_SFT_KEYS = {"prose_endings": None}
"""Warm-start settings added after warm starts were first cached (and the demo's shipped model was made,
its key recorded in its warm_start.json): at these values, which train exactly as before they existed,
they stay out of the key, so an earlier warm start keeps its key; set otherwise, they are in it."""


def warm_start_key(model: ModelConfig, data: DataConfig) -> dict:
    """Everything the warm-started weights depend on: base model files (``model.path``), data file
    contents, the data settings that shape the prompts, the SFT settings (``model.warm_start``), the
    procedure version."""
    base = resolve_model_path(model.path)
    files = {"train": [sha256_file(resolve_path(p)) for p in data.train_files],
             "val": [sha256_file(resolve_path(p)) for p in data.val_files]}
    sft = {k: v for k, v in asdict(model.warm_start).items() if _LATER_SFT_KEYS.get(k, _ALWAYS) != v}
    return {"version": SFT_FORMAT_VERSION, "base_model": sha256_tree(base), "data_files": files,
            "data": {k: getattr(data, k) for k in _DATA_KEYS}, "sft": sft}


def warm_start_path(model: ModelConfig, data: DataConfig, out_root: Optional[str | Path] = None) -> Path:
    """Where the warm start of ``model`` on ``data`` lives (exists or not): <root>/<base name>-sft-<hash16>."""
    root = Path(out_root) if out_root is not None else state_dir() / "models"
    blob = json.dumps(warm_start_key(model, data), sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]
    base_name = Path(model.path).name or "model"
    return root / f"{base_name}-sft-{digest}"


def is_complete(path: Path) -> bool:
    """A finished warm start: written atomically, so its record file means everything is there."""
    return (path / "warm_start.json").is_file() and (path / "config.json").is_file()



def initial_actor_path(cfg: RLHFConfig) -> Path:
    """The policy the run starts from; the reference and the critic's backbone follow it. Raises
    ``CheckpointError`` naming the stage to run when the warm-started model is not built yet."""
    if cfg.actor_rollout_ref.model.warm_start.enable:
        path = warm_start_path(cfg.actor_rollout_ref.model, cfg.data)
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
