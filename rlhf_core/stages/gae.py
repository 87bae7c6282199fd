"""Stage `gae`: iter_K/scored.parquet → iter_K/advantages.parquet (token rewards, advantages, returns).

    rlhf stage gae --run-dir RUN --iteration K [-c PRESET] [key=value ...]

With ``algorithm.use_kl_in_reward`` the token rewards carry the KL penalty ``−β·KL_t`` (estimator
``algorithm.kl_penalty``) with β = the KL controller's current coefficient; the controller then
takes one step with the iteration's measured KL and B = number of responses
(``algorithm.kl_ctrl``: fixed, or the adaptive controller of Ziegler et al. 2019). GAE
(``algorithm.gamma``, ``algorithm.lam``) and the whitening (``algorithm.norm_adv``) are in
``rlhf_core.training.advantages``.

KL controller state (``RunDir.kl_ctrl_path`` = kl_ctrl.json, the controller's ``state_dict()``):
iteration K always starts from the state recorded before K in ``iter_K/kl_ctrl_before.json``
(``run.lifecycle.take_kl_snapshot``; taken here when the flow's begin-iteration has not taken it). So a
rerun of K (forced, after a crash, after a rollback) uses the same coefficient, writes the same
table and leaves the same state: the controller never steps twice for one iteration. A retry after
a KL-guard rollback edits that snapshot (a raised coefficient), which this stage then uses.
A stored state gives the coefficient; ``target_kl`` and ``horizon`` come from the current config.

Metrics (``advantages.advantage_metrics``): verl's ``critic/rewards|advantages|returns|values/{mean,max,min}``
and ``critic/vf_explained_var`` with verl's reductions, ``actor/reward_kl_penalty`` and
``actor/reward_kl_penalty_coeff`` when the KL is in the reward; ours (``advantages/*``, ``returns/*``,
``kl/coef``, ``kl/coef_next``, ...) as before.

Inspect it with DuckDB:  SELECT avg(list_sum(token_level_rewards)) FROM 'RUN/iter_1/advantages.parquet'
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import pyarrow.parquet as pq

from rlhf_core.training.advantages import AdvantageSettings, compute_advantages
from rlhf_core.algos import estimator_takes, make_kl_controller
from rlhf_core.config.resolve import uses_critic
from rlhf_core.config import ConfigError, RLHFConfig
from rlhf_core.data.schemas import ADVANTAGES
from rlhf_core.errors import DataError, RLHFError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import kl_state_before, persist_kl_controller, take_kl_snapshot
from rlhf_core.io.timing import TABLE_READ, timed
from rlhf_core.stages.base import StageResult, execute_stage

CONFIG_SECTIONS = ("algorithm.",)


def run_gae(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False) -> StageResult:
    """Advantages of iteration ``iteration``; skipped when its scored table, KL snapshot and
    ``algorithm.*`` config are unchanged."""
    if iteration is None or iteration < 1:
        raise RLHFError("gae is a per-iteration stage: give --iteration K (K >= 1)")
    scored = run.scored(iteration)
    if not scored.is_file():
        raise DataError(f"{scored} not found: run `rlhf stage score --run-dir {run.root} "
                        f"--iteration {iteration}` first")
    if cfg.algorithm.use_kl_in_reward:
        # Before hashing the inputs: the snapshot is an input, and the first run must hash what a rerun will.
        take_kl_snapshot(run, iteration)
    snapshot = run.kl_snapshot(iteration)
    inputs = [scored] + ([snapshot] if snapshot.is_file() else [])

    def body() -> StageResult:
        return _gae(cfg, run, iteration)

    return execute_stage(stage="gae", cfg=cfg, run=run, iteration=iteration, inputs=inputs,
                         config_sections=CONFIG_SECTIONS, body=body, force=force)


def kl_controller_for(cfg: RLHFConfig, state: Optional[dict], source: Path):
    """The controller of ``algorithm.kl_ctrl`` starting at ``state["value"]`` (else at kl_coef)."""
    ctrl = cfg.algorithm.kl_ctrl
    coef = ctrl.kl_coef
    if state is not None:
        if not isinstance(state, dict) or not isinstance(state.get("value"), (int, float)):
            raise DataError(f"{source}: KL controller state {state!r} has no numeric \"value\"; restore the file "
                            "or delete it to restart the coefficient at algorithm.kl_ctrl.kl_coef")
        if state.get("type") != ctrl.type:
            raise ConfigError(
                f"{source} holds a {state.get('type')!r} KL controller but algorithm.kl_ctrl.type={ctrl.type!r}; "
                f"set algorithm.kl_ctrl.type={state.get('type')} to continue this run's controller, or delete "
                f"{source.name} (and kl_ctrl.json) to restart the coefficient at algorithm.kl_ctrl.kl_coef")
        coef = float(state["value"])
    return make_kl_controller(ctrl.type, coef, ctrl.target_kl, ctrl.horizon)


# ---------------------------------------------------------------------------------------------
# body
# ---------------------------------------------------------------------------------------------


def _gae(cfg: RLHFConfig, run: RunDir, k: int) -> StageResult:
    settings = replace(AdvantageSettings.from_algorithm(cfg.algorithm), use_critic=uses_critic(cfg))
    controller = None
    if settings.use_kl_in_reward:
        controller = kl_controller_for(cfg, kl_state_before(run, k), run.kl_snapshot(k))
    used = controller.value if controller is not None else 0.0
    with timed(TABLE_READ):
        scored = pq.read_table(run.scored(k))
    out = compute_advantages(scored, kl_coef=used, settings=settings, source=str(run.scored(k)))
    path = atomic_write_parquet(run.advantages(k), out.table, schema=ADVANTAGES)
    metrics = dict(out.metrics)
    kl_lines = [f"KL not in the reward (algorithm.use_kl_in_reward=false): token reward = score on the last "
                f"token; KL({settings.kl_penalty}) of the rollout policy to the reference "
                f"{out.kl_mean:.5f} per token"]
    if controller is not None:
        controller.update(current_kl=out.kl_mean, n_steps=out.num_responses)
        metrics["kl/coef_next"] = controller.value
        later = persist_kl_controller(run, k, controller.state_dict())
        kl_lines = [f"KL in reward: {settings.kl_penalty} estimator, coefficient {used:.6g} "
                    f"({cfg.algorithm.kl_ctrl.type}); measured KL {out.kl_mean:.5f} per token → next "
                    f"coefficient {controller.value:.6g}"]
        if later is not None:
            kl_lines.append(f"{run.kl_ctrl_path.name} left as is: iteration {later} already started from it")
    tokens = int(out.table.column("response_length").to_numpy().sum())
    return StageResult(stage="gae", iteration=k, outputs={"advantages": str(path)},
                       rows={"advantages": out.num_responses, "tokens": tokens},
                       metrics=metrics, summary=_summary(settings, out, metrics, kl_lines, path))


def _summary(settings, out, metrics: dict[str, float], kl_lines: list[str], path: Path) -> list[str]:
    spread = (f"mean {metrics['advantages/mean']:.4f} in [{metrics['advantages/min']:.3f}, "
              f"{metrics['advantages/max']:.3f}]")
    if estimator_takes(settings.adv_estimator, "values"):
        whitened = "whitened" if settings.norm_adv else "not whitened (algorithm.norm_adv=false)"
        values = f"; values mean {metrics['critic/values_mean']:.4f}" if settings.use_critic else ""
        estimate = (f"{settings.adv_estimator} γ={settings.gamma:g} λ={settings.lam:g}: advantages {whitened}, "
                    f"{spread}; returns mean {metrics['returns/mean']:.4f}{values}")
    else:
        estimate = f"{settings.adv_estimator} over {out.num_groups} prompt groups: advantages {spread}"
    return [
        f"{out.num_responses} responses; score mean {metrics['reward/score_mean']:.4f}, token-level reward "
        f"per response {metrics['reward/token_level_mean']:.4f}",
        *kl_lines,
        estimate,
        f"wrote {path}",
    ]
