"""The run session: everything one flow run keeps in memory between its stage calls, in one object
the flow creates and hands to every stage that uses models.

    the held models   live (lent) modules, frozen models, kept reference states  (scoring.held)
    trainer           the resident trainer (or worker group) of the run, while
                      ``training.run_trainer.resident_models`` keeps one         (training.run_trainer)

The stages pass the session on; the model passes below them (scoring, rewards, rollout) take it as
what they use of it, ``HeldModels``. ``RunSession()`` (a CLI rerun of one stage, a process a stage
starts) holds nothing: every model is read from disk and each update makes its own trainer.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from rlhf_core.config import RLHFConfig
from rlhf_core.scoring.held import HeldModels


class KeptTrainer(Protocol):
    """What the stages and the run's lifecycle ask of the trainer a session keeps
    (``training.resident.ResidentTrainer`` in this process, ``training.group_trainer.GroupTrainer``
    for a worker group of ranks)."""

    holds: Optional[int]
    """The iteration whose state its engines hold (None: none yet)."""

    def update(self, cfg: RLHFConfig, k: int, *, progress: Optional[bool] = None) -> dict[str, Any]:
        """Iteration ``k``'s PPO update from the state it starts from; the update's metrics."""

    def settle(self, k: int, outcome: str, *, save: bool) -> None:
        """Iteration ``k`` committed or rolled back (``outcome``); ``save``: write its checkpoint now."""

    def check_writes(self) -> None:
        """Raise a background checkpoint write's failure, if one failed."""

    def close(self, *, make_durable: bool = True) -> None:
        """Release the engines (``make_durable``: first write what only they hold)."""


class RunSession(HeldModels):
    """What one run holds in memory (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.trainer: Optional[KeptTrainer] = None
        """The trainer that keeps the run's models while ``training.run_trainer.resident_models`` keeps one."""

    def __repr__(self) -> str:
        trainer = type(self.trainer).__name__ if self.trainer is not None else None
        return f"RunSession(held={[str(p) for p in self.live.held_directories()]}, trainer={trainer})"
