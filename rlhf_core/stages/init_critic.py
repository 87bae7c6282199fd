"""Stage `init_critic`: the critic before training, built once per run so that scoring and the
first update start from the same value head.

    rlhf stage init_critic --run-dir RUN

models/critic_init/ = the backbone (critic.model.path, else the actor's initial model) with a fresh
one-output token-classification head, seeded by trainer.seed (Hugging Face format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer

from rlhf_core.config import RLHFConfig
from rlhf_core.config.reads import ActorModel, AdvEstimator, At, CriticEnable, build, config_keys
from rlhf_core.config.resolve import has_critic
from rlhf_core.config.schema import CriticModelConfig
from rlhf_core.io.atomic import atomic_dir
from rlhf_core.io.timing import CHECKPOINT_WRITE, MODEL_LOAD, timed
from rlhf_core.run.layout import RunDir
from rlhf_core.run.models import critic_backbone
from rlhf_core.stages.base import StageResult, stage_record


@dataclass(frozen=True)
class InitCriticSettings:
    has_critic: bool
    """Whether the run has a critic at all (``resolve.has_critic``)."""
    adv_estimator: str
    seed: int
    """trainer.seed: the fresh value head's initialisation."""


def init_critic_settings(critic_model: Annotated[CriticModelConfig, At("critic.model.")], actor_model: ActorModel,
                         seed: Annotated[int, At("trainer.seed")], critic_enable: CriticEnable,
                         adv_estimator: AdvEstimator) -> InitCriticSettings:
    """Everything the stage reads of the config: its parameters are the keys its config hash covers (the
    backbone, ``run.models.critic_backbone``, is critic.model.path, else the actor's initial model)."""
    return InitCriticSettings(has_critic=has_critic(critic_enable, adv_estimator), adv_estimator=adv_estimator,
                              seed=seed)


def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    """The config this stage's output depends on (its manifest's config hash): what its builder reads."""
    return config_keys(init_critic_settings)


def run_init_critic(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None,
                    force: bool = False) -> StageResult:
    out, settings = run.critic_init, build(init_critic_settings, cfg)
    if not settings.has_critic:
        return StageResult(stage="init_critic", skipped=True,
                           summary=[f"no critic in this run: algorithm.adv_estimator={settings.adv_estimator} "
                                    "reads no values (critic.enable=true builds one anyway)"])

    if (out / "config.json").is_file() and not force:  # built once per run: its weights are the run's critic start
        return StageResult(stage="init_critic", outputs={"critic_init": str(out)}, skipped=True,
                           summary=[f"initial critic {out} already built"])
    with stage_record(stage="init_critic", cfg=cfg, run=run, iteration=None, inputs=[],
                      config_sections=config_sections(cfg), force=force) as record:
        if record.skipped:
            return record.skipped
        backbone = critic_backbone(cfg)
        torch.manual_seed(settings.seed)
        with timed(MODEL_LOAD):
            model = AutoModelForTokenClassification.from_pretrained(backbone, num_labels=1, dtype=torch.float32)
        with timed(CHECKPOINT_WRITE), atomic_dir(out) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            AutoTokenizer.from_pretrained(backbone).save_pretrained(tmp)
        params = sum(p.numel() for p in model.parameters())
        return record.done(StageResult(
            stage="init_critic", outputs={"critic_init": str(out)}, rows={"parameters": params},
            summary=[f"initial critic on {backbone} ({params / 1e6:.1f} M parameters) → {out}"]))
