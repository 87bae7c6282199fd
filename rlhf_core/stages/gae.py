"""Stage `gae`: iter_K/scored.parquet → iter_K/advantages.parquet (token rewards, advantages, returns).

    rlhf stage gae --run-dir RUN --iteration K [-c PRESET] [key=value ...]

With ``algorithm.use_kl_in_reward`` the token rewards carry the KL penalty ``−β·KL_t`` (estimator
``algorithm.kl_penalty``) with β = the KL controller's current coefficient; the controller then
takes one step with the iteration's measured KL and B = number of responses
(``algorithm.kl_ctrl``: fixed, or the adaptive controller of Ziegler et al. 2019). GAE
(``algorithm.gamma``, ``algorithm.lam``) and the whitening (``algorithm.norm_adv``) are in
``rlhf_core.training.advantages``.

KL controller state: an output of this stage, ``iter_K/kl_ctrl.json`` = {"iteration": K, "used": the
controller state iteration K started from, "retry_scale": s, "next": the state after its step}.
Iteration K starts from the "next" of its committed predecessor (the latest committed iteration
before K whose gae wrote one; none: a fresh controller at algorithm.kl_ctrl.kl_coef), an input of
the stage like the scored table. A KL-breach retry of K records its decision in ``iter_K/retry.json``
({"attempt", "kl_coef_scale": s}, ``run.lifecycle.record_retry``), also an input (absent: s = 1): the
controller of K is built at ``used.value × s``, which is the coefficient used, and takes its one step
from there, so "next" already holds the raised coefficient and K+1 starts from it as it is. β has
this one source: the predecessor's state times K's own retry scale, never config.yaml. So a rerun of
K (forced, after a crash, after a rollback) uses the same coefficient and writes the same file, the
controller never steps twice for one iteration, and a rollback needs nothing put back (the
predecessor did not change). A stored state gives the value; ``target_kl`` and ``horizon`` come from
the current config.

Metrics (``advantages.advantage_metrics``): verl's ``critic/rewards|advantages|returns|values/{mean,max,min}``
and ``critic/vf_explained_var`` with verl's reductions, ``actor/reward_kl_penalty`` and
``actor/reward_kl_penalty_coeff`` when the KL is in the reward; ours (``advantages/*``, ``returns/*``,
``kl/coef``, ``kl/coef_next``, ...) as before.

Inspect it with DuckDB:  SELECT avg(list_sum(token_level_rewards)) FROM 'RUN/iter_1/advantages.parquet'
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import pyarrow.parquet as pq

from rlhf_core.training.advantages import AdvantageSettings, compute_advantages
from rlhf_core.algos.registry import estimator_takes
from rlhf_core.algos.controllers import make_kl_controller
from rlhf_core.config.reads import Algorithm, CriticEnable, build, config_keys
from rlhf_core.config.resolve import has_critic
from rlhf_core.config import ConfigError, RLHFConfig
from rlhf_core.config.schema import KLCtrlConfig
from rlhf_core.data.schemas import ADVANTAGES
from rlhf_core.errors import DataError, RLHFError
from rlhf_core.io.atomic import atomic_write_json, atomic_write_parquet
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.lifecycle import committed_iterations, read_retry_scale
from rlhf_core.run.manifest import read_manifest
from rlhf_core.io.timing import TABLE_READ, timed
from rlhf_core.stages.base import StageResult, stage_record

@dataclass(frozen=True)
class GaeSettings:
    advantages: AdvantageSettings
    kl_ctrl: KLCtrlConfig
    """The KL controller's settings (read when the KL is in the reward: ``advantages.use_kl_in_reward``)."""


def gae_settings(algorithm: Algorithm, critic_enable: CriticEnable) -> GaeSettings:
    """Everything the stage reads of the config: its parameters are the keys its config hash covers."""
    use_critic = has_critic(critic_enable, algorithm.adv_estimator)
    return GaeSettings(replace(AdvantageSettings.from_algorithm(algorithm), use_critic=use_critic), algorithm.kl_ctrl)


def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    """The config this stage's output depends on (its manifest's config hash): what its builder reads."""
    return config_keys(gae_settings)


def run_gae(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False) -> StageResult:
    """Advantages of iteration ``iteration``; skipped when its scored table, the KL controller
    state it starts from, its retry record (``iter_K/retry.json``) and the ``algorithm.*`` config
    are unchanged."""
    if iteration is None or iteration < 1:
        raise RLHFError("gae is a per-iteration stage: give --iteration K (K >= 1)")
    scored = run.scored(iteration)
    if not scored.is_file():
        raise DataError(f"{scored} not found: run `rlhf stage score --run-dir {run.root} "
                        f"--iteration {iteration}` first")
    stage = build(gae_settings, cfg)
    settings, ctrl = stage.advantages, stage.kl_ctrl
    source = controller_source(run, iteration) if settings.use_kl_in_reward else None
    retry = run.retry_record(iteration) if settings.use_kl_in_reward else None
    retry = retry if retry is not None and retry.is_file() else None
    inputs = [scored] + [p for p in (source, retry) if p is not None]
    with stage_record(stage="gae", cfg=cfg, run=run, iteration=iteration, inputs=inputs,
                      config_sections=config_sections(cfg), force=force) as record:
        if record.skipped:
            return record.skipped
        scale = read_retry_scale(run, iteration) if retry is not None else 1.0
        before, controller = reward_kl_controller(settings, ctrl, run, iteration, source, scale)
        used = controller.value if controller is not None else 0.0
        with timed(TABLE_READ):
            table = pq.read_table(scored)
        out = compute_advantages(table, kl_coef=used, settings=settings, source=str(scored))
        path = atomic_write_parquet(run.advantages(iteration), out.table, schema=ADVANTAGES)
        outputs, metrics = {"advantages": str(path)}, dict(out.metrics)
        if controller is not None:  # one step with the measured KL; the state the next iteration starts from
            controller.update(current_kl=out.kl_mean, n_steps=out.num_responses)
            metrics["kl/coef_next"] = controller.value
            atomic_write_json(run.kl_state(iteration), {"iteration": iteration, "used": before, "retry_scale": scale,
                                                        "next": controller.state_dict()})
            outputs["kl_ctrl"] = str(run.kl_state(iteration))
        tokens = int(out.table.column("response_length").to_numpy().sum())
        return record.done(StageResult(
            stage="gae", iteration=iteration, outputs=outputs, rows={"advantages": out.num_responses, "tokens": tokens},
            metrics=metrics, summary=_summary(settings, ctrl, out, metrics, path, used, scale, controller)))


def controller_source(run: RunDir, k: int) -> Optional[Path]:
    """The KL state file iteration ``k`` starts from: that of the latest committed iteration before
    ``k`` whose gae wrote one (its manifest records it as an output), None for a fresh controller.
    A recorded file that is gone is an error naming it, never a silent restart at kl_coef."""
    for j in reversed([j for j in committed_iterations(run) if j < k]):
        path = run.kl_state(j)
        if str(path.relative_to(run.root)) not in (read_manifest(run, j).get("gae") or {}).get("outputs", {}):
            continue  # that iteration ran without the KL in the reward: the controller did not move
        if not path.is_file():
            raise StateFileError(f"{path} is missing: iteration {k} starts from the KL controller state iteration "
                                 f"{j}'s gae wrote there; `rlhf run --resume {run.root}` rebuilds it (it reruns that "
                                 "gae)")
        return path
    return None


def read_controller_state(run: RunDir, path: Path) -> dict:
    """The "next" state in a KL state file (what the following iteration starts from)."""
    try:
        record = run.read_json(path)
    except StateFileError as exc:
        raise StateFileError(f"{exc}; `rlhf run --resume {run.root}` rebuilds it (it reruns the gae that wrote "
                             "it)") from None
    state = record.get("next") if isinstance(record, dict) else None
    if not isinstance(state, dict) or not isinstance(state.get("value"), (int, float)):
        raise StateFileError(f"{path} holds {record!r}, not a KL controller state ({{\"used\": ..., \"next\": "
                             f"{{\"value\": ...}}}}); `rlhf run --resume {run.root}` rebuilds it")
    return state


def kl_controller_for(ctrl: KLCtrlConfig, state: Optional[dict], source: Path, scale: float = 1.0):
    """The controller of ``ctrl`` (algorithm.kl_ctrl) starting at ``state["value"]`` (else at
    kl_coef) times ``scale`` (the iteration's retry scale)."""
    coef = ctrl.kl_coef
    if state is not None:
        if not isinstance(state, dict) or not isinstance(state.get("value"), (int, float)):
            raise DataError(f"{source}: KL controller state {state!r} has no numeric \"value\"")
        if state.get("type") != ctrl.type:
            raise ConfigError(
                f"{source} holds a {state.get('type')!r} KL controller but algorithm.kl_ctrl.type={ctrl.type!r}; "
                f"set algorithm.kl_ctrl.type={state.get('type')} to continue this run's controller")
        coef = float(state["value"])
    return make_kl_controller(ctrl.type, coef * scale, ctrl.target_kl, ctrl.horizon)


def check_reward_kl_coef(run: RunDir, k: int, start: float, scale: float, source: Optional[Path]) -> None:
    """Refuse, in one line naming where each factor comes from, a reward KL coefficient
    (``start`` × the retry ``scale``) beyond ``MAX_REWARD_KL_COEF``."""
    if start * scale <= MAX_REWARD_KL_COEF:  # False for NaN too
        return
    origin = f"the KL controller's state in {source}" if source is not None else "algorithm.kl_ctrl.kl_coef"
    fix = (f"delete {run.retry_record(k)} to run iteration {k} with the controller's own coefficient"
           if scale != 1 else "lower algorithm.kl_ctrl.kl_coef")
    raise DataError(f"iteration {k}'s reward KL coefficient would be {start:g} ({origin}) × {scale:g} (the retry "
                    f"scale in {run.retry_record(k)}) = {start * scale:g}, beyond {MAX_REWARD_KL_COEF:g}: the KL "
                    f"penalty would drown every score and overflow the rewards; {fix}, then rlhf run --resume {run.root}")


MAX_REWARD_KL_COEF = 1e6
"""The largest KL coefficient the reward takes: a million times a KL of nats per token already
drowns any score; a larger one (an edited retry.json, a huge kl_coef) would overflow float32 rewards."""


def reward_kl_controller(settings: AdvantageSettings, ctrl: KLCtrlConfig, run: RunDir, k: int,
                         source: Optional[Path], scale: float):
    """(the controller state iteration ``k`` starts from, its controller at that state × the retry
    ``scale``), or (None, None) when the KL is not in the reward."""
    if not settings.use_kl_in_reward:
        return None, None
    start = read_controller_state(run, source) if source is not None else None
    before = kl_controller_for(ctrl, start, source or run.kl_state(k)).state_dict()
    check_reward_kl_coef(run, k, before["value"], scale, source)
    return before, kl_controller_for(ctrl, start, source or run.kl_state(k), scale)


def _summary(settings: AdvantageSettings, ctrl: KLCtrlConfig, out, metrics: dict[str, float], path: Path,
             used: float, scale: float, controller) -> list[str]:
    kl_lines = [f"KL not in the reward (algorithm.use_kl_in_reward=false): token reward = score on the last "
                f"token; KL({settings.kl_penalty}) of the rollout policy to the reference "
                f"{out.kl_mean:.5f} per token"]
    if controller is not None:
        scaled = f" × retry scale {scale:g}" if scale != 1 else ""
        kl_lines = [f"KL in reward: {settings.kl_penalty} estimator, coefficient {used:.6g} "
                    f"({ctrl.type}{scaled}); measured KL {out.kl_mean:.5f} per token → next "
                    f"coefficient {controller.value:.6g}"]
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
