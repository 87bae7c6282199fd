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

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.config.schema import DataConfig, ModelConfig
from rlhf_core.run.inputs import model_keys
from rlhf_core.models.tiny import ensure_tiny_model
from rlhf_core.paths import TINY, locate_model, project_root
from rlhf_core.run.layout import RunDir
from rlhf_core.errors import RLHFError
from rlhf_core.io.hashing import sha256_tree
from rlhf_core.run.manifest import read_manifest, record_key, record_stage
from rlhf_core.run.models import initial_actor_path, warm_start_path
from rlhf_core.sft.demo_model import DEMO_MODEL
from rlhf_core.sft.warm_start import warm_start
from rlhf_core.stages.base import StageResult


@dataclass(frozen=True)
class WarmStartSettings:
    """What the stage builds, read of a config once per run of it (``warm_start_settings``)."""

    tiny: bool
    """Some model or tokenizer key names the project's tiny model (``run.inputs.model_keys``)."""
    warm_start: bool
    """actor_rollout_ref.model.warm_start.enable: fine-tune ``model`` on ``data`` into the initial policy."""
    model: ModelConfig
    """actor_rollout_ref.model."""
    data: DataConfig


def warm_start_settings(cfg: RLHFConfig) -> WarmStartSettings:
    """The stage's settings: the keys ``_build`` read of the config, read in the same order."""
    return WarmStartSettings(tiny=any(value == TINY for _, value in model_keys(cfg)),
                             warm_start=cfg.actor_rollout_ref.model.warm_start.enable,
                             model=cfg.actor_rollout_ref.model, data=cfg.data)


def run_warm_start(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False) -> StageResult:
    """Build what the run starts from (cached outside the run) and record the initial policy's
    sha256 as this stage's output, so a damaged cache is found (``run.integrity``) instead of trained
    on: when it no longer matches, the cache is built again and must reproduce the recorded bytes."""
    started = time.time()
    settings = warm_start_settings(cfg)
    summary = _build(settings)
    actor = initial_actor_path(cfg)
    key, digest = record_key(run, actor), sha256_tree(actor)
    recorded = ((read_manifest(run, None).get("warm_start") or {}).get("outputs") or {}).get(key)
    if recorded not in (None, digest):
        _rebuild(settings, actor, recorded)
        summary.append(f"the initial policy {actor} did not match this run's record: built again, the same bytes")
    summary.append(f"initial policy: {actor}")
    result = StageResult(stage="warm_start", outputs={"initial_actor": str(actor)}, summary=summary,
                         seconds=time.time() - started)
    record_stage(run, None, "warm_start", status="done", outputs={key: recorded or digest},
                 outputs_paths=result.outputs, seconds=result.seconds, started_at=started, metrics={}, rows={})
    return result


def _build(settings: WarmStartSettings) -> list[str]:
    summary = []
    if settings.tiny:
        tiny = ensure_tiny_model(locate_model(TINY))
        summary.append(f"tiny model: {tiny}")
    if settings.warm_start:
        summary.append(f"warm-started initial policy: {warm_start(settings.model, settings.data)}")
    return summary


def _rebuild(settings: WarmStartSettings, actor: Path, recorded: str) -> None:
    """Build the cached initial policy ``actor`` again; it must come out as ``recorded``."""
    changed = f"the initial policy {actor} changed since this run recorded it (sha256 {recorded[:12]}…)"
    ours = {locate_model(TINY).resolve()} | ({warm_start_path(settings.model, settings.data).resolve()}
                                             if settings.warm_start else set())
    if actor.resolve() not in ours:
        shipped = actor.resolve() == (project_root() / DEMO_MODEL).resolve()
        how = f" (`git checkout {DEMO_MODEL}` restores the shipped one)" if shipped else ""
        raise RLHFError(f"{changed}: restore it{how} — every iteration, the reference policy and a replay from "
                        "the initial models stand on it — or start a new run")
    if actor.is_symlink():  # a link to a shared build: replaced by a build of this machine's own
        actor.unlink()
    else:
        shutil.rmtree(actor)
    _build(settings)
    if sha256_tree(actor) != recorded:
        raise RLHFError(f"{changed}, and building it again here gives other bytes (a warm start is not "
                        "bit-identical across machines): copy it from the machine that started the run, or start "
                        "a new run")
