"""The models a run holds in memory between its stage calls, the part of the run session
(``run.session.RunSession``) the model passes below the stages use:

    live        the trainer's lent modules by checkpoint directory, a worker group answering for
                its processes' states, the rollout engine kept for the run   (models.live)
    frozen      the reference policy and the reward model, loaded once        (scoring.frozen)
    ref_states  the score pass's reference hidden states, for the guard       (scoring.ref_states)

A pass's arguments say where its models come from: held models that include ``iter_k``'s actor lend
the trainer's module; empty ones (``HeldModels()``: a CLI rerun of one stage, a process a stage
starts) read every model from disk. Nothing process-wide holds live state: two sessions in one
process (two runs, a test) never see each other's models. ``scoring.cache`` stays process-wide on
purpose: it is a memo of read-only directories keyed by their files' identity, whose hits are the
very objects a load would return.
"""

from __future__ import annotations

from typing import Any

from rlhf_core.models.live import LiveModels
from rlhf_core.scoring.frozen import FrozenModels
from rlhf_core.scoring.ref_states import RefStates


class HeldModels:
    """What one run holds of its models (see the module docstring). Not a dataclass on purpose:
    Prefect walks dataclass task arguments, and this one is a handle, not data."""

    def __init__(self) -> None:
        self.live = LiveModels()
        self.frozen = FrozenModels()
        self.ref_states = RefStates()

    def holds(self, model: Any) -> bool:
        """Whether ``model`` is one this session keeps (dropping a borrower's reference frees nothing)."""
        return self.live.is_live(model) or self.frozen.is_held(model)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(held={[str(p) for p in self.live.held_directories()]})"
