"""When things are due in a run, by verl's rules (``RayPPOTrainer.fit``): trainer.val_before_train
validates the initial policy (step 0) and trainer.val_only stops after it; test_freq / save_freq act
every N steps and at the last step, and -1 means never. Pure functions of the trainer section and step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from rlhf_core.notes import say_once
from rlhf_core.run.layout import RunDir
from rlhf_core.run.manifest import read_manifest

if TYPE_CHECKING:  # annotations only (see run.lifecycle)
    from rlhf_core.config.schema import TrainerConfig


def _every(freq: int, k: int, total: Optional[int]) -> bool:
    """verl's rule for test_freq and save_freq: ``freq > 0 and (last step or step % freq == 0)``."""
    return freq > 0 and (k == total or k % freq == 0)


def validate_due(trainer: TrainerConfig, k: int) -> bool:
    """Validate after step ``k``: every trainer.test_freq steps and at the last one (-1 = never)."""
    return _every(trainer.test_freq, k, trainer.total_iterations)


def initial_validation_due(trainer: TrainerConfig) -> bool:
    """verl's trainer.val_before_train: validate the policy a run (or resume) starts from."""
    return trainer.val_before_train


def stops_after_validation(trainer: TrainerConfig) -> bool:
    """verl's trainer.val_only: stop after the initial validation. As in verl it acts only with
    val_before_train (without it the run trains; that is said once)."""
    t = trainer
    if t.val_only and not t.val_before_train:
        say_once("config: trainer.val_only=true has no effect with trainer.val_before_train=false (as in verl): "
                 "the run trains; set trainer.val_before_train=true to only validate")
    return t.val_only and t.val_before_train


def curve_due(trainer: TrainerConfig, run: RunDir, k: int) -> bool:
    """Redraw the learning curve and report after iteration ``k``: every trainer.curve_freq
    iterations, after the last one, and whenever ``k`` was rolled back (the event must show)."""
    rolled_back = any(e.get("kind") == "rollback" and e.get("iteration") == k for e in run.events())
    return k % trainer.curve_freq == 0 or k == trainer.total_iterations or rolled_back


def save_due(trainer: TrainerConfig, k: int) -> bool:
    """Keep iteration ``k``'s checkpoint past the next commit: every trainer.save_freq steps and the
    last one (-1 = never: only the last-good checkpoint, which the KL guard needs, is kept)."""
    return _every(trainer.save_freq, k, trainer.total_iterations)


def missed_validations(trainer: TrainerConfig, run: RunDir, committed: list[int]) -> list[int]:
    """Steps whose validation was due but has no completed record (a crash came between the commit
    and the validation): step 0 under val_before_train when anything ran, and every committed step
    that validate_due. A resume redoes them, each on the policy as it was after its step."""
    due = ([0] if initial_validation_due(trainer) and (committed or run.iterations()) else []) + \
          [k for k in committed if validate_due(trainer, k)]
    return [k for k in due if read_manifest(run, k).get("validate", {}).get("status") != "done"]
