"""The stages and their one order, with what the run's state, the CLI and the Prefect tasks need to
know of each. It lives with the run's state because the manifests, the lifecycle and the integrity
check below the stages need the order; it imports no stage (so `rlhf --help` and `rlhf status` stay
fast). Each stage's functions are imported under the same name in ``rlhf_core.stages.catalog``,
which refuses to load unless it lists every stage declared here, in this order.

Every stage function has the contract
    run_<stage>(cfg: RLHFConfig, run: RunDir, iteration: int | None = None, force: bool = False) -> StageResult
Setup stages take iteration=None; iteration stages need it. A stage reads only its declared inputs,
writes only its outputs and never decides a commit (``rlhf_core.run.lifecycle`` does).
"""

from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class StageSpec:
    """One stage, declared once: the Prefect task (``tasks.stages``), the CLI command (`rlhf stage
    NAME`), the single-stage flow's choices and the docs are built from it; its functions are
    ``stages.catalog.CATALOG[name]``."""

    name: str
    per_iteration: bool
    help: str
    task: str
    """The Prefect task's name (its runs are named "<task>-iter<K>" for a per-iteration stage)."""
    retries: bool = True
    """Retried on a transient I/O error: never the update (its optimizer step is not idempotent) nor
    the guard (its verdict decides a commit), nor the warm start (it trains)."""
    in_commit: bool = False
    """One of the stages an iteration runs before its commit (``ITERATION_STAGES``): the flow runs it
    in every attempt, and a committed iteration without its record is damage (``run.integrity``). A
    per-iteration stage outside it (validation) runs after the commit, when due."""
    rolled_back: bool = False
    """A rollback invalidates its outputs (``ROLLED_BACK_STAGES``): computed from the update, or
    handing state on to the next iteration, so a retry reruns it. Rollout and score stay valid: they
    were computed from the last-good actor, which the rollback keeps."""
    report_outputs: tuple[str, ...] = ()
    """Outputs (by their key in the stage's result) that report on the others (``REPORT_OUTPUTS``):
    they carry timings, so a rerun never writes them byte for byte, while the rest of what they hold
    follows from the other outputs. A rerun whose other outputs are unchanged leaves everything
    downstream as it was."""


STAGES: dict[str, StageSpec] = {
    s.name: s
    for s in [
        StageSpec("warm_start", False, "the initial policy: builds the tiny model, runs the SFT warm start when enabled",
                  task="warm-start", retries=False),
        StageSpec("init_critic", False, "the initial critic: the backbone with a fresh value head → models/critic_init/",
                  task="init-critic"),
        StageSpec("preprocess", False,
                  "raw prompts (JSONL/Parquet/CSV) → prompts/train.parquet, val.parquet, rejects.parquet",
                  task="preprocess"),
        StageSpec("pack", False, "token-budget bin packing of prompts into generation batches", task="pack"),
        StageSpec("rollout", True,
                  "generate responses (hf / vllm) or import offline ones → iter_K/rollout.parquet",
                  task="rollout", in_commit=True),
        StageSpec("score", True, "rewards + old/ref log-probs + values → iter_K/scored.parquet",
                  task="score", in_commit=True),
        StageSpec("gae", True, "KL-in-reward penalty + GAE advantages → iter_K/advantages.parquet",
                  task="gae", in_commit=True, rolled_back=True),
        StageSpec("update", True, "PPO update of actor and critic with DeepSpeed → iter_K/checkpoint/",
                  task="update", retries=False, in_commit=True, rolled_back=True, report_outputs=("metrics",)),
        StageSpec("guard", True, "KL(actor‖ref) of the new actor vs the threshold → the verdict iter_K/guard.json",
                  task="kl-guard", retries=False, in_commit=True, rolled_back=True),
        StageSpec("validate", True,
                  "sampled accuracy of iteration K's actor on the validation prompts → iter_K/validation.parquet",
                  task="validate"),
    ]
}
"""Every stage, in the order a run runs them."""

SETUP_STAGES = tuple(name for name, spec in STAGES.items() if not spec.per_iteration)
"""The stages a run runs once, before its iterations, in order."""
ITERATION_STAGES = tuple(name for name, spec in STAGES.items() if spec.in_commit)
"""The stages of one training iteration, in order (validate follows when due, outside the commit)."""
REPORT_ORDER = tuple(name for name, spec in STAGES.items() if spec.per_iteration)
"""The order an iteration's stages report in: a metric two stages report is reported by the first."""
AFTER_COMMIT = tuple(name for name in REPORT_ORDER if name not in ITERATION_STAGES)
"""Per-iteration stages that measure a committed iteration (validation)."""
UPDATE = "update"
"""The stage that trains: what measures its checkpoint (``AFTER_COMMIT``) is computed from it."""
VALIDATE = "validate"
"""The stage that measures a policy (after a commit when ``run.schedule.validate_due``, and before training)."""
DOWNSTREAM = {name: ITERATION_STAGES[i + 1:] + (AFTER_COMMIT if i <= ITERATION_STAGES.index(UPDATE) else ())
              for i, name in enumerate(ITERATION_STAGES)} | {name: () for name in AFTER_COMMIT}
"""Per stage of an iteration, the stages of the same iteration computed from its outputs, which a rerun
makes stale: the later iteration stages, and validate up to the update (it measures the update's checkpoint)."""
REPORT_OUTPUTS = {name: spec.report_outputs for name, spec in STAGES.items() if spec.report_outputs}
"""Per stage, its report outputs (``StageSpec.report_outputs``)."""
ROLLED_BACK_STAGES = tuple(name for name, spec in STAGES.items() if spec.rolled_back)
"""Stages whose outputs a rollback invalidates (``StageSpec.rolled_back``)."""

