"""Stage registry: name → "module:function" (imported lazily, so `rlhf --help` stays fast and a
stage's heavy dependencies load only when that stage runs).

Every stage function has the contract
    run_<stage>(cfg: RLHFConfig, run: RunDir, iteration: int | None = None, force: bool = False) -> StageResult
Setup stages take iteration=None; iteration stages need it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StageSpec:
    name: str
    target: str  # "module:function"
    per_iteration: bool
    help: str

    def load(self) -> Callable:
        module, _, fn = self.target.partition(":")
        return getattr(importlib.import_module(module), fn)


STAGES: dict[str, StageSpec] = {
    s.name: s
    for s in [
        StageSpec("preprocess", "rlhf_core.stages.preprocess:run_preprocess", False,
                  "raw prompts (JSONL/Parquet/CSV) → prompts/train.parquet, val.parquet, rejects.parquet"),
        StageSpec("pack", "rlhf_core.stages.pack:run_pack", False,
                  "token-budget bin packing of prompts into generation batches"),
        StageSpec("rollout", "rlhf_core.stages.rollout:run_rollout", True,
                  "generate responses (hf / vllm) or import offline ones → iter_K/rollout.parquet"),
        StageSpec("score", "rlhf_core.stages.score:run_score", True,
                  "rewards + old/ref log-probs + values → iter_K/scored.parquet"),
        StageSpec("gae", "rlhf_core.stages.gae:run_gae", True,
                  "KL-in-reward penalty + GAE advantages → iter_K/advantages.parquet"),
        StageSpec("update", "rlhf_core.stages.update:run_update", True,
                  "PPO update of actor and critic with DeepSpeed → iter_K/checkpoint/"),
        StageSpec("guard", "rlhf_core.guard:run_guard", True,
                  "KL(actor‖ref) of the new actor vs the threshold → commit (last_good) or roll back"),
        StageSpec("validate", "rlhf_core.validation:run_validate", True,
                  "sampled accuracy of the current actor on the validation prompts → iter_K/validation.parquet"),
    ]
}


def get_stage(name: str) -> StageSpec:
    if name not in STAGES:
        from rlhf_core.errors import RLHFError

        raise RLHFError(f"unknown stage {name!r}; valid stages: {', '.join(STAGES)}")
    return STAGES[name]
