"""One PPO iteration, top to bottom: the recipe the pipeline flow runs for every iteration.

Read this file to know what an iteration does; read the modules each step names to know how. Each
step is one stage (a Prefect task, ``tasks.stages``) that reads its inputs from the run directory,
calls the math and records its outputs; whether it reruns, what it hashes, where its models come
from (a live trainer, or disk) and how a crash is recovered all stay behind that call.

Notation: x = prompt, y = response of T tokens, π = actor, π_old = the last-good actor that
generated y, π_ref = the frozen reference, V = critic, r(x, y) = the reward function's score,
β = the KL coefficient, γ/λ = algorithm.gamma/lam, ε = actor.clip_ratio.

  1. generate         y ~ π_old(·|x), rollout.n samples per prompt          stages/rollout.py
  2. score            r(x, y); log π_old(y_t), log π_ref(y_t), V(s_t)       stages/score.py
  3. shape rewards    R_t = −β·KL_t(π_old‖π_ref) + [t = T]·r(x, y)          stages/gae.py (training/advantages.py)
  4. advantages       Â_t = GAE(R, V; γ, λ), returns Â_t + V(s_t)           stages/gae.py (algos/advantage.py)
  5. update           min(ρ_t·Â_t, clip(ρ_t, 1−ε, 1+ε)·Â_t), ρ_t = π/π_old;
                      value loss on the returns; DeepSpeed step per mini-batch  stages/update.py (algos/losses.py)
  6. guard            KL(π_new‖π_ref) on the rollout's tokens vs
                      trainer.kl_rollback_threshold → a verdict             stages/guard.py
  7. commit / roll back  last_good.json moves, or the new checkpoint goes   run/lifecycle.py settle
  8. after a breach   retry with a smaller step (lr ÷, β ×), or halt        run/lifecycle.py retry_overrides

GRPO and the other group estimators read the same way: step 1 draws n > 1 responses per prompt,
step 2 computes no values (no critic), step 4 is the group's normalised score (algos/outcome.py,
``algorithm.adv_estimator``), step 5 updates the actor alone, usually with the KL in the loss
(actor.use_kl_loss) instead of step 3's reward penalty (β = 0 when algorithm.use_kl_in_reward is off).

The steps are the iteration stages in their declared order (``run.stage_order.ITERATION_STAGES``,
from each stage's ``StageSpec``), each called by its function: go to its definition to read the stage.
A new iteration stage gets its step here, and tests/flows/test_recipe.py fails until it has one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rlhf_core.config import RLHFConfig, apply_overrides
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import KLGuardHalt, retries_recorded
from rlhf_core.run.session import RunSession
from rlhf_core.stages.base import StageResult
from rlhf_core.stages.gae import run_gae
from rlhf_core.stages.guard import run_guard
from rlhf_core.stages.rollout import run_rollout
from rlhf_core.stages.score import run_score
from rlhf_core.stages.update import run_update
from tasks.breach import handle_breach_task
from tasks.stages import settle_task, stage_task


@dataclass
class Attempt:
    """The stages one attempt at iteration ``k`` ran, run quietly: the pipeline reports a whole
    iteration at once (``tasks.iteration.finish_iteration_task``) from these results."""

    run_dir: str
    k: int
    mlflow_run_id: Optional[str]
    session: RunSession
    results: list[dict[str, Any]] = field(default_factory=list)

    def stage(self, function: Callable[..., StageResult], cfg: RLHFConfig) -> dict[str, Any]:
        """Run stage ``function`` as its Prefect task (``tasks.stages``: logged, retried where it may
        be, skipped when its inputs and config are unchanged)."""
        result = stage_task(function)(cfg, self.run_dir, self.k, mlflow_run_id=self.mlflow_run_id, report=False,
                                      session=self.session)
        self.results.append(result)
        return result


def ppo_iteration(cfg: RLHFConfig, run_dir: str, k: int, mlflow_run_id: Optional[str], session: RunSession
                  ) -> tuple[RLHFConfig, list[dict[str, Any]]]:
    """Iteration ``k`` until the guard commits it. Returns the config it committed with (a retry
    changes it) and the committed attempt's stage results. Raises KLGuardHalt when
    trainer.on_kl_breach (or trainer.max_rollbacks) stops the run. ``session``: the flow run's
    models in memory (the trainer, the reference, the kept engine), handed to every step."""
    # The attempt count lives with the iteration (its retry record): a resume continues it, so a
    # kill during a retry never grants more than trainer.max_rollbacks retries.
    for attempt in itertools.count(retries_recorded(RunDir(run_dir), k) + 1):
        steps = Attempt(run_dir, k, mlflow_run_id, session)

        # 1. Generate: the last-good actor answers this iteration's prompts (the packed batch
        #    iter_K draws), rollout.n responses each, sampled at rollout.temperature/top_p/top_k;
        #    a vLLM engine on a GPU, HF generate on a CPU, or responses imported offline.
        steps.stage(run_rollout, cfg)

        # 2. Score: each response's reward r(x, y) (a rule such as GSM8K's exact answer, or a reward
        #    model), and the per-token numbers the loss needs: log-probs of the generating policy
        #    (π_old) and of the reference (π_ref), and the critic's values V(s_t).
        steps.stage(run_score, cfg)

        # 3. Shape rewards with KL: R_t = −β·KL_t + the score on the last token, KL_t estimated by
        #    algorithm.kl_penalty from log π_old − log π_ref; β is the KL controller's value
        #    (fixed, or adaptive toward target_kl), handed from iteration to iteration.
        # 4. Advantages: GAE over R and V (δ_t = R_t + γV_{t+1} − V_t, Â_t = Σ (γλ)^l δ_{t+l}),
        #    whitened over the batch (algorithm.norm_adv); returns = Â + V. Group estimators: the score normalised
        #    within each prompt's responses. Both steps are one stage: they share one read of
        #    the scored table and one write of the advantages.
        steps.stage(run_gae, cfg)

        # 5. Update: ppo_epochs passes over the batch in mini-batches (one optimizer step each,
        #    micro-batches accumulated): the clipped surrogate (dual-clip for negative
        #    advantages), optionally a KL loss to π_ref and an entropy bonus; the critic's
        #    clipped value loss on the returns; gradients clipped to actor.grad_clip.
        steps.stage(run_update, cfg)

        # 6. Guard: KL(π_new‖π_ref) per token on this rollout (and the validation prompts when
        #    configured) against trainer.kl_rollback_threshold; a non-finite update fails too.
        steps.stage(run_guard, cfg)

        # 7. Commit or roll back on the guard's verdict: a commit makes this checkpoint last-good
        #    (one atomic rename); a rollback discards it, and the next attempt starts again from
        #    the same last-good actor (rollout and scores stay valid, steps 3-6 rerun).
        if settle_task(cfg, run_dir, k, cfg.trainer.on_kl_breach, attempt, session) == "commit":
            return cfg, steps.results

        # 8. After a breach: trainer.on_kl_breach=retry reruns the iteration with the learning rate
        #    divided and the KL coefficients multiplied (at most trainer.max_rollbacks times);
        #    halt stops the run with a message saying how to go on.
        outcome = handle_breach_task(cfg, run_dir, k, attempt, mlflow_run_id=mlflow_run_id,
                                     stage_results=steps.results)
        if outcome["action"] == "halt":
            raise KLGuardHalt(outcome["message"])
        cfg = apply_overrides(cfg, outcome["overrides"])
    raise AssertionError("unreachable")
