"""Stage `warm_start`: the policy a run starts from exists before anything asks for it.

    rlhf stage warm_start --run-dir RUN

Builds the project's tiny model where any model key names 'tiny' (deterministic, a few MB, under
the state directory), and with ``actor_rollout_ref.model.warm_start.enable`` fine-tunes it into
the warm-started initial policy (``rlhf_core.sft.warm_start.warm_start``; cached by content, so every later
run with the same inputs reuses it). Both are caches outside the run directory, so the stage runs
every time (a cache hit costs a hash of its inputs) and never marks later stages stale: the
initial policy's content is what they record as their inputs.
"""

from __future__ import annotations

import time
from typing import Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.run.inputs import model_keys
from rlhf_core.models.tiny import ensure_tiny_model
from rlhf_core.paths import TINY, locate_model
from rlhf_core.run.layout import RunDir
from rlhf_core.run.manifest import record_stage
from rlhf_core.run.models import initial_actor_path
from rlhf_core.sft.warm_start import warm_start
from rlhf_core.stages.base import StageResult


def run_warm_start(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False) -> StageResult:
    started = time.time()
    summary = []
    if any(value == TINY for _, value in model_keys(cfg)):
        tiny = ensure_tiny_model(locate_model(TINY))
        summary.append(f"tiny model: {tiny}")
    if cfg.actor_rollout_ref.model.warm_start.enable:
        summary.append(f"warm-started initial policy: {warm_start(cfg.actor_rollout_ref.model, cfg.data)}")
    actor = initial_actor_path(cfg)
    summary.append(f"initial policy: {actor}")
    result = StageResult(stage="warm_start", outputs={"initial_actor": str(actor)}, summary=summary,
                         seconds=time.time() - started)
    record_stage(run, None, "warm_start", status="done", outputs_paths=result.outputs, seconds=result.seconds,
                 started_at=started, metrics={}, rows={})
    return result
