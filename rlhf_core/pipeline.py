"""Run planning for the pipeline: which run directory, which iterations, what is due when.

The Prefect flow (flows/pipeline.py) only wires tasks; every decision it needs lives here, as plain
functions that tests call without Prefect:

    plan = plan_run(preset="configs/demo.yaml", overrides=[...], run_name="demo"); open_run(plan)
    (preprocess) cfg = resolve_iterations(plan)
    for k in plan.iterations(): ...  validate_due(cfg, k), prune_checkpoints(cfg, run), ...

Training steps are derived as verl derives them (``config.resolve.total_iterations``): the count
of training prompts is known only after preprocess, so ``resolve_iterations`` fills
trainer.total_iterations in then and saves it in the run's config.yaml; a resume, a stage rerun and
the update's learning-rate schedule all read that one number.

Schedule (verl's ``RayPPOTrainer.fit``): trainer.val_before_train validates the initial policy
(step 0) and trainer.val_only stops after it; test_freq / save_freq act every N steps and at the
last step, and -1 means never.

Checkpoint retention: every iteration's update writes iter_k/checkpoint; after the guard commits
an iteration, only the last-good checkpoint and the last ``trainer.max_ckpt_to_keep`` checkpoints of
save points (every ``trainer.save_freq`` iterations, and the final one) are kept.
"""

from __future__ import annotations

import gc
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlhf_core.config import ConfigError, RLHFConfig, apply_overrides, config_from_dict, load_config, to_yaml
from rlhf_core.config import resolve
from rlhf_core.config.loader import parse_override, read_preset
from rlhf_core.config.notes import say_once
from rlhf_core.config.validate import LOGGERS_HERE
from rlhf_core.errors import RLHFError
from rlhf_core.guard import committed_iterations, discard_checkpoint
from rlhf_core.io.atomic import atomic_write_json, clean_temporaries
from rlhf_core.io.manifest import read_manifest, write_manifest
from rlhf_core.io.pointers import read_last_good, verified_last_good
from rlhf_core.io.rundir import ITERATION_STAGES, RunDir, write_config
from rlhf_core.inputs import check_inputs
from rlhf_core.paths import resolve_path
from rlhf_core.query import iteration_metrics_path


@dataclass
class RunPlan:
    cfg: RLHFConfig
    run: RunDir
    first_iteration: int
    """The next iteration to run: 1 for a new run, last-good + 1 on resume."""
    resumed: bool

    @property
    def last_iteration(self) -> int:
        total = self.cfg.trainer.total_iterations
        if total is None:  # a bug in the caller, not user input
            raise AssertionError("trainer.total_iterations is known only after preprocess: call resolve_iterations")
        return total

    def iterations(self) -> range:
        """The training steps still to run (none after trainer.val_only)."""
        if stops_after_validation(self.cfg):
            return range(self.first_iteration, self.first_iteration)
        return range(self.first_iteration, self.last_iteration + 1)


def resolve_run_config(run_dir: Optional[Path], preset: Optional[str], overrides: Sequence[str]) -> RLHFConfig:
    """A run's config: its saved config.yaml (+ overrides) when no preset is given, else the preset
    (+ overrides)."""
    saved = Path(run_dir) / "config.yaml" if run_dir else None
    if preset is None and saved is not None and saved.is_file():
        return apply_overrides(config_from_dict(read_preset(saved)), overrides)
    return load_config(resolve_path(preset) if preset else None, overrides)


def new_run_dir(cfg: RLHFConfig, run_name: Optional[str]) -> Path:
    """runs_root/<run_name or a timestamp>; refuses a non-empty existing directory."""
    root = Path(cfg.trainer.runs_root).expanduser().resolve()
    # a random suffix: two runs started in the same second (pool concurrency > 1) never collide
    path = root / (run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")
    if path.exists() and any(path.iterdir()):
        raise RLHFError(f"run directory {path} already exists; pick another run name or resume it with "
                        f"`rlhf run --resume {path}`")
    return path


def resume_point(run: RunDir) -> int:
    """The first iteration not yet committed: last-good + 1 (1 when nothing was committed)."""
    record = read_last_good(run)
    return record["iteration"] + 1 if record else 1


def plan_run(preset: Optional[str] = None, overrides: Sequence[str] = (), iterations: Optional[int] = None,
             run_name: Optional[str] = None, resume: Optional[str | Path] = None) -> RunPlan:
    """Resolve the config and the run directory and say where to start; writes nothing.

    ``resume`` names an existing run directory: its saved config (plus ``overrides``) is used and the
    run continues after its last committed iteration. ``iterations`` overrides
    trainer.total_iterations. Call ``open_run`` once the run directory is locked.
    """
    overrides = list(overrides) + ([f"trainer.total_iterations={iterations}"] if iterations else [])
    if resume:
        overrides = rederive_steps(overrides)
        run = RunDir(resume)
        if not run.config_path.is_file():
            raise RLHFError(f"cannot resume {run.root}: it has no config.yaml (is it a run directory?)")
        cfg = resolve_run_config(run.root, preset, overrides)
        note_loggers(cfg)
        return RunPlan(cfg=cfg, run=run, first_iteration=resume_point(run), resumed=True)
    cfg = resolve_run_config(None, preset, overrides)
    check_inputs(cfg)  # a missing data/model path fails before a run directory or MLflow run exists
    note_loggers(cfg)
    return RunPlan(cfg=cfg, run=RunDir(new_run_dir(cfg, run_name)), first_iteration=1, resumed=False)


STEP_KEYS = ("trainer.total_epochs", "trainer.total_training_steps")


def rederive_steps(overrides: Sequence[str]) -> list[str]:
    """A resume's overrides: when they change total_epochs or total_training_steps but not
    total_iterations, the saved total_iterations (filled in when the run started) is dropped so the
    new setting is derived again instead of being ignored."""
    keys = {parse_override(o)[0] for o in overrides}
    if keys & set(STEP_KEYS) and "trainer.total_iterations" not in keys:
        return [*overrides, "trainer.total_iterations=null"]
    return list(overrides)


def resolve_iterations(plan: RunPlan) -> RLHFConfig:
    """After preprocess: ``fill_total_iterations`` for the plan's run (``plan.cfg`` updated)."""
    plan.cfg = fill_total_iterations(plan.cfg, plan.run)
    return plan.cfg


def fill_total_iterations(cfg: RLHFConfig, run: RunDir) -> RLHFConfig:
    """``cfg`` with trainer.total_iterations filled in from the run's preprocessed prompts (verl:
    total_training_steps, else total_epochs × (train prompts // data.train_batch_size)) and saved in
    config.yaml; unchanged when already set or before preprocess. Zero steps (no prompt) is refused
    unless the run only validates (trainer.val_only)."""
    t = cfg.trainer
    if t.total_iterations is not None or not run.train_prompts.is_file():
        return cfg
    prompts = run.train_prompt_count()
    total = resolve.total_iterations(cfg, prompts)
    how = ("trainer.total_training_steps" if t.total_training_steps is not None else
           f"{t.total_epochs} epochs × {resolve.steps_per_epoch(cfg, prompts)} steps of data.train_batch_size="
           f"{cfg.data.train_batch_size} over {prompts} prompts")
    if total < 1 and not stops_after_validation(cfg):
        raise ConfigError(f"no training step to run ({how}); set trainer.total_training_steps or add prompts")
    say_once(f"config: training steps: {max(total, 0)} ({how})")
    cfg = apply_overrides(cfg, [f"trainer.total_iterations={max(total, 1)}"])
    save_config(run, cfg)
    return cfg


def open_run(plan: RunPlan) -> None:
    """Save the run's config (a resume's overrides included) and note a resume in the event log."""
    plan.run.root.mkdir(parents=True, exist_ok=True)
    if plan.resumed:
        removed = clean_temporaries(plan.run.root)  # leftovers of writes a crash interrupted
        # a damaged last-good checkpoint moves the pointer back to the newest one that verifies
        fallback = verified_last_good(plan.run)
        plan.first_iteration = resume_point(plan.run)
        plan.run.append_event("resume", plan.first_iteration, cleaned=[str(p) for p in removed],
                              fell_back_from=(fallback or {}).get("fell_back_from"))
    write_config(plan.run, to_yaml(plan.cfg))


def save_config(run: RunDir, cfg: RLHFConfig) -> None:
    """Persist a changed config (e.g. a retry's smaller learning rate) so a resume continues with it."""
    write_config(run, to_yaml(cfg))


# ---------------------------------------------------------------------------------------------
# schedule
# ---------------------------------------------------------------------------------------------


def _every(freq: int, k: int, total: Optional[int]) -> bool:
    """verl's rule for test_freq and save_freq: ``freq > 0 and (last step or step % freq == 0)``."""
    return freq > 0 and (k == total or k % freq == 0)


def validate_due(cfg: RLHFConfig, k: int) -> bool:
    """Validate after step ``k``: every trainer.test_freq steps and at the last one (-1 = never)."""
    return _every(cfg.trainer.test_freq, k, cfg.trainer.total_iterations)


def initial_validation_due(cfg: RLHFConfig) -> bool:
    """verl's trainer.val_before_train: validate the policy a run (or resume) starts from."""
    return cfg.trainer.val_before_train


def stops_after_validation(cfg: RLHFConfig) -> bool:
    """verl's trainer.val_only: stop after the initial validation. As in verl it acts only with
    val_before_train (without it the run trains; that is said once)."""
    t = cfg.trainer
    if t.val_only and not t.val_before_train:
        say_once("config: trainer.val_only=true has no effect with trainer.val_before_train=false (as in verl): "
                 "the run trains; set trainer.val_before_train=true to only validate")
    return t.val_only and t.val_before_train


def note_loggers(cfg: RLHFConfig) -> None:
    """Say once which trainer.logger entries this machine cannot serve (not an error, as a verl
    config names wandb by default)."""
    elsewhere = [name for name in cfg.trainer.logger if name not in LOGGERS_HERE]
    if elsewhere:
        here = [name for name in cfg.trainer.logger if name in LOGGERS_HERE]
        say_once(f"config: trainer.logger {', '.join(elsewhere)} not available here (no such service); metrics go "
                 f"to {', '.join(here) or 'the run directory only'} (trainer.logger=console,mlflow for both)")


def logs_to(cfg: RLHFConfig, backend: str) -> bool:
    """Whether trainer.logger lists ``backend``: 'console' = the per-iteration table, 'mlflow' = an
    MLflow run (none is created without it)."""
    return backend in cfg.trainer.logger


def curve_due(cfg: RLHFConfig, run: RunDir, k: int) -> bool:
    """Redraw the learning curve and report after iteration ``k``: every trainer.curve_freq
    iterations, after the last one, and whenever ``k`` was rolled back (the event must show)."""
    rolled_back = any(e.get("kind") == "rollback" and e.get("iteration") == k for e in run.events())
    return k % cfg.trainer.curve_freq == 0 or k == cfg.trainer.total_iterations or rolled_back


def save_due(cfg: RLHFConfig, k: int) -> bool:
    """Keep iteration ``k``'s checkpoint past the next commit: every trainer.save_freq steps and the
    last one (-1 = never: only the last-good checkpoint, which the KL guard needs, is kept)."""
    return _every(cfg.trainer.save_freq, k, cfg.trainer.total_iterations)


def prune_checkpoints(cfg: RLHFConfig, run: RunDir) -> list[int]:
    """Delete committed checkpoints that are neither last-good nor among the last
    trainer.max_ckpt_to_keep save points; note it in the update record. Returns the iterations."""
    record = read_last_good(run)
    last_good = record["iteration"] if record else None
    committed = committed_iterations(run)
    save_points = [k for k in committed if save_due(cfg, k)]
    keep = set(save_points[-cfg.trainer.max_ckpt_to_keep:] if cfg.trainer.max_ckpt_to_keep > 0 else [])
    keep.add(last_good)
    removed = []
    for k in committed:
        if k in keep or not run.checkpoint(k).exists():
            continue
        discard_checkpoint(run, k)
        manifest = read_manifest(run, k)
        if "update" in manifest:
            manifest["update"]["checkpoint_pruned"] = True
            write_manifest(run, k, manifest)
        removed.append(k)
    return removed


def settle_heap() -> None:
    """Collect once, then move every object alive now (imported modules, Prefect, MLflow, torch and
    transformers state) out of the garbage collector's view (``gc.freeze``). They live for the whole
    process anyway; afterwards each automatic full collection scans only what the iterations
    allocate instead of the whole heap (0.2-0.5 s per collection in a flow process without it)."""
    gc.collect()
    gc.freeze()


def mark_skipped(run: RunDir, k: Optional[int], stage: str) -> None:
    """Note that the last invocation of ``stage`` reused its outputs (shown as 'skipped')."""
    manifest = read_manifest(run, k)
    if stage in manifest:
        manifest[stage]["skipped_at"] = time.time()
        write_manifest(run, k, manifest)


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------

ALIASES = {
    "guard/kl_mean": "kl/mean",  # the guarded KL(actor‖ref) after the update
    "critic/score/mean": "reward/mean",  # verl's name ↔ ours: the mean sequence score (reward before KL)
}
"""Pairs of names for one quantity: each side is filled in from the other when a stage reports
only one (verl's names for verl's dashboards, ours for the CLI table and the learning curve)."""

TIMING = {
    "timing_s/gen": ("perf/stage_seconds/rollout",),
    "timing_s/reward": ("perf/score_seconds/reward",),
    "timing_s/old_log_prob": ("perf/score_seconds/old_log_prob", "perf/stage_seconds/score"),
    "timing_s/ref": ("perf/score_seconds/ref",),
    "timing_s/values": ("perf/score_seconds/values",),
    "timing_s/adv": ("perf/stage_seconds/gae",),
    "timing_s/update_critic": ("perf/critic_update_seconds",),
    "timing_s/update_actor": ("perf/actor_update_seconds", "perf/stage_seconds/update"),
    "timing_s/save_checkpoint": ("perf/checkpoint_seconds",),
    "timing_s/testing": ("perf/stage_seconds/validate",),
    "timing_s/step": ("perf/iteration_seconds",),
}
"""verl's step timers from our stage timings: the first name present wins. Approximations: one
stage (score) computes the rewards, old and reference log-probs and values, so without per-model
seconds from it timing_s/old_log_prob carries the whole stage and timing_s/ref, /values, /reward
are absent; likewise timing_s/update_actor is the whole update stage (critic and actor, with the
checkpoint save) unless the update reports perf/actor_update_seconds. timing_s/gen includes the
rollout's model load; timing_s/step is every stage of the iteration (the KL guard included)."""


def with_aliases(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` plus the other name of every ALIASES pair one side of which is present."""
    out = dict(metrics)
    for a, b in ALIASES.items():
        if a in out:
            out.setdefault(b, out[a])
        elif b in out:
            out[a] = out[b]
    return out


def timing_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """verl's timing_s/* names from an iteration's metrics (``TIMING``)."""
    out = {}
    for name, sources in TIMING.items():
        found = next((metrics[s] for s in sources if s in metrics), None)
        if found is not None:
            out[name] = float(found)
    return out


def steps_per_epoch(cfg: RLHFConfig, run: RunDir) -> int:
    """Iterations per pass over the training prompts as this run orders them: the pack stage's slot
    count (verl's train prompts // data.train_batch_size when the pack stage has not run)."""
    slots = (read_manifest(run, None).get("pack", {}).get("rows") or {}).get("slots")
    if slots:
        return int(slots)
    return max(1, resolve.steps_per_epoch(cfg, run.train_prompt_count())) if run.train_prompts.is_file() else 1


def iteration_metrics(cfg: RLHFConfig, run: RunDir, k: int) -> dict[str, float]:
    """Every stage metric of iteration ``k`` (manifest records, both names of each ALIASES pair),
    plus perf/stage_seconds/<stage>, perf/iteration_seconds, perf/iteration_tokens_per_s, verl's
    timing_s/* (``TIMING``), training/global_step and training/epoch (0-based, as verl counts);
    written to iter_k/iteration_metrics.json and returned."""
    manifest = read_manifest(run, k)
    out: dict[str, float] = {}
    seconds = 0.0
    for stage, rec in manifest.items():
        if rec.get("status") not in ("done", "stale"):
            continue
        for name, value in (rec.get("metrics") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out[name] = float(value)
        if rec.get("seconds") is not None:
            out[f"perf/stage_seconds/{stage}"] = float(rec["seconds"])
            seconds += float(rec["seconds"]) if stage in ITERATION_STAGES or stage == "validate" else 0.0
    out = with_aliases(out)
    out["perf/iteration_seconds"] = seconds
    tokens = iteration_tokens(run, k)
    if tokens and seconds > 0:
        out["perf/iteration_tokens_per_s"] = tokens / seconds
    out.update(timing_metrics(out))
    out["training/global_step"] = float(k)
    out["training/epoch"] = float((k - 1) // steps_per_epoch(cfg, run)) if k >= 1 else 0.0
    out["iteration"] = float(k)
    atomic_write_json(iteration_metrics_path(run, k), out)
    return out


REPORT_ORDER = ITERATION_STAGES + ("validate",)
"""The order an iteration's stages run in: a metric two stages report is reported by the first."""


def stage_reports(manifest: dict, statuses: Sequence[str] = ("done", "stale")) -> dict[str, dict[str, float]]:
    """What each stage of an iteration reports to MLflow, in run order: its metrics minus the names
    an earlier stage already reported (one point per metric and step; e.g. response_length/mean
    from rollout, not again from score), plus perf/stage_seconds/<stage>. Only records whose status
    is in ``statuses`` count, as reporters and as earlier stages."""
    taken: set[str] = set()
    out: dict[str, dict[str, float]] = {}
    for stage in REPORT_ORDER:
        rec = manifest.get(stage)
        if not rec or rec.get("status") not in statuses:
            continue
        metrics = rec.get("metrics") or {}
        mine = {name: value for name, value in metrics.items() if name not in taken}
        taken |= set(metrics)
        if rec.get("seconds") is not None:
            mine[f"perf/stage_seconds/{stage}"] = float(rec["seconds"])
        out[stage] = mine
    return out


def iteration_tokens(run: RunDir, k: int) -> int:
    """Prompt + response tokens of iteration ``k``'s rollout (0 when absent)."""
    if not run.rollout(k).is_file():
        return 0
    table = pq.read_table(run.rollout(k), columns=["prompt_token_ids", "response_length"])
    prompt = pc.sum(pc.list_value_length(table.column("prompt_token_ids"))).as_py() or 0
    response = pc.sum(table.column("response_length")).as_py() or 0
    return int(prompt + response)


ROW_COLUMNS = (("iter", "iteration", "{:>4.0f}"), ("reward", "reward/mean", "{:>7.3f}"),
               ("acc", "val/accuracy", "{:>6.3f}"), ("kl", "kl/mean", "{:>8.4f}"),
               ("clipfrac", "actor/pg_clipfrac", "{:>8.3f}"), ("grad_norm", "actor/grad_norm", "{:>9.3f}"),
               ("seconds", "perf/iteration_seconds", "{:>7.1f}"))


def format_iteration_header() -> str:
    widths = [len(fmt.format(0.0)) for _, _, fmt in ROW_COLUMNS]
    return " ".join(title.rjust(w) for (title, _, _), w in zip(ROW_COLUMNS, widths))


def format_iteration_row(metrics: dict[str, float], note: str = "") -> str:
    """One line of the CLI's per-iteration table ('-' where a metric is absent)."""
    cells = []
    for _, key, fmt in ROW_COLUMNS:
        value = metrics.get(key)
        width = len(fmt.format(0.0))
        cells.append(fmt.format(value) if isinstance(value, (int, float)) else "-".rjust(width))
    return " ".join(cells) + (f"  {note}" if note else "")


def alerts(cfg: RLHFConfig, metrics: dict[str, float]) -> list[str]:
    """Lines worth a warning: KL above the rollback threshold, clip fraction below 0.1 (the policy
    barely moves any more: a convergence signal)."""
    out = []
    kl = metrics.get("kl/mean")
    if kl is not None and kl > cfg.trainer.kl_rollback_threshold:
        out.append(f"KL {kl:.4f} above trainer.kl_rollback_threshold={cfg.trainer.kl_rollback_threshold}")
    clipfrac = metrics.get("actor/pg_clipfrac")
    if clipfrac is not None and clipfrac < 0.1:
        out.append(f"actor/pg_clipfrac {clipfrac:.3f} < 0.1: updates are small (a convergence signal)")
    return out
