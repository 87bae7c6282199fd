"""Run planning: which run directory and config, which iterations are left, how many steps.

The Prefect flow (flows/pipeline.py) only wires tasks; the decisions it needs live here and in
``run.schedule`` (what is due when), ``run.lifecycle`` (commit, roll back, resume) and
``run.report`` (what an iteration reports), as plain functions that tests call without Prefect:

    plan = plan_run(preset="configs/demo.yaml", overrides=[...], run_name="demo")
    open_run(plan)  (``control.opening``, under the run lock)
    (preprocess) cfg = resolve_iterations(plan)
    for k in plan.iterations(): ...

Training steps are derived as verl derives them (``config.resolve.total_iterations``): the count
of training prompts is known only after preprocess, so ``resolve_iterations`` fills
trainer.total_iterations in then and saves it in the run's config.yaml; a resume, a stage rerun and
the update's learning-rate schedule all read that one number.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from rlhf_core.config import ConfigError, RLHFConfig, apply_overrides, config_from_dict, load_config, to_yaml
from rlhf_core.config import resolve
from rlhf_core.run.inputs import check_inputs
from rlhf_core.config.loader import parse_override
from rlhf_core.notes import say_once
from rlhf_core.config.validate import LOGGERS_HERE
from rlhf_core.training.run_dtype import keep_recorded_dtype
from rlhf_core.data.preprocess import screen_files
from rlhf_core.data.outcome import (NoPromptsError, first_reject, no_prompts_problem, prompt_supply_problem,
                                    rejects_query)
from rlhf_core.errors import DataError, RLHFError, require_writable
from rlhf_core.paths import resolve_path
from rlhf_core.run.layout import RunDir, StateFileError, write_config
from rlhf_core.run.lifecycle import last_good_iteration, refuse_edited_retry_records
from rlhf_core.run.migrate import migrate, stamp
from rlhf_core.run.manifest import read_manifest
from rlhf_core.run.saved_config import run_config_tree
from rlhf_core.run.schedule import initial_validation_due, stops_after_validation
from rlhf_core.stages.base import refuse_out_of_date
from rlhf_core.stages.preprocess import data_files, refuse_changed_data


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
        if stops_after_validation(self.cfg.trainer):
            return range(self.first_iteration, self.first_iteration)
        return range(self.first_iteration, self.last_iteration + 1)


def resolve_run_config(run_dir: Optional[Path], preset: Optional[str], overrides: Sequence[str]) -> RLHFConfig:
    """A run's config: its saved config.yaml (+ overrides) when no preset is given — the config its
    newest committed iteration recorded when config.yaml no longer matches its seal, said once
    (``run.saved_config``) —, else the preset (+ overrides)."""
    run = RunDir(run_dir) if run_dir else None
    if preset is None and run is not None and run.config_path.is_file():
        tree, damaged = run_config_tree(run)
        if damaged:
            say_once(f"config: {damaged}")
        return apply_overrides(config_from_dict(tree), overrides)
    return load_config(resolve_path(preset) if preset else None, overrides)


def new_run_dir(cfg: RLHFConfig, run_name: Optional[str]) -> Path:
    """runs_root/<run_name or a timestamp>; refuses a non-empty existing directory, unless it holds a
    run that never started an iteration (``never_trained``: its data was refused, say), which
    ``open_run`` then starts afresh, so the same command works once the data is fixed."""
    root = Path(cfg.trainer.runs_root).expanduser().resolve()
    # a random suffix: two runs started in the same second (pool concurrency > 1) never collide
    path = root / (run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")
    if path.exists() and any(path.iterdir()) and not never_trained(RunDir(path)):
        raise RLHFError(f"run directory {path} already exists; pick another run name or resume it with "
                        f"`rlhf run --resume {path}`")
    return path


def never_trained(run: RunDir) -> bool:
    """A run directory of ours (config.yaml) whose run stopped in its setup: no iteration directory,
    no commit log. Its setup stages are redone in a moment (the models they build are cached
    outside the run), so a new run may take the name over."""
    return run.config_path.is_file() and not run.last_good_path.exists() and not run.iterations()


def resume_point(run: RunDir) -> int:
    """The first iteration not yet committed: last-good + 1 (1 when nothing was committed; also
    while the commit log is damaged, which ``open_run`` repairs before it asks again)."""
    try:
        return last_good_iteration(run) + 1
    except StateFileError:
        return 1


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
        require_writable(run.root, f"resume {run.root}")  # before any server starts
        check_resumable(run, cfg)
        note_loggers(cfg)
        return RunPlan(cfg=cfg, run=run, first_iteration=resume_point(run), resumed=True)
    cfg = resolve_run_config(None, preset, overrides)
    check_inputs(cfg)  # a missing data/model path fails before a run directory or MLflow run exists
    screen_data(cfg)
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
    """After preprocess: ``check_prompt_supply``, then ``fill_total_iterations`` for the plan's run
    (``plan.cfg`` updated)."""
    check_prompt_supply(plan.cfg, plan.run)
    plan.cfg = fill_total_iterations(plan.cfg, plan.run)
    return plan.cfg


def check_prompt_supply(cfg: RLHFConfig, run: RunDir) -> None:
    """Refuse (``DataError``, one line with the counts, the reasons and the fix) a run whose
    preprocess kept too little to train on (``data.outcome.prompt_supply_problem``): under
    data.min_accepted_fraction of its rows, fewer train prompts than one batch, or no validation
    prompt while it validates. Such a run used to train on what was left and exit 0."""
    rows = (read_manifest(run, None).get("preprocess") or {}).get("rows")
    if not rows:  # preprocess has not recorded counts here (tables written by other means)
        return
    problem = supply_problem(cfg, rows, rejects_query(run.root))
    if problem:
        raise DataError(problem)


def supply_problem(cfg: RLHFConfig, rows: dict[str, int], rejects_at: str) -> Optional[str]:
    """``prompt_supply_problem`` for this run's schedule: whether it trains and whether it validates."""
    validates = initial_validation_due(cfg.trainer) or cfg.trainer.test_freq > 0 or cfg.trainer.kl_guard_val_prompts > 0
    return prompt_supply_problem(rows, cfg.data, trains=not stops_after_validation(cfg.trainer), validates=validates,
                                 rejects_at=rejects_at)


def screen_data(cfg: RLHFConfig) -> None:
    """A new run's data mistakes, refused before its run directory, Prefect server or MLflow run
    exists (``data.preprocess.screen_files``: files read, rows adapted and deduplicated, no
    tokenizer): no rows, no row in the adapter's layout, too few rows accepted or too few to train
    or validate on. Only what the tokenizer decides (the length rule) is left to the stage; a
    refusal here is one the stage would make too."""
    train_files, val_files = data_files(cfg.data)
    screening = screen_files(train_files, val_files, cfg.data)
    if screening.train == 0:
        raise NoPromptsError(no_prompts_problem(screening, cfg.data), rows=screening.rows)
    problem = supply_problem(cfg, screening.rows, first_reject(screening))
    if problem:
        raise DataError(problem)


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
           f"{t.total_epochs} epochs × {resolve.steps_per_epoch(cfg.data.train_batch_size, prompts)} steps of data.train_batch_size="
           f"{cfg.data.train_batch_size} over {prompts} prompts")
    if total < 1 and not stops_after_validation(cfg.trainer):
        raise ConfigError(f"no training step to run ({how}); set trainer.total_training_steps or add prompts")
    say_once(f"config: training steps: {max(total, 0)} ({how})")
    cfg = apply_overrides(cfg, [f"trainer.total_iterations={max(total, 1)}"])
    save_config(run, cfg)
    return cfg


def saved_config(run: RunDir) -> RLHFConfig:
    """The run's config as config.yaml holds it (what its iterations ran with, before any overrides
    of the command at hand)."""
    return resolve_run_config(run.root, None, ())


def upgrade_format(run: RunDir, saved: RLHFConfig) -> Optional[str]:
    """``migrate`` with what it reads of the run's saved config; one line of what it did, or None."""
    return migrate(run, saved.algorithm.kl_ctrl, saved.data.reward_fn_key)


def save_config(run: RunDir, cfg: RLHFConfig) -> None:
    """Persist a changed config (e.g. a retry's smaller learning rate) so a resume continues with it."""
    write_config(run, to_yaml(cfg))


# ---------------------------------------------------------------------------------------------
# stage reruns: their overrides never become the run's config
# ---------------------------------------------------------------------------------------------


def stage_config(run: RunDir, preset: Optional[str], overrides: Sequence[str]) -> RLHFConfig:
    """The config of one stage run (``rlhf stage``): the run's config.yaml (else ``preset``) plus
    ``overrides``, with the training-step count filled in. config.yaml is written only for a new run
    directory: a rerun's overrides stay out of it (the stage's manifest record lists them), so a
    resume never trains with a value MLflow does not show."""
    if not run.config_path.is_file():
        cfg = resolve_run_config(None, preset, overrides)
        run.root.mkdir(parents=True, exist_ok=True)
        stamp(run)
        save_config(run, cfg)
        return fill_total_iterations(cfg, run)
    upgrade_format(run, saved_config(run))
    saved = fill_total_iterations(resolve_run_config(run.root, None, ()), run)  # saves only the run's own config
    cfg = apply_overrides(saved, overrides) if preset is None else resolve_run_config(None, preset, overrides)
    keep_recorded_dtype(cfg, run)
    if cfg.trainer.total_iterations is None and saved.trainer.total_iterations is not None:
        cfg = apply_overrides(cfg, [f"trainer.total_iterations={saved.trainer.total_iterations}"])
    return cfg


def check_resumable(run: RunDir, cfg: RLHFConfig) -> None:
    """A resume continues from last-good: refuse while a stage at or before it is stale or was rerun
    with overrides (``stages.base.out_of_date``), naming them and `rlhf rebuild`, and while the data
    files it trained on have changed (``refuse_changed_data``) or a committed iteration's retry record
    was edited (``refuse_edited_retry_records``)."""
    refuse_out_of_date(run, resume_point(run) - 1, "resume")
    refuse_changed_data(cfg.data, run, resume_point(run) - 1)
    refuse_edited_retry_records(run, resume_point(run) - 1)


# ---------------------------------------------------------------------------------------------
# loggers
# ---------------------------------------------------------------------------------------------


def note_loggers(cfg: RLHFConfig) -> None:
    """Say once which trainer.logger entries this machine cannot serve (not an error, as a verl
    config names wandb by default), and that a list without mlflow leaves the run untracked in
    MLflow (verl's quickstart says trainer.logger=console)."""
    loggers = cfg.trainer.logger
    elsewhere = [name for name in loggers if name not in LOGGERS_HERE]
    here = [name for name in loggers if name in LOGGERS_HERE]
    sinks = f"metrics go to {' and '.join([*here, 'the run directory'])}"
    if elsewhere:
        say_once(f"config: trainer.logger {', '.join(elsewhere)} not available here (no such service); {sinks} "
                 "(trainer.logger=[console,mlflow] for both)")
    elif "mlflow" not in loggers:
        say_once(f"config: trainer.logger={','.join(loggers) or '[]'} leaves MLflow off: no MLflow run; {sinks} "
                 "(trainer.logger=[console,mlflow] tracks it too)")


def logs_to(cfg: RLHFConfig, backend: str) -> bool:
    """Whether trainer.logger lists ``backend``: 'console' = the per-iteration table, 'mlflow' = an
    MLflow run (none is created without it)."""
    return backend in cfg.trainer.logger
